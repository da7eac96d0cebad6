"""Models for the ZeRO-3 tests (importable by spawned ranks): the patterns gather-on-use must survive."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class TiedLM(torch.nn.Module):
    """Tied input/output embedding (the head reads the embedding's weight: an external parameter), a
    block applied twice in one forward, a layer skipped on odd steps, block order permuted per step,
    optional (reentrant or non-reentrant) activation checkpointing."""

    def __init__(self, vocab: int = 23, d: int = 12, n: int = 3, ckpt: str = "") -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([Block(d) for _ in range(n)])
        self.twice = Block(d)
        self.sometimes = torch.nn.Linear(d, d)
        self.norm = torch.nn.LayerNorm(d)
        self.ckpt = ckpt
        self.step_no = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        order = list(range(len(self.blocks)))
        if self.step_no % 3 == 1:
            order.reverse()  # the layer order changes between steps
        for i in order:
            if self.ckpt and self.training:
                x = checkpoint(self.blocks[i], x, use_reentrant=self.ckpt == "reentrant")
            else:
                x = self.blocks[i](x)
        x = self.twice(self.twice(x))  # one parameter used twice in one forward
        if self.step_no % 2 == 0:
            x = x + self.sometimes(x)  # unused on odd steps
        h = self.norm(x)
        return F.linear(h, self.emb.weight)  # tied head


def make_tied(seed: int, ckpt: str = "") -> TiedLM:
    """ckpt: "" (none), "reentrant" or "non-reentrant" activation checkpointing of the blocks."""
    torch.manual_seed(seed)
    return TiedLM(ckpt=ckpt)


def tied_batches(steps: int, micro_global: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 23, (micro_global, 5), generator=g) for _ in range(steps)]


def tied_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
