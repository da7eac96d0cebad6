"""TorchCheckpointEngine: each file written with torch.save at once, crash-safely (checkpoint/store.py: a
temporary fsynced and renamed into place), and read weights_only (DeepSpeed's few checkpoint classes
allow-listed, checkpoint/safe_load.py). The engine's default when checkpoint.writer is not set."""
from __future__ import annotations

from typing import Any

from deepspeed_c.runtime.checkpoint_engine.checkpoint_engine import (CheckpointCommitInfo, CheckpointEngine,
                                                                     config_value)
from deepspeed_c.utils.logging import logger

ENGINE_NAME = "TorchCheckpointEngine"


def save_now(state_dict: Any, path: str) -> None:
    from deepspeed_c.checkpoint import store

    with store.through_engine(None):  # this is the write a checkpoint engine's save hands over to
        store.save_file(state_dict, path)


def load_now(path: str, map_location: Any = None) -> Any:
    """The file at `path`, weights_only; tensors moved to map_location where one is given."""
    from deepspeed_c.checkpoint import safe_load

    obj = safe_load.load(path)  # onto the host
    if map_location is None or str(map_location) == "cpu":
        return obj
    import torch

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(map_location) if not callable(map_location) else map_location(x, "cpu")
        if isinstance(x, dict):
            return type(x)((k, move(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
            return type(x)(move(v) for v in x)
        return x

    return move(obj)


class TorchCheckpointEngine(CheckpointEngine):

    def __init__(self, config_params: Any = None) -> None:
        super().__init__(config_params)
        self.name = ENGINE_NAME
        # DeepSpeed's default without a config is the legacy format; with one, checkpoint_serialization (True)
        self.zipfile_serialization = bool(config_value(config_params, "checkpoint_serialization", True)) \
            if config_params is not None else False

    def create(self, info: CheckpointCommitInfo) -> None:
        logger.debug(f"[{ENGINE_NAME}] checkpoint {info.tag} is about to be saved")

    def save(self, state_dict: Any, path: str) -> None:
        save_now(state_dict, path)

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_now(path, map_location)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True
