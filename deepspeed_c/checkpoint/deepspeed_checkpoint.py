"""DeepSpeedCheckpoint: DeepSpeed's class for inspecting a checkpoint tag folder (its 3D layout, its ZeRO
files per (pp, tp, dp) rank, the client's global state), over deepspeed_c's and DeepSpeed's checkpoints.

What deepspeed_c reads here: the model-parallel degrees from the file names (mp_rank_XX files; pipeline
layer files layer_XX-model_YY-model_states.pt), the data-parallel degree from the ZeRO files. Asking for
other degrees than the saved ones (DeepSpeed reshapes its Megatron 2D map then) raises
NotImplementedError: convert with ds_to_universal and load with checkpoint.load_universal instead."""
from __future__ import annotations

import os
import re
from typing import Any, Optional

import torch

from deepspeed_c.checkpoint import constants as C
from deepspeed_c.checkpoint.universal_source import load

ARGS_KEY = "args"
CHECKPOINT_INFO_KEY = "checkpoint_info"
ITERATION_KEY = "iteration"
EMBEDDING_LAYER_INDEX = 0
FINAL_LAYER_NORM_INDEX = -1
_LAYER_RE = re.compile(r"^(layer_\d+)(?:-model_(\d+))?-model_states\.pt$")  # "-model_XX": tensor slice
_ZERO_RE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


