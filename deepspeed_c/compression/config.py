"""The `compression_training` section parsed into DeepSpeed 0.19.6's nested layout:

    {technique: {"shared_parameters": {...}, "different_groups": {name: {"params": {...}, "modules": [...],
                                                                          "related_modules": [...] | None}}},
     "layer_reduction": {"enabled": bool, ...}}

with DeepSpeed's defaults. Unlike DeepSpeed, which ignores what it does not know, a misspelt key is an
error naming the closest known key, and the bit schedule is checked (target_bits <= start_bits)."""
from __future__ import annotations

import copy
import difflib
from typing import Any, Iterable

from deepspeed_c.compression import constants as C


class CompressionConfigError(ValueError):
    """A `compression_training` key or value deepspeed_c cannot use."""


def _closest(key: str, known: Iterable[str]) -> str:
    near = difflib.get_close_matches(key, list(known), n=1, cutoff=0.5)
    return f" (did you mean {near[0]!r}?)" if near else f" (known keys: {sorted(known)})"


def check_keys(section: dict, known: Iterable[str], where: str) -> None:
    known = list(known)
    for key in section:
        if key not in known:
            raise CompressionConfigError(f"compression_training: unknown key {key!r} in {where}{_closest(key, known)}")


# shared_parameters of each technique: key -> default
_WQ_SHARED = {C.TECHNIQUE_ENABLED: False, C.WEIGHT_QUANTIZE_KERNEL: False, C.TECHNIQUE_SCHEDULE_OFFSET: 0,
              C.WEIGHT_QUANTIZE_GROUPS: 1, C.WEIGHT_QUANTIZE_VERBOSE: False,
              C.WEIGHT_QUANTIZE_TYPE: C.WEIGHT_QUANTIZE_SYMMETRIC, C.WEIGHT_QUANTIZE_IN_FORWARD_ENABLED: False,
              C.WEIGHT_QUANTIZE_ROUNDING: C.WEIGHT_QUANTIZE_NEAREST_ROUNDING}
_AQ_SHARED = {C.TECHNIQUE_ENABLED: False, C.ACTIVATION_QUANTIZE_TYPE: C.WEIGHT_QUANTIZE_SYMMETRIC,
              C.ACTIVATION_QUANTIZE_RANGE: C.ACTIVATION_QUANTIZE_RANGE_DYNAMIC, C.TECHNIQUE_SCHEDULE_OFFSET: 1000}
_PRUNE_SHARED = {C.TECHNIQUE_ENABLED: False, C.PRUNING_METHOD: C.PRUNING_METHOD_L1, C.TECHNIQUE_SCHEDULE_OFFSET: 1000}
_SPARSE_EXTRA = {C.SPARSE_PRUNING_BLOCK_PATTERN: "4x1", C.PRUNING_DENSE_RATIO: 0.1,
                 C.SPARSE_PRUNING_SCHEDULE_OFFSET_STRIDE: 1, C.SPARSE_PRUNING_EXCLUDED_MODULES: [],
                 C.TECHNIQUE_SCHEDULE_OFFSET_END: None}
_METHODS = {C.WEIGHT_QUANTIZATION: None, C.ACTIVATION_QUANTIZATION: None,
            C.SPARSE_PRUNING: (C.PRUNING_METHOD_L1, C.PRUNING_METHOD_TOPK, C.SPARSE_PRUNING_METHOD_SNIP_MOMENTUM),
            C.ROW_PRUNING: (C.PRUNING_METHOD_L1, C.PRUNING_METHOD_TOPK),
            C.HEAD_PRUNING: (C.PRUNING_METHOD_TOPK,), C.CHANNEL_PRUNING: (C.PRUNING_METHOD_L1, C.PRUNING_METHOD_TOPK)}
# params of each group: required keys, optional keys -> default
_GROUP_PARAMS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    C.WEIGHT_QUANTIZATION: ((C.WEIGHT_QUANTIZE_START_BITS, C.WEIGHT_QUANTIZE_TARGET_BITS),
                            {C.WEIGHT_QUANTIZATION_PERIOD: 1}),
    C.ACTIVATION_QUANTIZATION: ((C.ACTIVATION_QUANTIZE_BITS,), {}),
    C.SPARSE_PRUNING: ((C.PRUNING_DENSE_RATIO,), {}),
    C.ROW_PRUNING: ((C.PRUNING_DENSE_RATIO,), {}),
    C.HEAD_PRUNING: ((C.PRUNING_DENSE_RATIO,), {}),
    C.CHANNEL_PRUNING: ((C.PRUNING_DENSE_RATIO,), {}),
}


