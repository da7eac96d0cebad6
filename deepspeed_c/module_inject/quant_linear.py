"""The quant section of init_inference for injected blocks and plain Linear layers: weight-only int8 / int4.

`QuantSpec.from_config` reads DeepSpeed's section ({"enabled": true, "weight": {"num_bits": 8, "q_groups": 1,
"q_type": "symmetric"}}; q_groups is the number of groups each weight row is split into) plus deepspeed_c's
`weight.group_size` (inputs a scale covers; wins over q_groups). dtype=torch.int8 without a section is
int8 with one scale a row. Activations stay in the compute dtype (weight-only).

Injected blocks (fused decoder / encoder) keep their GEMM weights as QuantizedWeight modules (`q_<name>`)
and call them through `_linear`; outside injection, each nn.Linear of the model except the LM head becomes
a QuantLinear. Both run ops.transformer.inference.quant.linear (the CUDA dequantize-GEMM on a GPU)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from deepspeed_c.ops.transformer.inference import quant as Q

# the GEMM weights of the injected blocks (FusedDecoderBlock, FusedEncoderLayer)
BLOCK_WEIGHTS = ("wqkv", "wo", "w1", "w2")


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 8
    q_groups: int = 1
    group_size: Optional[int] = None

    @staticmethod
    def from_config(section: Any, dtype: torch.dtype) -> Optional["QuantSpec"]:
        """None when nothing is quantized."""
        section = dict(section or {})
        if not section or not section.get("enabled", True):
            return QuantSpec() if dtype == torch.int8 else None
        weight = dict(section.get("weight") or {})
        known = {"enabled", "num_bits", "q_groups", "q_type", "group_size", "quantized_initialization",
                 "post_init_quant"}
        unknown = sorted(set(weight) - known)
        if unknown:
            raise ValueError(f"quant.weight: unknown key(s) {unknown} (expected some of {sorted(known)})")
        extra = sorted(set(section) - {"enabled", "weight", "activation", "qkv"})
        if extra:
            raise ValueError(f"quant: unknown key(s) {extra} (expected enabled, weight, activation, qkv)")
        if not weight.get("enabled", True):
            return QuantSpec() if dtype == torch.int8 else None
        q_type = str(weight.get("q_type", "symmetric"))
        if q_type not in ("symmetric", "sym"):
            raise NotImplementedError(f"quant.weight.q_type={q_type!r}: only 'symmetric' weight quantization is built")
        bits = int(weight.get("num_bits", 8))
        if bits not in Q.QMAX:
            raise ValueError(f"quant.weight.num_bits={bits} is not supported (8 or 4)")
        groups = int(weight.get("q_groups", 1))
        size = weight.get("group_size")
        if groups < 1 or (size is not None and int(size) < 1):
            raise ValueError(f"quant.weight: q_groups={groups} and group_size={size} must be positive")
        return QuantSpec(bits, groups, None if size is None else int(size))

    def group_for(self, what: str, in_features: int) -> int:
        group = self.group_size if self.group_size is not None else in_features // max(1, self.q_groups)
        if self.group_size is None and in_features % self.q_groups != 0:
            raise ValueError(f"quant: {what} has input width {in_features}, which q_groups={self.q_groups} does "
                             "not divide")
        Q.check_group(what, in_features, self.bits, group)
        return group


class QuantizedWeight(nn.Module):
    """A [N, K] weight held quantized; called with x it computes x @ W^T (+ bias)."""

    def __init__(self, weight: Tensor, bits: int, group: int) -> None:
        super().__init__()
        q, scales = Q.quantize(weight, bits, group)
        self.register_buffer("qweight", q.to(weight.device))
        self.register_buffer("scales", scales.to(weight.device))
        self.bits, self.group = bits, group
        self.out_features, self.in_features = weight.shape

    def _apply(self, fn: Any, recurse: bool = True) -> "QuantizedWeight":
        """model.to(fp16) must move the scales but keep them float32 (their values came from fp32 math)."""
        scales = self.scales
        super()._apply(fn, recurse)
        self.scales = scales.to(self.scales.device)
        return self

    def forward(self, x: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        return Q.linear(x, self.qweight, self.scales, self.bits, self.group, bias)

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        return Q.dequantize(self.qweight, self.scales, self.bits, self.group, dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, int{self.bits}, group {self.group}"


class QuantLinear(nn.Module):
    """nn.Linear with a quantized weight (outside kernel injection)."""

    def __init__(self, linear: nn.Linear, spec: QuantSpec, name: str) -> None:
        super().__init__()
        group = spec.group_for(name, linear.in_features)
        self.qw = QuantizedWeight(linear.weight, spec.bits, group)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        return self.qw(x, self.bias)


@torch.no_grad()
def quantize_blocks(model: nn.Module, spec: QuantSpec, compute_dtype: torch.dtype) -> int:
    """Every injected block's GEMM weights become QuantizedWeight modules; returns how many."""
    count = 0
    for prefix, module in model.named_modules():
        if not hasattr(module, "_linear"):
            continue
        for name in BLOCK_WEIGHTS:
            w = getattr(module, name, None)
            if not isinstance(w, Tensor):
                continue
            group = spec.group_for(f"{prefix}.{name}", w.shape[1])
            setattr(module, "q_" + name, QuantizedWeight(w.to(torch.float32), spec.bits, group))
            setattr(module, name, None)
            count += 1
    model.to(compute_dtype)  # qweight (integer) and scales (float32, see QuantizedWeight._apply) keep theirs
    return count


@torch.no_grad()
def quantize_linears(model: nn.Module, spec: QuantSpec, compute_dtype: torch.dtype) -> int:
    """Outside injection: each nn.Linear (and GPT-2 Conv1D) except the LM head becomes a QuantLinear."""
    from deepspeed_c.module_inject.auto_tp import _is_conv1d

    head = getattr(model, "get_output_embeddings", lambda: None)()
    todo = []
    for prefix, module in model.named_modules():
        for child_name, child in module.named_children():
            if child is head:
                continue
            if isinstance(child, nn.Linear):
                todo.append((module, child_name, child, f"{prefix}.{child_name}".lstrip(".")))
            elif _is_conv1d(child):
                lin = nn.Linear(child.weight.shape[0], child.weight.shape[1], bias=child.bias is not None)
                lin.weight.data = child.weight.detach().t().contiguous()
                if child.bias is not None:
                    lin.bias.data = child.bias.detach()
                todo.append((module, child_name, lin, f"{prefix}.{child_name}".lstrip(".")))
    for parent, child_name, lin, name in todo:
        setattr(parent, child_name, QuantLinear(lin.float(), spec, name))
    model.to(compute_dtype)
    return len(todo)
