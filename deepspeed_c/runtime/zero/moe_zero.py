"""ZeRO stages 1 and 2 for models with MoE layers: one ZeRO optimizer per reduction set, behind the
one seam.

Ordinary parameters are partitioned over the data-parallel group; each expert group's parameters
(`ep_size_{n}`) over its expert-data-parallel group, where their gradients are summed and then
divided by the data-parallel world size (DeepSpeed's averaging, so an expert's gradient does not
depend on ep_size). The gradient norm for clipping and overflow is DeepSpeed's ZeRO one: every
rank's partitions of every set, squared and summed over the data-parallel group, which counts each
expert once, so every member takes the same overflow decision; fp16's dynamic loss scale is the first
member's, which the others only read. All members share the user's param-group dicts, so lr
schedulers and `param_groups[i]["lr"]` keep working; each member steps a shallow copy of the user's
optimizer that sees only its own groups (with offload_optimizer, each member offloads its own
partitions). Checkpoints: partition_export hands every member's export over with its ranks;
runtime/checkpointing/moe.py converts them to DeepSpeed's MoE ZeRO files and back."""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from deepspeed_c.runtime.moe_reduction import ExpertParallelism, ReducerSet, is_expert_param
from deepspeed_c.runtime.optimizer_seam import EngineOptimizer, MemberExports
from deepspeed_c.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer


def _comm() -> Any:
    import deepspeed_c.comm as dist

    return dist


class _Member(DeepSpeedZeroOptimizer):
    """One set's ZeRO optimizer; the global squared norm comes from the composite."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epilogue = None  # the fused epilogue computes its own (set-local) norm
        self.norm_sq = 0.0

    def _global_sq_norm(self, parts: Sequence[torch.Tensor]) -> float:
        return self.norm_sq

    def step_with_sq_norm(self, norm_sq: float) -> bool:
        """One step whose clipping and overflow use `norm_sq`, the whole model's squared gradient norm."""
        self.norm_sq = norm_sq
        return self.step()


class _FollowerScaler:
    """A member's view of the leader member's loss scaler: it reads the scale and never updates it,
    so a dynamic scale moves once a step however many members there are."""

    def __init__(self, leader: Any) -> None:
        self.leader = leader

    @property
    def cur_scale(self) -> float:
        return self.leader.cur_scale

    @property
    def loss_scale(self) -> float:
        return self.leader.cur_scale

    def update_scale(self, overflow: bool) -> None:
        """The leader (the first member, stepped first) has updated it for this step."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.leader, name)


def _split_groups(basic: torch.optim.Optimizer) -> None:
    """Every param group holds ordinary parameters only or one expert group's only (DeepSpeed's
    split_params_into_different_moe_groups_for_optimizer, applied in place before any step)."""
    from deepspeed_c.moe.utils import split_params_into_different_moe_groups_for_optimizer

    def mixed(g: dict) -> bool:
        kinds = {p.group_name if is_expert_param(p) else None for p in g["params"]}
        return len(kinds) > 1

    if not any(mixed(g) for g in basic.param_groups):
        return
    groups = []
    for i, g in enumerate(basic.param_groups):
        g.setdefault("name", f"param_group_{i}")
        groups.append(g)
    basic.param_groups = split_params_into_different_moe_groups_for_optimizer(groups, max_group_size=None)
    basic.param_groups = [g for g in basic.param_groups if g["params"]]


def _member_optimizer(basic: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """The user's optimizer, seeing only `groups` (the same dicts) and with a state of its own."""
    opt = object.__new__(type(basic))  # not copy.copy: torch's __getstate__ keeps only some attributes
    opt.__dict__.update(vars(basic))
    opt.param_groups = groups
    opt.state = defaultdict(dict)
    for name in ("_plans", "_ready"):  # per-instance caches keyed by the parameters it steps (FusedAdam, CPU Adam)
        if name in vars(opt):
            setattr(opt, name, type(vars(opt)[name])())
    return opt


