"""DeepSpeed's deepspeed.checkpoint.reshape_meg_2d: the (pipeline, tensor) grid of a Megatron-style
checkpoint as a map from grid cell to the source ranks it takes, and its contraction to smaller degrees
(each new cell takes a consecutive run of the old cells' ranks: tensor dimension first, then pipeline)."""
from __future__ import annotations

from typing import Optional

from deepspeed_c.checkpoint.reshape_utils import partition_data


class meg_2d_parallel_map:  # noqa: N801 (DeepSpeed's name)
    """cell (pp_index, tp_index) -> list of source indices; keys are "pp,tp" strings, as DeepSpeed's."""

    def __init__(self, pp_degree: int, tp_degree: int) -> None:
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.map: dict[str, list] = {}

    def simple_init(self) -> None:
        """The identity grid: cell (i // tp, i % tp) holds rank i."""
        self.map = {self._make_key(i // self.tp_degree, i % self.tp_degree): [i]
                    for i in range(self.pp_degree * self.tp_degree)}

    def add_data(self, pp_index: int, tp_index: int, data: list) -> None:
        self._validate_indices(pp_index, tp_index)
        if type(data) is not list:
            raise AssertionError(f"meg_2d_parallel_map.add_data: data must be a list, got {type(data).__name__}")
        self.map.setdefault(self._make_key(pp_index, tp_index), []).extend(data)

    def get_data(self, pp_index: Optional[int] = None, tp_index: Optional[int] = None) -> list:
        """The cell's indices; None for an index: every cell along that dimension, pp-major."""
        self._validate_indices(pp_index, tp_index)
        pps = range(self.pp_degree) if pp_index is None else [pp_index]
        tps = range(self.tp_degree) if tp_index is None else [tp_index]
        return [x for i in pps for j in tps for x in self.map[self._make_key(i, j)]]

    def print_data(self, tag: str) -> None:
        print(tag)
        for key, value in self.map.items():
            print(f"{key} = {value}")

    def _validate_indices(self, pp_index: Optional[int], tp_index: Optional[int]) -> None:
        if pp_index is not None and not 0 <= pp_index < self.pp_degree:
            raise AssertionError(f"pp_index {pp_index} outside pp_degree {self.pp_degree}")
        if tp_index is not None and not 0 <= tp_index < self.tp_degree:
            raise AssertionError(f"tp_index {tp_index} outside tp_degree {self.tp_degree}")

    @staticmethod
    def _make_key(i: int, j: int) -> str:
        return f"{i},{j}"


def _reshape_tp_dimension(old: meg_2d_parallel_map, new_tp_degree: int) -> meg_2d_parallel_map:
    new = meg_2d_parallel_map(old.pp_degree, new_tp_degree)
    for i in range(old.pp_degree):
        for j, part in enumerate(partition_data(old.get_data(pp_index=i), new_tp_degree)):
            new.add_data(i, j, part)
    return new


def _reshape_pp_dimension(old: meg_2d_parallel_map, new_pp_degree: int) -> meg_2d_parallel_map:
    new = meg_2d_parallel_map(new_pp_degree, old.tp_degree)
    for j in range(old.tp_degree):
        for i, part in enumerate(partition_data(old.get_data(tp_index=j), new_pp_degree)):
            new.add_data(i, j, part)
    return new


def reshape_meg_2d_parallel(old_pp_degree: int, old_tp_degree: int, new_pp_degree: int, new_tp_degree: int,
                            verbose: bool = False) -> meg_2d_parallel_map:
    """The new (pp, tp) grid's cells, each listing the old ranks it merges. Only contraction is possible."""
    if new_pp_degree > old_pp_degree or new_tp_degree > old_tp_degree:
        raise AssertionError(f"reshape_meg_2d_parallel: cannot expand (pp {old_pp_degree} -> {new_pp_degree}, "
                             f"tp {old_tp_degree} -> {new_tp_degree}); only contraction is supported")
    grid = meg_2d_parallel_map(old_pp_degree, old_tp_degree)
    grid.simple_init()
    if verbose:
        grid.print_data("original_2d_map:")
    if old_tp_degree != new_tp_degree:
        grid = _reshape_tp_dimension(grid, new_tp_degree)
    if verbose:
        grid.print_data("after_tp_reshape:")
    if old_pp_degree != new_pp_degree:
        grid = _reshape_pp_dimension(grid, new_pp_degree)
    if verbose:
        grid.print_data("final_2d_map:")
    return grid


def get_mpu_ranks(tp_size: int = 1, pp_size: int = 1, dp_size: int = 1,
                  virtual_pp_size: Optional[int] = None) -> tuple[list, list, list]:
    """Megatron's rank groups for a tp x pp x dp world: (tensor groups, pipeline groups, data groups).
    Tensor groups are consecutive ranks; data groups stride by tp inside each pipeline block."""
    world = tp_size * pp_size * dp_size
    tp, pp = min(tp_size, world), min(pp_size, world)
    dp = world // (tp * pp)
    block = world // pp  # ranks per pipeline stage
    dp_groups = [list(range(i * block + j, (i + 1) * block, tp)) for i in range(pp) for j in range(tp)]
    pp_groups = [[g[i] for g in dp_groups] for i in range(dp)]
    tp_groups = [list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)]
    return tp_groups, pp_groups, dp_groups
