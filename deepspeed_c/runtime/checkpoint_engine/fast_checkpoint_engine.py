"""FastCheckpointEngine: checkpoint.writer without decoupled. In the engine, its files are snapshotted into
host buffers and written by a background thread, committed at the next commit point
(runtime/checkpointing/async_writer.py: writer types fast, python and mock). Called directly, save() writes
the file at once, as DeepSpeed's does."""
from __future__ import annotations

from typing import Any, Optional

from deepspeed_c.runtime.checkpoint_engine.checkpoint_engine import (CheckpointCommitInfo, CheckpointEngine,
                                                                     config_value)
from deepspeed_c.runtime.checkpoint_engine.torch_checkpoint_engine import load_now, save_now


def writer_config(config_params: Any, decoupled: bool) -> Any:
    """checkpoint.writer of `config_params` parsed (async_writer.WriterConfig), decoupled as asked."""
    import dataclasses

    from deepspeed_c.runtime.checkpointing.async_writer import WriterConfig

    section = config_value(config_params, "writer", None)
    parsed = WriterConfig.parse(section) if section is not None else WriterConfig()
    return dataclasses.replace(parsed, decoupled=decoupled)


class FastCheckpointEngine(CheckpointEngine):

    def __init__(self, config_params: Any, dp_writer_config: Any = None, optimize_dp_state: bool = False, *,
                 writer: Any = None) -> None:
        """DeepSpeed's arguments; `writer` (ours): an already parsed checkpoint.writer section, used instead of
        the one read from config_params."""
        super().__init__(config_params)
        self.name = "FastCheckpointEngine"
        self.serialization_enabled = bool(config_value(config_params, "checkpoint_serialization", True))
        self.optimize_dp_state = optimize_dp_state
        self.dp_writer_config = dp_writer_config
        self.writer_config = writer if writer is not None else writer_config(config_params, decoupled=False)

    @property
    def writes(self) -> bool:
        """False for the mock writer (DeepSpeed's benchmark writer: nothing reaches the disk)."""
        return self.writer_config.type != "MOCK"

    def create(self, info: CheckpointCommitInfo) -> None:
        pass

    def save(self, state_dict: Any, path: str) -> None:
        if self.dp_writer_config is not False and self.writes:  # False: this rank writes nothing
            save_now(state_dict, path)

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_now(path, map_location)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return self.dp_writer_config is not False

    def background_writer_config(self) -> Optional[Any]:
        """What the engine's background writer runs with (async_writer.WriterConfig)."""
        return self.writer_config
