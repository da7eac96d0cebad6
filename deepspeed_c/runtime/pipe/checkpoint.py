"""Per-layer pipeline checkpoint files in DeepSpeed's layout: `layer_XX[-model_YY]-model_states.pt`
holding one layer's state_dict (keys relative to the layer), so any pipeline degree (or a plain
model of the same layers) can load them: each stage reads the files of the layers it owns."""
from __future__ import annotations

import os
from typing import Any

import torch


def save_layer_files(module: Any, save_dir: str, exclude_frozen_params: bool = False) -> None:
    """Data-parallel rank 0 of each stage writes its layers that have a state_dict (a tied module
    used through a forward_fn is saved by the stage where it appears as a plain module)."""
    if module._grid.data_parallel_id != 0:
        return
    os.makedirs(save_dir, exist_ok=True)
    for idx, layer in enumerate(module.forward_funcs):
        if not hasattr(layer, "state_dict"):
            continue
        sd = layer.state_dict()
        if exclude_frozen_params:
            for n, p in layer.named_parameters():
                if not p.requires_grad:
                    sd.pop(n, None)
        # clone: a view would drag its whole storage into the file
        sd = {k: v.detach().clone().cpu() for k, v in sd.items()}
        path = module.ckpt_layer_path(save_dir, idx)
        tmp = path + ".tmp"
        torch.save(sd, tmp)
        os.replace(tmp, path)


def load_layer_files(module: Any, load_dir: str, strict: bool = True) -> None:
    for idx, layer in enumerate(module.forward_funcs):
        if not hasattr(layer, "load_state_dict"):
            continue
        files = module.ckpt_layer_path_list(load_dir, idx)
        if not files:
            raise FileNotFoundError(f"no checkpoint file for layer {idx + module._local_start} in {load_dir} "
                                    f"(expected layer_{idx + module._local_start:02d}-*model_states.pt)")
        rank = module._grid.get_slice_parallel_rank()
        path = files[rank] if len(files) > 1 else files[0]
        sd = torch.load(path, map_location="cpu", weights_only=True)
        layer.load_state_dict(sd, strict=strict)
