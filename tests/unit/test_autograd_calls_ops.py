"""deepspeed_c's custom autograd Functions under the ways users call autograd (tests/unit/autograd_calls.py):
autograd.grad, backward(inputs=), create_graph penalties, torch.func grad / vmap and accumulation, each against a
float64 plain-torch reference of the same math, on CPU in one process:
- compression: the fake quantizers (straight-through) and TopKBinarizer inside LinearLayer_Compress layers
- DS4Sci_EvoformerAttention's torch path, and SparseSelfAttention's kernel Function driven by a host stand-in
  for the CUDA op (first-order only, as the kernels)
- deepspeed checkpointing.checkpoint (reentrant): .backward and torch.func right; autograd.grad, inputs= and
  create_graph raise naming what is unsupported."""
from __future__ import annotations

import math
import warnings

import torch

from tests.unit.autograd_calls import Case, failures, run, run_raises

H = 8


def _check(name: str, errs: dict[str, float]) -> None:
    bad = failures(errs)
    assert not bad, f"{name}: {bad} (all: {errs})"


# -- compression ------------------------------------------------------------------------------------------
def _ste(value_fp32: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The straight-through estimator in float64: the fp32 quantized value, the identity gradient."""
    return value_fp32.double() + (x - x.detach())


def _topk(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    keep = math.ceil(ratio * scores.numel())
    mask = torch.zeros(scores.numel(), dtype=torch.float64)
    mask[scores.detach().flatten().argsort(descending=True)[:keep]] = 1.0
    return mask.view(scores.shape) + (scores - scores.detach())


def _compression_case(kind: str) -> Case:
    from deepspeed_c.compression import quant_reference as R
    from deepspeed_c.compression.basic_layer import LinearLayer_Compress

    torch.manual_seed(1)
    a, b = LinearLayer_Compress(H, H), LinearLayer_Compress(H, 4)
    if kind == "sym8_sparse_act":
        a.enable_weight_quantization(8, 8, 1, True, "symmetric", 2)
        a.enable_sparse_pruning(0.5, "topk")
        a.sparse_pruning_enabled = True
        b.enable_weight_quantization(8, 8, 1, True, "asymmetric", 1)
        b.enable_activation_quantization(8, "asymmetric", "dynamic")
        b.activation_quantization_enabled = True
    else:  # binary / ternary weights, topk row pruning
        a.enable_weight_quantization(1, 1, 1, True, "symmetric", 2)
        b.enable_weight_quantization(2, 2, 1, True, "symmetric", 1)
        b.enable_row_pruning(0.5, "topk")
        b.row_pruning_enabled = True
    for layer in (a, b):
        layer.weight_quantization_enabled = True
    module = torch.nn.Sequential(a, torch.nn.Tanh(), b)
    full = {k: v.detach().double() for k, v in module.named_parameters()}

    def ref(p: dict, x: torch.Tensor) -> torch.Tensor:
        w0, w2 = p["0.weight"], p["2.weight"]
        if kind == "sym8_sparse_act":
            w0 = _ste(R.fake_quant(w0.detach().float(), 8, 2, False), w0) * _topk(p["0.sparse_mask_scores"], 0.5)
            w2 = _ste(R.fake_quant(w2.detach().float(), 8, 1, True), w2)
        else:
            w0 = _ste(R.binary(w0.detach().float(), 2), w0)
            w2 = _ste(R.ternary(w2.detach().float(), 1), w2) * _topk(p["2.row_mask_scores"], 0.5).view(-1, 1)
        h = torch.tanh(x @ w0.t() + p["0.bias"])
        bias2 = p["2.bias"]
        if kind == "sym8_sparse_act":
            h = _ste(R.fake_quant(h.detach().float(), 8, h.shape[0], True), h)  # one group per row
        else:
            bias2 = bias2 * _topk(p["2.row_mask_scores"], 0.5).view(-1)
        return h @ w2.t() + bias2

    return Case(module, ref, full, torch.randn(3, H), "0.weight")


class _Quantized(torch.nn.Module):
    """x -> activation quantizer -> weight fake-quantized by `quantizer`, masked by TopKBinarizer with a learnt
    (sigmoid) threshold: the Functions called as layers call them, under torch.func too."""

    def __init__(self, quantizer: str, bits: int, groups: int) -> None:
        super().__init__()
        self.quantizer, self.bits, self.groups = quantizer, bits, groups
        self.weight = torch.nn.Parameter(torch.randn(4, H))
        self.scores = torch.nn.Parameter(torch.randn(4, H))
        self.threshold = torch.nn.Parameter(torch.tensor([0.3]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed_c.compression import utils as U

        w = getattr(U, self.quantizer).apply(self.weight, self.bits, None, None, self.groups)
        x = U.AsymQuantizer.apply(x, 8, None, None, x.shape[0])  # dynamic: one group per row
        return x @ (w * U.TopKBinarizer.apply(self.scores, self.threshold, True)).t()


def _quantized_ref(quantizer: str, bits: int, groups: int, ratio: float):
    from deepspeed_c.compression import quant_reference as R

    def ref(p: dict, x: torch.Tensor) -> torch.Tensor:
        w = p["weight"].detach().float()
        value = {"SymQuantizer": lambda: R.fake_quant(w, bits, groups, False),
                 "AsymQuantizer": lambda: R.fake_quant(w, bits, groups, True),
                 "TernaryQuantizer": lambda: R.ternary(w, groups), "BinaryQuantizer": lambda: R.binary(w, groups)}
        w = _ste(value[quantizer](), p["weight"])
        x = _ste(R.fake_quant(x.detach().float(), 8, x.shape[0], True), x)
        mask = _topk(p["scores"], ratio)
        mask = mask + mask.detach() * (p["threshold"] - p["threshold"].detach())  # d/d threshold: sum(grad * mask)
        return x @ (w * mask).t()

    return ref


def test_compression_quantizers_autograd_calls() -> None:
    # LinearLayer_Compress under every call, torch.func's functional_call included (its substituted weights lack
    # the Parameter's MoQ attributes, which the forward used to read)
    for kind in ("sym8_sparse_act", "binary_ternary_rows"):
        _check(kind, run(_compression_case(kind)))
    for quantizer, bits, groups in (("SymQuantizer", 8, 2), ("AsymQuantizer", 4, 1), ("TernaryQuantizer", 2, 2),
                                    ("BinaryQuantizer", 1, 1)):
        torch.manual_seed(2)
        module = _Quantized(quantizer, bits, groups)
        ratio = torch.sigmoid(module.threshold.detach()).item()
        full = {k: v.detach().double() for k, v in module.named_parameters()}
        case = Case(module, _quantized_ref(quantizer, bits, groups, ratio), full, torch.randn(3, H), "weight")
        _check(quantizer, run(case))


def test_quant_act_calibration_under_torch_func() -> None:
    """QuantAct's training-mode range calibration: under torch.func.grad with the buffer passed to functional_call
    it updates the passed buffer as a plain forward would (momentum towards the batch's [min, max]); where a
    transform cannot write the buffer (vmap, a captured buffer) it raises naming QuantAct and torch.func."""
    from deepspeed_c.compression.basic_layer import LinearLayer_Compress

    torch.manual_seed(5)
    layer = LinearLayer_Compress(H, 4)
    layer.enable_activation_quantization(8, "asymmetric", "static")
    layer.activation_quantization_enabled = True
    params = {k: v.detach() for k, v in layer.named_parameters()}
    x0, x1 = torch.randn(3, H), torch.randn(3, H) * 2
    buffers = {"activation_quantizer.x_min_max": torch.zeros(2)}

    def loss(p: dict, b: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(layer, (p, b), (x,)).sum()

    expect = torch.stack((x0.min(), x0.max())).double()  # the first batch seeds the range
    for x in (x0, x1):
        torch.func.grad(loss)(params, buffers, x)
        expect = expect * 0.95 + torch.stack((x.min(), x.max())).double() * 0.05
        got = buffers["activation_quantizer.x_min_max"]
        assert ((got.double() - expect).norm() / expect.norm()).item() < 1e-6, (got, expect)

    captured = (lambda: torch.func.grad(lambda p, x: torch.func.functional_call(layer, p, (x,)).sum())(params, x0))
    per_sample = (lambda: torch.func.vmap(torch.func.grad(loss), in_dims=(None, None, 0))(params, buffers, x0))
    assert run_raises(captured, "QuantAct", "torch.func", "x_min_max")
    assert run_raises(per_sample, "QuantAct", "torch.func", "x_min_max")


# -- attention ---------------------------------------------------------------------------------------------
def _attention64(q, k, v, *biases):  # heads before the sequence axis: [..., L, D]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    for b in biases:
        if b is not None:
            s = s + b
    return torch.softmax(s, dim=-1) @ v


class _Evo(torch.nn.Module):
    """x [batch, 16] -> q, k, v [batch, 1, L=2, H=2, D=4] projections, a learnt pair bias, a fixed mask bias."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.pair = torch.nn.Parameter(torch.randn(1, 1, 2, 2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed_c.ops.deepspeed4science import DS4Sci_EvoformerAttention

        B = x.shape[0]
        q, k, v = self.qkv(x).view(B, 1, 2, 2, 12).split(4, dim=-1)  # non-contiguous views
        mask = torch.tensor([0.0, -2.0]).view(1, 1, 1, 1, 2).expand(B, 1, 1, 1, 2)
        return DS4Sci_EvoformerAttention(q, k, v, [mask, self.pair.expand(B, 1, 2, 2, 2)]).reshape(B, 16)


def _evo_ref(p: dict, x: torch.Tensor) -> torch.Tensor:
    B = x.shape[0]
    q, k, v = (x @ p["qkv.weight"].t() + p["qkv.bias"]).view(B, 1, 2, 2, 12).split(4, dim=-1)
    heads = [t.permute(0, 1, 3, 2, 4) for t in (q, k, v)]  # [B, 1, H, L, D]
    mask = torch.tensor([0.0, -2.0], dtype=torch.float64).view(1, 1, 1, 1, 2)
    return _attention64(*heads, mask, p["pair"]).permute(0, 1, 3, 2, 4).reshape(B, 16)


class _SparseHostOp:
    """The CUDA op's calls, computed on the host from the dense masked form (first-order, like the kernels)."""

    def __init__(self, layout: torch.Tensor) -> None:
        self.layout = layout
        self.backward_calls = 0

    def forward(self, q, k, v, o, lse, row_ptr, cols, kpm, am, rpe, block, scale, *plan) -> None:
        from deepspeed_c.ops.sparse_attention.reference import dense_sparse_attention

        o.copy_(dense_sparse_attention(q, k, v, self.layout, block, scale, kpm, am, rpe))

    def backward(self, d_o, q, k, v, o, lse, delta, row_ptr, cols, col_ptr, rows, kpm, am, rpe, dq, dk, dv, block,
                 scale, *plan) -> None:
        from deepspeed_c.ops.sparse_attention.reference import dense_sparse_attention

        self.backward_calls += 1
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = dense_sparse_attention(*leaves, self.layout, block, scale, kpm, am, rpe)
            for dst, g in zip((dq, dk, dv), torch.autograd.grad(out, leaves, d_o)):
                dst.copy_(g)


class _Sparse(torch.nn.Module):
    """x [batch, 8] -> q, k, v [batch, H=2, L=4, D=1] through the kernel Function (blocks of 2, a 2 x 2 layout)."""

    def __init__(self, tables) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)
        self.tables = tables

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed_c.ops.sparse_attention.kernel import sparse_attention_cuda

        B = x.shape[0]
        q, k, v = self.qkv(x).view(B, 2, 4, 3).unbind(-1)
        out = sparse_attention_cuda(q[..., None], k[..., None], v[..., None], self.tables, 2, 0.7)
        return out.reshape(B, 8)


def _sparse_ref(layout: torch.Tensor):
    from deepspeed_c.ops.sparse_attention.reference import token_mask

    allowed = token_mask(layout, 2)

    def ref(p: dict, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        q, k, v = (t[..., None] for t in (x @ p["qkv.weight"].t() + p["qkv.bias"]).view(B, 2, 4, 3).unbind(-1))
        s = (q @ k.transpose(-1, -2)) * 0.7
        s = s.masked_fill(~allowed, float("-inf"))
        return (torch.softmax(s, dim=-1) @ v).reshape(B, 8)

    return ref


def test_attention_autograd_calls(monkeypatch) -> None:
    torch.manual_seed(3)
    evo = _Evo()
    full = {k: v.detach().double() for k, v in evo.named_parameters()}
    _check("evoformer", run(Case(evo, _evo_ref, full, torch.randn(3, 16), "qkv.weight")))

    from deepspeed_c.ops.sparse_attention import kernel

    layout = torch.tensor([[[1, 0], [1, 1]], [[1, 1], [0, 1]]], dtype=torch.bool)
    host = _SparseHostOp(layout)
    monkeypatch.setattr(kernel, "cuda_op", lambda: host)
    tables = kernel.BlockTables.from_layout(layout, torch.device("cpu"), balance=False)
    sparse = _Sparse(tables)
    full = {k: v.detach().double() for k, v in sparse.named_parameters()}
    _check("sparse_attention", run(Case(sparse, _sparse_ref(layout), full, torch.randn(3, 8), "qkv.weight")))
    assert host.backward_calls > 0  # the Function's own backward ran in the plain calls


# -- reentrant activation checkpointing --------------------------------------------------------------------
class _Checkpointed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(H, H), torch.nn.Linear(H, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed_c.runtime.activation_checkpointing import checkpointing

        h = checkpointing.checkpoint(lambda t: torch.tanh(self.a(t)), x)
        return self.b(h)


def test_reentrant_checkpoint_autograd_calls() -> None:
    torch.manual_seed(4)
    m = _Checkpointed()
    full = {k: v.detach().double() for k, v in m.named_parameters()}

    def ref(p: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ p["a.weight"].t() + p["a.bias"]) @ p["b.weight"].t() + p["b.bias"]

    x = torch.randn(3, H)
    # supported: .backward(), accumulation, torch.func (it runs the function itself there)
    _check("checkpoint", run(Case(m, ref, full, x, "a.weight"), ("backward", "func", "vmap", "accum")))
    # refused with errors naming what is unsupported (never a silently wrong gradient)
    xr = x.clone().requires_grad_()

    def loss() -> torch.Tensor:
        return m(xr).sin().sum()

    assert run_raises(lambda: torch.autograd.grad(loss(), [xr]), "checkpoint", "autograd.grad")
    assert run_raises(lambda: loss().backward(inputs=[xr]), "checkpoint", "inputs")
    assert run_raises(lambda: torch.autograd.grad(loss(), xr, create_graph=True), "checkpoint", "autograd.grad")
    with warnings.catch_warnings():  # torch's note on the .grad reference cycle of backward(create_graph=True)
        warnings.simplefilter("ignore", UserWarning)
        assert run_raises(lambda: loss().backward(create_graph=True), "checkpoint", "create_graph")