def _choice(d: dict, key: str, allowed: Iterable[str], where: str) -> None:
    allowed = tuple(allowed)
    if d[key] not in allowed:
        raise CompressionConfigError(f"compression_training.{where}.{key} = {d[key]!r}: expected one of {allowed}")


def _shared(technique: str, raw: dict) -> dict:
    where = f"{technique}.{C.SHARED_PARAMETERS}"
    if technique == C.WEIGHT_QUANTIZATION:
        defaults = dict(_WQ_SHARED)
        check_keys(raw, [*defaults, C.WEIGHT_QUANTIZE_FP16_MIXED_QUANTIZE, C.WEIGHT_QUANTIZE_CHANGE_RATIO], where)
    elif technique == C.ACTIVATION_QUANTIZATION:
        defaults = dict(_AQ_SHARED)
        check_keys(raw, defaults, where)
    else:
        defaults = dict(_PRUNE_SHARED)
        if technique == C.HEAD_PRUNING:
            defaults[C.PRUNING_METHOD] = C.PRUNING_METHOD_TOPK
        extra = list(_SPARSE_EXTRA) if technique == C.SPARSE_PRUNING else []
        check_keys(raw, [*defaults, *extra, *([C.HEAD_PRUNING_NUM_HEADS] if technique == C.HEAD_PRUNING else [])],
                   where)
    out = {k: raw.get(k, v) for k, v in defaults.items()}
    if technique == C.WEIGHT_QUANTIZATION:
        _choice(out, C.WEIGHT_QUANTIZE_TYPE, (C.WEIGHT_QUANTIZE_SYMMETRIC, C.WEIGHT_QUANTIZE_ASYMMETRIC), where)
        _choice(out, C.WEIGHT_QUANTIZE_ROUNDING,
                (C.WEIGHT_QUANTIZE_NEAREST_ROUNDING, C.WEIGHT_QUANTIZE_STOCHASTIC_ROUNDING), where)
        mixed = raw.get(C.WEIGHT_QUANTIZE_FP16_MIXED_QUANTIZE, {})
        if isinstance(mixed, bool):  # a flat spelling found in the wild (DeepSpeed itself fails on it)
            mixed = {C.WEIGHT_QUANTIZE_FP16_MIXED_QUANTIZE_ENABLED: mixed}
        check_keys(mixed, (C.WEIGHT_QUANTIZE_FP16_MIXED_QUANTIZE_ENABLED, C.WEIGHT_QUANTIZE_CHANGE_RATIO),
                   f"{where}.{C.WEIGHT_QUANTIZE_FP16_MIXED_QUANTIZE}")
        out[C.WEIGHT_QUANTIZE_FP16_MIXED_QUANTIZE] = mixed.get(C.WEIGHT_QUANTIZE_FP16_MIXED_QUANTIZE_ENABLED, False)
        out[C.WEIGHT_QUANTIZE_CHANGE_RATIO] = mixed.get(C.WEIGHT_QUANTIZE_CHANGE_RATIO,
                                                        raw.get(C.WEIGHT_QUANTIZE_CHANGE_RATIO, 0.001))
        if not isinstance(out[C.WEIGHT_QUANTIZE_GROUPS], int) or out[C.WEIGHT_QUANTIZE_GROUPS] < 1:
            raise CompressionConfigError(f"compression_training.{where}.{C.WEIGHT_QUANTIZE_GROUPS} = "
                                         f"{out[C.WEIGHT_QUANTIZE_GROUPS]!r}: expected an int >= 1")
    elif technique == C.ACTIVATION_QUANTIZATION:
        _choice(out, C.ACTIVATION_QUANTIZE_TYPE, (C.WEIGHT_QUANTIZE_SYMMETRIC, C.WEIGHT_QUANTIZE_ASYMMETRIC), where)
        _choice(out, C.ACTIVATION_QUANTIZE_RANGE,
                (C.ACTIVATION_QUANTIZE_RANGE_DYNAMIC, C.ACTIVATION_QUANTIZE_RANGE_STATIC), where)
    else:
        _choice(out, C.PRUNING_METHOD, _METHODS[technique], where)
        if technique == C.SPARSE_PRUNING:
            # DeepSpeed reads schedule_offset_end only for snip_momentum, yet its scheduler needs it for
            # every method; the end defaults to the offset (pruning, once on, stays on)
            # the snip_momentum keys only for that method: a shared dense_ratio would override the groups'
            snip = out[C.PRUNING_METHOD] == C.SPARSE_PRUNING_METHOD_SNIP_MOMENTUM
            for k, v in _SPARSE_EXTRA.items():
                if snip or k == C.TECHNIQUE_SCHEDULE_OFFSET_END:
                    out[k] = raw.get(k, v)
            if out[C.TECHNIQUE_SCHEDULE_OFFSET_END] is None:
                out[C.TECHNIQUE_SCHEDULE_OFFSET_END] = out[C.TECHNIQUE_SCHEDULE_OFFSET]
            if out[C.TECHNIQUE_SCHEDULE_OFFSET_END] < out[C.TECHNIQUE_SCHEDULE_OFFSET]:
                raise CompressionConfigError(f"compression_training.{where}: schedule_offset_end "
                                             f"({out[C.TECHNIQUE_SCHEDULE_OFFSET_END]}) < schedule_offset "
                                             f"({out[C.TECHNIQUE_SCHEDULE_OFFSET]})")
            if out[C.PRUNING_METHOD] == C.SPARSE_PRUNING_METHOD_SNIP_MOMENTUM and out[C.TECHNIQUE_ENABLED]:
                raise NotImplementedError("deepspeed_c: config key 'compression_training.sparse_pruning."
                                          "shared_parameters.method' = 'snip_momentum' needs Intel Neural "
                                          "Compressor's pruners, which deepspeed_c does not build; use 'l1' or "
                                          "'topk'")
        if technique == C.HEAD_PRUNING and out[C.TECHNIQUE_ENABLED]:
            heads = raw.get(C.HEAD_PRUNING_NUM_HEADS)
            if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
                raise CompressionConfigError(f"compression_training.{where}.{C.HEAD_PRUNING_NUM_HEADS} = "
                                             f"{heads!r}: head pruning needs a positive int number of heads")
            out[C.HEAD_PRUNING_NUM_HEADS] = heads
    return out


