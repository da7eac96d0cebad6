"""ZeRO stage 3 memory estimators: what params, gradients and optimizer states need per CPU and per GPU.

The figures follow DeepSpeed's ZeRO-3 formulas (bytes, Adam in mixed precision), so a user sees the
same numbers and the same printed table as with `deepspeed.runtime.zero.stage3`:

* trainable state is 18 bytes a parameter (2 fp16/bf16 weight + 4 fp32 master + 8 Adam moments
  + 4 fp32 gradient), or 16 when the parameters stay on the GPU (their 2 bytes counted there);
* the GPU always holds one gathered layer: ``4 * largest_layer_params`` bytes;
* without ``zero_init`` each process first builds the whole model on the host in fp32, so host memory
  must also hold ``4 * total_params`` bytes for each GPU of the node;
* host figures are multiplied by ``additional_buffer_factor``.

`deepspeed_c.runtime.zero.stage3` re-exports these names.
"""
from __future__ import annotations

from typing import Iterable

import torch

from deepspeed_c.runtime.config.zero import OffloadDeviceEnum

__all__ = ["estimate_zero3_model_states_mem_needs", "estimate_zero3_model_states_mem_needs_all_live",
           "estimate_zero3_model_states_mem_needs_all_cold", "model_to_params"]


def estimate_zero3_model_states_mem_needs(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                                          num_nodes: int = 1, cpu_offload: bool = True,
                                          cpu_offload_params: bool = True, zero_init: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
    """(cpu bytes, gpu bytes, largest layer bytes) per device for ZeRO-3 params, grads and optimizer states.

    `cpu_offload` is offload_optimizer=cpu, `cpu_offload_params` is offload_param=cpu (only meaningful
    with `cpu_offload`), `zero_init` says whether the model is built under `zero.Init`."""
    total_gpus = num_nodes * num_gpus_per_node
    per_node_share = 1 / num_nodes  # host memory is per node: its ranks split the model's state
    layer_bytes = 4 * largest_layer_params

    if cpu_offload:
        state_bytes = 18 if cpu_offload_params else 16  # bytes a parameter kept on the host
        gpu_mem = layer_bytes if cpu_offload_params else layer_bytes + int(2 * total_params / total_gpus)
        if zero_init:
            cpu_mem = total_params * state_bytes * per_node_share * additional_buffer_factor
        else:
            host_bytes = max(4 * num_gpus_per_node, state_bytes * per_node_share)
            cpu_mem = total_params * host_bytes * additional_buffer_factor
    else:
        gpu_mem = layer_bytes + int(18 * total_params / total_gpus)
        built = largest_layer_params if zero_init else total_params  # what each process builds in fp32
        cpu_mem = built * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), layer_bytes


def _numel(p: torch.Tensor) -> int:
    """The full element count, also for a parameter partitioned by zero.Init (its local tensor is empty)."""
    return int(getattr(p, "ds_numel", p.numel()))


def model_to_params(model: torch.nn.Module) -> tuple[int, int]:
    """(total parameters, largest layer's parameters) of `model`.

    Tied parameters count once. A layer is one module with its own (non-recursive) parameters, as
    DeepSpeed counts it. Works for models built under zero.Init (full sizes from `ds_numel`)."""
    seen: dict[object, int] = {}
    for p in model.parameters():
        # tied weights may be distinct Parameters over one storage; partitioned ones have no storage
        key: object = ("storage", p.data_ptr()) if p.numel() > 0 else ("param", id(p))
        seen[key] = _numel(p)
    total_params = sum(seen.values())
    largest_layer_params = max((_layer_numel(m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total_params, largest_layer_params


def _layer_numel(params: Iterable[torch.Tensor]) -> int:
    return sum(_numel(p) for p in params)


def estimate_zero3_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """Prints ZeRO-3 memory needs for `model` and the given hardware (sizes derived from the model).

    For a hypothetical model use `estimate_zero3_model_states_mem_needs_all_cold`."""
    total_params, largest_layer_params = model_to_params(model)
    estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params, num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


def _options(cpu_offload: bool, cpu_offload_params: bool, zero_init: bool) -> str:
    cpu = f"{OffloadDeviceEnum.cpu:4}"  # formatted as DeepSpeed formats it, so the rows read the same
    return ", ".join([f"offload_param={cpu if cpu_offload_params else 'none'}",
                      f"offload_optimizer={cpu if cpu_offload else 'none'}",
                      f"zero_init={int(bool(zero_init))}"])


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Prints ZeRO-3 memory needs for a model of `total_params` parameters whose largest layer has
    `largest_layer_params`, one row per offload / zero_init combination (no model needed)."""
    nodes = f"{num_nodes} node{'s' if num_nodes > 1 else ''}"
    gpus = f"{num_gpus_per_node} GPU{'s' if num_gpus_per_node > 1 else ''} per node"
    print("Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {nodes}, {gpus}.\n"
          f"SW: Model with {int(total_params / 1e6)}M total params, "
          f"{int(largest_layer_params / 1e6)}M largest layer params.")
    print("  per CPU  |  per GPU |   Options")
    # offload_param=cpu needs offload_optimizer=cpu, so (no optimizer offload, param offload) is skipped
    for cpu_offload, cpu_offload_params in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            cpu_mem, gpu_mem, _ = estimate_zero3_model_states_mem_needs(
                total_params, largest_layer_params, num_gpus_per_node, num_nodes, cpu_offload, cpu_offload_params,
                zero_init, additional_buffer_factor)
            print(f" {cpu_mem / 2**30:7.2f}GB | {gpu_mem / 2**30:6.2f}GB | "
                  f"{_options(cpu_offload, cpu_offload_params, zero_init)}")