class DeepSpeedCheckpoint:
    def __init__(self, dir: str, tp_degree: Optional[int] = None, pp_degree: Optional[int] = None,  # noqa: A002
                 dp_degree: Optional[int] = None, final_layer_norm_idx: int = FINAL_LAYER_NORM_INDEX) -> None:
        if not os.path.isdir(dir):
            raise FileNotFoundError(f"DeepSpeedCheckpoint: {dir} is not a directory")
        self.dir = dir
        self.final_layer_norm_idx = final_layer_norm_idx
        self.file_list = sorted(os.path.join(dir, f) for f in os.listdir(dir) if f.endswith(".pt"))
        names = [os.path.basename(f) for f in self.file_list]
        self.layer_files = [f for f, n in zip(self.file_list, names) if _LAYER_RE.match(n)]
        self.mp_rank_files = [f for f, n in zip(self.file_list, names) if _MODEL_RE.match(n)]
        zero = [(int(m.group(1)), int(m.group(2)), f)
                for f, n in zip(self.file_list, names) if (m := _ZERO_RE.match(n))]
        self._zero = {(mp, dp): f for dp, mp, f in zero}
        if not self.mp_rank_files and not any(n.endswith(C.MODEL_FILE_SUFFIX) for n in names):
            raise FileNotFoundError(f"DeepSpeedCheckpoint: {dir} holds no model-states files "
                                    "(mp_rank_*_model_states.pt)")
        pipeline = bool(self.layer_files)
        mps = sorted({mp for mp, _ in self._zero}) or list(range(max(1, len(self.mp_rank_files))))
        src_dp = len({dp for _, dp in self._zero}) or 1
        tp_ranks = sorted({int(_LAYER_RE.match(os.path.basename(f)).group(2) or 0) for f in self.layer_files})
        self._src_tp = len(tp_ranks) if pipeline else len(mps)
        self._src_pp = max(1, len(self.mp_rank_files) // max(1, self._src_tp)) if pipeline else 1
        self._src_dp = src_dp
        self.tp_degree = self._src_tp if tp_degree is None else tp_degree
        self.pp_degree = self._src_pp if pp_degree is None else pp_degree
        self.dp_degree = self._src_dp if dp_degree is None else dp_degree
        if self.is_change_tp_degree() or self.is_change_pp_degree() or self.is_change_dp_degree():
            raise NotImplementedError(
                f"DeepSpeedCheckpoint: {dir} was saved at tp {self._src_tp}, pp {self._src_pp}, dp {self._src_dp}; "
                f"reshaping it to tp {self.tp_degree}, pp {self.pp_degree}, dp {self.dp_degree} is not supported: "
                "convert it with `python -m deepspeed_c.checkpoint.ds_to_universal` and load it with "
                "checkpoint.load_universal")
        self.original_world_size = self._src_tp * self._src_pp * self._src_dp
        self.world_size = self.tp_degree * self.pp_degree * self.dp_degree
        self.global_state: dict[str, Any] = {}
        self.layer_keys = sorted({_LAYER_RE.match(os.path.basename(f)).group(1) for f in self.layer_files})
        self.layer_count = len(self.layer_keys)
        self.pp_to_transformer_map = self._build_pp_transformer_map()

    # -- degrees ----------------------------------------------------------------------------------------
    def is_change_tp_degree(self) -> bool:
        return self.tp_degree != self._src_tp

    def is_change_pp_degree(self) -> bool:
        return self.pp_degree != self._src_pp

    def is_change_dp_degree(self) -> bool:
        return self.dp_degree != self._src_dp

    # -- ZeRO files ---------------------------------------------------------------------------------------
    def _mp_index(self, pp_index: int, tp_index: int) -> int:
        return pp_index * self.tp_degree + tp_index

    def get_zero_files(self, pp_index: int, tp_index: int, dp_index: int) -> list:
        path = self._zero.get((self._mp_index(pp_index, tp_index), dp_index))
        return [path] if path is not None else []

    def get_zero_checkpoint_state(self, pp_index: int, tp_index: int, dp_index: int,
                                  strip_tensor_paddings: bool = True) -> dict:
        """The ZeRO file of (pp, tp, dp); with strip_tensor_paddings each group's partition (and its
        moments) without the group's trailing padding (group_paddings), as DeepSpeed hands them out."""
        files = self.get_zero_files(pp_index, tp_index, dp_index)
        if not files:
            raise FileNotFoundError(f"DeepSpeedCheckpoint: no ZeRO file for pp {pp_index}, tp {tp_index}, dp "
                                    f"{dp_index} in {self.dir}")
        sd = dict(load(files[0]))
        sd.pop(C.PARAM_SHAPES, None)
        osd = sd.get(C.OPTIMIZER_STATE_DICT)
        if strip_tensor_paddings and isinstance(osd, dict) and C.SINGLE_PARTITION_OF_FP32_GROUPS in osd:
            sd[C.OPTIMIZER_STATE_DICT] = _strip(osd)
        return sd

    # -- the model-states files ------------------------------------------------------------------------------
    def _get_checkpoint_value(self, key: str) -> Any:
        if key not in self.global_state:
            first = self.mp_rank_files[0] if self.mp_rank_files else self.file_list[0]
            self.global_state[key] = load(first).get(key)
        return self.global_state[key]

    def get_iteration(self) -> int:
        value = self._get_checkpoint_value(ITERATION_KEY)
        return 0 if value is None else value

    def get_args(self) -> Any:
        return self._get_checkpoint_value(ARGS_KEY)

    def get_checkpoint_info(self, info_key: str = CHECKPOINT_INFO_KEY) -> Any:
        return self._get_checkpoint_value(info_key)

    # -- pipeline layer files ------------------------------------------------------------------------------
    def _layer_files(self, key: str, tp_index: int) -> list:
        return [f for f in self.layer_files if os.path.basename(f).startswith(f"{key}-model_{tp_index:02d}-")
                or (tp_index == 0 and os.path.basename(f) == f"{key}-model_states.pt")]

    def get_embedding_layer_id(self) -> str:
        return self.layer_keys[EMBEDDING_LAYER_INDEX]

    def get_final_norm_layer_id(self) -> str:
        return self.layer_keys[self.final_layer_norm_idx]

    def get_embedding_files(self, tp_index: int) -> list:
        return self._layer_files(self.get_embedding_layer_id(), tp_index)

    def get_final_norm_files(self, tp_index: int) -> list:
        return self._layer_files(self.get_final_norm_layer_id(), tp_index)

    def get_embedding_state(self, tp_index: int) -> dict:
        return _merged([load(f) for f in self.get_embedding_files(tp_index)])

    def get_final_norm_state(self, tp_index: int) -> dict:
        return _merged([load(f) for f in self.get_final_norm_files(tp_index)])

    def _build_pp_transformer_map(self) -> dict[int, list]:
        body = self.layer_keys[1:-1]
        per = len(body) // self.pp_degree if self.pp_degree else 0
        return {pp: body[pp * per:(pp + 1) * per] for pp in range(self.pp_degree)}

    def get_pp_transformer_map(self, pp_index: int) -> list:
        return self.pp_to_transformer_map[pp_index]

    def get_transformer_state(self, tp_index: int, pp_index: int) -> list:
        return [load(f) for key in self.get_pp_transformer_map(pp_index) for f in self._layer_files(key, tp_index)]

    def get_2d_parallel_files(self, tp_index: int, pp_index: int) -> list:
        mp = self._mp_index(pp_index, tp_index)
        return [f for f in self.mp_rank_files if os.path.basename(f) == f"mp_rank_{mp:02d}_model_states.pt"]

    def get_2d_parallel_state(self, tp_index: int, pp_index: int) -> dict:
        if tp_index >= self.tp_degree or pp_index >= self.pp_degree:
            raise IndexError(f"DeepSpeedCheckpoint: (tp {tp_index}, pp {pp_index}) is outside tp {self.tp_degree} x "
                             f"pp {self.pp_degree}")
        return _merged([load(f) for f in self.get_2d_parallel_files(tp_index, pp_index)])

    def validate_files(self) -> None:
        for f in self.file_list:
            if not os.path.isfile(f):
                raise FileNotFoundError(f"DeepSpeedCheckpoint: {f} is missing")

    def show_pp_transformer_map(self) -> None:
        for pp, layers in self.pp_to_transformer_map.items():
            print(f"pp {pp}: {layers}")


def _merged(sds: list[dict]) -> dict:
    out: dict = {}
    for sd in sds:
        out.update(sd)
    return out


def _strip(osd: dict) -> dict:
    out = dict(osd)
    paddings = osd.get(C.GROUP_PADDINGS) or [0] * len(osd[C.SINGLE_PARTITION_OF_FP32_GROUPS])
    masters = osd[C.SINGLE_PARTITION_OF_FP32_GROUPS]
    out[C.SINGLE_PARTITION_OF_FP32_GROUPS] = [m[:m.numel() - int(p)] for m, p in zip(masters, paddings)]
    base = osd.get(C.BASE_OPTIMIZER_STATE)
    if isinstance(base, dict) and "state" in base:
        state = {}
        for g, entry in base["state"].items():
            n, p = masters[int(g)].numel(), int(paddings[int(g)])
            state[g] = {k: v[:n - p] if torch.is_tensor(v) and v.dim() == 1 and v.numel() == n else v
                        for k, v in entry.items()}
        out[C.BASE_OPTIMIZER_STATE] = dict(base, state=state)
    return out
