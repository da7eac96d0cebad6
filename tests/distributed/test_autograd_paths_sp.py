"""Ulysses DistributedAttention, FPDT's attention and logits loss, and the expert-parallel MoE layer on 2 gloo
ranks under the ways users call autograd (autograd.grad, backward(inputs=), a create_graph penalty, torch.func
grad / vmap(grad), accumulation; tests/distributed/autograd_path_checks.py), each rank's gradients against a
float64 single-process reference of the whole sequence / all tokens (weight gradients summed over the group).
FPDT must raise naming create_graph (its chunked backward is not differentiable); everything else must match."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from tests.distributed.autograd_path_checks import Case, check_paths
from tests.harness import run_distributed

B, S, H, HEADS, HD = 2, 8, 8, 2, 4


def _summed(group):
    from deepspeed_c import comm as dist

    def reduce(name: str, g: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(g, group=group)
        return g
    return reduce


def _slice_norms(parts: int, dim: int):
    return lambda g: sum(p.norm() for p in g.chunk(parts, dim=dim))


def _causal(q, k, v):
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    mask = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
    return torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(mask, float("-inf")).softmax(-1), v)


class _Local(torch.nn.Module):
    def forward(self, q, k, v):
        return _causal(q, k, v)


class _Ulysses(torch.nn.Module):
    def __init__(self, group) -> None:
        super().__init__()
        from deepspeed_c.sequence.layer import DistributedAttention

        self.qkv = torch.nn.Linear(H, 3 * HEADS * HD)
        self.attn = DistributedAttention(_Local(), group)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, HEADS, HD).unbind(2)
        return self.attn(q, k, v, 0)


def _ulysses_ref(p, x):
    q, k, v = (x @ p["qkv.weight"].t() + p["qkv.bias"]).view(x.shape[0], x.shape[1], 3, HEADS, HD).unbind(2)
    return (_causal(q, k, v).tanh() ** 2).sum()


def _ulysses_case(group, rank, world) -> Case:
    torch.manual_seed(0)
    m = _Ulysses(group)
    x_full, x2_full = torch.randn(B, S, H), torch.randn(B, S, H)
    local = lambda t: t.chunk(world, dim=1)[rank]  # noqa: E731
    return Case("DistributedAttention", m, lambda mm, x: (mm(x).tanh() ** 2).sum(), _ulysses_ref, local(x_full),
                x_full, x2_full, ["qkv.weight", "qkv.bias"], local=local, reduce=_summed(group), per_sample=0,
                extra={"penalty_parts": _slice_norms(world, 1)})


def _rope_tables():
    pos = torch.arange(S, dtype=torch.float64)
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    ang = torch.cat([torch.outer(pos, inv)] * 2, dim=-1)[:, None, None, :]
    return ang.cos(), ang.sin()


def _rope(t, cos, sin):
    a, b = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-b, a), dim=-1) * sin


def _fpdt_attention_case(group, rank, world) -> Case:
    from deepspeed_c.sequence.fpdt_layer import FPDT_Attention, token_order

    torch.manual_seed(1)
    chunk = 4
    cfg = SimpleNamespace(kv_channels=HD, num_attention_heads=HEADS, num_key_value_heads=HEADS, hidden_size=H,
                          attention_dropout=0.0)
    p = lambda *s: torch.nn.Parameter(torch.randn(*s) * 0.3)  # noqa: E731
    m = FPDT_Attention(cfg, p(3 * HEADS * HD, H), p(3 * HEADS * HD), p(H, HEADS * HD), None, group, chunk_size=chunk)
    cos, sin = _rope_tables()
    mine = token_order(S, chunk, world).view(world, -1)[rank]

    def ref(w, x):  # x [S, B, H] in sequence order
        qkv = x @ w["qkv_linear_weight"].t() + w["qkv_linear_bias"]
        q, k, v = (t.reshape(S, x.shape[1], HEADS, HD).permute(1, 0, 2, 3) for t in qkv.chunk(3, dim=-1))
        c, s_ = cos.permute(1, 0, 2, 3), sin.permute(1, 0, 2, 3)
        o = _causal(_rope(q, c, s_), _rope(k, c, s_), v).flatten(2).permute(1, 0, 2) @ w["qkv_dense_weight"].t()
        return (o.tanh() ** 2).sum()

    x_full, x2_full = torch.randn(S, B, H), torch.randn(S, B, H)
    loss = lambda mm, x: (mm(x, None, None, (cos.float(), sin.float()))[0].tanh() ** 2).sum()  # noqa: E731
    return Case("FPDT_Attention", m, loss, ref, x_full[mine], x_full, x2_full,
                ["qkv_linear_weight", "qkv_linear_bias", "qkv_dense_weight"], local=lambda t: t[mine],
                reduce=_summed(group), create_graph_may_raise=True, per_sample=1)


class _LossHead(torch.nn.Module):
    def __init__(self, group, rank, world, labels) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(11, H) * 0.5)
        self.group, self.rank, self.world, self.labels = group, rank, world, labels

    def forward(self, x):
        from deepspeed_c.sequence.fpdt_layer import FPDT_LogitsLoss

        return FPDT_LogitsLoss.apply(x, self.labels, self.w, self.rank, self.world, self.group, 2)


def _fpdt_loss_case(group, rank, world) -> Case:
    from deepspeed_c.sequence.fpdt_layer import token_order

    torch.manual_seed(2)
    labels = torch.randint(0, 11, (B, S))
    labels[0, 3] = -100  # ignored token
    order = token_order(S, 4, world)
    mine = order.view(world, -1)[rank]
    coef = torch.rand(S, B, dtype=torch.float64)  # the same scalar on every rank, from the gathered losses
    m = _LossHead(group, rank, world, labels[:, mine])

    def ref(w, x):
        ce = F.cross_entropy((x @ w["w"].t()).reshape(-1, 11), labels.t().reshape(-1), ignore_index=-100,
                             reduction="none").view(S, B)
        return (ce[order].tanh() * coef).sum()

    x_full, x2_full = torch.randn(S, B, H), torch.randn(S, B, H)
    return Case("FPDT_LogitsLoss", m, lambda mm, x: (mm(x).tanh() * coef.float()).sum(), ref, x_full[mine], x_full,
                x2_full, ["w"], local=lambda t: t[mine], reduce=_summed(group), create_graph_may_raise=True)


def _moe_case(group, rank, world) -> Case:
    from deepspeed_c import comm as dist
    from deepspeed_c.moe.experts import Experts
    from deepspeed_c.moe.sharded_moe import MOELayer, TopKGate

    E, T = 4, 6
    local_e = E // world
    torch.manual_seed(3)
    experts = [torch.nn.Sequential(torch.nn.Linear(H, 12), torch.nn.Tanh(), torch.nn.Linear(12, H)) for _ in range(E)]
    gate = TopKGate(H, E, k=1, capacity_factor=float(E), min_capacity=0, use_rts=False)  # no drops: capacity >= T
    ex = Experts(experts[0], local_e)
    for j in range(local_e):
        ex.deepspeed_experts[j].load_state_dict(experts[rank * local_e + j].state_dict())
    m = MOELayer(gate, ex, "ep", world, local_e)
    m._set_ep_group(group)
    remote = [{n: t.detach().double() for n, t in e.state_dict().items()} for e in experts]

    def ref(p, x):  # all tokens, all experts; this rank's experts from p (differentiated)
        gates = (x @ p["gate.wg.weight"].t()).softmax(-1)
        idx = gates.argmax(-1)
        rows = []
        for t, e in enumerate(idx.tolist()):
            pe = remote[e]
            if e // local_e == rank:
                pre = f"experts.deepspeed_experts.{e % local_e}."
                pe = {n: p[pre + n] for n in pe}
            rows.append(torch.tanh(x[t] @ pe["0.weight"].t() + pe["0.bias"]) @ pe["2.weight"].t() + pe["2.bias"])
        return ((gates.gather(1, idx[:, None]) * torch.stack(rows)).tanh() ** 2).sum()

    def reduce(name: str, g: torch.Tensor) -> torch.Tensor:
        if name.startswith("gate."):  # replicated: each rank holds its tokens' part
            dist.all_reduce(g, group=group)
        return g  # a local expert's gradient is whole on its rank (the exchange brings every token's part)

    x_full, x2_full = torch.randn(world * T, H), torch.randn(world * T, H)
    local = lambda t: t.chunk(world, dim=0)[rank]  # noqa: E731
    return Case("MOELayer", m, lambda mm, x: (mm(x).tanh() ** 2).sum(), ref, local(x_full), x_full, x2_full,
                ["gate.wg.weight", "experts.deepspeed_experts.1.0.weight"], local=local, reduce=reduce,
                extra={"penalty_parts": _slice_norms(world, 0)})


def _body(rank: int, world: int) -> bool:
    import torch.distributed as tdist

    group = tdist.new_group(list(range(world)))
    # the penalty is on x: a replicated weight's gradient is a per-rank part, whose norm the reference lacks
    for make in (_ulysses_case, _fpdt_attention_case, _fpdt_loss_case, _moe_case):
        check_paths(make(group, rank, world))
    return True


def test_autograd_paths_sequence_and_expert_parallel():
    assert run_distributed(_body, world_size=2) == [True, True]
