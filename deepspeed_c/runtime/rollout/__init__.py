"""deepspeed.runtime.rollout: on-policy generation for RL and distillation training (DeepSpeed 0.19.8's API).

RolloutEngine (the backend contract), its dataclasses RolloutRequest / RolloutBatch / SamplingConfig /
RolloutConfig, HybridEngineRollout (generation from the training engine's live weights), the OPSD pieces
ResponseTokenBatch / JSDLossOutput / generalized_jsd_loss, and build_rollout, which picks the backend."""
from __future__ import annotations

from typing import Any

from deepspeed_c.runtime.rollout.base import (RolloutBatch, RolloutConfig, RolloutEngine, RolloutRequest,
                                              SamplingConfig)
from deepspeed_c.runtime.rollout.hybrid_engine_rollout import HybridEngineRollout
from deepspeed_c.runtime.rollout.opsd import JSDLossOutput, ResponseTokenBatch, generalized_jsd_loss

__all__ = [
    "HybridEngineRollout",
    "JSDLossOutput",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutRequest",
    "ResponseTokenBatch",
    "SamplingConfig",
    "build_rollout",
    "generalized_jsd_loss",
]

_ENGINES = ("hybrid_engine", )


def build_rollout(rollout_cfg: Any, student_engine: Any = None, tokenizer: Any = None, **kwargs: Any) -> Any:
    """The rollout engine named by rollout_cfg.engine (a RolloutConfig or anything with that attribute);
    "hybrid_engine" needs the student's engine and its tokenizer. Extra keyword arguments are accepted and
    unused, as in DeepSpeed."""
    name = getattr(rollout_cfg, "engine", None)
    if name == "hybrid_engine":
        if student_engine is None or tokenizer is None:
            missing = [k for k, v in (("student_engine", student_engine), ("tokenizer", tokenizer)) if v is None]
            raise ValueError(f"hybrid_engine rollout needs both student_engine and tokenizer; missing "
                             f"{', '.join(missing)}")
        return HybridEngineRollout(engine=student_engine, tokenizer=tokenizer, cfg=rollout_cfg)
    raise ValueError(f"Unknown rollout engine {name!r} (rollout_cfg.engine); choose from "
                     f"{', '.join(repr(e) for e in _ENGINES)}")
