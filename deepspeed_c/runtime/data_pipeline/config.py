"""Parsing of the legacy `curriculum_learning` section (DeepSpeed 0.19.6's keys: enabled, curriculum_type,
min_difficulty, max_difficulty, schedule_type, schedule_config). DeepSpeed's config exposes it as
`curriculum_enabled_legacy` and `curriculum_params_legacy` (the section without `enabled`, or False when
the section is absent); a bad schedule raises at initialize naming the key."""
from __future__ import annotations

import copy
from typing import Any, Union

from deepspeed_c.runtime.config.utils import DeepSpeedConfigError
from deepspeed_c.runtime.data_pipeline.constants import CURRICULUM_LEARNING_LEGACY, CURRICULUM_TYPE
from deepspeed_c.runtime.data_pipeline.curriculum_scheduler import validate_schedule

CURRICULUM_TYPES_LEGACY = ("seqlen", )


def parse_curriculum_legacy(param_dict: dict[str, Any]) -> tuple[bool, Union[dict, bool]]:
    """(curriculum_enabled_legacy, curriculum_params_legacy) of a user config."""
    raw = param_dict.get(CURRICULUM_LEARNING_LEGACY)
    if raw is None:
        return False, False
    path = CURRICULUM_LEARNING_LEGACY
    if not isinstance(raw, dict):
        raise DeepSpeedConfigError(f"Config key '{path}' must be a JSON object (dict), got {raw!r}")
    enabled = raw.get("enabled", False)
    if not isinstance(enabled, bool):
        raise DeepSpeedConfigError(f"Invalid value {enabled!r} for config key '{path}.enabled': expected true/false")
    params = copy.deepcopy({k: v for k, v in raw.items() if k != "enabled"})
    if not enabled:
        return False, params
    kind = params.get(CURRICULUM_TYPE)
    if kind not in CURRICULUM_TYPES_LEGACY:
        # why: DeepSpeed runs any other type's schedule but hands its value to nothing; fail rather than
        # train silently without a curriculum
        raise DeepSpeedConfigError(f"Invalid value {kind!r} for config key '{path}.{CURRICULUM_TYPE}': the legacy "
                                   "curriculum supports 'seqlen' (the difficulty is passed to the model's forward as "
                                   "curriculum_seqlen); for other metrics use data_efficiency.data_sampling")
    validate_schedule(params, path)
    return True, params


_DE = "data_efficiency"
_ROUTING_PATH = "data_efficiency.data_routing.random_ltd"


def _section(raw: Any, path: str) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise DeepSpeedConfigError(f"Config key '{path}' must be a JSON object (dict), got {raw!r}")
    return raw


def _flag(raw: dict, path: str) -> bool:
    value = raw.get("enabled", False)
    if not isinstance(value, bool):
        raise DeepSpeedConfigError(f"Invalid value {value!r} for config key '{path}.enabled': expected true/false")
    return value


def _check_random_ltd(cfg: dict) -> None:
    from deepspeed_c.runtime.data_pipeline.data_routing.scheduler import validate_random_ltd

    validate_random_ltd(cfg, _ROUTING_PATH)
    for key, allowed in (("model_type", ("encoder", "decoder")), ("hidden_state_order", ("batch_seq_dim",
                                                                                          "seq_batch_dim"))):
        if cfg.get(key) not in allowed:
            raise DeepSpeedConfigError(f"Invalid value {cfg.get(key)!r} for config key '{_ROUTING_PATH}.{key}': "
                                       f"expected one of {', '.join(allowed)}")
    ids = cfg.get("random_ltd_layer_id")
    if not isinstance(ids, list) or len(ids) != cfg["random_ltd_layer_num"] \
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DeepSpeedConfigError(f"Config key '{_ROUTING_PATH}.random_ltd_layer_id' must list "
                                   f"random_ltd_layer_num={cfg['random_ltd_layer_num']} layer ids, got {ids!r}")


def _check_curriculum_metrics(curriculum: dict) -> None:
    """The metrics' keys and index files, checked at initialize (the sampler reads them on rank 0 only)."""
    from deepspeed_c.runtime.data_pipeline.data_sampling.data_sampler import validate_metric

    path = f"{_DE}.data_sampling.curriculum_learning"
    metrics = curriculum.get("curriculum_metrics")
    if not isinstance(metrics, dict) or not metrics:
        raise DeepSpeedConfigError(f"Config key '{path}.curriculum_metrics' must name at least one metric")
    if not isinstance(curriculum.get("data_cluster_path"), str):
        raise DeepSpeedConfigError(f"Config key '{path}.data_cluster_path' is required (where the clusters go)")
    for name, cfg in metrics.items():
        if not isinstance(cfg, dict):
            raise DeepSpeedConfigError(f"Config key '{path}.curriculum_metrics.{name}' must be a JSON object")
        validate_metric(name, cfg)
        validate_schedule(cfg, f"{path}.curriculum_metrics.{name}")


def parse_data_efficiency(param_dict: dict[str, Any]) -> dict[str, Any]:
    """The config attributes of the `data_efficiency` section, with DeepSpeed's names and nesting:
    data_efficiency_enabled, data_efficiency_config ({enabled, seed, data_sampling, data_routing}) and
    random_ltd_enabled (DeepSpeed reads random_ltd.enabled alone). With data_sampling.curriculum_learning on,
    each metric's keys and index files are checked here, so a bad one fails at initialize naming the key."""
    from deepspeed_c.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import parse_dynamic_batching

    raw = _section(param_dict.get(_DE), _DE)
    enabled = _flag(raw, _DE)
    seed = raw.get("seed", 1234)
    sampling = _section(raw.get("data_sampling"), f"{_DE}.data_sampling")
    curriculum = _section(sampling.get("curriculum_learning"), f"{_DE}.data_sampling.curriculum_learning")
    sampling_on = _flag(sampling, f"{_DE}.data_sampling")
    curriculum_on = _flag(curriculum, f"{_DE}.data_sampling.curriculum_learning")
    dynamic = parse_dynamic_batching(sampling.get("dynamic_batching"))
    if curriculum_on:
        _check_curriculum_metrics(curriculum)
    routing = _section(raw.get("data_routing"), f"{_DE}.data_routing")
    ltd_raw = _section(routing.get("random_ltd"), _ROUTING_PATH)
    ltd_on = _flag(ltd_raw, _ROUTING_PATH)
    random_ltd: dict[str, Any] = {"enabled": False, "layer_token_lr_schedule": {"enabled": False}}
    if ltd_on:
        random_ltd.update(copy.deepcopy(ltd_raw))
        _check_random_ltd(random_ltd)
    config = {"enabled": enabled, "seed": seed,
              "data_sampling": {**copy.deepcopy(sampling), "enabled": sampling_on,
                                "num_epochs": sampling.get("num_epochs", 1000),
                                "num_workers": sampling.get("num_workers", 0),
                                "pin_memory": sampling.get("pin_memory", False),
                                "curriculum_learning": {**copy.deepcopy(curriculum), "enabled": curriculum_on},
                                "dynamic_batching": dynamic},
              "data_routing": {"enabled": _flag(routing, f"{_DE}.data_routing"), "random_ltd": random_ltd}}
    return {"data_efficiency_enabled": enabled, "data_efficiency_config": config, "random_ltd_enabled": ltd_on,
            "curriculum_learning_enabled": curriculum_on}
