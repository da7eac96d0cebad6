"""CheckpointEngine, DeepSpeed's interface for where checkpoint files go, and CheckpointCommitInfo.

What the engine calls, in order, on save_checkpoint(save_dir, tag): makedirs(save_dir, exist_ok=True) on the
directory's writer rank; create(info) on every rank; makedirs(tag directory) on the writer; save(state_dict,
path) for each of this rank's files; then commit(info) on every rank and, on the writer, the `latest` file
(save_latest). A decoupled engine (is_decoupled() True) is committed later, at the next commit point
(engine.checkpoint_commit(), the next save or load, engine.destroy()), with get_commit_info(). On
load_checkpoint every file is read with load(path, map_location). preserves_storage_sharing() True: the
engine saves copies of tensors that view a larger storage (torch.save would write the whole storage)."""
from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class CheckpointCommitInfo:
    tag: str
    save_dir: str
    save_latest: bool


class CheckpointEngine(abc.ABC):

    def __init__(self, config_params: Any = None) -> None:
        self.name: Optional[str] = None

    @abc.abstractmethod
    def create(self, info: CheckpointCommitInfo) -> Any:
        """A checkpoint `info.tag` is about to be saved."""

    @abc.abstractmethod
    def save(self, state_dict: Any, path: str) -> Any:
        ...

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    @abc.abstractmethod
    def load(self, path: str, map_location: Any = None) -> Any:
        ...

    @abc.abstractmethod
    def commit(self, info: CheckpointCommitInfo) -> Any:
        """Every file of `info.tag` has been handed to save: make the checkpoint durable."""

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def set_commit_info(self, info: CheckpointCommitInfo) -> None:
        pass

    def get_commit_info(self) -> Optional[CheckpointCommitInfo]:
        return None

    def cleanup(self) -> None:
        pass

    def preserves_storage_sharing(self) -> bool:
        return True


def config_value(config_params: Any, key: str, default: Any) -> Any:
    """checkpoint.<key> of a parsed config (ours: attributes; DeepSpeed's: a dict), `default` without one."""
    section = getattr(config_params, "checkpoint_config", None) if config_params is not None else None
    if section is None:
        return default
    if isinstance(section, dict):
        return section.get(key, default)
    return getattr(section, key, default)
