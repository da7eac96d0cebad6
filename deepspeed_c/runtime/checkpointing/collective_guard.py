"""Keeping the ranks of a collective entry point together when one of them fails.

Entry points that every rank must call (save_checkpoint, load_checkpoint, save_16bit_model) check
their arguments on every rank before any collective, so a bad argument raises the same error
everywhere instead of leaving the other ranks at a barrier. Work that only some ranks do (rank 0
writing a file) runs under `rank_local_step`: its outcome is shared with one all-reduce, and a
failure on any rank raises on every rank."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist


def check_dir_arg(entry_point: str, name: str, value: Any) -> str:
    """`value` as a directory path, or ValueError naming the entry point and the argument."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{entry_point}: {name} must be a non-empty directory path (str or os.PathLike), "
                         f"got {value!r}")
    return value


def dir_group(value: str) -> Optional[tuple[int, ...]]:
    """None when every rank names the same directory; else the global ranks that name this rank's (by real
    path). DeepSpeed lets each rank write its files wherever it is told (a split checkpoint: per-rank
    experiment directories with a timestamp in the name); the checkpoint engine then saves each directory's
    ranks as one group with its own writer. Collective over the default group."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return None
    dirs: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(dirs, os.path.realpath(value))
    if len(set(dirs)) == 1:
        return None
    mine = dirs[tdist.get_rank()]
    return tuple(r for r, d in enumerate(dirs) if d == mine)


def tags_agree(tag: str) -> bool:
    """Whether every rank passes this tag (its hash's min and max over the default group). Collective (not for
    a world of one)."""
    import hashlib

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True

    from deepspeed_c.comm import collective_device

    digest = torch.tensor(list(hashlib.sha1(tag.encode()).digest()[:8]), dtype=torch.int64, device=collective_device())
    lo, hi = digest.clone(), digest.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return torch.equal(lo, hi)


def validate_tag(tag: str, enabled: bool, fail: bool) -> Optional[bool]:
    """checkpoint.tag_validation as DeepSpeed: ranks passing different tags fail with AssertionError on every
    rank (FAIL) or log a warning on each (WARN). None when not checked (IGNORE, or not distributed), else
    whether the tags agree. Collective when checked (not for a world of one: nothing to compare)."""
    if not enabled or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if tags_agree(tag):
        return True
    from deepspeed_c.utils.logging import logger

    msg = (f"[rank={dist.get_rank()}] The checkpoint tag name {tag!r} is not consistent across all ranks "
           "(checkpoint.tag_validation); a rank-specific tag breaks restoring with another world size")
    if fail:
        raise AssertionError(msg)  # DeepSpeed asserts here
    logger.warning(msg)
    return False


@dataclass(frozen=True)
class SaveGroup:
    """A save whose ranks name different (directory, tag) pairs: the ranks sharing this rank's pair save
    one tag directory, with their own writer. `staging`: every tag staged in this rank's directory by
    this save (no writer removes another's staging directory as a stale one); `writes_latest`: this
    group's tag is the one `latest` of the directory names (that of the directory's lowest rank, as
    only DeepSpeed's rank 0 writes `latest`); `split_dirs`: the ranks name different directories."""
    members: tuple[int, ...]
    staging: tuple[str, ...]
    writes_latest: bool
    split_dirs: bool


def save_group(save_dir: str, tag: str) -> Optional[SaveGroup]:
    """None when every rank names the same directory and tag; else this rank's SaveGroup. DeepSpeed lets
    each rank write its files wherever it is told: per-rank directories (experiment names stamped with the
    time) or, with checkpoint.tag_validation WARN / IGNORE, per-rank tags. Collective over the default
    group."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return None
    pairs: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(pairs, (os.path.realpath(save_dir), tag))
    if len(set(pairs)) == 1:
        return None
    mine = pairs[tdist.get_rank()]
    members = tuple(r for r, p in enumerate(pairs) if p == mine)
    same_dir = [r for r, p in enumerate(pairs) if p[0] == mine[0]]
    return SaveGroup(members=members, staging=tuple(sorted({pairs[r][1] for r in same_dir})),
                     writes_latest=min(members) == min(same_dir), split_dirs=len({p[0] for p in pairs}) > 1)


class RankFailed(RuntimeError):
    """Raised on the ranks whose own part succeeded when another rank's part failed. `errors` maps each
    failing rank (global rank) to its error as text, so this rank's message names what went wrong there
    (the damaged file, the full disk) and not only where."""

    def __init__(self, message: str, errors: Optional[dict[int, str]] = None) -> None:
        super().__init__(message)
        self.errors: dict[int, str] = dict(errors or {})


_ERROR_CHARS = 2000  # of each failing rank's message carried to the others (a traceback stays on its rank)


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= _ERROR_CHARS else text[:_ERROR_CHARS] + " ..."


@contextlib.contextmanager
def rank_local_step(what: str, group: Any = None, distributed: bool | None = None) -> Iterator[None]:
    """Run the body (which may do nothing on this rank); then every rank learns whether any rank's
    body raised, and all of them raise: the failing rank its own exception, the others RankFailed.
    `distributed` (default: whether torch.distributed is initialised) says whether there are other
    ranks to tell."""
    error: BaseException | None = None
    try:
        yield
    except Exception as e:  # re-raised below, after the other ranks have heard of it
        error = e
    if distributed is None:
        distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        from deepspeed_c.comm import collective_device

        flag = torch.tensor([dist.get_rank() + 1 if error is not None else 0], dtype=torch.int64,
                            device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        failed = int(flag.item())
    else:
        failed = 1 if error is not None else 0
    if failed and distributed:
        # every rank knows a rank failed, so all of them take part in this second, rare collective:
        # the failures' text travels to the ranks that would otherwise only learn a rank number
        texts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(texts, (dist.get_rank(), _describe(error)) if error is not None else None, group=group)
        errors = {r: t for r, t in (x for x in texts if x is not None)}
    else:
        errors = {0: _describe(error)} if error is not None else {}
    if error is not None:
        raise error
    if failed:
        shown = "; ".join(f"rank {r}: {t}" for r, t in sorted(errors.items()))
        raise RankFailed(f"{what} failed on rank {failed - 1} ({shown}); this rank's part succeeded, and every rank "
                         "raises so that none waits for the failed one", errors)
