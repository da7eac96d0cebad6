"""CurriculumScheduler: the difficulty (a sequence length, or any metric value) at each global step,
from `min_difficulty` to `max_difficulty` along DeepSpeed's schedules:

- fixed_linear: {total_curriculum_step, difficulty_step}, a straight ramp;
- fixed_root:   {total_curriculum_step, difficulty_step, root_degree}, a root-shaped ramp (degree 2 rises
  fast early, then slowly);
- fixed_discrete: {difficulty: [d0, ..., dn], max_step: [s0, ..., s(n-1)]}, difficulty d_i up to step s_i
  and dn after the last;
- custom: a function global_step -> difficulty given through `set_custom_get_difficulty`.

Ramps are floored to a multiple of `difficulty_step` and capped at `max_difficulty`. DeepSpeed 0.19.8
also raises a ramp value that the flooring took below `min_difficulty` to the first multiple of the step
at or above it; 0.19.6 (the last release of the legacy `curriculum_learning` section) did not. The engine's
legacy scheduler is built with `raise_to_min_difficulty=False` to keep 0.19.6's values.

Bad configs raise DeepSpeedConfigError naming the key under `key_path`."""
from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Optional

from deepspeed_c.runtime.config.utils import DeepSpeedConfigError
from deepspeed_c.runtime.data_pipeline.constants import (CURRENT_DIFFICULTY, CUSTOM, FIXED_DISCRETE, FIXED_LINEAR,
                                                         FIXED_ROOT, MAX_DIFFICULTY, MIN_DIFFICULTY, SCHEDULE_CONFIG,
                                                         SCHEDULE_DIFFICULTY, SCHEDULE_DIFFICULTY_STEP,
                                                         SCHEDULE_MAX_STEP, SCHEDULE_ROOT_DEGREE, SCHEDULE_TOTAL_STEP,
                                                         SCHEDULE_TYPE, SCHEDULE_TYPES)
from deepspeed_c.runtime.data_pipeline.schedule_math import first_multiple_at_or_above, root_ramp
from deepspeed_c.utils.logging import logger


def _number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DeepSpeedConfigError(f"Invalid value {value!r} for config key '{path}': expected a number")
    return value


def _positive_int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DeepSpeedConfigError(f"Invalid value {value!r} for config key '{path}': expected an int > 0")
    return value


def _require(cfg: Mapping[str, Any], key: str, path: str, why: str) -> Any:
    if key not in cfg:
        raise DeepSpeedConfigError(f"Config key '{path}.{key}' is required {why}")
    return cfg[key]


def validate_schedule(config: Mapping[str, Any], key_path: str) -> None:
    """Checks one curriculum schedule (min/max difficulty, schedule_type, schedule_config)."""
    if not isinstance(config, Mapping):
        raise DeepSpeedConfigError(f"Config key '{key_path}' must be a JSON object, got {config!r}")
    lo = _number(_require(config, MIN_DIFFICULTY, key_path, "for curriculum learning"), f"{key_path}.{MIN_DIFFICULTY}")
    hi = _number(_require(config, MAX_DIFFICULTY, key_path, "for curriculum learning"), f"{key_path}.{MAX_DIFFICULTY}")
    if lo > hi:
        raise DeepSpeedConfigError(f"Config key '{key_path}.{MIN_DIFFICULTY}' ({lo}) is larger than "
                                   f"'{key_path}.{MAX_DIFFICULTY}' ({hi}): the curriculum must rise from min to max")
    kind = _require(config, SCHEDULE_TYPE, key_path, "for curriculum learning")
    if kind not in SCHEDULE_TYPES:
        raise DeepSpeedConfigError(f"Invalid value {kind!r} for config key '{key_path}.{SCHEDULE_TYPE}': expected "
                                   f"one of {', '.join(SCHEDULE_TYPES)}")
    if kind == CUSTOM:
        return
    sc_path = f"{key_path}.{SCHEDULE_CONFIG}"
    sc = _require(config, SCHEDULE_CONFIG, key_path, f"with schedule_type {kind!r}")
    if not isinstance(sc, Mapping):
        raise DeepSpeedConfigError(f"Config key '{sc_path}' must be a JSON object, got {sc!r}")
    if kind == FIXED_DISCRETE:
        diffs = _require(sc, SCHEDULE_DIFFICULTY, sc_path, "with schedule_type 'fixed_discrete'")
        steps = _require(sc, SCHEDULE_MAX_STEP, sc_path, "with schedule_type 'fixed_discrete'")
        if not isinstance(diffs, list) or not isinstance(steps, list) or not steps \
                or len(diffs) != len(steps) + 1:
            raise DeepSpeedConfigError(
                f"Config keys '{sc_path}.difficulty' and '{sc_path}.max_step' must be non-empty lists with one "
                f"more difficulty than max_step (the last difficulty holds after the last step); got {diffs!r} "
                f"and {steps!r}")
        return
    why = f"with schedule_type {kind!r}"
    _positive_int(_require(sc, SCHEDULE_TOTAL_STEP, sc_path, why), f"{sc_path}.{SCHEDULE_TOTAL_STEP}")
    step = _positive_int(_require(sc, SCHEDULE_DIFFICULTY_STEP, sc_path, why), f"{sc_path}.{SCHEDULE_DIFFICULTY_STEP}")
    if kind == FIXED_ROOT:
        degree = _number(_require(sc, SCHEDULE_ROOT_DEGREE, sc_path, why), f"{sc_path}.{SCHEDULE_ROOT_DEGREE}")
        if degree <= 0:
            raise DeepSpeedConfigError(f"Invalid value {degree!r} for config key '{sc_path}.{SCHEDULE_ROOT_DEGREE}': "
                                       "expected a number > 0")
    if step % 8 != 0:
        # why: a seqlen difficulty that is not a multiple of 8 (fp16) / 16 (int8) misses the tensor cores
        logger.warning(f"{sc_path}.{SCHEDULE_DIFFICULTY_STEP} = {step} is not a multiple of 8: with the seqlen "
                       "metric, sequence lengths off multiples of 8 (fp16) or 16 (int8) miss NVIDIA Tensor Cores")


