"""The `quantize_training` section (the MoQ tutorial's format) and the parameters it schedules.

    "quantize_training": {"enabled": true, "quantize_verbose": true, "quantizer_kernel": true,
                          "quantize_type": "symmetric" | "asymmetric",
                          "quantize-algo": {"q_type": ..., "rounding": ...},
                          "quantize_bits": {"start_bits": 16, "target_bits": 8},
                          "quantize_schedule": {"quantize_period": 400, "schedule_offset": 0},
                          "quantize_groups": 8,
                          "fp16_mixed_quantize": {"enabled": false, "quantize_change_ratio": 0.001},
                          "eigenvalue": {"enabled": false, ...}}

Every weight of two or more dimensions starts at start_bits and steps down to target_bits, one bit per period
(the period doubling after each drop, stretched by the block's Hessian eigenvalue when `eigenvalue.enabled`:
compression/engine_hooks.py), from schedule_offset on (runtime/quantize.py steps it). DeepSpeed 0.19.6 reads
only `eigenvalue` from this section (its MoQ runs from compression_training.weight_quantization without
quantize_weight_in_forward, which this engine supports as well)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from deepspeed_c.compression.config import CompressionConfigError, check_keys

_KEYS = ("enabled", "quantize_verbose", "quantizer_kernel", "quantize_type", "quantize-algo", "quantize_bits",
         "quantize_schedule", "quantize_groups", "fp16_mixed_quantize", "eigenvalue")


@dataclass
class MoQConfig:
    enabled: bool = False
    verbose: bool = False
    kernel: bool = False
    q_type: str = "symmetric"
    rounding: str = "nearest"
    start_bits: int = 16
    target_bits: int = 8
    period: int = 1
    schedule_offset: int = 0
    groups: int = 1
    mixed_fp16: bool = False
    change_ratio: float = 0.001
    eigenvalue: Optional[dict] = None


def _top_level_eigenvalue(param_dict: dict) -> Optional[dict]:
    """The documented top-level `eigenvalue` section, when enabled: it times MoQ as the nested one does."""
    top = param_dict.get("eigenvalue")
    return top if isinstance(top, dict) and top.get("enabled") else None


def parse_quantize_training(param_dict: dict) -> MoQConfig:
    raw = param_dict.get("quantize_training") or {}
    check_keys(raw, _KEYS, "quantize_training")
    algo = raw.get("quantize-algo", {})
    check_keys(algo, ("q_type", "rounding"), "quantize_training.quantize-algo")
    bits = raw.get("quantize_bits", {})
    check_keys(bits, ("start_bits", "target_bits"), "quantize_training.quantize_bits")
    sched = raw.get("quantize_schedule", {})
    check_keys(sched, ("quantize_period", "schedule_offset"), "quantize_training.quantize_schedule")
    mixed = raw.get("fp16_mixed_quantize", {})
    check_keys(mixed, ("enabled", "quantize_change_ratio"), "quantize_training.fp16_mixed_quantize")
    cfg = MoQConfig(enabled=bool(raw.get("enabled", False)), verbose=bool(raw.get("quantize_verbose", False)),
                    kernel=bool(raw.get("quantizer_kernel", False)),
                    q_type=algo.get("q_type", raw.get("quantize_type", "symmetric")),
                    rounding=algo.get("rounding", "nearest"), start_bits=bits.get("start_bits", 16),
                    target_bits=bits.get("target_bits", 8), period=sched.get("quantize_period", 1),
                    schedule_offset=sched.get("schedule_offset", 0), groups=raw.get("quantize_groups", 1),
                    mixed_fp16=bool(mixed.get("enabled", False)),
                    change_ratio=mixed.get("quantize_change_ratio", 0.001),
                    eigenvalue=raw.get("eigenvalue") or _top_level_eigenvalue(param_dict))
    if cfg.q_type not in ("symmetric", "asymmetric"):
        raise CompressionConfigError(f"quantize_training.quantize-algo.q_type = {cfg.q_type!r}: expected "
                                     "'symmetric' or 'asymmetric'")
    if cfg.rounding not in ("nearest", "stochastic"):
        raise CompressionConfigError(f"quantize_training.quantize-algo.rounding = {cfg.rounding!r}: expected "
                                     "'nearest' or 'stochastic'")
    if not (isinstance(cfg.target_bits, int) and isinstance(cfg.start_bits, int) and 1 <= cfg.target_bits):
        raise CompressionConfigError("quantize_training.quantize_bits: start_bits and target_bits must be ints >= 1")
    if cfg.target_bits > cfg.start_bits:
        raise CompressionConfigError(f"quantize_training.quantize_bits: target_bits ({cfg.target_bits}) > "
                                     f"start_bits ({cfg.start_bits}); the bit schedule only steps down")
    if not isinstance(cfg.period, int) or cfg.period < 1:
        raise CompressionConfigError(f"quantize_training.quantize_schedule.quantize_period = {cfg.period!r}: "
                                     "expected an int >= 1")
    return cfg


def drop_one_bit(p: torch.Tensor, factor: int = 1) -> None:
    """One step of a weight's MoQ bit schedule (the per-parameter protocol this module and init_compression set
    up): one bit less, the period doubled and multiplied by `factor` (the block's eigenvalue factor)."""
    p.q_period = (p.q_period << 1) * factor
    p.start_bits -= 1


def mark_moq_parameters(module: torch.nn.Module, start_bits: int, target_bits: int, period: int) -> int:
    """Give every weight of 2+ dimensions its bit schedule; returns how many were marked."""
    count = 0
    for p in module.parameters():
        if p.dim() > 1:
            p.start_bits, p.target_bits, p.q_period = start_bits, target_bits, period
            count += 1
    return count
