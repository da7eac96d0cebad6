"""What a ZeRO checkpoint tag folder (deepspeed_c's or DeepSpeed's) holds, found from its file names and
its model-states files: the ZeRO stage, the data-/tensor-/pipeline-parallel degrees, the optimizer file of
every (model-parallel rank, data-parallel rank), and each parameter's shape. ds_to_universal and
DeepSpeedCheckpoint read a checkpoint through this; nothing here loads an optimizer file whole except to
read its stage."""
from __future__ import annotations

import glob
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

from deepspeed_c.checkpoint import constants as C
from deepspeed_c.checkpoint import safe_load

_OPTIM_RE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_Z3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_LAYER_RE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")  # "-model_XX": tensor slice


def load(path: str) -> Any:
    """A checkpoint file (weights_only, DeepSpeed's classes allow-listed), its tensors mapped from the file."""
    return safe_load.load(path, mmap=True)


def shape_numel(shape: Any) -> int:
    return int(math.prod(tuple(shape)))


@dataclass
class SourceCheckpoint:
    folder: str
    zero_stage: int
    dp_degree: int
    tp_degree: int
    pp_degree: int
    optim_files: dict[tuple[int, int], str]  # (model-parallel rank, dp rank) -> path
    model_files: list[str]  # the model-states files (mp_rank_* or, at stage 3, zero_pp_rank_*_model_states)
    layer_files: list[str]  # pipeline layer files (layer_XX-model_YY-model_states.pt)
    universal_info: Optional[dict]  # the model-states file's universal_checkpoint_info, if any
    # per model-parallel rank: parameter name -> shape (this rank's shard under tensor parallelism)
    param_shapes: dict[int, "OrderedDict[str, tuple]"] = field(default_factory=dict)

    @property
    def mp_degree(self) -> int:
        return max(self.tp_degree, self.pp_degree)

    def mp_to_tp_pp(self, mp: int) -> tuple[int, int]:
        """(tp index, pp index) of a model-parallel rank in the file names: DeepSpeed's checkpoint_mp_rank
        counts the tensor slices of each stage in turn (stage x tp_degree + tensor rank)."""
        return mp % self.tp_degree, mp // self.tp_degree


def _names(folder: str, pattern: re.Pattern) -> list[tuple[tuple[int, ...], str]]:
    out = []
    for name in os.listdir(folder):
        m = pattern.match(name)
        if m:
            out.append((tuple(int(g or 0) for g in m.groups()), os.path.join(folder, name)))
    return sorted(out)


