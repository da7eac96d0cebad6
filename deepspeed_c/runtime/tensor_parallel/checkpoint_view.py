"""AutoTP checkpoints: saved as the unsharded model's, so they load at any tensor-parallel degree.

Around engine.save_checkpoint / load_checkpoint every tensor-parallel parameter (and each optimizer
state tensor shaped like it: Adam's moments) is swapped, in place, for the whole tensor gathered over
its TP group, in the original model's layout (GPT-2's Conv1D weights transposed back); the engine's
checkpointer then writes or reads exactly what it would for the unsharded model (DeepSpeed's stage-0
layout, mp_rank_00_model_states.pt), and afterwards each rank keeps its own slice again -- of the
values just loaded, when loading. Parameter objects never change, so the optimizer's state stays keyed
to them. Built for ZeRO stage 0 in fp32; anything else raises before a file is touched.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from deepspeed_c.module_inject.layers import TensorParallel_Layer


def check_supported(engine: Any, what: str) -> None:
    size = engine.mpu.get_model_parallel_world_size()
    if engine.zero_optimization_stage() > 0 or engine.bfloat16_enabled() or engine.fp16_enabled():
        raise NotImplementedError(
            f"{what} with tensor_parallel.autotp_size={size} is built for fp32 at ZeRO stage 0 only (this engine: "
            f"zero_optimization.stage={engine.zero_optimization_stage()}, bf16={engine.bfloat16_enabled()}, "
            f"fp16={engine.fp16_enabled()}); save_16bit_model writes the whole weights at any setting")


def _sharded(module: torch.nn.Module) -> list[tuple[TensorParallel_Layer, str, torch.nn.Parameter]]:
    out = []
    for layer in module.modules():
        if isinstance(layer, TensorParallel_Layer) and layer.tp_world_size > 1:
            for key in ("weight", "bias"):
                p = getattr(layer, key)
                if p is not None and getattr(p, "ds_is_tensor_model_parallel", False):
                    out.append((layer, key, p))
    return out


def _to_full(layer: TensorParallel_Layer, key: str, t: torch.Tensor, dim: int) -> torch.Tensor:
    full = layer._gather(t, dim)
    return full.t().contiguous() if key == "weight" and getattr(layer, "conv1d", False) else full


def _to_shard(layer: TensorParallel_Layer, key: str, t: torch.Tensor, dim: int) -> torch.Tensor:
    if key == "weight" and getattr(layer, "conv1d", False):
        t = t.t()
    return layer._shard(torch.nn.Parameter(t.contiguous(), requires_grad=False), dim, layer._label()).data


@contextlib.contextmanager
def full_view(engine: Any) -> Iterator[None]:
    """Inside: every TP parameter and its same-shaped optimizer states whole (collective on entry and exit)."""
    state = engine.basic_optimizer.state if engine.basic_optimizer is not None else {}
    entries = _sharded(engine.module)
    shard_shapes = {id(p): p.shape for _, _, p in entries}
    with torch.no_grad():
        for layer, key, p in entries:
            dim = p.partition_dim
            for name, value in list(state.get(p, {}).items()):
                if isinstance(value, torch.Tensor) and value.shape == p.shape:
                    state[p][name] = _to_full(layer, key, value, dim)
            p.data = _to_full(layer, key, p.data, dim)
    try:
        yield
    finally:
        # re-read: torch's load_state_dict replaces the optimizer's state dict as a whole
        state = engine.basic_optimizer.state if engine.basic_optimizer is not None else {}
        with torch.no_grad():
            for layer, key, p in entries:
                dim = p.partition_dim
                full_shape = p.shape
                p.data = _to_shard(layer, key, p.data, dim)
                assert p.shape == shard_shapes[id(p)], (layer._label(), p.shape, shard_shapes[id(p)])
                for name, value in list(state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor) and value.shape == full_shape:
                        state[p][name] = _to_shard(layer, key, value, dim)
