"""The GPU paths of deepspeed_c's custom autograd Functions under the ways users call autograd
(tests/unit/autograd_calls.py: autograd.grad, backward(inputs=[x]), create_graph penalties on x and on a weight,
torch.func grad and vmap(grad), two accumulated backwards), each against a float64 plain-torch reference computed
on the same GPU:
- DS4Sci_EvoformerAttention in bf16 and fp16 (the flash-style CUDA kernels; fp32 takes the torch path), with a
  learnt mask bias and pair bias; create_graph recomputes through plain torch;
- SparseSelfAttention's kernel Function (op sparse_attn) in fp16 and bf16, block 16;
- MOELayer top-1 / top-2 (the CUDA gating op: select, plan, dispatch / combine and their backward moves), fp32;
  vmap(grad) must raise naming vmap (capacity couples a batch's tokens);
- random-LTD GatherTokens / ScatterTokens (the CUDA token kernels), both layouts, fp32;
- TiledMLP, TiledFusedLogitsLoss, sequence_tiled_compute and FPDT_FFN (with and without add_bias) on cuda, fp32.
Tolerances, norm-wise relative per tensor: fp32 as autograd_calls.TOL with TF32 off (cuBLAS would otherwise round
fp32 matmul inputs to 10 mantissa bits); the half kernels' inputs and outputs are rounded to bf16 / fp16, so
every check there has one bound, HALF_TOL: 2e-2 for bf16 (8 mantissa bits: 2^-9 relative rounding per element,
amplified through the softmax and the loss; the chunked torch path on the same inputs measures up to 6e-3) and 5e-3
for fp16 (11 bits; measured up to 7e-4).
Each case also asserts the path it means to test ran: the Function's own forward and backward on the device (a
wrapper counts the calls) and, on a GPU, the op's CUDA entry points in forward and in backward (a wrapper around
the built op counts calls and the devices of their tensors; the results are the op's own).
Skipped without CUDA. DSC_AUTOGRAD_CUDA_ON_CPU=1 runs the same cases on the CPU to check this file's logic (the
sparse op by the host stand-in of test_autograd_calls_ops, the CUDA-entry assertions skipped)."""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.unit.autograd_calls import ALL, TOL, Case, failures, run, run_raises

ON_CPU = os.environ.get("DSC_AUTOGRAD_CUDA_ON_CPU") == "1"
GPU = torch.cuda.is_available() and not ON_CPU
DEV = torch.device("cuda" if GPU else "cpu")
pytestmark = pytest.mark.skipif(not GPU and not ON_CPU, reason="needs a CUDA GPU (DSC_AUTOGRAD_CUDA_ON_CPU=1 runs "
                                "the same cases on the CPU without the GPU-path assertions)")

HALF_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def half(dtype: torch.dtype) -> dict[str, float]:
    """failures' per-check scale that makes every bound HALF_TOL[dtype]."""
    return {k: HALF_TOL[dtype] / t for k, t in TOL.items()}


PLAIN = ("grad", "backward", "inputs", "cg_x", "cg_w", "accum")  # the checks that run the Functions themselves


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


# -- call counting ------------------------------------------------------------------------------------------
class Calls:
    """(tag, name, phase, device types of the tensor arguments) of every counted call; phase 'bwd' when autograd's
    engine is running a node (the call came from a backward), else 'fwd'."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str, frozenset]] = []

    def note(self, tag: str, name: str, args: Iterable[Any]) -> None:
        devices = frozenset(a.device.type for a in args if isinstance(a, torch.Tensor))
        phase = "bwd" if torch._C._current_autograd_node() is not None else "fwd"
        self.log.append((tag, name, phase, devices))

    def ran(self, start: int, tag: str, what: str) -> None:
        """Since log[start]: `tag` called in forward and in backward, every call's tensors on DEV."""
        mine = [c for c in self.log[start:] if c[0] == tag]
        assert {c[2] for c in mine} == {"fwd", "bwd"}, f"{what}: {tag} not called in forward and backward: {mine}"
        off = [c for c in mine if c[3] != {DEV.type}]
        assert not off, f"{what}: {tag} called with tensors off {DEV.type}: {off}"


