"""init_compression / redundancy_clean: DeepSpeed's entry points of the compression library.

init_compression swaps every nn.Linear / nn.Conv2d / nn.Embedding / nn.BatchNorm2d for its
compression-aware twin (basic_layer), arms the techniques of the `compression_training` groups on the
layers their `modules` patterns match (regular expressions searched in the dotted names), and, with
`layer_reduction`, first copies the teacher's chosen layers into the student. The techniques switch on
when the compression scheduler reaches their schedule_offset (the engine steps it; without the engine,
step `compression_scheduler` yourself).

redundancy_clean folds what training learnt into plain weights: quantized weights, zeroed pruned entries,
and, for row / head / channel pruning with `related_modules`, smaller layers (the related layers lose the
matching input columns, Q/K/V rows, or channels)."""
from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

import torch

from deepspeed_c.compression import constants as C
from deepspeed_c.compression.config import CompressionConfigError, get_compression_config
from deepspeed_c.compression.helper import (compression_preparation, fix_compression, is_module_compressible,
                                            recursive_getattr)
from deepspeed_c.utils.logging import logger


def _no_duplicate_keys(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        dup = sorted({k for k, _ in pairs if sum(1 for k2, _ in pairs if k2 == k) > 1})
        raise ValueError(f"Duplicate keys in DeepSpeed config: {dup}")
    return out


def check_deepspeed_config(config: Any) -> dict:
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)) and os.path.exists(config):
        with open(config) as f:
            return json.load(f, object_pairs_hook=_no_duplicate_keys)
    raise ValueError(f"Expected a string path to an existing deepspeed config, or a dictionary. Received: {config}")


def _pattern(key_word: str) -> str:
    # DeepSpeed documents '*' as the default scope, which is no valid regular expression: read it as "all"
    return ".*" if key_word == "*" else key_word


def get_module_name(group_name: str, model: torch.nn.Module, key_word: str, exist_module_name: set,
                    mpu: Any = None, verbose: bool = True) -> tuple[list[str], set]:
    """The compressible modules whose names `key_word` matches (re.search) and that are not in
    `exist_module_name` yet (which grows); with verbose, a module a previous group took is an error."""
    found = []
    pattern = _pattern(key_word)
    for name, module in model.named_modules():
        if re.search(pattern, name) is None or not is_module_compressible(module, mpu):
            continue
        if name in exist_module_name:
            if verbose:
                raise ValueError(f"{name} is already added to compression, please check your config file for "
                                 f"{group_name}.")
            continue
        exist_module_name.add(name)
        found.append(name)
    return found, exist_module_name


def _none_matched(technique: str, group: str, key: str, pattern: str, model: torch.nn.Module) -> CompressionConfigError:
    names = [n for n, m in model.named_modules() if n and is_module_compressible(m)]
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    return CompressionConfigError(f"compression_training.{technique}.different_groups.{group}.{key}: pattern "
                                  f"{pattern!r} matches no compressible module (Linear, Conv2d, Embedding, "
                                  f"BatchNorm2d); the model has: {shown}")


def get_compress_methods(model: torch.nn.Module, compress_methods: dict, mpu: Any = None,
                         strict: bool = False) -> list:
    """[module name lists, related module name lists, {technique: group params + shared params}] per group."""
    items = []
    for technique, content in compress_methods.items():
        if technique == C.LAYER_REDUCTION:
            continue
        taken: set = set()
        shared = content[C.SHARED_PARAMETERS]
        check = strict and shared[C.TECHNIQUE_ENABLED]
        for group, params in content[C.DIFFERENT_GROUPS].items():
            module_lists, related_lists = [], []
            related = params[C.DIFFERENT_GROUPS_RELATED_MODULE_SCOPE]
            for i, key_word in enumerate(params[C.DIFFERENT_GROUPS_MODULE_SCOPE]):
                names, taken = get_module_name(group, model, key_word, taken, mpu=mpu)
                if check and not names:
                    raise _none_matched(technique, group, C.DIFFERENT_GROUPS_MODULE_SCOPE, key_word, model)
                module_lists.append(names)
                if related:
                    per_key = []
                    for rkw in related[i]:
                        rnames, _ = get_module_name(group, model, rkw, set(), mpu=mpu)
                        if check and not rnames:
                            raise _none_matched(technique, group, C.DIFFERENT_GROUPS_RELATED_MODULE_SCOPE, rkw, model)
                        per_key.append(rnames)
                    related_lists.append(per_key)
            if module_lists:
                combined = {**params[C.DIFFERENT_GROUPS_PARAMETERS], **shared}
                items.append([module_lists, related_lists, {technique: combined}])
    return items


