"""Each rank's own 1-bit optimizer state in a checkpoint: one file per rank beside the shared files.

DeepSpeed saves rank 0's optimizer state only and resets the compression errors on load (each
rank's differ), so its resumed run is a run that reloaded, not the run that never stopped. Here
every rank also writes `onebit_errors_rank_{rank:05d}_of_{world:05d}.pt` (global rank and world
size) into the tag directory, which the engine's checkpointer stages, lists in the manifest and
commits with the rest: the worker and server errors of each compressed all-reduce the optimizer
holds (with 1-bit LAMB's carried padding), and 0/1 Adam's local-step state (see
ZeroOneAdam.local_rank_state).

On load, after load_state_dict has reset all of it: the ranks of the data-parallel group each read
their own file and tell each other whether it fits (same world and rank, same optimizer, buffers
of the sizes this run's plans and parameters have). Only when every rank's fits do all restore
(the resumed run is then bit for bit the uninterrupted one); otherwise all keep the reset, as
DeepSpeed, and the group's rank 0 logs why, once. A file that is present but damaged raises, on
every rank, as any damaged checkpoint file does."""
from __future__ import annotations

import os
import re
from typing import Any, Optional

import torch

from deepspeed_c.checkpoint import store

FORMAT = 1
_NAME_RE = re.compile(r"onebit_errors_rank_(\d+)_of_(\d+)\.pt$")


def file_name(rank: int, world: int) -> str:
    return f"onebit_errors_rank_{rank:05d}_of_{world:05d}.pt"


def _global_rank_world() -> tuple[int, int]:
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


def _group_rank(opt: Any) -> int:
    return opt.comm_backend_handle.rank if opt.comm_backend_handle is not None else 0


def _device(opt: Any) -> Optional[torch.device]:
    for group in opt.param_groups:
        for p in group["params"]:
            return p.device
    return None


def rank_file(opt: Any) -> tuple[str, dict]:
    """(name, contents) of this rank's file."""
    rank, world = _global_rank_world()
    payload = {
        "format": FORMAT, "optimizer": type(opt).__name__, "rank": rank, "world": world,
        "dp_rank": _group_rank(opt), "dp_world": opt.size,
        "plans": [{"key": key, **plan.rank_state()} for key, plan in opt.compression_plans()],
        "local": opt.local_rank_state(),
    }
    return file_name(rank, world), payload


def _missing(tag_dir: str, name: str, world: int) -> str:
    try:
        worlds = sorted({int(m.group(2)) for n in os.listdir(tag_dir) if (m := _NAME_RE.match(n))})
    except OSError:
        worlds = []
    if not worlds:
        return (f"{tag_dir} holds no 1-bit optimizer rank files (a checkpoint written by DeepSpeed or by an older "
                "deepspeed_c)")
    if world not in worlds:
        return f"{tag_dir} was saved by {' / '.join(map(str, worlds))} ranks, this run has {world}"
    return f"{name} is missing from {tag_dir}"


def _check(opt: Any, payload: Any, rank: int, world: int) -> Optional[str]:
    """Why `payload` cannot be restored into `opt` on this rank, or None."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        return f"format {payload.get('format') if isinstance(payload, dict) else type(payload).__name__!r}, " \
               f"this deepspeed_c reads {FORMAT}"
    expected = {"optimizer": type(opt).__name__, "rank": rank, "world": world, "dp_rank": _group_rank(opt),
                "dp_world": opt.size}
    for key, mine in expected.items():
        if payload.get(key) != mine:
            return f"saved with {key} {payload.get(key)!r}, this run has {mine!r}"
    plans = payload.get("plans")
    if not isinstance(plans, list) or (plans and opt.comm_backend_handle is None):
        return "its compressed all-reduce states do not fit this optimizer"
    return opt.local_rank_state_mismatch(payload.get("local") or {})


def _build_plans(opt: Any, payload: dict) -> tuple[list, Optional[str]]:
    """The saved plans rebuilt on this run's device, with their state; or a reason they do not fit."""
    device = _device(opt)
    built = []
    for i, entry in enumerate(payload["plans"]):
        numels = entry.get("numels") if isinstance(entry, dict) else None
        if not isinstance(numels, list) or not all(isinstance(n, int) and n >= 0 for n in numels):
            return [], f"plan {i} has no valid numels"
        plan = opt.comm_backend_handle.plan(numels, device, persistent_pad=bool(entry.get("persistent_pad")))
        why = plan.mismatch(entry)
        if why is not None:
            return [], f"plan {i} ({entry.get('key')!r}): {why}"
        built.append((str(entry.get("key")), plan, entry))
    return built, None


def _agree(opt: Any, mine: tuple[str, str]) -> list[tuple[str, str]]:
    """Every group rank's (status, message); just this rank's without a group."""
    if opt.size <= 1:
        return [mine]
    import deepspeed_c.comm as dist
    from deepspeed_c.runtime.fp16.onebit.base import data_parallel_world

    group, size = data_parallel_world(opt.deepspeed)
    out: list[Any] = [None] * size
    dist.all_gather_object(out, mine, group=group)
    return out


def restore(opt: Any, tag_dir: str, manifest: Any) -> None:
    rank, world = _global_rank_world()
    name = file_name(rank, world)
    payload: Any = None
    built: list = []
    error: Optional[Exception] = None
    status, message = "ok", ""
    try:
        if not os.path.isfile(os.path.join(tag_dir, name)):
            status, message = "reset", _missing(tag_dir, name, world)
        else:
            payload = store.load_file(tag_dir, name, manifest)
            why = _check(opt, payload, rank, world)
            if why is None:
                built, why = _build_plans(opt, payload)
            if why is not None:
                status, message = "reset", f"{name}: {why}"
    except Exception as e:  # raised below, once every rank has heard of it
        error, status, message = e, "error", f"{type(e).__name__}: {e}"
    everyone = _agree(opt, (status, message))
    if error is not None:
        raise error
    failed = [(r, m) for r, (s, m) in enumerate(everyone) if s == "error"]
    if failed:
        raise RuntimeError(f"load_checkpoint: reading the 1-bit optimizer rank files failed on data-parallel rank "
                           f"{failed[0][0]}: {failed[0][1]}")
    resets = [(r, m) for r, (s, m) in enumerate(everyone) if s == "reset"]
    if resets:
        if _group_rank(opt) == 0:
            from deepspeed_c.utils.logging import logger

            r, m = resets[0]
            more = f" (and {len(resets) - 1} more rank(s))" if len(resets) > 1 else ""
            logger.warning(f"load_checkpoint: {type(opt).__name__}'s compression errors restart at zero, as in "
                           f"DeepSpeed, so the resumed run differs from an uninterrupted one: data-parallel rank {r}: "
                           f"{m}{more}")
        return
    for key, plan, entry in built:
        plan.load_rank_state(entry)
    opt.adopt_plans([(key, plan) for key, plan, _ in built])
    opt.load_local_rank_state(payload.get("local") or {})
