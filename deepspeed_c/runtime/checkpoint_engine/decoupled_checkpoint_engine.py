"""DecoupledCheckpointEngine: checkpoint.writer with decoupled true. In the engine, its files are staged in
shared memory and written by a child process (runtime/checkpointing/process_writer.py); the checkpoint is
committed at the next commit point (engine.checkpoint_commit(), the next save or load, engine.destroy()), as
DeepSpeed commits it at the next step. Called directly, save() snapshots the state (training may change it
afterwards) and commit() writes what was saved since create() from a thread and returns when it is on disk."""
from __future__ import annotations

from typing import Any, Optional

from deepspeed_c.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
from deepspeed_c.runtime.checkpoint_engine.fast_checkpoint_engine import writer_config
from deepspeed_c.runtime.checkpoint_engine.torch_checkpoint_engine import load_now

ENGINE_NAME = "DecoupledCheckpointEngine"


class DecoupledCheckpointEngine(CheckpointEngine):

    def __init__(self, config_params: Any, dp_writer_config: Any = None, optimize_dp_state: bool = False, *,
                 writer: Any = None) -> None:
        """DeepSpeed's arguments; `writer` (ours): an already parsed checkpoint.writer section, used instead of
        the one read from config_params."""
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.dp_writer_config = dp_writer_config
        self.optimize_dp_state = optimize_dp_state
        self.writer_config = writer if writer is not None else writer_config(config_params, decoupled=True)
        self.commit_info: Optional[CheckpointCommitInfo] = None
        self._writer: Any = None  # a BackgroundWriter, made on the first direct save
        self._staged = 0

    def create(self, info: CheckpointCommitInfo) -> None:
        self.commit_info = info

    def save(self, state_dict: Any, path: str) -> None:
        if self.dp_writer_config is False:
            return
        if self._writer is None:
            import dataclasses

            from deepspeed_c.runtime.checkpointing.async_writer import BackgroundWriter

            # called directly: a writer thread (the engine's saves go to its child process instead)
            self._writer = BackgroundWriter(dataclasses.replace(self.writer_config, decoupled=False))
        self._writer.stage(f"file{self._staged}", state_dict, path)
        self._staged += 1

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_now(path, map_location)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        if info != self.commit_info:
            raise ValueError(f"[{ENGINE_NAME}] commit({info}) does not match the checkpoint being saved "
                             f"({self.commit_info})")
        if self._writer is not None and self._staged:
            self._writer.start()
            self._writer.wait()  # raises the write's failure
        self._staged = 0
        self.commit_info = None
        return True

    def get_commit_info(self) -> Optional[CheckpointCommitInfo]:
        return self.commit_info

    def is_decoupled(self) -> bool:
        return True

    def cleanup(self) -> None:
        if self.commit_info is not None:
            self.commit(self.commit_info)

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return self.dp_writer_config is not False

    def background_writer_config(self) -> Optional[Any]:
        return self.writer_config
