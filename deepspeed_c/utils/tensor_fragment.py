"""Access to the partitioned (ZeRO stage 1/2) state of a model parameter: its fp32 master, gradient
and optimizer states, whole (`safe_get_full_*` / `safe_set_full_*`) or just the elements this rank
owns (`safe_get_local_*` / `safe_set_local_*`), by DeepSpeed's names.

The `full` getters are collectives (every data-parallel rank must call them, in the same order) that
move only the parameter's own elements (each rank its slices of it), so walking a whole model costs
O(model) communication, not O(parameters x model); the setters and the `local` functions are not
collectives. A parameter that ZeRO does not partition (stage 0, a
frozen parameter) has no such state: the getters return None, as DeepSpeed's do.

Gradients exist from the end of the backward of an accumulation boundary until the step, averaged
over ranks (fp16: still multiplied by the loss scale)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_set_full_grad",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_optimizer_state", "safe_set_local_grad", "fragment_address"]


@dataclass
class fragment_address:  # noqa: N801 (DeepSpeed's name; its ZeRO checkpoints pickle it under this path)
    """Where a parameter's elements sit in a rank's flat partition: `numel` of them from `start`."""

    numel: int
    start: int


def _owner(param: torch.nn.Parameter) -> Optional[tuple[Any, int, int]]:
    from deepspeed_c.runtime.zero.stage_1_and_2 import OWNER_ATTR

    entry = getattr(param, OWNER_ATTR, None)
    if entry is None:
        return None
    ref, g, i = entry
    opt = ref()
    return None if opt is None else (opt, g, i)


def _grad_partition(opt: Any, g: int, create: bool = False) -> Optional[torch.Tensor]:
    master = opt.fp32_partitions[g]
    if master.grad is not None:
        return master.grad
    if create:
        return opt.reducer.grad_partition(g)
    return opt.reducer.grad_partitions[g]


def _state_partition(opt: Any, g: int, key: str) -> torch.Tensor:
    state = opt.local_optimizer_state(g)
    if key not in state:
        raise KeyError(f"optimizer state has no key {key!r} for this parameter; keys: {sorted(state)} "
                       f"(states appear after the first step)")
    return state[key]


def _gather_param(opt: Any, g: int, i: int, part: torch.Tensor, numel: int, device: torch.device) -> torch.Tensor:
    """Param i of group g, whole in fp32, from every rank's slices of it in `part` (this rank's
    partition-shaped tensor). Each rank hands the collective only its own elements of this parameter
    (padded to the largest rank's count): O(param numel) moved, not the group's partition."""
    rows = opt.partition_plans[g].runtime_slices
    rows = rows[rows[:, 0] == i]  # columns: param, rank, param_start, local_start, length, bucket
    world = opt.world_size
    out = torch.empty(numel, dtype=torch.float32, device=device)
    local = part.detach()
    if world == 1:
        for _, _, pstart, lstart, n, _ in rows.tolist():
            out[pstart:pstart + n].copy_(local[lstart:lstart + n])
        return out
    import deepspeed_c.comm as dist

    counts = torch.zeros(world, dtype=torch.int64).index_add_(0, rows[:, 1], rows[:, 4])
    width = max(int(counts.max()), 1)
    dev = dist.collective_device(opt.dp_process_group)
    send = torch.zeros(width, dtype=torch.float32, device=dev)
    by_rank: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    for _, r, pstart, lstart, n, _ in rows.tolist():
        by_rank[r].append((pstart, lstart, n))
    pos = 0
    for _, lstart, n in by_rank[opt.rank]:
        send[pos:pos + n].copy_(local[lstart:lstart + n])
        pos += n
    recv = torch.empty(width * world, dtype=torch.float32, device=dev)
    dist.all_gather_into_tensor(recv, send, group=opt.dp_process_group)
    recv = recv.to(device)
    for r, pieces in enumerate(by_rank):
        pos = r * width
        for pstart, _, n in pieces:
            out[pstart:pstart + n].copy_(recv[pos:pos + n])
            pos += n
    return out


def _whole_shape(param: torch.nn.Parameter) -> torch.Size:
    """The parameter's real shape: under ZeRO-3 its data is a placeholder and ds_shape the shape."""
    return torch.Size(getattr(param, "ds_shape", param.shape))


def _full(param: torch.nn.Parameter, which: str, key: Optional[str] = None) -> Optional[torch.Tensor]:
    found = _owner(param)
    if found is None:
        return None
    opt, g, i = found
    if which == "param":
        part = opt.fp32_partitions[g]
    elif which == "grad":
        part = _grad_partition(opt, g)
        if part is None:
            return None
    else:
        part = _state_partition(opt, g, key or "")
    shape = _whole_shape(param)
    return _gather_param(opt, g, i, part, shape.numel(), param.device).view(shape)


def _write_full(param: torch.nn.Parameter, value: torch.Tensor, target: torch.Tensor, opt: Any, g: int,
                i: int) -> None:
    shape = _whole_shape(param)
    if value.numel() != shape.numel():
        raise ValueError(f"value has {value.numel()} elements; the parameter has {shape.numel()} "
                         f"(shape {tuple(shape)})")
    src = value.detach().reshape(-1).to(device=target.device, dtype=target.dtype)
    with torch.no_grad():
        for pstart, lstart, n in opt.param_slices(g, i):
            target[lstart:lstart + n].copy_(src[pstart:pstart + n])


def _require(param: torch.nn.Parameter) -> tuple[Any, int, int]:
    found = _owner(param)
    if found is None:
        raise ValueError("this parameter is not partitioned by a ZeRO stage 1/2 optimizer (stage 0, frozen, or "
                         "not part of an engine)")
    return found


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The whole fp32 master of `param` (a collective)."""
    return _full(param, "param")


def safe_get_full_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """`param.grad` when the parameter holds one (stage 0, ZeRO-1 between reductions or inside
    no_sync, as DeepSpeed); otherwise the whole reduced gradient from ZeRO's partitions in fp32 (a
    collective); None when there is none."""
    if param.grad is not None:
        return param.grad
    return _full(param, "grad")


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    """The whole optimizer state `optim_state_key` (e.g. "exp_avg") of `param` (a collective)."""
    return _full(param, "state", optim_state_key)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Sets the fp32 master from a whole tensor (each rank keeps its own part); the model parameter
    follows at the next step's all-gather."""
    opt, g, i = _require(param)
    _write_full(param, value, opt.fp32_partitions[g].data, opt, g, i)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    opt, g, i = _require(param)
    _write_full(param, value, _state_partition(opt, g, optim_state_key), opt, g, i)


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Writes `param.grad` when the parameter holds one (stage 0, ZeRO-1 between reductions or inside
    no_sync), as DeepSpeed does; otherwise this rank's part of ZeRO's reduced gradient partition."""
    if param.grad is not None:
        if value.numel() != param.numel():
            raise ValueError(f"value has {value.numel()} elements; the parameter has {param.numel()} "
                             f"(shape {tuple(param.shape)})")
        with torch.no_grad():
            param.grad.copy_(value.detach().reshape(param.grad.shape))
        return
    opt, g, i = _require(param)
    _write_full(param, value, _grad_partition(opt, g, create=True), opt, g, i)


# -- local: this rank's elements of the parameter, in parameter order (a 1-D tensor) ----------------
def _local(param: torch.nn.Parameter, target: Optional[torch.Tensor], opt: Any, g: int, i: int) -> Optional[
        torch.Tensor]:
    if target is None:
        return None
    pieces = [target[lstart:lstart + n] for _, lstart, n in opt.param_slices(g, i)]
    if not pieces:
        return torch.empty(0, dtype=torch.float32, device=target.device)
    return torch.cat(pieces).detach().float()


def _write_local(value: torch.Tensor, target: torch.Tensor, opt: Any, g: int, i: int) -> None:
    slices = opt.param_slices(g, i)
    total = sum(n for _, _, n in slices)
    if value.numel() != total:
        raise ValueError(f"value has {value.numel()} elements; this rank owns {total} of the parameter")
    src = value.detach().reshape(-1).to(device=target.device, dtype=target.dtype)
    pos = 0
    with torch.no_grad():
        for _, lstart, n in slices:
            target[lstart:lstart + n].copy_(src[pos:pos + n])
            pos += n


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    found = _owner(param)
    return None if found is None else _local(param, found[0].fp32_partitions[found[1]], *found)


def safe_get_local_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    found = _owner(param)
    return None if found is None else _local(param, _grad_partition(found[0], found[1]), *found)


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    found = _owner(param)
    if found is None:
        return None
    return _local(param, _state_partition(found[0], found[1], optim_state_key), *found)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    opt, g, i = _require(param)
    _write_local(value, opt.fp32_partitions[g].data, opt, g, i)


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    opt, g, i = _require(param)
    _write_local(value, _grad_partition(opt, g, create=True), opt, g, i)


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    opt, g, i = _require(param)
    _write_local(value, _state_partition(opt, g, optim_state_key), opt, g, i)


def _states_in_memory(fn: Any) -> Any:
    """The owning optimizer's masters and optimizer state are in memory while fn runs (under NVMe
    offload they live in swap files between steps: read back for the call, written out after)."""
    import functools

    @functools.wraps(fn)
    def wrapper(param: torch.nn.Parameter, *args: Any, **kwargs: Any) -> Any:
        found = _owner(param)
        if found is None:
            return fn(param, *args, **kwargs)
        with found[0].resident():
            return fn(param, *args, **kwargs)
    return wrapper


for _name in [n for n in __all__ if n.startswith("safe_")]:
    globals()[_name] = _states_in_memory(globals()[_name])


def safe_update_full_grad_vectorized(param_list: list, update_func: Any) -> None:
    """Replaces each parameter's whole gradient g by update_func(g, param): in place in `param.grad` where the
    parameter holds one, else through ZeRO's partitions (safe_get_full_grad / safe_set_full_grad, so a
    collective: every rank passes the same list). Parameters without a gradient are left alone. The new value
    should be in the gradient-accumulation dtype."""
    for p in param_list:
        if p.grad is not None:
            with torch.no_grad():
                p.grad.copy_(update_func(p.grad, p))
        elif p.requires_grad:
            grad = safe_get_full_grad(p)
            if grad is not None:
                safe_set_full_grad(p, update_func(grad, p))


__all__.append("safe_update_full_grad_vectorized")
