"""Checkpoint helpers with DeepSpeed's names."""
from __future__ import annotations

import os
from typing import Any

import torch

from deepspeed_c.checkpoint.constants import (MODEL_FILE_PREFIX, MODEL_FILE_SUFFIX, OPTIM_FILE_SUFFIX,
                                              ZERO_FILE_PREFIX)


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """The model-states file of one tensor-parallel rank, its rank given as text ("00")."""
    return os.path.join(base_folder, f"{MODEL_FILE_PREFIX}{mp_rank_str}{MODEL_FILE_SUFFIX}")


def get_zero_ckpt_name_for_rank(base_folder: str, dp_rank: int, mp_rank: int) -> str:
    """The ZeRO optimizer-states file of one (data-parallel, tensor-parallel) rank pair."""
    return os.path.join(base_folder, f"{ZERO_FILE_PREFIX}{dp_rank}_{MODEL_FILE_PREFIX}{mp_rank:02d}{OPTIM_FILE_SUFFIX}")


def get_layer_ckpt_name_for_rank(base_folder: str, layer_id: Any, tp_rank: int) -> str:
    """A pipeline layer's file (layer_id as written, e.g. "layer_03") of one tensor-parallel rank."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}{MODEL_FILE_SUFFIX}")


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:
    """A copy of `item` whose tensors are detached clones on `device`, so torch.save writes only
    each tensor's own elements (not the whole, possibly much larger, storage it views into).
    Dicts, lists and tuples are rebuilt with the same type; anything else is returned as is."""
    if torch.is_tensor(item):
        if item.device == device:
            return item.detach().clone()
        return item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item
