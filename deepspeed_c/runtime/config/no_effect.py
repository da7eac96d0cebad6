"""Config keys deepspeed_c accepts but that change nothing here, each with the reason.

`initialize` warns once per key (per process) when a config sets one of them to a value other
than its default; the README's table lists the same entries. Keys whose behaviour is built are not
here: zero_optimization.overlap_comm=false (stage 2 awaits each bucket's reduction),
load_from_fp32_weights=false, ignore_unused_parameters=false, cpu_offload_use_pin_memory,
offload_optimizer.cpuadam_cores_perc (threads of the host optimizer),
checkpoint.use_node_local_storage (runtime/checkpointing/nodes.py), offload_param.buffer_count,
buffer_size and max_in_cpu (runtime/swap_tensor/partitioned_param_swapper.py)."""
from __future__ import annotations

from typing import Any, Iterable, NamedTuple

from deepspeed_c.utils.logging import logger


class NoEffect(NamedTuple):
    path: tuple[str, ...]  # keys from the top of the config
    default: Any
    reason: str


NO_EFFECT: tuple[NoEffect, ...] = (
    NoEffect(("zero_optimization", "allgather_partitions"), True,
             "every rank all-gathers its updated partition, one collective per bucket (no broadcast path)"),
    NoEffect(("zero_optimization", "use_multi_rank_bucket_allreduce"), True,
             "each gradient bucket is one reduce-scatter (or one all-reduce with reduce_scatter=false)"),
    NoEffect(("zero_optimization", "elastic_checkpoint"), False,
             "checkpoints reshard to any world size on load without it"),
    NoEffect(("zero_optimization", "offload_optimizer", "pipeline_read"), False,
             "the NVMe optimizer step reads the next sub-group while it steps this one whenever buffer_count holds "
             "two sub-groups' states (8 for Adam)"),
    NoEffect(("zero_optimization", "offload_optimizer", "pipeline_write"), False,
             "the NVMe optimizer step writes sub-groups back while it steps the next whenever buffer_count holds "
             "two sub-groups' states (8 for Adam)"),
    NoEffect(("zero_optimization", "offload_optimizer", "fast_init"), False,
             "the NVMe swap files are written once at initialize, sub-group by sub-group"),
    NoEffect(("aio", "single_submit"), False, "each worker submits its whole batch of requests in one system call"),
    NoEffect(("aio", "overlap_events"), True, "each worker reaps its completions as they arrive"),
    NoEffect(("zero_optimization", "stage3_use_all_reduce_for_fetch_params"), False,
             "ZeRO-3 gathers each unit with one all_gather_into_tensor"),
    NoEffect(("zero_optimization", "stage3_allgather_sequential"), False,
             "ZeRO-3's gathers follow the fetch plan; each unit is one collective"),
    NoEffect(("zero_optimization", "pipeline_loading_checkpoint"), False,
             "ZeRO-3 checkpoints load partition by partition without it"),
    NoEffect(("zero_optimization", "override_module_apply"), True,
             "module.apply is not wrapped; use GatheredParameters around initialisation code"),
    NoEffect(("zero_optimization", "log_trace_cache_warnings"), False,
             "a changed module order rebuilds or switches the fetch plan without a warning"),
    NoEffect(("zero_optimization", "enable_sanity_checks"), False,
             "ranks running different modules are detected while a trace is recorded anyway"),
    NoEffect(("bf16", "immediate_grad_update"), False,
             "bf16 gradients are accumulated by the precision collaborator at the step"),
    NoEffect(("optimizer", "legacy_fusion"), False, "the fused optimizers have one implementation"),
    NoEffect(("dump_state",), False, "the engine state is not printed at initialize"),
    NoEffect(("disable_allgather",), False, "ZeRO 1/2 always all-gathers the updated weights"),
    NoEffect(("checkpoint", "checkpoint_serialization"), True, "files are written with torch.save's zip format"),
)

_WARNED: set[tuple[str, ...]] = set()


def _lookup(params: dict, path: Iterable[str]) -> tuple[bool, Any]:
    node: Any = params
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def warn_keys_without_effect(params: dict) -> list[str]:
    """One warning per key set to a non-default value; returns the dotted keys warned about now."""
    warned = []
    for entry in NO_EFFECT:
        found, value = _lookup(params, entry.path)
        if not found or value == entry.default or value == "auto" or entry.path in _WARNED:
            continue
        _WARNED.add(entry.path)
        key = ".".join(entry.path)
        logger.warning(f"Config key '{key}' = {value!r} has no effect in deepspeed_c: {entry.reason}.")
        warned.append(key)
    return warned
