"""Models whose outputs and activation checkpointing exercise how the engine scales and reduces
gradients (tests/distributed/test_engine_backward_semantics.py); importable by spawned ranks."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class AuxOutputs(torch.nn.Module):
    """Returns (logits, aux_loss): the user trains on mse(logits) + aux_loss."""

    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh())
        self.head = torch.nn.Linear(24, 3)
        self.as_dict = as_dict

    def forward(self, x: torch.Tensor) -> Any:
        h = self.body(x)
        logits, aux = self.head(h), 0.1 * h.pow(2).mean()
        return {"logits": logits, "aux_loss": aux} if self.as_dict else (logits, aux)


class LoRACheckpointed(torch.nn.Module):
    """Frozen base layers with trainable low-rank adapters, each block under activation
    checkpointing, and a frozen head: the first gradient of a backward arrives inside a checkpoint."""

    def __init__(self, reentrant: bool, blocks: int = 3, d: int = 12, rank: int = 2) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.base = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(blocks))
        self.down = torch.nn.ModuleList(torch.nn.Linear(d, rank, bias=False) for _ in range(blocks))
        self.up = torch.nn.ModuleList(torch.nn.Linear(rank, d, bias=False) for _ in range(blocks))
        self.head = torch.nn.Linear(d, 3)
        for p in list(self.base.parameters()) + list(self.head.parameters()):
            p.requires_grad_(False)
        for up in self.up:  # LoRA starts at zero; a small value makes every adapter's gradient nonzero
            torch.nn.init.normal_(up.weight, std=0.1)

    def _block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base[i](x) + self.up[i](self.down[i](x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant:
            x = x.detach().requires_grad_(True)  # reentrant checkpointing needs an input requiring grad
        for i in range(len(self.base)):
            x = checkpoint(self._block, i, x, use_reentrant=self.reentrant)
        return self.head(x)


def tiny_causal_lm(seed: int) -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def make(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "aux":
        return AuxOutputs()
    if kind == "dict":
        return AuxOutputs(as_dict=True)
    if kind == "lora-reentrant":
        return LoRACheckpointed(reentrant=True)
    if kind == "lora-nonreentrant":
        return LoRACheckpointed(reentrant=False)
    if kind == "hf":
        return tiny_causal_lm(seed)
    raise ValueError(kind)


def batches(kind: str, steps: int, n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    if kind == "hf":
        return [torch.randint(0, 32, (n, 8), generator=g) for _ in range(steps)]
    return [(torch.randn(n, 12, generator=g), torch.randn(n, 3, generator=g)) for _ in range(steps)]


def user_loss(kind: str, out: Any, batch: Any) -> torch.Tensor:
    """The loss the user computes from the model's outputs (never the model's own loss)."""
    if kind == "aux":
        logits, aux = out
        return F.mse_loss(logits, batch[1]) + aux
    if kind == "dict":
        return F.mse_loss(out["logits"], batch[1]) + out["aux_loss"]
    if kind == "hf":
        logits = out.logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
    return F.mse_loss(out, batch[1])


def run_model(kind: str, model: torch.nn.Module, batch: Any) -> Any:
    if kind == "hf":  # the model computes its own loss too (labels given); the user ignores it
        return model(input_ids=batch, labels=batch)
    return model(batch[0])


def shard(kind: str, batch: Any, rank: int, micro: int, device: Any = "cpu") -> Any:
    sl = slice(rank * micro, (rank + 1) * micro)
    return batch[sl].to(device) if kind == "hf" else (batch[0][sl].to(device), batch[1][sl].to(device))
