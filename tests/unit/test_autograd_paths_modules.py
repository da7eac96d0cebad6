"""ALST's tiled computations (TiledMLP, TiledFusedLogitsLoss, sequence_tiled_compute), random-LTD's
GatherTokens/ScatterTokens, FPDT_FFN and the MoE layer's dispatch/combine under the ways users call autograd
(tests/distributed/autograd_path_checks.py: autograd.grad, backward(inputs=[x]), a create_graph penalty on x
and on a weight, torch.func grad and vmap(grad), two accumulated backwards), fp32 against a float64 plain-torch
reference of the same math."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deepspeed_c.moe.experts import Experts
from deepspeed_c.moe.sharded_moe import MOELayer, TopKGate
from deepspeed_c.ops.random_ltd.dropping_utils import GatherTokens, ScatterTokens
from deepspeed_c.runtime.sequence_parallel.tiled_compute import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute
from deepspeed_c.sequence.fpdt_ffn import FPDT_FFN, bias_gelu
from tests.distributed.autograd_path_checks import Case, check_paths

B, S, H, V = 2, 6, 8, 11


def _lin(x, p, name):
    return x @ p[f"{name}.weight"].t() + p[f"{name}.bias"]


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(H, 16), torch.nn.Linear(16, H)

    def forward(self, x):
        return TiledMLP.apply(lambda m, t: m.down(torch.tanh(m.up(t))), self, x, 3, list(self.parameters()))


class _Head(torch.nn.Module):
    def __init__(self, y) -> None:
        super().__init__()
        self.lm, self.y = torch.nn.Linear(H, V), y

    def forward(self, x):
        return TiledFusedLogitsLoss.apply(lambda m, xt, yt: F.cross_entropy(m.lm(xt), yt), self, x, self.y, None, 3,
                                          list(self.parameters()), "mean")


class _Tiled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(H, H)

    def forward(self, x):  # 3 tiles of 2 positions, the outputs joined on dim 1
        return sequence_tiled_compute(lambda x: self.lin(x).tanh(), S, 3, {"x": x}, {}, "x", list(self.parameters()),
                                      1, None)


class _Ltd(torch.nn.Module):
    def __init__(self, idx, batch_first) -> None:
        super().__init__()
        self.lin, self.idx, self.batch_first = torch.nn.Linear(H, H), idx, batch_first

    def forward(self, x):
        h, part = GatherTokens.apply(x, self.idx, self.batch_first)
        return ScatterTokens.apply(h, self.lin(part).tanh(), self.idx, self.batch_first)


class _Ffn(torch.nn.Module):
    def __init__(self, add_bias) -> None:
        super().__init__()
        r = lambda *s: torch.nn.Parameter(torch.randn(*s) * 0.3)  # noqa: E731
        self.w1, self.b1, self.w2, self.b2, self.add_bias = r(16, H), r(16), r(H, 16), r(H), add_bias

    def forward(self, x):
        out, bias = FPDT_FFN.apply(x, self.w1, self.b1, self.w2, self.b2, self.add_bias, 2)
        return out if bias is None else out + bias


def _moe(k):
    E = 4
    gate = TopKGate(H, E, k=k, capacity_factor=float(E), min_capacity=0, use_rts=False,
                    top2_2nd_expert_sampling=False)  # capacity >= tokens: no drops
    ex = Experts(torch.nn.Sequential(torch.nn.Linear(H, 12), torch.nn.Tanh(), torch.nn.Linear(12, H)), E)
    for p in ex.parameters():
        p.data.normal_(0, 0.4)
    m = MOELayer(gate, ex, "ep", 1, E)

    def ref(p, x):
        gates = (x @ p["gate.wg.weight"].t()).softmax(-1)
        idx = gates.topk(k, -1).indices
        w = gates.gather(1, idx)
        w = w / w.sum(1, keepdim=True) if k > 1 else w
        out = 0
        for r in range(k):
            rows = [_lin(torch.tanh(_lin(x[t], p, f"experts.deepspeed_experts.{e}.0")), p,
                         f"experts.deepspeed_experts.{e}.2") for t, e in enumerate(idx[:, r].tolist())]
            out = out + w[:, r:r + 1] * torch.stack(rows)
        return (out.tanh() ** 2).sum()
    return m, ref


def _cases():
    torch.manual_seed(0)
    x, x2 = torch.randn(B, S, H), torch.randn(B, S, H)
    y = torch.randint(0, V, (B, S))
    sq = lambda f: (lambda m, xx: (f(m(xx)) ** 2).sum())  # noqa: E731
    yield Case("TiledMLP", _Mlp(), sq(torch.tanh),
               lambda p, x: (_lin(torch.tanh(_lin(x, p, "up")), p, "down").tanh() ** 2).sum(), x, x, x2,
               ["up.weight", "down.bias"], per_sample=0)
    yield Case("TiledFusedLogitsLoss", _Head(y), lambda m, xx: m(xx),
               lambda p, x: F.cross_entropy(_lin(x, p, "lm").reshape(-1, V), y.reshape(-1)), x, x, x2, ["lm.weight"])
    yield Case("SequenceTiledCompute", _Tiled(), sq(lambda t: t), lambda p, x: (_lin(x, p, "lin").tanh() ** 2).sum(),
               x, x, x2, ["lin.weight", "lin.bias"])
    idx = torch.stack([torch.randperm(S)[:3].sort().values for _ in range(B)]).int()
    pos = torch.arange(S, dtype=torch.float64)
    for batch_first in (True, False):
        xl, xl2 = (x, x2) if batch_first else (x.transpose(0, 1).contiguous(), x2.transpose(0, 1).contiguous())
        shape = (1, S, 1) if batch_first else (S, 1, 1)

        def ltd_ref(p, x, batch_first=batch_first, shape=shape):
            i = (idx.long() if batch_first else idx.long().t()).unsqueeze(-1).expand(-1, -1, H)
            dim = 1 if batch_first else 0
            part = _lin(torch.gather(x, dim, i), p, "lin").tanh()
            return (torch.scatter(x, dim, i, part) ** 2 * pos.view(shape)).sum()
        yield Case("GatherTokens", _Ltd(idx, batch_first), lambda m, xx, shape=shape: (
            m(xx) ** 2 * pos.float().view(shape)).sum(), ltd_ref, xl, xl, xl2, ["lin.weight"])
    xs, xs2 = torch.randn(S, B, H), torch.randn(S, B, H)
    for add_bias in (True, False):
        yield Case("FPDT_FFN", _Ffn(add_bias), sq(torch.tanh),
                   lambda p, x: ((bias_gelu(x @ p["w1"].t() + p["b1"]) @ p["w2"].t() + p["b2"]).tanh() ** 2).sum(),
                   xs, xs, xs2, ["w1", "b1", "b2"], per_sample=1)
    for k in (1, 2):
        m, ref = _moe(k)
        xt, xt2 = torch.randn(10, H), torch.randn(10, H)
        yield Case("MOELayer", m, sq(torch.tanh), ref, xt, xt, xt2,
                   ["gate.wg.weight", "experts.deepspeed_experts.1.0.weight"])


def test_autograd_paths_tiled_ltd_ffn_moe():
    for case in _cases():
        for target in ("x", case.weights[0]):
            case.penalty_on = target
            check_paths(case)


def _hooked_grads(weight: torch.Tensor, run) -> tuple:
    """Runs `run()` with a recording and a halving hook on `weight`: (sum of the gradients the hooks saw,
    weight.grad, number of hook calls)."""
    seen: list = []
    handles = [weight.register_hook(lambda g: seen.append(g.detach().double().clone())),
               weight.register_hook(lambda g: g * 0.5)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return sum(seen), weight.grad.detach().double().clone(), len(seen)


def test_user_hooks_see_each_gradient_once():
    """A user's tensor hooks on a weight of every module above, in a plain backward and in a create_graph
    penalty on x: the gradients the hooks see sum to the weight's whole gradient and a halving hook halves
    .grad once, as in plain torch (float64 reference of the same math, the same hooks). Tiled modules call
    them once per tile in the fast path (DeepSpeed's per-tile backward): 3 calls for 3 tiles. Before, the
    tiled nodes and the create_graph recomputations ran them twice on the gradients they return to autograd."""
    for case in _cases():
        weight = case.weights[0]
        for form in ("backward", "penalty"):
            module = case.module
            module.zero_grad(set_to_none=True)
            params = {n: p.detach().double().requires_grad_(True) for n, p in module.named_parameters()}

            def run(fn, x, form=form):
                x = x.clone().requires_grad_(True)
                loss = fn(x)
                if form == "penalty":
                    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
                    loss = loss + (gx ** 2).sum()
                loss.backward()

            got = _hooked_grads(dict(module.named_parameters())[weight], lambda: run(lambda x: case.loss(module, x),
                                                                                    case.x))
            want = _hooked_grads(params[weight], lambda: run(lambda x: case.ref(params, x), case.x_full.double()))
            what = f"{case.name} {weight} ({form})"
            assert float((got[0] - want[0]).norm() / want[0].norm()) < case.tol, f"{what}: the hooks saw another sum"
            assert float((got[1] - want[1]).norm() / want[1].norm()) < case.tol, f"{what}: .grad differs"
            tiled = case.name in ("TiledMLP", "TiledFusedLogitsLoss", "SequenceTiledCompute")
            calls = 3 if tiled else want[2]  # the tiled ones: once a tile; the others: as plain torch
            assert got[2] == calls, f"{what}: the hooks ran {got[2]} times, expected {calls}"