def _check_head_pruning(model: torch.nn.Module, items: list) -> None:
    for module_lists, related_lists, technique in items:
        v = technique.get(C.HEAD_PRUNING)
        if v is None or not v[C.TECHNIQUE_ENABLED]:
            continue
        heads = v[C.HEAD_PRUNING_NUM_HEADS]
        for names in module_lists:
            for name in names:
                width = getattr(recursive_getattr(model, name), "in_features", None)
                if width is not None and width % heads:
                    raise CompressionConfigError(f"compression_training.head_pruning: num_heads={heads} does not "
                                                 f"divide the width {width} (in_features) of {name!r}")
        for per_key in related_lists:
            for rnames in per_key:
                for name in rnames:
                    width = getattr(recursive_getattr(model, name), "out_features", None)
                    if width is not None and width % heads:
                        raise CompressionConfigError(f"compression_training.head_pruning: num_heads={heads} does "
                                                     f"not divide the width {width} (out_features) of related "
                                                     f"module {name!r}")


def init_compression(model: torch.nn.Module, deepspeed_config: Any, teacher_model: Optional[torch.nn.Module] = None,
                     mpu: Any = None) -> torch.nn.Module:
    """Make `model` compression-aware in place (see the module doc); returns it."""
    config = check_deepspeed_config(deepspeed_config)
    compress_methods = get_compression_config(config)
    c_model = model.module if hasattr(model, "module") else model
    if compress_methods[C.LAYER_REDUCTION][C.LAYER_REDUCTION_ENABLED]:
        if teacher_model is None:
            raise ValueError("compression_training.layer_reduction is enabled: init_compression needs teacher_model")
        student_initialization(c_model, teacher_model, config)
    items = get_compress_methods(c_model, compress_methods, mpu=mpu, strict=True)
    _check_head_pruning(c_model, items)
    compression_preparation(c_model, items, mpu)
    return model


_CLEAN_ORDER = [C.WEIGHT_QUANTIZATION, C.SPARSE_PRUNING, C.ROW_PRUNING, C.HEAD_PRUNING, C.CHANNEL_PRUNING,
                C.ACTIVATION_QUANTIZATION]


def redundancy_clean(model: torch.nn.Module, deepspeed_config: Any, mpu: Any = None) -> torch.nn.Module:
    """Fold the compression into the weights in place (see the module doc); returns the model."""
    compress_methods = get_compression_config(check_deepspeed_config(deepspeed_config))
    c_model = model.module if hasattr(model, "module") else model
    items = get_compress_methods(c_model, compress_methods, mpu=mpu)
    items.sort(key=lambda item: _CLEAN_ORDER.index(next(iter(item[2]))))
    for module_lists, related_lists, technique in items:
        shrink = bool(related_lists)
        for i, names in enumerate(module_lists):
            masks = []
            for name in names:
                mask = fix_compression(c_model, name, technique, dim_reduction=shrink)
                if shrink:
                    masks.append(mask)
            if shrink:
                # DeepSpeed pairs the j-th related module of each pattern with the j-th matched layer's mask
                for rnames in related_lists[i]:
                    for j, name in enumerate(rnames):
                        fix_compression(c_model, name, technique, mask=masks[j], dim_reduction=True)
    return model


def student_initialization(student_model: torch.nn.Module, teacher_model: torch.nn.Module,
                           deepspeed_config: Any) -> None:
    """Copy teacher layer teacher_layer[i] (under module_name_prefix) into student layer i, and the modules of
    other_module_name whole (embeddings, pooler, head): the layer-reduction initialisation of XTC / ZeroQuant-LKD."""
    lr = get_compression_config(check_deepspeed_config(deepspeed_config))[C.LAYER_REDUCTION]
    prefix, teacher_layer = lr[C.MODULE_NAME_PREFIX], lr[C.TEACHER_LAYER]
    pairs = [(f"{prefix}.{s}", f"{prefix}.{t}") for s, t in enumerate(teacher_layer)]
    pairs += [(name, name) for name in lr[C.OTHER_MODULE_NAME]]
    for s_name, t_name in pairs:
        try:
            s_module, t_module = recursive_getattr(student_model, s_name), recursive_getattr(teacher_model, t_name)
        except AttributeError as e:
            raise CompressionConfigError(f"compression_training.layer_reduction: no module {e.args[0]!r} on the path "
                                         f"{s_name!r} (student) / {t_name!r} (teacher)") from None
        s_params, t_params = list(s_module.parameters()), list(t_module.parameters())
        if [p.shape for p in s_params] != [p.shape for p in t_params]:
            raise CompressionConfigError(f"compression_training.layer_reduction: student {s_name!r} and teacher "
                                         f"{t_name!r} have different parameter shapes")
        logger.info(f"layer_reduction: student {s_name} <- teacher {t_name}")
        with torch.no_grad():
            for s_param, t_param in zip(s_params, t_params):
                s_param.data.copy_(t_param.data)
