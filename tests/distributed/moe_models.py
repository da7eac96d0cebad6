"""A small transformer with two MoE layers (each with its own ep_size), its data, and the mapping
from the one-process model (every expert local) to an expert-parallel rank's slice of it."""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from deepspeed_c.moe.layer import MoE

H, V, T = 16, 23, 6  # hidden, vocabulary, tokens per sample
EXPERTS = 4


def expert() -> nn.Module:
    return nn.Sequential(nn.Linear(H, 24), nn.GELU(), nn.Linear(24, H))


class Block(nn.Module):

    def __init__(self, ep_size: int, k: int, residual: bool, drop_tokens: bool = True) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.attn = nn.MultiheadAttention(H, 2, batch_first=True, bias=False)  # key bias: zero gradient, Adam noise
        self.moe = MoE(H, expert(), num_experts=EXPERTS, ep_size=ep_size, k=k, capacity_factor=1.0, min_capacity=2,
                       use_residual=residual, use_rts=False, top2_2nd_expert_sampling=False, drop_tokens=drop_tokens)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        out, l_aux, _ = self.moe(self.ln2(x))
        return x + out, l_aux


class MoENet(nn.Module):

    def __init__(self, ep_sizes: tuple[int, int], residual: bool = False, drop_tokens: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList([Block(ep_sizes[0], 2, residual, drop_tokens),
                                     Block(ep_sizes[1], 1, False, drop_tokens)])
        self.head = nn.Linear(H, V)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        aux = torch.zeros((), device=x.device)
        for b in self.blocks:
            x, l_aux = b(x)
            aux = aux + l_aux
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1)) + 0.01 * aux


def make_full(seed: int, residual: bool = False, drop_tokens: bool = True) -> MoENet:
    torch.manual_seed(seed)
    model = MoENet((1, 1), residual, drop_tokens)
    if residual:  # the residual MLP starts as a copy of the experts: make it differ, or its coefficient's
        with torch.no_grad():  # gradient is round-off only
            for b in model.blocks:
                if b.moe.use_residual:
                    for p in b.moe.mlp.parameters():
                        p.add_(torch.randn_like(p) * 0.2)
    return model


EXPERT_KEY = re.compile(r"^(blocks\.(\d+)\.moe\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..*)$")


def local_name(full_name: str, rank: int, ep_sizes: tuple[int, int]) -> Any:
    """The name a full-model parameter has on `rank` of an expert-parallel model (None when
    another rank holds that expert)."""
    m = EXPERT_KEY.match(full_name)
    if not m:
        return full_name
    layer, global_id = int(m.group(2)), int(m.group(3))
    ep = ep_sizes[layer]
    per_rank = EXPERTS // ep
    if global_id // per_rank != rank % ep:
        return None
    return f"{m.group(1)}{global_id % per_rank}{m.group(4)}"


def make_sharded(full: MoENet, rank: int, ep_sizes: tuple[int, int], residual: bool = False,
                 drop_tokens: bool = True) -> MoENet:
    model = MoENet(ep_sizes, residual, drop_tokens)
    state = {}
    for name, value in full.state_dict().items():
        mine = local_name(name, rank, ep_sizes)
        if mine is not None:
            state[mine] = value.clone()
    model.load_state_dict(state, strict=True)
    return model


def make_batches(steps: int, per_rank: int, world: int, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (world, per_rank, T)
    return [(torch.randint(0, V, shape, generator=g), torch.randint(0, V, shape, generator=g)) for _ in range(steps)]


def gate_margins(x: torch.Tensor, weight: torch.Tensor, k: int) -> torch.Tensor:
    """Per token of x ([..., H]): how far its top-k routing is from a flip. The smallest gap among its
    k + 1 largest gate logits (the k-th against the (k+1)-th decides which experts are chosen; for
    k = 2 the first against the second decides which choice is first, and first choices fill the
    capacity first and alone count for the balancing loss), relative to ||x|| * max_e ||w_e||, a
    bound on every logit's size, so rounding of relative size eps in x or the gate weight moves a
    gap by at most ~4 eps of it. Computed in float64 from the fp32 values. The routers here drop by
    token order (use_rts=False) or not at all, so given the chosen experts every drop is exact:
    these gaps are the only places where rounding can change a routing decision."""
    x64 = x.detach().reshape(-1, x.shape[-1]).double()
    w64 = weight.detach().double()
    top = torch.nn.functional.linear(x64, w64).topk(k + 1, dim=1).values
    gaps = (top[:, :-1] - top[:, 1:]).min(dim=1).values
    return gaps / (x64.norm(dim=1) * w64.norm(dim=1).max()).clamp_min(torch.finfo(torch.float64).tiny)


class MarginRecorder:
    """While entered, every MoE layer of `model` records the gate margins (gate_margins) of each input
    it routes: `smallest()` is the smallest since the last `clear()`."""

    def __init__(self, model: MoENet) -> None:
        self.model = model
        self.seen: list[torch.Tensor] = []
        self._handles: list[Any] = []

    def _hook(self, moe: MoE, args: tuple) -> None:
        gate = moe.deepspeed_moe.gate
        self.seen.append(gate_margins(args[0], gate.wg.weight, gate.k))

    def __enter__(self) -> "MarginRecorder":
        self._handles = [b.moe.register_forward_pre_hook(self._hook) for b in self.model.blocks]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()

    def clear(self) -> None:
        self.seen = []

    def smallest(self) -> float:
        if not self.seen:
            raise AssertionError("no MoE layer ran since the last clear()")
        return float(torch.cat(self.seen).min())
