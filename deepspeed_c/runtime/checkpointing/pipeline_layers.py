"""Per-layer pipeline checkpoint files in DeepSpeed's layout: `layer_XX[-model_YY]-model_states.pt`
holding one layer's state_dict (keys relative to the layer), so any pipeline degree (or a plain
model of the same layers) can load them: each stage reads the files of the layers it owns.

Writing is split from the destination: layer_file_states gives {file name: state_dict} and the
caller decides where the files go (the engine's crash-safe staging directory, or a plain directory
for PipelineModule.save_state_dict). Every read goes through checkpoint.store.load_file, i.e. the
weights_only loader, verified against the tag's manifest where there is one."""
from __future__ import annotations

import glob
import os
import re
from typing import Any, Optional

from deepspeed_c.checkpoint import store

LayerStates = list[tuple[int, dict]]  # (index into module.forward_funcs, that layer's state_dict)


def layer_file_states(module: Any, exclude_frozen_params: bool = False,
                      parallel_write: bool = False) -> dict[str, dict]:
    """{file name: CPU state_dict} of the layers this rank writes: data-parallel rank 0 of each stage
    writes its layers that have a state_dict (a tied module used through a forward_fn is saved by the
    stage where it appears as a plain module); with checkpoint.parallel_write.pipeline_stage the
    stage's data-parallel ranks split the layers."""
    grid = module.mpu()
    dp_rank, dp = grid.data_parallel_id, grid.data_parallel_size
    n = len(module.forward_funcs)
    if parallel_write:
        from deepspeed_c.runtime.pipe.partition import partition_uniform

        bounds = partition_uniform(n, dp)
        start, stop = bounds[dp_rank], bounds[dp_rank + 1]
    elif dp_rank != 0:
        return {}
    else:
        start, stop = 0, n
    out: dict[str, dict] = {}
    for idx in range(start, stop):
        layer = module.forward_funcs[idx]
        if not hasattr(layer, "state_dict"):
            continue
        sd = layer.state_dict()
        if exclude_frozen_params:
            for name, p in layer.named_parameters():
                if not p.requires_grad:
                    sd.pop(name, None)
        # clone: a view would drag its whole storage into the file
        out[os.path.basename(module.ckpt_layer_path("", idx))] = {k: v.detach().clone().cpu() for k, v in sd.items()}
    return out


def save_layer_files(module: Any, save_dir: str, exclude_frozen_params: bool = False,
                     parallel_write: bool = False) -> None:
    """PipelineModule.save_state_dict: the layer files straight into `save_dir`, each replaced
    atomically (the engine's save_checkpoint stages them with a manifest instead)."""
    os.makedirs(save_dir, exist_ok=True)
    for name, sd in layer_file_states(module, exclude_frozen_params, parallel_write).items():
        store.torch_save_atomic(sd, os.path.join(save_dir, name))


def manifest_if_any(ckpt_dir: str) -> Optional[dict]:
    """The directory's manifest, or None without a warning: a directory of layer files written by
    save_state_dict (or by DeepSpeed) has none."""
    if not os.path.isfile(os.path.join(ckpt_dir, store.MANIFEST_NAME)):
        return None
    return store.read_manifest(ckpt_dir)


def read_layer_files(module: Any, ckpt_dir: str, manifest: Optional[dict]) -> LayerStates:
    """This rank's layers' state_dicts from `ckpt_dir`, weights_only and verified; nothing is applied,
    so a failure leaves the model as it was."""
    out: LayerStates = []
    for idx, layer in enumerate(module.forward_funcs):
        if not hasattr(layer, "load_state_dict"):
            continue
        files = module.ckpt_layer_path_list(ckpt_dir, idx)
        if not files:
            layer_id = module.layer_id(idx)
            raise FileNotFoundError(f"no checkpoint file for layer {layer_id} in {ckpt_dir} "
                                    f"(expected layer_{layer_id:02d}-*model_states.pt; directory holds: "
                                    f"{store.listing(ckpt_dir)})")
        rank = module.mpu().get_slice_parallel_rank()
        path = files[rank] if len(files) > 1 else files[0]
        out.append((idx, store.load_file(ckpt_dir, os.path.basename(path), manifest)))
    return out


def apply_layer_states(module: Any, states: LayerStates, strict: bool) -> None:
    for idx, sd in states:
        module.forward_funcs[idx].load_state_dict(sd, strict=strict)


def state_dict_from_layer_files(ckpt_dir: str) -> dict:
    """The layer files of a pipeline checkpoint as one state_dict keyed like torch.nn.Sequential's
    ('<layer index>.<name>'), for loading into a non-pipeline model of the same layers."""
    ckpt_dir = str(ckpt_dir)
    manifest = manifest_if_any(ckpt_dir)
    out: dict = {}
    for path in sorted(glob.glob(os.path.join(ckpt_dir, "layer_*-model_states.pt"))):
        m = re.match(r"layer_(\d+)-", os.path.basename(path))
        if m is None:
            continue
        for k, v in store.load_file(ckpt_dir, os.path.basename(path), manifest).items():
            out[f"{int(m.group(1))}.{k}"] = v
    return out
