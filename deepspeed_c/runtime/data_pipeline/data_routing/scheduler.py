"""RandomLTDScheduler: how many tokens the random-LTD layers keep at each global step, and the layer-tokens
consumed so far (DeepSpeed's `random_ltd_schedule`).

The kept sequence length ramps linearly (schedule_type fixed_linear, the only one DeepSpeed has) from
`min_value` to `max_value` over `schedule_config.require_steps` steps, floored to a multiple of
`schedule_config.seq_per_step` and capped at max_value. Unlike the curriculum ramp it is not raised back
to min_value after flooring (DeepSpeed 0.19.8 does not). Each new step adds global_batch_size x (kept
tokens x random-LTD layers + max_value x the other layers) to `consumed_layer_tokens`.

The config is the `data_efficiency.data_routing.random_ltd` section plus `global_batch_size` (the engine
fills it from train_batch_size, as DeepSpeed does)."""
from __future__ import annotations

from typing import Any, Mapping

from deepspeed_c.runtime.config.utils import DeepSpeedConfigError
from deepspeed_c.runtime.data_pipeline.constants import (FIXED_LINEAR, RANDOM_LTD_CONSUMED_LAYER_TOKENS,
                                                         RANDOM_LTD_CURR_STEP, RANDOM_LTD_CURRENT_VALUE,
                                                         RANDOM_LTD_GLOBAL_BATCH_SIZE, RANDOM_LTD_LAYER_NUM,
                                                         RANDOM_LTD_LAYER_TOKEN_LR_SCHEDULE, RANDOM_LTD_MAX_VALUE,
                                                         RANDOM_LTD_MIN_VALUE, RANDOM_LTD_REQUIRE_STEPS,
                                                         RANDOM_LTD_SCHEDULE, RANDOM_LTD_SEQ_PER_STEP,
                                                         RANDOM_LTD_TOTAL_LAYER_NUM, SCHEDULE_CONFIG, SCHEDULE_TYPE)
from deepspeed_c.runtime.data_pipeline.schedule_math import root_ramp

_PATH = "data_efficiency.data_routing.random_ltd"


def _get(cfg: Mapping[str, Any], key: str, path: str) -> Any:
    if not isinstance(cfg, Mapping) or key not in cfg:
        raise DeepSpeedConfigError(f"Config key '{path}.{key}' is required for random-LTD")
    return cfg[key]