class MoEZeroOptimizer(EngineOptimizer):

    def __init__(self, basic: torch.optim.Optimizer, moe: ExpertParallelism, *, stage: int,
                 make: Callable[..., DeepSpeedZeroOptimizer], common: dict, dp_group: Any, dp_world_size: int,
                 gradient_average: bool) -> None:
        from deepspeed_c.utils import groups as ds_groups

        self.optimizer = basic
        self.stage = stage
        self.dp_group = dp_group
        self.dp_rank = common["rank"]  # names this rank's ZeRO file
        self.dp_world_size = dp_world_size
        _split_groups(basic)
        self.members: list[_Member] = []
        self.member_names: list[Optional[str]] = []  # None: the ordinary parameters; else the expert group
        self.scales: list[float] = []
        by_set: dict[Optional[str], list[dict]] = {}
        for g in basic.param_groups:
            name = next((p.group_name for p in g["params"] if is_expert_param(p)), None)
            by_set.setdefault(name, []).append(g)
        for name, groups in by_set.items():
            kw = dict(common)
            if name is not None:
                kw.update(rank=ds_groups._get_expert_data_parallel_rank(name),
                          world_size=ds_groups._get_expert_data_parallel_world_size(name),
                          dp_process_group=ds_groups._get_expert_data_parallel_group(name),
                          gradient_average=False, prescale_gradients=False, gradient_predivide_factor=1.0)
            if self.members and kw.get("loss_scaler") is not None:
                kw["loss_scaler"] = _FollowerScaler(kw["loss_scaler"])
            self.members.append(make(_member_optimizer(basic, groups), stage=stage, **kw))
            self.member_names.append(name)
            # expert gradients: summed over the expert-data-parallel group, divided by the dp world size
            self.scales.append(1.0 / dp_world_size if name is not None and gradient_average else 1.0)
        self.loss_scaler = self.members[0].loss_scaler
        self.overflow = False
        self._reducers = ReducerSet([m.reducer for m in self.members])

    # -- the optimizer face ----------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        merged: dict = {}
        for m in self.members:
            merged.update(m.optimizer.state)
        return merged

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @property
    def cur_scale(self) -> float:
        return self.members[0].cur_scale

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.members[0].dynamic_loss_scale

    def note_backward_scale(self, scale: float) -> None:
        for m in self.members:
            m.note_backward_scale(scale)

    # -- the seam ---------------------------------------------------------------------------------
    def before_step(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Nothing to fill: each member's reducer sent zeros for parameters that got no gradient."""

    def owned_reducer(self) -> ReducerSet:
        return self._reducers

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in self.members:
            m.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> bool:
        parts = []
        for m, scale in zip(self.members, self.scales):
            mine = m.reduced_grad_partitions()
            if scale != 1.0:
                torch._foreach_mul_(mine, scale)
            parts.append(mine)
        dev = self.members[0].bit16_groups[0][0].device
        local = torch.zeros((), dtype=torch.float32, device=dev)
        for t in (t for mine in parts for t in mine):
            local += torch.linalg.vector_norm(t, 2.0, dtype=torch.float32).to(dev) ** 2
        if self.dp_world_size > 1:
            _comm().all_reduce(local, group=self.dp_group)
        total = float(local.item())
        skipped = False
        for m in self.members:
            skipped = m.step_with_sq_norm(total) or skipped
        self.overflow = skipped
        self._global_grad_norm = self.members[0].global_grad_norm
        return skipped

    def model_param_groups(self) -> list[list[torch.nn.Parameter]]:
        return [g for m in self.members for g in m.model_param_groups()]

    def model_file_state(self) -> Optional[dict]:
        return None

    @contextlib.contextmanager
    def partition_export(self) -> Iterator[MemberExports]:
        """Every member's partition_export with the global ranks it is cut over (the ordinary parameters'
        member: the data-parallel group; an expert group's: its expert-data-parallel group), for the
        checkpointer (runtime/checkpointing/zero.py, moe.py) to convert; each member's state resident while
        the context lasts."""
        from deepspeed_c.utils import groups

        with contextlib.ExitStack() as stack:
            members = []
            for m, name in zip(self.members, self.member_names):
                ranks = (list(groups._get_expert_data_parallel_group_ranks(name)) if name is not None
                         else list(range(self.dp_world_size)))
                members.append((stack.enter_context(m.partition_export()), ranks))
            yield MemberExports(rank=self.dp_rank, world_size=self.dp_world_size, members=members)

    def import_partition_state(self, state: Optional[Sequence[Optional[dict]]], load_optimizer_states: bool,
                               load_from_fp32_weights: bool) -> None:
        """One runtime-layout state per member, in partition_export's order (None: masters only)."""
        states = list(state) if state is not None else [None] * len(self.members)
        for m, st in zip(self.members, states):
            m.import_partition_state(st, load_optimizer_states, load_from_fp32_weights)

    def refresh_masters(self) -> None:
        for m in self.members:
            m.refresh_masters()

    def destroy(self) -> None:
        for m in self.members:
            m.destroy()

    def state_dict(self) -> dict:
        raise NotImplementedError("state_dict of the MoE ZeRO optimizer is not built yet")


def configure_moe_zero_optimizer(basic: torch.optim.Optimizer, moe: ExpertParallelism, stage: int,
                                 common: dict) -> Any:
    """The ZeRO optimizer of a model with MoE layers (runtime/engine/zero_setup.configure_zero_optimizer):
    common holds the data-parallel group, its size and the gradient averaging as the members get them."""
    return MoEZeroOptimizer(basic, moe, stage=stage, make=_Member, common=common, dp_group=common["dp_process_group"],
                            dp_world_size=common["world_size"], gradient_average=common["gradient_average"])
