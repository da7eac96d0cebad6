"""DeepSpeed's deepspeed.checkpoint.reshape_utils: finding a checkpoint folder's files by prefix, splitting
rank lists into equal parts, and merging the states of several ranks' files (tensors concatenated on
dim 0, containers merged key by key, other values taken from the first)."""
from __future__ import annotations

import os
import re
from collections import OrderedDict
from typing import Any, Optional

import torch

from deepspeed_c.checkpoint.constants import (BF16_ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, MODEL_FILE_PREFIX,
                                              OPTIM_FILE_SUFFIX, ZERO_FILE_PREFIX)


def basic_folder_validation(dir: str) -> None:  # noqa: A002 (DeepSpeed's argument name)
    # DeepSpeed asserts here; callers catch AssertionError
    assert os.path.exists(dir), f"{dir} path does not exist"
    assert os.path.isdir(dir), f"{dir} is not a folder"


def get_files_with_prefix(all_files: list[str], prefix: str) -> list[str]:
    """The paths whose file name starts with `prefix`, sorted."""
    return sorted(p for p in all_files if os.path.basename(p).startswith(prefix))


def validate_files(file_list: list[str]) -> None:
    """Reports (prints, as DeepSpeed) each listed file that does not exist."""
    for path in file_list:
        if not os.path.isfile(path):
            print(f"Error: {path} is not existent")


def get_files(dir: str) -> list[str]:  # noqa: A002
    """Every file under `dir`, recursively."""
    return [os.path.join(root, f) for root, _, files in os.walk(dir) for f in files]


def sort_zero_files(files: list[str], prefix: str) -> list[str]:
    """ZeRO files ordered by (dp rank, mp rank), the numbers read from their names (not sorted as text:
    rank 10 comes after rank 9)."""
    pattern = re.compile(f"{re.escape(prefix)}([0-9]+)_{MODEL_FILE_PREFIX}([0-9]+)")
    keyed = []
    for path in files:
        m = pattern.search(path)
        if m is None:
            raise ValueError(f"Cannot parse dp_rank and mp_rank from {path}")
        keyed.append((int(m.group(1)), int(m.group(2)), path))
    return [p for _, _, p in sorted(keyed, key=lambda k: (k[0], k[1]))]


def get_zero_files(dir: str) -> list[str]:  # noqa: A002
    """The ZeRO optimizer files of a tag folder (plain, fp16_ or bf16_ named, the first kind found), in rank
    order. Only *_optim_states.pt: a stage-3 folder's zero_pp_rank_*_model_states.pt share the prefix."""
    optim = [p for p in get_files(dir) if p.endswith(OPTIM_FILE_SUFFIX)]
    for prefix in (ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX):
        found = get_files_with_prefix(optim, prefix)
        if found:
            return sort_zero_files(found, prefix)
    return []


def partition_data(data_list: list, num_partitions: int) -> list[list]:
    """`data_list` cut into `num_partitions` consecutive equal parts (its length must divide evenly)."""
    if num_partitions <= 0 or len(data_list) % num_partitions != 0:
        # DeepSpeed asserts the divisibility; AssertionError keeps its callers' handling
        raise AssertionError(f"partition_data: {len(data_list)} items do not split into {num_partitions} equal parts")
    size = len(data_list) // num_partitions
    return [data_list[i:i + size] for i in range(0, len(data_list), size)]


def _where(key_list: Optional[list]) -> str:
    return ".".join(str(k) for k in key_list or []) or "<root>"


def merge_state_dict(dict_a: dict, dict_b: dict, key_list: list) -> dict:
    """dict_b's keys, in its order, each merged with dict_a's value where dict_a has the key."""
    out = type(dict_a)()
    for key, value in dict_b.items():
        out[key] = merge_state(dict_a[key], value, [*key_list, str(key)]) if key in dict_a else value
    return out


def merge_state_list(list_a: list, list_b: list, key_list: list) -> list:
    if len(list_a) != len(list_b):
        raise ValueError(f"Cannot merge lists of different lengths, a = {len(list_a)} b = {len(list_b)} "
                         f"(at {_where(key_list)})")
    return [merge_state(a, b, key_list) for a, b in zip(list_a, list_b)]


def merge_state(state_a: Any, state_b: Any, key_list: Optional[list] = None) -> Any:
    """Two ranks' states as one: tensors concatenated along dim 0, dicts and lists/tuples merged element
    by element, anything else (scalars, 0-dim tensors) state_a's. Different types at the same place raise ValueError."""
    key_list = list(key_list or [])
    if type(state_a) is not type(state_b):
        raise ValueError(f"Cannot merge two states of types {type(state_a)} and type {type(state_b)} "
                         f"(at {_where(key_list)})")
    if type(state_a) in (dict, OrderedDict):
        return merge_state_dict(state_a, state_b, key_list)
    if type(state_a) in (list, tuple):
        return type(state_a)(merge_state_list(state_a, state_b, key_list))
    if torch.is_tensor(state_a) and state_a.dim() > 0:
        return torch.cat([state_a, state_b], 0)
    # a 0-dim tensor (torch Adam's per-group `step`) is a counter, the same on every rank: kept, as scalars are
    return state_a
