"""ds_to_universal's first phase: each ZeRO optimizer file (one per model-parallel rank and data-parallel
rank) cut into per-parameter fragments, `<temp>/<param>/<tp index>/<state>.<dp index:02d>`, as DeepSpeed's
converter lays out its temporary folder. One optimizer file is open at a time (its tensors mapped, so
only the pages read are in memory) and each fragment is written as soon as it is cut."""
from __future__ import annotations

import os
import re
from typing import Any

import torch

from deepspeed_c.checkpoint import constants as C
from deepspeed_c.checkpoint.universal_source import SourceCheckpoint, load, shape_numel


def fragment_path(temp: str, name: str, tp: int, state: str, dp: int) -> str:
    return os.path.join(temp, name, str(tp), f"{state}.{dp:02d}")


def _write(path: str, value: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(value, path)


def _flat_states(base_state: dict, masters: torch.Tensor) -> dict[str, Any]:
    """The optimizer states laid out like `masters` (exp_avg, exp_avg_sq, ...) and the step."""
    out: dict[str, Any] = {C.FP32_WEIGHT_KEY: masters.reshape(-1)}
    for key, value in base_state.items():
        if torch.is_tensor(value) and value.dim() == 1 and value.numel() == masters.numel():
            out[key] = value
        elif key == C.UNIVERSAL_STEP:
            out[key] = value
    return out


def _dump(temp: str, name: str, tp: int, dp: int, states: dict[str, Any], start: int, numel: int) -> None:
    for key, value in states.items():
        if key == C.UNIVERSAL_STEP:
            _write(fragment_path(temp, name, tp, key, dp), value.clone() if torch.is_tensor(value) else value)
        else:
            _write(fragment_path(temp, name, tp, key, dp), value.reshape(-1).narrow(0, start, numel).clone())


def extract_zero12(src: SourceCheckpoint, temp: str, key: tuple[int, int]) -> None:
    """Fragments of one ZeRO-1/2 file: each parameter's slice of this rank's partition, found through the
    file's param_slice_mappings."""
    mp, dp = key
    tp, pp = src.mp_to_tp_pp(mp)
    osd = load(src.optim_files[key])[C.OPTIMIZER_STATE_DICT]
    mappings = osd.get(C.PARAM_SLICE_MAPPINGS)
    if mappings is None:
        raise ValueError(f"{src.optim_files[key]} has no {C.PARAM_SLICE_MAPPINGS!r} (written before DeepSpeed recorded "
                         "where each parameter lies in a partition); it cannot be converted")
    info = src.universal_info or {}
    pipe_replicated = info.get(C.PIPELINE_REPLICATED_PARAMETER_PATTERNS, [])
    state = osd[C.BASE_OPTIMIZER_STATE]["state"]
    masters = osd[C.SINGLE_PARTITION_OF_FP32_GROUPS]
    for g, mapping in enumerate(mappings):
        states = _flat_states(state.get(g, {}), masters[g])
        for name, frag in mapping.items():
            if pp > 0 and any(re.match(p, name) for p in pipe_replicated):
                continue  # tied weights held by the first and last stages: the first stage's copy
            _dump(temp, name, tp, dp, states, int(frag.start), int(frag.numel))


def extract_zero3(src: SourceCheckpoint, temp: str, key: tuple[int, int]) -> None:
    """Fragments of one ZeRO-3 file: its sub-groups' flat partitions hold, per parameter in order,
    ceil(numel / dp) elements of which the last rank's are partly padding."""
    mp, dp = key
    tp, _ = src.mp_to_tp_pp(mp)
    osd = load(src.optim_files[key])[C.OPTIMIZER_STATE_DICT]
    flats = osd[C.FP32_FLAT_GROUPS]
    torch_state = osd[C.OPTIMIZER_STATE_DICT]["state"]
    count = osd.get(C.PARTITION_COUNT, src.dp_degree)
    count = int(max(count) if isinstance(count, (list, tuple)) else count)
    shapes = list(src.param_shapes[mp].items())
    groups = _sub_groups(src, mp)
    if len(groups) != len(flats):
        raise ValueError(f"{src.optim_files[key]}: {len(flats)} fp32 sub-groups, its model-states file's "
                         f"{C.PARAM_SHAPES} name {len(groups)}")
    for i, names in enumerate(groups):
        states = _flat_states(torch_state.get(i, {}), flats[i])
        offset = 0
        for name in names:
            numel = shape_numel(dict(shapes)[name])
            part = -(-numel // count)
            held = max(0, min(part, numel - dp * part))
            _dump(temp, name, tp, dp, states, offset, held)
            offset += part


def _sub_groups(src: SourceCheckpoint, mp: int) -> list[list[str]]:
    """Stage 3: the parameter names of each sub-group, from the model-states file's param_shapes."""
    path = next((p for p in src.model_files if p.endswith(f"_mp_rank_{mp:02d}_model_states.pt")), src.model_files[0])
    groups = load(path)[C.PARAM_SHAPES]
    return [list(group) for group in groups]
