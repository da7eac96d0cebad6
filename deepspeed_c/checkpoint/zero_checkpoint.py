"""DeepSpeed's deepspeed.checkpoint.ZeROCheckpoint: the ZeRO optimizer files of a tag folder addressed by
(pp, tp, dp) rank, optionally for a smaller target shape (reshape), whose ranks each get the merged state
of the source files they take over (tensors concatenated, each file's base optimizer state first cut to
its group's unpadded length, partition_count set to the target's dp degree; as in DeepSpeed, the fp32
partitions are concatenated whole)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from deepspeed_c.checkpoint.constants import BASE_OPTIMIZER_STATE, GROUP_PADDINGS, OPTIMIZER_STATE_DICT, PARTITION_COUNT
from deepspeed_c.checkpoint.reshape_3d_utils import get_model_3d_descriptor, model_3d_desc
from deepspeed_c.checkpoint.reshape_utils import basic_folder_validation, get_zero_files, merge_state

GROUP_STATE_KEY = "state"


class ZeROCheckpoint:
    def __init__(self, dir: str, source_3d: Optional[model_3d_desc] = None) -> None:  # noqa: A002
        basic_folder_validation(dir)
        self.dir = dir
        self.file_list = get_zero_files(dir)
        self.num_files = len(self.file_list)
        if self.num_files == 0:
            raise AssertionError(f"No ZeRO files found in {dir}")
        self.src_3d = get_model_3d_descriptor(dir) if source_3d is None else source_3d
        self.target_3d = model_3d_desc(self.src_3d.pp_degree, self.src_3d.tp_degree, self.src_3d.dp_degree)
        self._3d_file_map = self.src_3d.reshape(self.target_3d)

    # -- the source shape -------------------------------------------------------------------------------
    def get_src_world_size(self) -> int:
        return self.src_3d.world_size()

    def get_src_tp_degree(self) -> int:
        return self.src_3d.tp_degree

    def get_src_pp_degree(self) -> int:
        return self.src_3d.pp_degree

    def get_src_dp_degree(self) -> int:
        return self.src_3d.dp_degree

    # -- files and states of a target rank -------------------------------------------------------------------
    def get_file_indices_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[int]:
        if dp_index >= len(self._3d_file_map):
            raise AssertionError(f"DP index {dp_index} >= DP degree {len(self._3d_file_map)}")
        return self._3d_file_map[dp_index].get_data(pp_index, tp_index)

    def get_files_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        return [self.file_list[i] for i in self.get_file_indices_for_rank(pp_index, tp_index, dp_index)]

    def get_state_for_rank(self, pp_index: int, tp_index: int, dp_index: int,
                           keys_to_ignore: Sequence[str] = (), strip_tensor_paddings: bool = True) -> Any:
        """The merged state of the target rank's source files (None when it takes none)."""
        from deepspeed_c.checkpoint.safe_load import load

        merged = None
        for path in self.get_files_for_rank(pp_index, tp_index, dp_index):
            sd = load(path)
            for key in keys_to_ignore:
                sd.pop(key, None)
            if strip_tensor_paddings:
                self._strip_tensor_paddings(sd)
            merged = sd if merged is None else merge_state(merged, sd)
            self._update_partition_count(merged)
            if strip_tensor_paddings:
                self._clear_group_paddings(merged)
        return merged

    def print_3d_index_map(self, tag: Optional[str] = None) -> None:
        if tag:
            print(f"3D index map: {tag}")
        for dp_index, grid in enumerate(self._3d_file_map):
            grid.print_data(f"dp = {dp_index}")

    def print_3d_file_map(self, tag: Optional[str] = None) -> None:
        if tag:
            print(f"3D file map: {tag}")
        for dp_index, grid in enumerate(self._3d_file_map):
            for pp_index in range(grid.pp_degree):
                for tp_index in range(grid.tp_degree):
                    files = [self.file_list[i] for i in grid.get_data(pp_index, tp_index)]
                    print(f"{pp_index}, {tp_index}, {dp_index} => {files}")

    def reshape(self, target_3d_desc: model_3d_desc) -> None:
        self.target_3d = target_3d_desc
        self._3d_file_map = self.src_3d.reshape(target_3d_desc)

    # -- helpers over the file's optimizer_state_dict --------------------------------------------------------------
    def _strip_tensor_paddings(self, sd: dict) -> None:
        """Each group's state tensors without the group's trailing padding (step counters untouched)."""
        groups = self._get_param_group_states(sd)
        paddings = self._get_optimizer_state(sd, GROUP_PADDINGS)
        if groups is None or paddings is None:
            return
        for key, group_state in groups.items():
            pad = int(paddings[key])
            if pad == 0:
                continue
            for name, value in group_state.items():
                if name != "step" and torch.is_tensor(value):
                    group_state[name] = value.narrow(0, 0, value.numel() - pad).clone()

    def _clear_group_paddings(self, sd: dict) -> None:
        paddings = self._get_optimizer_state(sd, GROUP_PADDINGS)
        if paddings:
            sd[OPTIMIZER_STATE_DICT][GROUP_PADDINGS] = [0] * len(paddings)

    def _get_optimizer_state(self, sd: dict, state_key: str) -> Any:
        osd = sd.get(OPTIMIZER_STATE_DICT)
        return None if osd is None else osd.get(state_key)

    def _get_param_group_states(self, sd: dict) -> Any:
        base = self._get_optimizer_state(sd, BASE_OPTIMIZER_STATE)
        return None if base is None else base.get(GROUP_STATE_KEY)

    def _update_partition_count(self, sd: dict) -> None:
        counts = self._get_optimizer_state(sd, PARTITION_COUNT)
        if counts:
            sd[OPTIMIZER_STATE_DICT][PARTITION_COUNT] = [self.target_3d.dp_degree] * len(counts)
