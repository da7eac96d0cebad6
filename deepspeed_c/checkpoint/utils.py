"""Checkpoint helpers with DeepSpeed's names."""
from __future__ import annotations

from typing import Any

import torch


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
