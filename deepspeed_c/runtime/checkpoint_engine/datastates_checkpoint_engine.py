"""DataStatesCheckpointEngine: DeepSpeed's engine over the DataStates-LLM package (`datastates`), which is
not part of deepspeed_c. The engine maps `datastates_ckpt` onto its own decoupled background writer
(runtime/checkpointing/async_writer.py: WriterConfig.from_datastates); this class wraps the package itself
when it is installed."""
from __future__ import annotations

from typing import Any, Optional

from deepspeed_c.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

ENGINE_NAME = "DataStatesCheckpointEngine"


class DataStatesCheckpointEngine(CheckpointEngine):

    def __init__(self, deepspeed_config: Any, rank: int) -> None:
        super().__init__(deepspeed_config)
        self.name = ENGINE_NAME
        self.commit_info: Optional[CheckpointCommitInfo] = None
        self.ckpt_engine: Any = None
        try:
            from datastates import CheckpointEngine as _DataStates
        except ImportError:
            raise RuntimeError("DataStatesCheckpointEngine needs the `datastates` package "
                               "(https://github.com/DataStates/datastates-llm); without it set `datastates_ckpt` "
                               "in the config, which deepspeed_c serves with its own background writer") from None
        self.ckpt_engine = _DataStates(deepspeed_config, rank)

    def create(self, info: CheckpointCommitInfo) -> None:
        self.commit_info = info

    def save(self, state_dict: Any, path: str) -> Any:
        return self.ckpt_engine.save(state_dict, path)

    def load(self, path: str, map_location: Any = None) -> Any:
        return self.ckpt_engine.load(path, map_location)

    def commit(self, info: Optional[CheckpointCommitInfo]) -> Optional[bool]:
        if info is None:
            return None
        if info != self.commit_info:
            raise ValueError(f"[{ENGINE_NAME}] commit({info}) does not match the checkpoint being saved "
                             f"({self.commit_info})")
        self.ckpt_engine.wait(persist=True)
        self.commit_info = None
        return True

    def cleanup(self) -> None:
        if self.ckpt_engine is not None:
            self.commit(self.commit_info)
            self.ckpt_engine.wait(persist=True)
            self.ckpt_engine = None

    def is_decoupled(self) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False
