"""ZeRO stage 2 memory estimators (DeepSpeed's formulas and printed table): bytes per CPU and per GPU for
params, gradients and optimizer states. `deepspeed_c.runtime.zero.stage_1_and_2` re-exports these names,
where DeepSpeed users import them from."""
from __future__ import annotations

import torch

__all__ = ["estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_live",
           "estimate_zero2_model_states_mem_needs_all_cold"]


def estimate_zero2_model_states_mem_needs(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(cpu bytes, gpu bytes) per device for params, gradients and optimizer states under ZeRO-2."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 4 * total_params + int(16 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def _print_table(total_params: int, num_gpus_per_node: int, num_nodes: int, additional_buffer_factor: float) -> None:
    nodes = f"{num_nodes} node{'s' if num_nodes > 1 else ''}"
    gpus = f"{num_gpus_per_node} GPU{'s' if num_gpus_per_node > 1 else ''} per node"
    print("Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {nodes}, {gpus}.\n"
          f"SW: Model with {int(total_params / 1e6)}M total params.")
    print("  per CPU  |  per GPU |   Options")
    for cpu_offload in (True, False):
        cpu_mem, gpu_mem = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes,
                                                                 cpu_offload, additional_buffer_factor)
        option = "cpu" if cpu_offload else "none"
        print(f" {cpu_mem / 2**30:7.2f}GB | {gpu_mem / 2**30:6.2f}GB | offload_optimizer={option}")


def estimate_zero2_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """Prints ZeRO-2 memory needs for `model` (its parameters must be materialised on this process)."""
    total_params = sum(p.numel() for p in model.parameters())
    _print_table(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """Prints ZeRO-2 memory needs for a model of `total_params` parameters (no model needed)."""
    _print_table(int(total_params), num_gpus_per_node, num_nodes, additional_buffer_factor)
