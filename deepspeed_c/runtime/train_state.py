"""The training counters the engine advances and a checkpoint carries: one object that saves and
loads itself, so the checkpointers restore a run through `load_state_dict` instead of writing the
engine's fields.

DeepSpeed keeps these as plain engine attributes (`engine.global_steps`, ...), which users, Hugging
Face, Lightning and tests read and set; `TrainStateAttributes` gives the engine those attributes as
properties over its `train_state`, so both views stay one state."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

# the counters a checkpoint's model-states file holds, under DeepSpeed's key names
SAVED_KEYS = ("global_steps", "global_samples", "skipped_steps")


@dataclass
class TrainState:
    """global_steps: optimizer steps taken (skipped ones included, as DeepSpeed counts them);
    global_samples: samples consumed by those steps, over all data-parallel ranks;
    skipped_steps: steps skipped for an fp16 overflow; micro_steps: forward/backward/step rounds.
    micro_steps is not saved (DeepSpeed's checkpoints do not carry it): a resumed run counts its
    micro-steps afresh, as DeepSpeed's does."""
    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0
    micro_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        """The counters under the checkpoint keys of DeepSpeed's model-states file."""
        return {"global_steps": self.global_steps, "global_samples": self.global_samples,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Mapping[str, Any], samples_per_step: Optional[int] = None) -> None:
        """Restores the counters from a model-states dict (extra keys are ignored). A checkpoint
        without `global_samples` (written before DeepSpeed saved it) gets global_steps *
        samples_per_step, or 0 when no batch size is given; `global_steps` and `skipped_steps` are
        required, as in DeepSpeed's loader."""
        steps = state["global_steps"]
        skipped = state["skipped_steps"]
        default = steps * samples_per_step if samples_per_step is not None else 0
        self.global_steps = steps
        self.global_samples = state.get("global_samples", default)
        self.skipped_steps = skipped

    def record_step(self, samples: int) -> None:
        """An optimizer step was taken (applied or skipped) on `samples` samples."""
        self.global_steps += 1
        self.global_samples += samples


def _delegate(name: str, doc: str) -> property:
    def get(self: Any) -> int:
        return getattr(self.train_state, name)

    def set_(self: Any, value: int) -> None:
        setattr(self.train_state, name, value)

    return property(get, set_, doc=doc)


class TrainStateAttributes:
    """DeepSpeed's counter attributes of the engine, read and written through `self.train_state`."""
    train_state: TrainState

    global_steps = _delegate("global_steps", "optimizer steps taken (DeepSpeed's engine.global_steps)")
    global_samples = _delegate("global_samples", "samples consumed over all data-parallel ranks")
    skipped_steps = _delegate("skipped_steps", "steps skipped for an fp16 overflow")
    micro_steps = _delegate("micro_steps", "micro-steps (forward/backward/step rounds) taken")
