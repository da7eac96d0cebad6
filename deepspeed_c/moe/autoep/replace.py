"""Scans a Hugging Face model for MoE blocks and swaps each block's experts for an AutoEPExperts.

Run once, by deepspeed.initialize, before the engine creates the expert groups and broadcasts parameters.
Every rank must start from the same weights (same seed or same checkpoint): each keeps its own slice of them."""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from deepspeed_c.moe.autoep.layer import AutoEPExperts
from deepspeed_c.moe.autoep.presets import Preset, resolve_preset

_OVERRIDES = ("moe_layer_pattern", "expert_pattern", "router_pattern", "expert_w1", "expert_w2")


def _ep_rank(ep_size: int, use_data_before_expert_parallel_: bool) -> int:
    import torch.distributed as dist

    from deepspeed_c.utils.groups import expert_layout

    distributed = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    if ep_size > 1 and world % ep_size != 0:
        raise ValueError(f"expert_parallel.autoep_size={ep_size} must divide the world size ({world}"
                         f"{'' if distributed else ': torch.distributed is not initialized'})")
    ep_groups, _ = expert_layout(world, ep_size, use_data_before_expert_parallel_)
    return next(g.index(rank) for g in ep_groups if rank in g)


def _matches(pattern: str, name: str) -> bool:
    # a preset's pattern names the causal-LM wrapper's path (model.layers.N.mlp); a bare base model's
    # modules lack the leading "model."
    return re.fullmatch(pattern, name) is not None or re.fullmatch(pattern, f"model.{name}") is not None


def _expert_weights(block_name: str, experts: nn.Module, preset: Preset) -> tuple[nn.Parameter, nn.Parameter]:
    w1, w2 = getattr(experts, preset.expert_w1, None), getattr(experts, preset.expert_w2, None)
    for key, w in (("expert_w1", w1), ("expert_w2", w2)):
        if not isinstance(w, nn.Parameter) or w.dim() != 3:
            raise ValueError(f"expert_parallel.{key}={getattr(preset, key)!r}: {block_name}.{preset.expert_pattern} "
                             f"({type(experts).__name__}) has no 3-D expert weight of that name (found "
                             f"{type(w).__name__}); AutoEP reads transformers 5's fused layout [experts, out, in]")
    if w1.shape[0] != w2.shape[0] or w1.shape[1] != 2 * w2.shape[2] or w1.shape[2] != w2.shape[1]:
        raise ValueError(f"{block_name}: expert weights {preset.expert_w1} {tuple(w1.shape)} and {preset.expert_w2} "
                         f"{tuple(w2.shape)} are not [E, 2F, H] and [E, H, F] (SiLU-gated experts)")
    return w1, w2


def apply_autoep(model: nn.Module, cfg: Any, tensor_parallel: bool = False,
                 use_data_before_expert_parallel_: bool = False) -> list[str]:
    """Replaces the experts of every matched MoE block of model (in place) when cfg.enabled; returns the
    matched block names. cfg is the parsed `expert_parallel` section."""
    if cfg is None or not cfg.enabled:
        return []
    if tensor_parallel:
        raise ValueError("expert_parallel.enabled (AutoEP) cannot combine with a model-parallel mpu's tensor "
                         "parallelism: the expert groups would span the tensor-parallel ranks")
    hf_config = getattr(model, "config", None)
    model_type = getattr(hf_config, "model_type", None)
    preset = resolve_preset(cfg.preset_model, model_type, {k: getattr(cfg, k) for k in _OVERRIDES})
    if preset.name != "custom" and preset.model_types and model_type not in (None, *preset.model_types):
        raise ValueError(f"expert_parallel.preset_model={preset.name!r} describes model types {preset.model_types}, "
                         f"but model.config.model_type is {model_type!r}")
    try:
        re.compile(preset.moe_layer_pattern)
    except re.error as e:
        raise ValueError(f"expert_parallel.moe_layer_pattern={preset.moe_layer_pattern!r} is not a valid regular "
                         f"expression: {e}") from None
    ep_size = cfg.autoep_size
    ep_rank = _ep_rank(ep_size, use_data_before_expert_parallel_)
    blocks = [(n, m) for n, m in model.named_modules() if _matches(preset.moe_layer_pattern, n)]
    blocks = [(n, m) for n, m in blocks if isinstance(getattr(m, preset.expert_pattern, None), nn.Module)]
    if not blocks:
        raise ValueError(f"expert_parallel: no MoE block matched (preset {preset.name!r}, moe_layer_pattern "
                         f"{preset.moe_layer_pattern!r} with an {preset.expert_pattern!r} child); set "
                         "expert_parallel.preset_model or expert_parallel.moe_layer_pattern / expert_pattern")
    for name, block in blocks:
        experts = getattr(block, preset.expert_pattern)
        if not isinstance(getattr(block, preset.router_pattern, None), nn.Module):
            raise ValueError(f"expert_parallel.router_pattern={preset.router_pattern!r}: {name} has no such child")
        w1, w2 = _expert_weights(name, experts, preset)
        num_experts = w1.shape[0]
        if num_experts % ep_size != 0:
            raise ValueError(f"expert_parallel.autoep_size={ep_size} must divide the number of experts of every MoE "
                             f"layer; {name} has {num_experts}")
        act_fn = getattr(experts, "act_fn", None)
        # no act_fn: the experts' own gated activation of the fused output (MiniMax-M3's clamped SwiGLU)
        gate_fn = getattr(experts, "_apply_gate", None) if act_fn is None else None
        if act_fn is None and not callable(gate_fn):
            raise ValueError(f"{name}.{preset.expert_pattern} ({type(experts).__name__}) has neither act_fn nor "
                             "_apply_gate: its expert activation is unknown to AutoEP")
        with torch.no_grad():
            layer = AutoEPExperts(w1, w2, act_fn, num_experts, ep_size, ep_rank, cfg.route_scale,
                                  (preset.expert_w1, preset.expert_w2), gate_fn=gate_fn)
        setattr(block, preset.expert_pattern, layer)
    return [n for n, _ in blocks]
