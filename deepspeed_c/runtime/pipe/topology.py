"""Process topologies (`deepspeed.runtime.pipe.topology`): a cartesian grid of ranks over named
axes, the last axis varying fastest (DeepSpeed's rank order), and the process groups of a
pipeline x data (x model) run built from it."""
from __future__ import annotations

import itertools
from collections import namedtuple
from typing import Any, Optional

import torch.distributed as dist


class ProcessTopology:
    """Maps n-dimensional coordinates (named axes) to linear ranks and back.

    >>> ProcessTopology(axes=['pipe', 'data'], dims=[2, 2]).get_rank(pipe=1, data=0)
    2
    """

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: axes {axes} and dims {dims} differ in length")
        for a, d in zip(axes, dims):
            if not isinstance(d, int) or d < 1:
                raise ValueError(f"ProcessTopology: dimension of axis {a!r} must be an int >= 1, got {d!r}")
        self.axes = list(axes)
        self.dims = list(dims)
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        self.mapping: dict[Any, int] = {}
        for rank, coord in enumerate(itertools.product(*[range(d) for d in dims])):
            self.mapping[self.ProcessCoord(*coord)] = rank
        self._coords = list(self.mapping)  # rank -> coordinate

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank of a full coordinate, e.g. get_rank(pipe=1, data=0)."""
        if len(coord_kwargs) != len(self.axes):
            raise ValueError(f"get_rank needs a value for every axis {self.axes}, got {sorted(coord_kwargs)}")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"coordinate {key} is outside the topology (dims {dict(zip(self.axes, self.dims))})")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_rank_repr(self, rank: int, omit_axes: list[str] = ["data", "pipe"], inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """A string of rank's coordinate on the axes not omitted, e.g. 'model_01' (checkpoint names)."""
        omit = frozenset(omit_axes)
        coord = self.get_coord(rank)
        return outer_sep.join(f"{ax}{inner_sep}{getattr(coord, ax):02d}" for ax in self.axes if ax not in omit)

    def get_dim(self, axis: str) -> int:
        """Length of an axis; 0 when the topology has no such axis."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int):
        """The ProcessCoord of a rank (axes as attributes)."""
        if not 0 <= rank < len(self._coords):
            raise ValueError(f"rank {rank} not found in a topology of {len(self._coords)} ranks")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Lists of ranks that differ only in `axis` (one communicator each); [] for an unknown axis."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for coord in itertools.product(*[range(self.get_dim(a)) for a in others]):
            fixed = dict(zip(others, coord))
            lists.append([self.mapping[self.ProcessCoord(**fixed, **{axis: i})] for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Ranks whose coordinate matches every given axis value."""
        return [r for c, r in self.mapping.items() if all(getattr(c, k) == v for k, v in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate on `axis` is idx."""
        i = self.axes.index(axis)
        return [r for c, r in self.mapping.items() if c[i] == idx]

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism: axes ['pipe', 'data'], so data-parallel peers are adjacent ranks."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor-slicing) parallelism: axes ['pipe', 'data', 'model']."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def _prime_factors(n: int) -> list[int]:
    if n <= 0:  # 0 would otherwise return [] and a negative its sign-less factors
        raise ValueError(f"_prime_factors takes a strictly positive integer, got {n}")
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


class PipelineParallelGrid:
    """The process groups of a topology for the calling rank: pipe (the stages of my replica),
    data (my stage's replicas), model (pipe x model of my data index) and slice (tensor slicing).
    Every rank creates every group in the same order, as torch.distributed requires."""

    def __init__(self, topology: Optional[ProcessTopology] = None, process_group: Any = None) -> None:
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if topology is None:
            # DeepSpeed's default: alternate the prime factors of the world between pipe and data
            num_pp = num_dp = 1
            for i, p in enumerate(_prime_factors(self.world_size)):
                if i % 2 == 0:
                    num_pp *= p
                else:
                    num_dp *= p
            topology = PipeDataParallelTopology(num_pp=num_pp, num_dp=num_dp)
        if topology.world_size() != self.world_size:
            raise ValueError(f"the topology has {topology.world_size()} ranks ({dict(zip(topology.axes, topology.dims))}) "
                             f"but the world size is {self.world_size}")
        self._topo = topology
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = self.get_stage_id()
        self.data_parallel_id = self.get_data_parallel_id()

        self.ds_model_proc_group = None
        self.ds_model_rank = -1
        self.ds_model_world_size = 1
        for dp in range(self.data_parallel_size):
            ranks = sorted(topology.get_axis_list(axis="data", idx=dp)) if "data" in topology.axes else \
                list(range(self.world_size))
            group = dist.new_group(ranks=ranks)
            if self.global_rank in ranks:
                self.ds_model_proc_group = group
                self.ds_model_world_size = len(ranks)
                self.ds_model_rank = ranks.index(self.global_rank)

        self.dp_group: list[int] = []
        self.dp_groups = topology.get_axis_comm_lists("data") or [[r] for r in range(self.world_size)]
        self.dp_proc_group = None
        for g in self.dp_groups:
            group = dist.new_group(ranks=g)
            if self.global_rank in g:
                self.dp_group, self.dp_proc_group = g, group

        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.p2p_groups = self._build_p2p_groups()

        self.pp_group: list[int] = []
        self.pp_proc_group = None
        self.pipe_groups = topology.get_axis_comm_lists("pipe") or [[r] for r in range(self.world_size)]
        for ranks in self.pipe_groups:
            group = dist.new_group(ranks=ranks)
            if self.global_rank in ranks:
                self.pp_group, self.pp_proc_group = ranks, group

        self.slice_group: list[int] = []
        self.slice_proc_group = None
        lists = topology.get_axis_comm_lists("model") if self.model_parallel_size > 1 else \
            [[r] for r in range(self.world_size)]
        for g in lists:
            group = dist.new_group(ranks=g)
            if self.global_rank in g:
                self.slice_group, self.slice_proc_group = g, group

    def get_stage_id(self) -> int:
        coord = self._topo.get_coord(rank=self.global_rank)
        return getattr(coord, "pipe", 0)

    def get_data_parallel_id(self) -> int:
        coord = self._topo.get_coord(rank=self.global_rank)
        return getattr(coord, "data", 0)

    def _build_p2p_groups(self) -> list[list[int]]:
        """[rank, the same replica's next stage's rank (wrapping)] for every rank."""
        out = []
        for rank in range(self.world_size):
            for lst in self._topo.get_axis_comm_lists("pipe"):
                if rank in lst:
                    out.append([rank, lst[(lst.index(rank) + 1) % len(lst)]])
                    break
        return out

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of `stage_id` in my replica (other axes as mine unless given)."""
        me = self._topo.get_coord(self.global_rank)
        if "pipe" not in self._topo.axes:
            return self.global_rank
        return self._topo.get_rank(**me._replace(pipe=stage_id, **kwargs)._asdict())

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.get_stage_id()

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.get_pipe_parallel_rank()

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.get_pipe_parallel_world_size()

    def get_pipe_parallel_group(self):
        return self.pp_proc_group

    def get_pipeline_model_parallel_group(self):
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self):
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        coord = self._topo.get_coord(rank=self.global_rank)
        return getattr(coord, "model", 0)

    def get_tensor_model_parallel_rank(self) -> int:
        return self.get_slice_parallel_rank()

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.get_slice_parallel_world_size()

    def get_slice_parallel_group(self):
        return self.slice_proc_group

    def get_tensor_model_parallel_group(self):
        return self.slice_proc_group
