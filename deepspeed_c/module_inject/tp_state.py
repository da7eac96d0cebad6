"""Whole-model views of a tensor-parallel model: the state dict with every shard gathered (what
save_16bit_model writes, in the original model's names and layouts -- GPT-2's Conv1D included)."""
from __future__ import annotations

import torch

from deepspeed_c.module_inject.layers import TensorParallel_Layer


def has_tp_layers(module: torch.nn.Module) -> bool:
    return any(isinstance(m, TensorParallel_Layer) and m.tp_world_size > 1 for m in module.modules())


def gathered_state_dict(module: torch.nn.Module, state: dict) -> dict:
    """`state` (module.state_dict()'s names) with each tensor-parallel layer's weight and bias replaced by the
    full tensor. Collective over each layer's TP group: every rank must call it."""
    out = dict(state)
    for name, sub in module.named_modules():
        if isinstance(sub, TensorParallel_Layer):
            for key, value in sub.full_state().items():
                full_key = f"{name}.{key}" if name else key
                if full_key in out:  # exclude_frozen_parameters may have left it out
                    out[full_key] = value.to(state[full_key].dtype)
    return out