class _Counted:
    """A built op whose calls are counted, then passed to the op unchanged."""

    def __init__(self, op: Any, tag: str, calls: Calls) -> None:
        self._op, self._tag, self._calls = op, tag, calls

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._op, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._calls.note(self._tag, name, args)
            return attr(*args, **kwargs)
        return call


def count_function(monkeypatch, cls: type, calls: Calls) -> str:
    """Count cls's forward and backward calls (torch looks both up on the class at each call)."""
    for phase in ("forward", "backward"):
        fn = cls.__dict__[phase].__func__

        def wrapped(ctx: Any, *args: Any, _fn: Callable = fn, _phase: str = phase) -> Any:
            calls.note(cls.__name__, _phase, args)
            return _fn(ctx, *args)
        monkeypatch.setattr(cls, phase, staticmethod(wrapped))
    return cls.__name__


def count_op(monkeypatch, module: Any, getter: str, tag: str, calls: Calls) -> str:
    """Wrap `module.getter` (the function that returns the built op) so the op it returns counts its calls."""
    original = getattr(module, getter)

    def counted(*args: Any) -> Any:
        op = original(*args)
        return None if op is None else _Counted(op, tag, calls)
    monkeypatch.setattr(module, getter, counted)
    return tag


def check(name: str, case: Case, calls: Calls, nodes: list[str], kernels: list[str], checks: tuple = ALL,
          scale: Any = 1.0) -> dict[str, list]:
    """run() one check at a time: each PLAIN check must have run every node (both modes) and every kernel tag
    (on a GPU); then all errors within TOL * scale. Returns each check's counted calls."""
    errs: dict[str, float] = {}
    logged: dict[str, list] = {}
    for c in checks:
        start = len(calls.log)
        errs.update(run(case, (c,)))
        logged[c] = calls.log[start:]
        if c in PLAIN:
            for tag in nodes + (kernels if GPU else []):
                calls.ran(start, tag, f"{name} {c}")
    bad = failures(errs, scale)
    assert not bad, f"{name} on {DEV.type}: {bad} (all: {errs})"
    return logged


def _params64(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().double() for k, v in module.named_parameters()}


def _lin(x: torch.Tensor, p: dict, name: str) -> torch.Tensor:
    return x @ p[f"{name}.weight"].t() + p[f"{name}.bias"]


# -- DS4Sci_EvoformerAttention ------------------------------------------------------------------------------
EN, EL, EH, ED = 2, 5, 2, 8  # N, L (not a tile multiple), H, D


