"""The engine's checkpoint engine (engine.checkpoint_engine, DeepSpeed's CheckpointEngine interface) and
how the checkpointer uses it.

The built-in engines (exactly TorchCheckpointEngine, FastCheckpointEngine, DecoupledCheckpointEngine) name the
checkpointer's own writers: crash-safe files in a staging directory committed with a manifest, written at
once (Torch) or by the background writer (Fast; Decoupled: its child process). Any other engine, a user's
subclass included, gets DeepSpeed's protocol instead: makedirs and create, save(state, path) for every file
straight into the tag directory, then commit (and `latest`) on every rank, or at the next commit point when it
is_decoupled(); loads read every file with its load(path, map_location). Its files carry no manifest: that
engine answers for them."""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

from deepspeed_c.checkpoint import store
from deepspeed_c.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from deepspeed_c.runtime.checkpointing.collective_guard import rank_local_step


def builtin_engine(writer_config: Optional[Any]) -> Any:
    """The built-in engine naming the checkpointer's writer for checkpoint.writer (parsed; None: synchronous)."""
    from deepspeed_c.runtime.checkpoint_engine.decoupled_checkpoint_engine import DecoupledCheckpointEngine
    from deepspeed_c.runtime.checkpoint_engine.fast_checkpoint_engine import FastCheckpointEngine
    from deepspeed_c.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    if writer_config is None:
        return TorchCheckpointEngine()
    return (DecoupledCheckpointEngine if writer_config.decoupled else FastCheckpointEngine)(None, True,
                                                                                          writer=writer_config)


def native_writer(ckpt_engine: Any) -> tuple[bool, Optional[Any]]:
    """(whether the checkpointer writes the files of `ckpt_engine` itself, its background writer's config)."""
    from deepspeed_c.runtime.checkpoint_engine.decoupled_checkpoint_engine import DecoupledCheckpointEngine
    from deepspeed_c.runtime.checkpoint_engine.fast_checkpoint_engine import FastCheckpointEngine
    from deepspeed_c.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    kind = type(ckpt_engine)
    if kind is TorchCheckpointEngine:
        return True, None
    if kind in (FastCheckpointEngine, DecoupledCheckpointEngine):
        return True, ckpt_engine.writer_config
    return False, None


def check_engine(ckpt_engine: Any) -> None:
    missing = [m for m in ("create", "save", "load", "commit") if not callable(getattr(ckpt_engine, m, None))]
    if missing:
        raise TypeError(f"checkpoint_engine: {type(ckpt_engine).__name__} lacks {missing}; a checkpoint engine "
                        "implements deepspeed.runtime.checkpoint_engine.checkpoint_engine.CheckpointEngine")


def _is_decoupled(ckpt_engine: Any) -> bool:
    fn = getattr(ckpt_engine, "is_decoupled", None)
    return bool(fn()) if callable(fn) else False


def begin(ckpt_engine: Any, info: CheckpointCommitInfo, scope: Any, distributed: bool) -> str:
    """makedirs (on the directory's writer) and create (on every rank) before a save's files; returns the tag
    directory, which the files then go straight into."""
    tag_dir = os.path.join(info.save_dir, info.tag)
    with rank_local_step("save_checkpoint (the checkpoint engine's makedirs and create)", distributed=distributed):
        if scope.writer:
            for path in (info.save_dir, tag_dir):
                mk = getattr(ckpt_engine, "makedirs", None)
                mk(path, exist_ok=True) if callable(mk) else os.makedirs(path, exist_ok=True)
        ckpt_engine.create(info)
    return tag_dir


def finish(ckpt_engine: Any, info: CheckpointCommitInfo, scope: Any, distributed: bool,
           copy_scripts: Callable[[str], None]) -> Optional[tuple]:
    """After every rank handed its files over: commit now, or (decoupled) return the (info, scope) to pass to
    commit() at the next commit point."""
    if _is_decoupled(ckpt_engine):
        return info, scope
    commit(ckpt_engine, info, scope, distributed, copy_scripts)
    return None


def commit(ckpt_engine: Any, info: CheckpointCommitInfo, scope: Any, distributed: bool,
           copy_scripts: Callable[[str], None]) -> None:
    """The engine's commit on every rank (a decoupled one's own commit info where it keeps one), then the
    directory's writer adds the recovery scripts and `latest`."""
    kept = None
    if _is_decoupled(ckpt_engine) and callable(getattr(ckpt_engine, "get_commit_info", None)):
        kept = ckpt_engine.get_commit_info()
    with rank_local_step("save_checkpoint (the checkpoint engine's commit)", distributed=distributed):
        ckpt_engine.commit(kept if kept is not None else info)
        if scope.writer:
            copy_scripts(info.save_dir)
            if info.save_latest:
                store.write_bytes_atomic(os.path.join(info.save_dir, store.LATEST_NAME), info.tag.encode())