def _int(value: Any, path: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DeepSpeedConfigError(f"Invalid value {value!r} for config key '{path}': expected an int >= {minimum}")
    return value


def validate_random_ltd(config: Mapping[str, Any], key_path: str = _PATH) -> None:
    total = _int(_get(config, RANDOM_LTD_TOTAL_LAYER_NUM, key_path), f"{key_path}.{RANDOM_LTD_TOTAL_LAYER_NUM}", 1)
    layers = _int(_get(config, RANDOM_LTD_LAYER_NUM, key_path), f"{key_path}.{RANDOM_LTD_LAYER_NUM}", 0)
    if layers > total:
        raise DeepSpeedConfigError(f"Config key '{key_path}.{RANDOM_LTD_LAYER_NUM}' ({layers}) is larger than "
                                   f"'{key_path}.{RANDOM_LTD_TOTAL_LAYER_NUM}' ({total})")
    sched_path = f"{key_path}.{RANDOM_LTD_SCHEDULE}"
    sched = _get(config, RANDOM_LTD_SCHEDULE, key_path)
    lo = _int(_get(sched, RANDOM_LTD_MIN_VALUE, sched_path), f"{sched_path}.{RANDOM_LTD_MIN_VALUE}", 0)
    hi = _int(_get(sched, RANDOM_LTD_MAX_VALUE, sched_path), f"{sched_path}.{RANDOM_LTD_MAX_VALUE}", 0)
    if lo > hi:
        raise DeepSpeedConfigError(f"Config key '{sched_path}.{RANDOM_LTD_MIN_VALUE}' ({lo}) is larger than "
                                   f"'{sched_path}.{RANDOM_LTD_MAX_VALUE}' ({hi})")
    kind = _get(sched, SCHEDULE_TYPE, sched_path)
    if kind != FIXED_LINEAR:
        raise DeepSpeedConfigError(f"Invalid value {kind!r} for config key '{sched_path}.{SCHEDULE_TYPE}': random-LTD "
                                   f"supports only 'fixed_linear'")
    sc_path = f"{sched_path}.{SCHEDULE_CONFIG}"
    sc = _get(sched, SCHEDULE_CONFIG, sched_path)
    _int(_get(sc, RANDOM_LTD_SEQ_PER_STEP, sc_path), f"{sc_path}.{RANDOM_LTD_SEQ_PER_STEP}", 1)
    _int(_get(sc, RANDOM_LTD_REQUIRE_STEPS, sc_path), f"{sc_path}.{RANDOM_LTD_REQUIRE_STEPS}", 1)
    lr = config.get(RANDOM_LTD_LAYER_TOKEN_LR_SCHEDULE) or {}
    if isinstance(lr, Mapping) and lr.get("enabled", False):
        raise NotImplementedError(f"Config key '{key_path}.{RANDOM_LTD_LAYER_TOKEN_LR_SCHEDULE}.enabled' asks for "
                                  "the layer-token learning-rate schedule, which DeepSpeed itself does not implement "
                                  "(it raises NotImplementedError); remove it or set it to false")


class RandomLTDScheduler:
    """DeepSpeed's random-LTD scheduler; `state` holds DeepSpeed's keys."""

    def __init__(self, config: Mapping[str, Any], key_path: str = _PATH) -> None:
        validate_random_ltd(config, key_path)
        self.model_layer_num: int = config[RANDOM_LTD_TOTAL_LAYER_NUM]
        self.random_ltd_layer_num: int = config[RANDOM_LTD_LAYER_NUM]
        self.config_schedule: Mapping[str, Any] = config[RANDOM_LTD_SCHEDULE]
        self.global_batch_size: int = config.get(RANDOM_LTD_GLOBAL_BATCH_SIZE, 1)
        self.state: dict[str, Any] = {}
        self.reset_to_init()

    def reset_to_init(self) -> None:
        sched = self.config_schedule
        self.state.update({RANDOM_LTD_MIN_VALUE: sched[RANDOM_LTD_MIN_VALUE],
                           RANDOM_LTD_MAX_VALUE: sched[RANDOM_LTD_MAX_VALUE],
                           RANDOM_LTD_CURRENT_VALUE: sched[RANDOM_LTD_MIN_VALUE],
                           SCHEDULE_CONFIG: dict(sched[SCHEDULE_CONFIG]), SCHEDULE_TYPE: sched[SCHEDULE_TYPE],
                           RANDOM_LTD_CONSUMED_LAYER_TOKENS: 0, RANDOM_LTD_CURR_STEP: -1})

    def get_value(self, global_steps: int) -> int:
        sc = self.state[SCHEDULE_CONFIG]
        value = root_ramp(global_steps, sc[RANDOM_LTD_REQUIRE_STEPS], 1, self.state[RANDOM_LTD_MIN_VALUE],
                          self.state[RANDOM_LTD_MAX_VALUE], sc[RANDOM_LTD_SEQ_PER_STEP])
        return min(value, self.state[RANDOM_LTD_MAX_VALUE])

    def get_current_seq(self) -> int:
        return self.state[RANDOM_LTD_CURRENT_VALUE]

    def set_current_seq(self, seq_length: int) -> None:
        self.state[RANDOM_LTD_CURRENT_VALUE] = seq_length

    def set_sample(self, indices: Any, attention_mask: Any) -> None:
        """The kept positions (and cut masks) the first random-LTD layer drew for this forward's layers."""
        self.state["sample_idx"], self.state["attention_mask"] = indices, attention_mask

    def get_sample(self) -> tuple[Any, Any]:
        if "sample_idx" not in self.state:
            raise RuntimeError("random-LTD: no tokens drawn yet in this forward (the layer with random_ltd_layer_id "
                               "0 draws them; does random_ltd_layer_id list the first wrapped layer?)")
        return self.state["sample_idx"], self.state["attention_mask"]

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def update_seq(self, global_steps: int) -> None:
        """Called at each training forward: moves the kept length to `global_steps`'s value (until max_value)
        and, once per new step, counts the layer-tokens the step consumes."""
        if self.state[RANDOM_LTD_CURRENT_VALUE] < self.state[RANDOM_LTD_MAX_VALUE]:
            self.state[RANDOM_LTD_CURRENT_VALUE] = self.get_value(global_steps)
        if global_steps != self.state[RANDOM_LTD_CURR_STEP]:
            kept = self.state[RANDOM_LTD_CURRENT_VALUE] * self.random_ltd_layer_num
            full = self.state[RANDOM_LTD_MAX_VALUE] * (self.model_layer_num - self.random_ltd_layer_num)
            self.state[RANDOM_LTD_CONSUMED_LAYER_TOKENS] += self.global_batch_size * (kept + full)
            self.state[RANDOM_LTD_CURR_STEP] = global_steps

    def get_total_layer_tokens(self, train_iters: int) -> int:
        for step in range(train_iters):
            self.update_seq(step)
        return self.state[RANDOM_LTD_CONSUMED_LAYER_TOKENS]

    _SAVED = (RANDOM_LTD_CONSUMED_LAYER_TOKENS, RANDOM_LTD_CURR_STEP, RANDOM_LTD_CURRENT_VALUE, RANDOM_LTD_MIN_VALUE,
              RANDOM_LTD_MAX_VALUE)

    def state_dict(self) -> dict[str, Any]:
        return {key: self.state[key] for key in self._SAVED}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for key in self._SAVED:
            self.state[key] = state_dict[key]