class _Evo(torch.nn.Module):
    """x [batch, 16] -> q, k, v [batch, N, L, H, D] (non-contiguous views) in `dtype`, a learnt mask bias (plus a
    fixed -1e9 on one key of n=1) and a learnt pair bias; the output back in fp32."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.qkv = torch.nn.Linear(16, 3 * EN * EL * EH * ED)
        self.mask = torch.nn.Parameter(0.5 * torch.randn(1, EN, 1, 1, EL))
        self.pair = torch.nn.Parameter(torch.randn(1, 1, EH, EL, EL))
        hard = torch.zeros(1, EN, 1, 1, EL)
        hard[0, 1, 0, 0, 3] = -1e9
        self.register_buffer("hard", hard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed_c.ops.deepspeed4science import DS4Sci_EvoformerAttention

        B, dt = x.shape[0], self.dtype
        q, k, v = self.qkv(x).view(B, EN, EL, EH, 3 * ED).split(ED, dim=-1)
        biases = [(self.mask + self.hard).expand(B, EN, 1, 1, EL).to(dt), self.pair.expand(B, 1, EH, EL, EL).to(dt)]
        return DS4Sci_EvoformerAttention(q.to(dt), k.to(dt), v.to(dt), biases).float().reshape(B, -1)


def _evo_ref(hard: torch.Tensor) -> Callable:
    def ref(p: dict, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        q, k, v = (t.permute(0, 1, 3, 2, 4) for t in _lin(x, p, "qkv").view(B, EN, EL, EH, 3 * ED).split(ED, dim=-1))
        s = q @ k.transpose(-1, -2) / math.sqrt(ED) + (p["mask"] + hard.double()) + p["pair"]
        return (torch.softmax(s, dim=-1) @ v).permute(0, 1, 3, 2, 4).reshape(B, -1)
    return ref


def test_evoformer_attention_kernels(monkeypatch) -> None:
    from deepspeed_c.ops.deepspeed4science import evoformer_attn

    calls = Calls()
    nodes = [count_function(monkeypatch, evoformer_attn.EvoformerFusedAttention, calls)]
    kernels = [count_op(monkeypatch, evoformer_attn, "cuda_op", "evoformer_attn op", calls)]
    for dtype in (torch.bfloat16, torch.float16):
        torch.manual_seed(3)
        m = _Evo(dtype).to(DEV)
        case = Case(m, _evo_ref(m.hard), _params64(m), torch.randn(3, 16).to(DEV), "qkv.weight")
        check(f"evoformer {dtype}", case, calls, nodes, kernels, scale=half(dtype))
        case.weight = "pair"  # the create_graph penalty on the pair bias (its gradient is the kernel's dbias2)
        check(f"evoformer {dtype} (pair)", case, calls, nodes, kernels, ("cg_w",), scale=half(dtype))


# -- sparse attention ----------------------------------------------------------------------------------------
SH, SL, SD, BLOCK = 2, 32, 8, 16  # heads, sequence, head dim, the kernels' smallest block
LAYOUT = torch.tensor([[[1, 0], [1, 1]], [[1, 1], [0, 1]]], dtype=torch.bool)  # [H, nb, nb]
SCALE = 1.0 / math.sqrt(SD)


class _Sparse(torch.nn.Module):
    def __init__(self, tables: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.qkv, self.tables, self.dtype = torch.nn.Linear(8, 3 * SH * SL * SD), tables, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed_c.ops.sparse_attention.kernel import sparse_attention_cuda

        B, dt = x.shape[0], self.dtype
        q, k, v = self.qkv(x).view(B, SH, SL, 3 * SD).split(SD, dim=-1)
        return sparse_attention_cuda(q.to(dt), k.to(dt), v.to(dt), self.tables, BLOCK, SCALE).float().reshape(B, -1)


def _sparse_ref(p: dict, x: torch.Tensor) -> torch.Tensor:
    from deepspeed_c.ops.sparse_attention.reference import token_mask

    B = x.shape[0]
    q, k, v = _lin(x, p, "qkv").view(B, SH, SL, 3 * SD).split(SD, dim=-1)
    s = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~token_mask(LAYOUT, BLOCK).to(x.device), float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).reshape(B, -1)


def test_sparse_attention_kernels(monkeypatch) -> None:
    from deepspeed_c.ops.sparse_attention import kernel

    calls = Calls()
    if not GPU:  # the host stand-in for the CUDA op (first-order, as the kernels)
        from tests.unit.test_autograd_calls_ops import _SparseHostOp

        host = _SparseHostOp(LAYOUT)
        monkeypatch.setattr(kernel, "cuda_op", lambda: host)
    nodes = [count_function(monkeypatch, kernel.SparseAttentionFunction, calls)]
    kernels = [count_op(monkeypatch, kernel, "cuda_op", "sparse_attn op", calls)]
    tables = kernel.BlockTables.from_layout(LAYOUT, DEV)
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(4)
        m = _Sparse(tables, dtype).to(DEV)
        case = Case(m, _sparse_ref, _params64(m), torch.randn(3, 8).to(DEV), "qkv.weight")
        if GPU:
            assert kernel.kernel_supports(torch.empty(1, SH, SL, SD, dtype=dtype, device=DEV), BLOCK)
        check(f"sparse attention {dtype}", case, calls, nodes, kernels, scale=half(dtype))


# -- MoE -----------------------------------------------------------------------------------------------------
MH, E = 8, 4


def _moe(k: int) -> tuple[torch.nn.Module, Callable]:
    from deepspeed_c.moe.experts import Experts
    from deepspeed_c.moe.sharded_moe import MOELayer, TopKGate

    gate = TopKGate(MH, E, k=k, capacity_factor=float(E), min_capacity=0, use_rts=False,
                    top2_2nd_expert_sampling=False)  # capacity >= tokens: no drops
    ex = Experts(torch.nn.Sequential(torch.nn.Linear(MH, 12), torch.nn.Tanh(), torch.nn.Linear(12, MH)), E)
    for p in ex.parameters():
        p.data.normal_(0, 0.4)
    m = MOELayer(gate, ex, "ep", 1, E).to(DEV)

    def ref(p: dict, x: torch.Tensor) -> torch.Tensor:
        gates = (x @ p["gate.wg.weight"].t()).softmax(-1)
        idx = gates.topk(k, -1).indices
        w = gates.gather(1, idx)
        w = w / w.sum(1, keepdim=True) if k > 1 else w
        out = 0
        for r in range(k):
            rows = [_lin(torch.tanh(_lin(x[t], p, f"experts.deepspeed_experts.{e}.0")), p,
                         f"experts.deepspeed_experts.{e}.2") for t, e in enumerate(idx[:, r].tolist())]
            out = out + w[:, r:r + 1] * torch.stack(rows)
        return out
    return m, ref


def test_moe_gating_dispatch_combine(monkeypatch) -> None:
    from deepspeed_c.moe import gating_core

    calls = Calls()
    nodes = [count_function(monkeypatch, gating_core.Dispatch, calls),
             count_function(monkeypatch, gating_core.Combine, calls)]
    kernels = [count_op(monkeypatch, gating_core, "op_for", "moe gating op", calls)]
    for k in (1, 2):
        torch.manual_seed(5)
        m, ref = _moe(k)
        x = torch.randn(16, MH).to(DEV)
        chosen = (x.double() @ m.gate.wg.weight.detach().double().t()).topk(k, -1).indices
        assert chosen.unique().numel() == E, "the case must route tokens to every expert (else some have no grad)"
        case = Case(m, ref, _params64(m), x, "gate.wg.weight", vmap=False)
        logged = check(f"moe top-{k}", case, calls, nodes, kernels)
        if GPU:  # under torch.func.grad the routing read its inputs through the wrappers: the CUDA op ran
            assert any(c[0] == "moe gating op" and c[3] == {"cuda"} for c in logged["func"]), logged["func"]
        case.weight = "experts.deepspeed_experts.1.0.weight"
        check(f"moe top-{k} (expert weight)", case, calls, nodes, kernels, ("cg_w",))
        params = {n: p.detach() for n, p in m.named_parameters()}
        per_sample = torch.func.vmap(torch.func.grad(lambda p, xx: torch.func.functional_call(m, p, (xx[None],))
                                                     .sum()), in_dims=(None, 0))
        assert run_raises(lambda: per_sample(params, x), "vmap"), "MoE under vmap(grad): no clear error"


# -- random-LTD ----------------------------------------------------------------------------------------------
B, S, H, V = 2, 6, 8, 11


class _Ltd(torch.nn.Module):
    """x [B, S, H] (seq-first inside when not batch_first) -> gather the kept tokens, a layer on them, scatter."""

    def __init__(self, idx: torch.Tensor, batch_first: bool) -> None:
        super().__init__()
        self.lin, self.idx, self.batch_first = torch.nn.Linear(H, H), idx, batch_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed_c.ops.random_ltd.dropping_utils import GatherTokens, ScatterTokens

        x = x if self.batch_first else x.transpose(0, 1).contiguous()
        h, part = GatherTokens.apply(x, self.idx, self.batch_first)
        out = ScatterTokens.apply(h, self.lin(part).tanh(), self.idx, self.batch_first)
        return out if self.batch_first else out.transpose(0, 1)


def test_random_ltd_token_kernels(monkeypatch) -> None:
    from deepspeed_c.ops.random_ltd import dropping_utils, token_ops

    calls = Calls()
    nodes = [count_function(monkeypatch, dropping_utils._GatherTokensNode, calls),
             count_function(monkeypatch, dropping_utils._ScatterTokensNode, calls)]
    kernels = [count_op(monkeypatch, token_ops, "_op", "token kernels", calls)]
    torch.manual_seed(6)
    idx = torch.stack([torch.randperm(S)[:3].sort().values for _ in range(B)]).int().to(DEV)
    i = idx.long().unsqueeze(-1).expand(-1, -1, H)

    def ref(p: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.scatter(x, 1, i, _lin(torch.gather(x, 1, i), p, "lin").tanh())

    for batch_first in (True, False):
        m = _Ltd(idx, batch_first).to(DEV)
        # vmap left out: the indices are per sample of the whole batch
        case = Case(m, ref, _params64(m), torch.randn(B, S, H).to(DEV), "lin.weight", vmap=False)
        check(f"random-LTD batch_first={batch_first}", case, calls, nodes, kernels)


# -- ALST tiling and FPDT_FFN --------------------------------------------------------------------------------
class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(H, 16), torch.nn.Linear(16, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed_c.runtime.sequence_parallel.tiled_compute import TiledMLP

        return TiledMLP.apply(lambda m, t: m.down(torch.tanh(m.up(t))), self, x, 3, list(self.parameters()))


class _Head(torch.nn.Module):
    """The tiled cross-entropy of an lm head, as a 1-element output (vmap left out: y is the whole batch's)."""

    def __init__(self, y: torch.Tensor) -> None:
        super().__init__()
        self.lm, self.y = torch.nn.Linear(H, V), y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed_c.runtime.sequence_parallel.tiled_compute import TiledFusedLogitsLoss

        return TiledFusedLogitsLoss.apply(lambda m, xt, yt: F.cross_entropy(m.lm(xt), yt), self, x, self.y, None, 3,
                                          list(self.parameters()), "mean").reshape(1)


class _Tiled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # 3 tiles of 2 positions, joined on dim 1
        from deepspeed_c.runtime.sequence_parallel.tiled_compute import sequence_tiled_compute

        return sequence_tiled_compute(lambda x: self.lin(x).tanh(), S, 3, {"x": x}, {}, "x", list(self.parameters()),
                                      1, None)


class _Ffn(torch.nn.Module):
    """x [B, S, H] -> FPDT_FFN over [S, B, H] in chunks of 2 rows (3 chunks)."""

    def __init__(self, add_bias: bool) -> None:
        super().__init__()
        r = lambda *s: torch.nn.Parameter(torch.randn(*s) * 0.3)  # noqa: E731
        self.w1, self.b1, self.w2, self.b2, self.add_bias = r(16, H), r(16), r(H, 16), r(H), add_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed_c.sequence.fpdt_ffn import FPDT_FFN

        out, bias = FPDT_FFN.apply(x.transpose(0, 1), self.w1, self.b1, self.w2, self.b2, self.add_bias, 2)
        return (out if bias is None else out + bias).transpose(0, 1)


def test_tiled_compute_and_fpdt_ffn(monkeypatch) -> None:
    from deepspeed_c.runtime.sequence_parallel import tiled_compute as T
    from deepspeed_c.sequence import fpdt_ffn
    from deepspeed_c.sequence.fpdt_ffn import bias_gelu

    calls = Calls()
    torch.manual_seed(7)
    x = torch.randn(B, S, H).to(DEV)
    y = torch.randint(0, V, (B, S)).to(DEV)
    cases = [
        ("TiledMLP", T._TiledMLPNode, _Mlp(), lambda p, x: _lin(torch.tanh(_lin(x, p, "up")), p, "down"),
         "up.weight", True),
        ("TiledFusedLogitsLoss", T._TiledFusedLogitsLossNode, _Head(y),
         lambda p, x: F.cross_entropy(_lin(x, p, "lm").reshape(-1, V), y.reshape(-1)).reshape(1), "lm.weight", False),
        ("sequence_tiled_compute", T._SequenceTiledComputeNode, _Tiled(), lambda p, x: _lin(x, p, "lin").tanh(),
         "lin.weight", True),
    ]
    for add_bias in (True, False):
        cases.append((f"FPDT_FFN add_bias={add_bias}", fpdt_ffn._FPDTFFNNode, _Ffn(add_bias),
                      lambda p, x: bias_gelu(x @ p["w1"].t() + p["b1"]) @ p["w2"].t() + p["b2"], "w1", True))
    for node in {c[1] for c in cases}:
        count_function(monkeypatch, node, calls)
    for name, node, module, ref, weight, vmap in cases:
        m = module.to(DEV)
        check(name, Case(m, ref, _params64(m), x, weight, vmap=vmap), calls, [node.__name__], [])
