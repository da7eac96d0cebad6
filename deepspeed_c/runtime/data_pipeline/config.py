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