class CurriculumScheduler:
    """DeepSpeed's curriculum scheduler. `state` holds DeepSpeed's keys (min_difficulty, max_difficulty,
    current_difficulty, schedule_type, schedule_config)."""

    def __init__(self, config: Mapping[str, Any], key_path: str = "curriculum_learning",
                 raise_to_min_difficulty: bool = True) -> None:
        validate_schedule(config, key_path)
        self.raise_to_min_difficulty = raise_to_min_difficulty
        self.custom_get_difficulty: Optional[Callable[[int], Any]] = None
        self.state: dict[str, Any] = {
            MIN_DIFFICULTY: config[MIN_DIFFICULTY],
            MAX_DIFFICULTY: config[MAX_DIFFICULTY],
            CURRENT_DIFFICULTY: config[MIN_DIFFICULTY],
            SCHEDULE_TYPE: config[SCHEDULE_TYPE],
        }
        if config[SCHEDULE_TYPE] != CUSTOM:
            self.state[SCHEDULE_CONFIG] = copy.deepcopy(dict(config[SCHEDULE_CONFIG]))

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], Any]) -> None:
        self.custom_get_difficulty = schedule_function

    def get_current_difficulty(self) -> Any:
        return self.state[CURRENT_DIFFICULTY]

    def set_current_difficulty(self, difficulty: Any) -> None:
        self.state[CURRENT_DIFFICULTY] = difficulty

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint carries (a custom schedule's function is not saved: set it again after load)."""
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state = copy.deepcopy(dict(state))

    def _discrete(self, global_steps: int) -> Any:
        sc = self.state[SCHEDULE_CONFIG]
        for difficulty, max_step in zip(sc[SCHEDULE_DIFFICULTY], sc[SCHEDULE_MAX_STEP]):
            if global_steps <= max_step:
                return difficulty
        return sc[SCHEDULE_DIFFICULTY][-1]

    def _ramp(self, global_steps: int, root_degree: float) -> int:
        sc = self.state[SCHEDULE_CONFIG]
        lo, hi, step = self.state[MIN_DIFFICULTY], self.state[MAX_DIFFICULTY], sc[SCHEDULE_DIFFICULTY_STEP]
        value = root_ramp(global_steps, sc[SCHEDULE_TOTAL_STEP], root_degree, lo, hi, step)
        if self.raise_to_min_difficulty:
            value = max(value, first_multiple_at_or_above(lo, step))
        return min(value, hi)

    def get_difficulty(self, global_steps: int) -> Any:
        kind = self.state[SCHEDULE_TYPE]
        if kind == FIXED_DISCRETE:
            return self._discrete(global_steps)
        if kind == FIXED_LINEAR:
            return self._ramp(global_steps, 1)
        if kind == FIXED_ROOT:
            return self._ramp(global_steps, self.state[SCHEDULE_CONFIG][SCHEDULE_ROOT_DEGREE])
        if self.custom_get_difficulty is None:
            raise RuntimeError("curriculum schedule_type 'custom' needs a schedule function: call "
                               "engine.set_custom_curriculum_learning_schedule(fn) (or "
                               "CurriculumScheduler.set_custom_get_difficulty(fn)) before training")
        return self.custom_get_difficulty(global_steps)

    def update_difficulty(self, global_steps: int) -> Any:
        """Moves to the difficulty of `global_steps` unless max_difficulty was reached (then it stays)."""
        if self.state[CURRENT_DIFFICULTY] < self.state[MAX_DIFFICULTY]:
            self.state[CURRENT_DIFFICULTY] = self.get_difficulty(global_steps)
        return self.state[CURRENT_DIFFICULTY]
