"""A tiny causal LM with SDPA attention for the AutoSP tests: token + position embeddings, one attention
block, a head; forward(input_ids, labels, position_ids) returns (mean cross entropy, logits)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS = 32, 16, 4


class TinySdpaLM(torch.nn.Module):
    def __init__(self, heads: int = HEADS, graph_break: bool = False, attention: bool = True,
                 loss: str = "ce") -> None:
        super().__init__()
        self.heads, self.graph_break, self.attention, self.loss = heads, graph_break, attention, loss
        self.tok = torch.nn.Embedding(VOCAB, HIDDEN)
        self.pos = torch.nn.Embedding(64, HIDDEN)
        # no qkv bias: the key bias's true gradient is zero (softmax ignores a per-query constant), so its
        # rounding noise, normalised by Adam, would compare noise with noise
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.mlp = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor) -> tuple:
        b, s = input_ids.shape
        x = self.tok(input_ids) + self.pos(position_ids)
        if self.attention:
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, HIDDEN // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, HIDDEN))
        if self.graph_break:
            torch._dynamo.graph_break()
        x = x + torch.tanh(self.mlp(x))
        logits = self.head(x)
        if self.loss == "shifted":  # Hugging Face's in-model shift: pad, then drop the first label
            labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        if self.loss == "mse":  # a loss of the labels that is not a cross entropy
            return (logits.float().mean(-1) - labels.float()).pow(2).mean(), logits
        loss = F.cross_entropy(logits.view(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        return loss, logits


def batch(step: int, b: int = 2, s: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    labels = torch.randint(0, VOCAB, (b, s), generator=g)
    labels[0, 1] = -100  # an ignored token: the loss counts the rest over the whole sequence
    return ids, labels, torch.arange(s).expand(b, s).clone()