def _degrees(model_state: dict, layers: list[str], mp_ranks: int, folder: str) -> tuple[int, int]:
    """(pp, tp) degrees: the model-states file's checkpoint_parallel_dimensions where it has them, else a
    pipeline's model-parallel ranks are its stages times its tensor slices (layer files named
    layer_XX-model_YY- per slice) and a non-pipeline checkpoint's are tensor slices."""
    dims = model_state.get(C.CHECKPOINT_PARALLEL_DIMS)
    if isinstance(dims, dict) and C.CHECKPOINT_PP_DEGREE in dims and C.CHECKPOINT_TP_DEGREE in dims:
        pp, tp = int(dims[C.CHECKPOINT_PP_DEGREE]), int(dims[C.CHECKPOINT_TP_DEGREE])
    elif layers:
        slices = {m.group(2) for m in (_LAYER_RE.match(os.path.basename(f)) for f in layers) if m and m.group(2)}
        tp = max(1, len(slices))
        pp = max(1, mp_ranks // tp)
    else:
        pp, tp = 1, mp_ranks
    if pp * tp != mp_ranks:
        raise ValueError(f"{folder}: {mp_ranks} model-parallel ranks' ZeRO files, but pp {pp} x tp {tp} ranks")
    return pp, tp


def _shapes_of(model_state: dict, path: str) -> "OrderedDict[str, tuple]":
    groups = model_state.get(C.PARAM_SHAPES)
    if not isinstance(groups, (list, tuple)) or not groups:
        raise ValueError(f"{path}: its {C.PARAM_SHAPES!r} is empty or missing (a checkpoint saved without a ZeRO "
                         "optimizer cannot be converted to a universal checkpoint)")
    out: OrderedDict[str, tuple] = OrderedDict()
    for group in groups:
        for name, shape in group.items():
            out[name] = tuple(int(d) for d in shape)
    return out


def zero_stage_of(optim_state: dict) -> int:
    """3 for a stage-3 file (fp32_flat_groups), else the file's zero_stage (an int or DeepSpeed's enum)."""
    if C.FP32_FLAT_GROUPS in optim_state:
        return 3
    stage = optim_state.get(C.ZERO_STAGE, 1)
    value = getattr(stage, "value", stage)
    if isinstance(value, (list, tuple)):
        value = value[0]
    return int(value) if isinstance(value, int) else 1


def read_source(folder: str) -> SourceCheckpoint:
    """The checkpoint tag folder's layout. Raises FileNotFoundError / ValueError naming what is missing."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    optim = _names(folder, _OPTIM_RE)
    if not optim:
        held = ", ".join(sorted(os.listdir(folder))) or "<empty>"
        raise FileNotFoundError(f"{folder} holds no ZeRO optimizer files (*zero_pp_rank_*_optim_states.pt): a "
                                f"universal checkpoint is converted from a ZeRO stage 1-3 checkpoint (holds: {held})")
    optim_files = {(mp, dp): path for (dp, mp), path in optim}
    dps = sorted({dp for _, dp in optim_files})
    mps = sorted({mp for mp, _ in optim_files})
    missing = [(mp, dp) for mp in mps for dp in dps if (mp, dp) not in optim_files]
    if missing or dps != list(range(len(dps))) or mps != list(range(len(mps))):
        raise FileNotFoundError(f"{folder}: ZeRO optimizer files are missing for (mp rank, dp rank) {missing or 'gaps'}"
                                f" (found dp ranks {dps}, mp ranks {mps})")
    first_optim = load(optim_files[(0, 0)])[C.OPTIMIZER_STATE_DICT]
    stage = zero_stage_of(first_optim)
    layers = [p for _, p in _names(folder, _LAYER_RE)]
    if stage == 3:
        model = _names(folder, _Z3_MODEL_RE)
        model_files = [p for _, p in model]
    else:
        model = _names(folder, _MODEL_RE)
        model_files = [p for _, p in model]
    if not model_files:
        raise FileNotFoundError(f"{folder} holds no model-states files (mp_rank_*_model_states.pt or, at ZeRO stage "
                                "3, zero_pp_rank_*_mp_rank_*_model_states.pt)")
    first_model = load(model_files[0])
    pp, tp = _degrees(first_model, layers, len(mps), folder)
    src = SourceCheckpoint(folder=folder, zero_stage=stage, dp_degree=len(dps), tp_degree=tp, pp_degree=pp,
                           optim_files=optim_files, model_files=model_files, layer_files=layers,
                           universal_info=first_model.get(C.UNIVERSAL_CHECKPOINT_INFO))
    if stage == 3:
        # every rank's file names the same shapes; tensor parallelism: one set per mp rank
        by_mp = {key[1]: path for key, path in model if key[0] == 0}
        for mp in mps:
            src.param_shapes[mp] = _shapes_of(load(by_mp.get(mp, model_files[0])), by_mp.get(mp, model_files[0]))
    else:
        by_mp = {key[0]: path for key, path in model}
        for mp in mps:
            path = by_mp.get(mp)
            if path is None:
                raise FileNotFoundError(f"{folder}: model-states file mp_rank_{mp:02d}_model_states.pt is missing")
            src.param_shapes[mp] = _shapes_of(load(path), path)
    return src


def universal_files(folder: str) -> list[str]:
    """The parameter folders of a universal checkpoint's zero/ folder."""
    root = os.path.join(folder, C.UNIVERSAL_ZERO_FOLDER)
    return sorted(os.path.relpath(os.path.dirname(p), root)
                  for p in glob.glob(os.path.join(root, "**", "fp32.pt"), recursive=True))