def _group_params(technique: str, name: str, raw: dict) -> dict:
    where = f"{technique}.{C.DIFFERENT_GROUPS}.{name}.{C.DIFFERENT_GROUPS_PARAMETERS}"
    required, optional = _GROUP_PARAMS[technique]
    check_keys(raw, [*required, *optional], where)
    for key in required:
        if key not in raw:
            raise CompressionConfigError(f"compression_training.{where}: {key!r} must be specified")
    out = {**optional, **raw}
    if technique == C.WEIGHT_QUANTIZATION:
        start, target = out[C.WEIGHT_QUANTIZE_START_BITS], out[C.WEIGHT_QUANTIZE_TARGET_BITS]
        for key, bits in ((C.WEIGHT_QUANTIZE_START_BITS, start), (C.WEIGHT_QUANTIZE_TARGET_BITS, target)):
            if not isinstance(bits, int) or isinstance(bits, bool) or bits < 1:
                raise CompressionConfigError(f"compression_training.{where}.{key} = {bits!r}: expected an int >= 1")
        if target > start:
            raise CompressionConfigError(f"compression_training.{where}: target_bits ({target}) > start_bits "
                                         f"({start}); the bit schedule only steps down")
        period = out[C.WEIGHT_QUANTIZATION_PERIOD]
        if not isinstance(period, int) or period < 0:
            raise CompressionConfigError(f"compression_training.{where}.{C.WEIGHT_QUANTIZATION_PERIOD} = "
                                         f"{period!r}: expected an int >= 0")
    elif technique == C.ACTIVATION_QUANTIZATION:
        if out[C.ACTIVATION_QUANTIZE_BITS] not in (4, 8):
            raise CompressionConfigError(f"compression_training.{where}.{C.ACTIVATION_QUANTIZE_BITS} = "
                                         f"{out[C.ACTIVATION_QUANTIZE_BITS]!r}: activations quantize to 4 or 8 bits")
    else:
        ratio = out[C.PRUNING_DENSE_RATIO]
        if not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise CompressionConfigError(f"compression_training.{where}.{C.PRUNING_DENSE_RATIO} = {ratio!r}: "
                                         "expected a fraction in (0, 1]")
    return out


