"""DeepSpeed's deepspeed.checkpoint.reshape_3d_utils: a checkpoint's (pp, tp, dp) shape (model_3d_desc),
read from a tag folder, and the map from a smaller target shape's ranks to the source files they merge.

The shape comes from the model-states files' checkpoint_parallel_dimensions (deepspeed_c and DeepSpeed
0.19.8 both write it); folders without it (older DeepSpeed) are read from the file names: pipeline layer
files give tp, the mp_rank_* files pp * tp, the ZeRO files dp."""
from __future__ import annotations

from typing import Any

from deepspeed_c.checkpoint.constants import (CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE,
                                              LAYER_FILE_PREFIX, MODEL_FILE_PREFIX)
from deepspeed_c.checkpoint.reshape_meg_2d import meg_2d_parallel_map, reshape_meg_2d_parallel
from deepspeed_c.checkpoint.reshape_utils import get_files, get_files_with_prefix, get_zero_files, partition_data

PP_DIM = "PP"
TP_DIM = "TP"
DP_DIM = "DP"


class model_3d_desc:  # noqa: N801 (DeepSpeed's name)
    def __init__(self, pp_degree: int = 1, tp_degree: int = 1, dp_degree: int = 1) -> None:
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.dp_degree = dp_degree

    def _dims(self) -> tuple:
        return ((PP_DIM, self.pp_degree), (TP_DIM, self.tp_degree), (DP_DIM, self.dp_degree))

    def reshape(self, target_3d_desc: "model_3d_desc", verbose: bool = False) -> list[meg_2d_parallel_map]:
        """One (pp, tp) map per target dp rank, each cell listing the source rank indices (pp-tp-major inside
        dp blocks, i.e. indices into the ZeRO file list) that target rank merges."""
        ok, errors = self.can_reshape(target_3d_desc)
        if not ok:
            raise AssertionError(",".join(errors))
        grid = reshape_meg_2d_parallel(old_pp_degree=self.pp_degree, old_tp_degree=self.tp_degree,
                                       new_pp_degree=target_3d_desc.pp_degree, new_tp_degree=target_3d_desc.tp_degree,
                                       verbose=verbose)
        flat = flatten_dp_dimension(grid, self.pp_degree * self.tp_degree, self.dp_degree)
        return unflatten_dp_dimension(flat, target_3d_desc.dp_degree)

    def get_desc(self) -> str:
        return f"{PP_DIM},{TP_DIM},{DP_DIM} = ({self.pp_degree}, {self.tp_degree}, {self.dp_degree})"

    def world_size(self) -> int:
        return self.pp_degree * self.tp_degree * self.dp_degree

    def is_valid(self, pp_index: int, tp_index: int, dp_index: int) -> tuple[bool, list[str]]:
        errors = [f"{name} indexing error: index {index} >= degree {degree}"
                  for index, (name, degree) in zip((pp_index, tp_index, dp_index), self._dims()) if index >= degree]
        return not errors, errors

    def can_reshape(self, target_3d_desc: "model_3d_desc") -> tuple[bool, list[str]]:
        errors = [f"Expansion reshape not supported - {name}: {mine} ---> {theirs}"
                  for (name, mine), (_, theirs) in zip(self._dims(), target_3d_desc._dims()) if theirs > mine]
        return not errors, errors

    def __repr__(self) -> str:
        return f"model_3d_desc({self.get_desc()})"


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def get_model_3d_descriptor_from_metadata(file_list: list[str], zero_file_list: list[str],
                                          model_state_metadata: list[tuple[str, dict]]) -> model_3d_desc:
    """The shape from (model file, {checkpoint_parallel_dimensions: ...}) pairs, without loading tensors.
    Dimensions present in some files only, differing between files, or not matching the file counts raise
    RuntimeError naming them."""
    model_files = [name for name, _ in model_state_metadata]
    dims, missing = [], []
    for name, meta in model_state_metadata:
        d = meta.get(CHECKPOINT_PARALLEL_DIMS)
        if d is None:
            missing.append(name)
            continue
        if not isinstance(d, dict):
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} must be a dictionary in {name}.")
        for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE):
            if not _positive(d.get(key)):
                raise RuntimeError(f"Checkpoint {key} must be a positive integer in {name}, got {d.get(key)!r}.")
        dims.append((d[CHECKPOINT_PP_DEGREE], d[CHECKPOINT_TP_DEGREE]))
    if dims:
        if missing:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} is missing from model-state files: {missing}")
        if len(set(dims)) != 1:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} disagrees across model-state files: {dims}")
        pp, tp = dims[0]
        if len(model_files) != pp * tp:
            raise RuntimeError(f"Checkpoint model-state file count {len(model_files)} does not match "
                               f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}.")
        if len(zero_file_list) % (pp * tp):
            raise RuntimeError(f"Checkpoint ZeRO file count {len(zero_file_list)} is not divisible by "
                               f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}.")
        return model_3d_desc(pp, tp, max(1, len(zero_file_list) // (pp * tp)))
    # no recorded dimensions: from the names (the first pipeline layer's tensor slices give tp)
    layer_slices = len(get_files_with_prefix(file_list, f"{LAYER_FILE_PREFIX}01"))
    if layer_slices:
        tp = layer_slices
        pp = len(model_files) // tp
    else:
        tp, pp = max(1, len(model_files)), 1
    return model_3d_desc(pp, tp, max(1, len(zero_file_list) // (pp * tp)))


def get_model_3d_descriptor(dir: str) -> model_3d_desc:  # noqa: A002 (DeepSpeed's argument name)
    """The (pp, tp, dp) shape of the tag folder `dir`."""
    from deepspeed_c.checkpoint.universal_source import load

    files = get_files(dir)
    meta = [(f, {CHECKPOINT_PARALLEL_DIMS: load(f).get(CHECKPOINT_PARALLEL_DIMS)})
            for f in get_files_with_prefix(files, MODEL_FILE_PREFIX)]
    return get_model_3d_descriptor_from_metadata(files, get_zero_files(dir), meta)


def flatten_dp_dimension(meg_2d_map: meg_2d_parallel_map, src_2d_size: int, dp_degree: int) -> meg_2d_parallel_map:
    """Each cell's (dp 0) indices extended by the same cell's indices in every source dp block."""
    out = meg_2d_parallel_map(meg_2d_map.pp_degree, meg_2d_map.tp_degree)
    for pp in range(meg_2d_map.pp_degree):
        for tp in range(meg_2d_map.tp_degree):
            for idx in meg_2d_map.get_data(pp, tp):
                out.add_data(pp, tp, [idx + d * src_2d_size for d in range(dp_degree)])
    return out


def unflatten_dp_dimension(meg_2d_map: meg_2d_parallel_map, dp_degree: int) -> list[meg_2d_parallel_map]:
    """Each cell's indices split into dp_degree consecutive parts, one map per target dp rank."""
    maps = [meg_2d_parallel_map(pp_degree=meg_2d_map.pp_degree, tp_degree=meg_2d_map.tp_degree)
            for _ in range(dp_degree)]
    for pp in range(meg_2d_map.pp_degree):
        for tp in range(meg_2d_map.tp_degree):
            for part, target in zip(partition_data(meg_2d_map.get_data(pp, tp), dp_degree), maps):
                target.add_data(pp, tp, part)
    return maps
