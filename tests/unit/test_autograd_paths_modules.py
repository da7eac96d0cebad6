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


def test_tiled_weights_user_hooks_see_each_tile_once():
    """A user's tensor hooks on the tiled weights (TiledMLP, TiledFusedLogitsLoss, sequence_tiled_compute): each
    tile's gradient passes them once, as DeepSpeed's nested per-tile backward does, so the gradients a recording
    hook sees sum to the whole gradient and a scaling hook scales .grad exactly once. Reference: the same math
    untiled in plain torch, the same hooks (called once there, with the whole gradient)."""
    torch.manual_seed(0)
    y = torch.randint(0, V, (B, S))
    for name, tiled, plain in (
            ("TiledMLP", _Mlp(), lambda m, x: m.down(torch.tanh(m.up(x)))),
            ("TiledFusedLogitsLoss", _Head(y), lambda m, x: F.cross_entropy(m.lm(x).flatten(0, 1), y.flatten())),
            ("sequence_tiled_compute", _Tiled(), lambda m, x: m.lin(x).tanh())):
        ref = type(tiled)(y) if name == "TiledFusedLogitsLoss" else type(tiled)()
        ref.load_state_dict(tiled.state_dict())
        x = torch.randn(B, S, H)
        grads = {}
        for label, module, fn in (("tiled", tiled, lambda m, t: m(t)), ("plain", ref, plain)):
            seen = []
            w = next(module.parameters())  # the first weight: recorded and halved by the user's hooks
            handles = [w.register_hook(lambda g, seen=seen: seen.append(g.clone())),
                       w.register_hook(lambda g: g * 0.5)]
            fn(module, x.clone().requires_grad_(True)).pow(2).sum().backward()
            for h in handles:
                h.remove()
            grads[label] = (sum(seen), w.grad.clone(), len(seen))
        (seen_t, grad_t, calls_t), (seen_p, grad_p, _) = grads["tiled"], grads["plain"]
        assert calls_t == 3, f"{name}: the recording hook ran {calls_t} times for 3 tiles"
        assert float((seen_t - seen_p).norm() / seen_p.norm()) < 1e-5, f"{name}: the hooks saw another gradient"
        assert float((grad_t - grad_p).norm() / grad_p.norm()) < 1e-5, f"{name}: .grad differs (a hook ran twice)"