def _technique(technique: str, raw: dict) -> dict:
    check_keys(raw, (C.SHARED_PARAMETERS, C.DIFFERENT_GROUPS), technique)
    shared = _shared(technique, raw.get(C.SHARED_PARAMETERS, {}))
    groups_raw = raw.get(C.DIFFERENT_GROUPS)
    if groups_raw is None:
        snip = shared.get(C.PRUNING_METHOD) == C.SPARSE_PRUNING_METHOD_SNIP_MOMENTUM
        if shared[C.TECHNIQUE_ENABLED] and not snip:
            raise CompressionConfigError(f"compression_training.{technique}: enabled, so "
                                         f"{C.DIFFERENT_GROUPS!r} must be specified")
        groups_raw = {}
    groups = {}
    for name, group in groups_raw.items():
        where = f"{technique}.{C.DIFFERENT_GROUPS}.{name}"
        check_keys(group, (C.DIFFERENT_GROUPS_PARAMETERS, C.DIFFERENT_GROUPS_MODULE_SCOPE,
                           C.DIFFERENT_GROUPS_RELATED_MODULE_SCOPE), where)
        if C.DIFFERENT_GROUPS_PARAMETERS not in group:
            raise CompressionConfigError(f"compression_training.{where}: {C.DIFFERENT_GROUPS_PARAMETERS!r} "
                                         "must be specified")
        modules = group.get(C.DIFFERENT_GROUPS_MODULE_SCOPE, C.DIFFERENT_GROUPS_MODULE_SCOPE_DEFAULT)
        modules = [modules] if isinstance(modules, str) else modules
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise CompressionConfigError(f"compression_training.{where}.{C.DIFFERENT_GROUPS_MODULE_SCOPE} = "
                                         f"{modules!r}: expected a list of module name patterns")
        related = group.get(C.DIFFERENT_GROUPS_RELATED_MODULE_SCOPE)
        if related is not None and (not isinstance(related, list) or len(related) != len(modules)
                                    or not all(isinstance(r, list) for r in related)):
            raise CompressionConfigError(f"compression_training.{where}.{C.DIFFERENT_GROUPS_RELATED_MODULE_SCOPE}"
                                         f" = {related!r}: expected one list of patterns per entry of 'modules'")
        params = _group_params(technique, name, dict(group[C.DIFFERENT_GROUPS_PARAMETERS]))
        groups[name] = {C.DIFFERENT_GROUPS_PARAMETERS: params, C.DIFFERENT_GROUPS_MODULE_SCOPE: modules,
                        C.DIFFERENT_GROUPS_RELATED_MODULE_SCOPE: related}
    return {C.SHARED_PARAMETERS: shared, C.DIFFERENT_GROUPS: groups}


def _layer_reduction(raw: dict) -> dict:
    check_keys(raw, (C.LAYER_REDUCTION_ENABLED, C.KEEP_NUMBER_LAYER, C.MODULE_NAME_PREFIX, C.TEACHER_LAYER,
                     C.OTHER_MODULE_NAME), C.LAYER_REDUCTION)
    if not raw.get(C.LAYER_REDUCTION_ENABLED, False):
        return {C.LAYER_REDUCTION_ENABLED: False}
    for key in (C.MODULE_NAME_PREFIX, C.TEACHER_LAYER):
        if key not in raw:
            raise CompressionConfigError(f"compression_training.{C.LAYER_REDUCTION}: {key!r} must be specified")
    out = copy.deepcopy(raw)
    out.setdefault(C.OTHER_MODULE_NAME, [])
    keep = out.get(C.KEEP_NUMBER_LAYER)
    if keep is not None and keep != len(out[C.TEACHER_LAYER]):
        raise CompressionConfigError(f"compression_training.{C.LAYER_REDUCTION}: keep_number_layer ({keep}) != "
                                     f"len(teacher_layer) ({len(out[C.TEACHER_LAYER])})")
    return out


def get_compression_config(param_dict: dict) -> dict:
    """The parsed `compression_training` section of a DeepSpeed config dict (not modified)."""
    raw = param_dict.get(C.COMPRESSION_TRAINING) or {}
    if not isinstance(raw, dict):
        raise CompressionConfigError(f"compression_training must be a dict, got {type(raw).__name__}")
    check_keys(raw, C.TECHNIQUES, "compression_training")
    out = {t: _technique(t, raw.get(t, {})) for t in C.TECHNIQUES if t != C.LAYER_REDUCTION}
    out[C.LAYER_REDUCTION] = _layer_reduction(raw.get(C.LAYER_REDUCTION, {}))
    return out


def get_quantize_enabled(param_dict: dict) -> bool:
    raw = (param_dict.get(C.COMPRESSION_TRAINING) or {}).get(C.WEIGHT_QUANTIZATION, {})
    return bool(raw.get(C.SHARED_PARAMETERS, {}).get(C.TECHNIQUE_ENABLED, False))
