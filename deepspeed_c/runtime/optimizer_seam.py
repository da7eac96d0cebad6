"""The one seam between the engine and the optimizer it steps.

The engine holds an `EngineOptimizer` and calls only this protocol: it never asks which kind it
holds. DeepSpeed's roles map onto it: the plain torch optimizer (`PlainOptimizer`, an adapter that
keeps the user's optimizer as `engine.optimizer`), its FP16/BF16 mixed-precision optimizer
(runtime/precision.MixedPrecisionOptimizer) and the ZeRO 1/2 optimizer
(runtime/zero/stage_1_and_2.DeepSpeedZeroOptimizer); ZeRO 3, pipeline and MoE optimizers implement
the same methods. Checkpoint state goes through the same objects (runtime/checkpointing/engine.py); a
partitioned (ZeRO) optimizer hands its state over as data (partition_export) and takes a loaded one back
(import_partition_state): the conversion to DeepSpeed's files is the checkpointer's
(runtime/checkpointing/zero.py, zero3.py), which the optimizer never calls."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch

from deepspeed_c.runtime.grad_norm import clip_coefficient, global_norm, scale_


@dataclass(frozen=True)
class SavedCheckpoint:
    """What an optimizer's load_checkpoint_state reads from: one tag directory of a checkpoint."""
    tag_dir: str
    manifest: Any
    model_state: dict  # the model-states file (mp_rank_00_model_states.pt, or a stage-3 rank's own)
    bf16: bool  # names of ZeRO files carry DeepSpeed's bf16_ prefix
    load_from_fp32_weights: bool
    node_local: bool  # checkpoint.use_node_local_storage: only this node's files are readable
    # a ZeRO-3 checkpoint: per-rank zero_pp_rank_{r}_mp_rank_00_model_states.pt whose `module` holds
    # placeholders; the weights are the ZeRO files' fp32 partitions and the frozen_param_fragments
    partitioned_weights: bool = False
    model_rank: Optional[int] = None  # whose per-rank model-states file model_state is (stage 3)
    mp_rank: int = 0  # a pipeline checkpoint: the stage whose ZeRO files (..._mp_rank_{stage:02d}_...) to read

    def read_rank_file(self, name: str) -> Optional[dict]:
        """A rank's own file `name` of the tag directory (rank_checkpoint_file's), verified against the
        manifest; None when the checkpoint has none of that name."""
        import os

        from deepspeed_c.checkpoint import store

        if not os.path.isfile(os.path.join(self.tag_dir, name)):
            return None
        return store.load_file(self.tag_dir, name, self.manifest)


@dataclass
class PartitionExport:
    """A partitioned (ZeRO) optimizer's checkpoint state as data, in its runtime layout: what the
    checkpointer (runtime/checkpointing/zero.py, zero3.py) converts to and from DeepSpeed's on-disk layout.
    The optimizer never sees that layout; the checkpointer never calls into the optimizer beyond
    partition_export / import_partition_state / refresh_masters."""
    stage: int
    rank: int
    world_size: int
    group: Any  # the data-parallel process group the partitions are cut over
    plans: list  # one ops.partition.PartitionPlan per param group (runtime layout)
    params: list  # the model parameters of each group, in plan order
    masters: list  # this rank's live flat masters per group (a load fills them in place)
    state: dict  # state_dict(clone_masters=False): base_optimizer_state (moments, steps), scaler, overflow, ...
    loss_scaler: Any = None  # the scaler whose scale the files record
    sub_group_size: int = 0  # stage 3: DeepSpeed's checkpoint sub-groups
    store: Any = None  # stage 3: the ParamStore (frozen parameters' shards are its last group)
    extra: dict = field(default_factory=dict)


@dataclass
class MemberExports:
    """A composite optimizer's checkpoint state as data (the MoE ZeRO optimizer: one ZeRO optimizer per
    reduction set): each member's PartitionExport with the global ranks its partitions are cut over (member
    rank r is global rank ranks[r]), in the order of the groups in each rank's ZeRO file. The checkpointer
    (runtime/checkpointing/zero.py, moe.py) converts them; import_partition_state then takes one
    runtime-layout state per member."""
    rank: int  # this rank's data-parallel rank (names its ZeRO file)
    world_size: int  # the data-parallel world size
    members: list  # [(PartitionExport, list[int] of global ranks)]


class EngineOptimizer:
    """What the engine needs; the defaults suit an optimizer over whole (unpartitioned) gradients."""

    _global_grad_norm: Any = None

    def before_step(self, params: Sequence[torch.nn.Parameter]) -> None:
        """DeepSpeed reduces and steps a zero gradient for a trainable parameter that got none."""
        for p in params:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def step(self, closure: Any = None) -> bool:
        """One optimizer step; True when it was skipped (overflow), DeepSpeed's convention."""
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        raise NotImplementedError

    @property
    def global_grad_norm(self) -> Any:
        """The last step's unscaled global gradient norm (float, device scalar or None)."""
        return self._global_grad_norm

    def resident(self) -> ContextManager[None]:
        """The optimizer's states in device memory for the duration (a ZeRO optimizer with offloaded states
        brings them back; checkpoint code reading them uses this); a no-op by default."""
        return self._resident()

    def _resident(self) -> ContextManager[None]:
        """The hook `resident` calls: subclasses that move their states override it."""
        return contextlib.nullcontext()

    def owned_reducer(self) -> Any:
        """The gradient reducer this optimizer brings (ZeRO's partitioner), or None for the engine's."""
        return None

    def reduction_slots(self) -> Any:
        """Where the engine's reducer reads and writes gradients (None: param.grad)."""
        return None

    def flat_grad_partitions(self) -> Optional[Callable[[], Sequence[Optional[torch.Tensor]]]]:
        """ZeRO-1/2: a getter of the reduced flat gradient partitions this optimizer steps from, one per param
        group, read at each call (None entries for groups without a reducing backward since the last step);
        None (the default) where the optimizer steps from each parameter's gradient (reduction slot)."""
        return None

    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Moves the optimizer's states to host memory (engine.offload_states); ZeRO optimizers only."""
        raise RuntimeError(f"offload_states needs a ZeRO optimizer (zero_optimization.stage 1 or 2); this engine "
                           f"steps {type(self).__name__}, which DeepSpeed cannot offload either")

    def reload_states(self, non_blocking: bool = False) -> None:
        raise RuntimeError(f"reload_states needs a ZeRO optimizer (zero_optimization.stage 1 or 2); this engine "
                           f"steps {type(self).__name__}")

    def destroy(self) -> None:
        """Drops hooks and buffers (engine.destroy)."""

    def release_gathered_params(self) -> None:
        """ZeRO-3: every gathered parameter released (engine.empty_partition_cache); nothing below."""

    # -- checkpoint state (runtime/checkpointing/engine.py writes DeepSpeed's layout from these) ----------
    def model_param_groups(self) -> list[list[torch.nn.Parameter]]:
        """The model parameters each param group steps (the model file's param_shapes)."""
        raise NotImplementedError

    def model_file_state(self) -> Optional[dict]:
        """What the model-states file holds under "optimizer" (None: the state is in per-rank files)."""
        return self.state_dict()

    def partition_export(self) -> ContextManager[Optional[PartitionExport]]:
        """A partitioned optimizer's state as data while the context lasts (its states resident in memory),
        which the checkpointer converts to DeepSpeed's ZeRO files and back; None (the default) for
        optimizers whose state is not partitioned over ranks (their protocol methods below serve)."""
        return contextlib.nullcontext(None)

    def import_partition_state(self, state: Optional[dict], load_optimizer_states: bool,
                               load_from_fp32_weights: bool) -> None:
        """Applies a runtime-layout state the checkpointer built from partition_export's (its masters were
        filled in place); None: only the masters were loaded, the model weights follow them."""
        raise NotImplementedError(f"{type(self).__name__} keeps no partitioned state")

    def partition_checkpoint_state(self, param_name: Callable[[torch.nn.Parameter], str]) -> Optional[tuple[int, dict]]:
        """(data-parallel rank, its ZeRO file's optimizer_state_dict) for an optimizer without a
        partition_export that writes per-rank ZeRO files of its own; None otherwise. A collective where it is
        not None."""
        return None

    def load_checkpoint_state(self, saved: SavedCheckpoint, load_optimizer_states: bool) -> None:
        raise NotImplementedError

    def writes_partition_files(self) -> bool:
        """Whether this rank writes its partition's files (ZeRO file, stage 3's model-states file); False on a
        rank whose partition another rank holds too and writes (MiCS's replicas: the first shard group writes)."""
        return True

    def rank_checkpoint_file(self) -> Optional[tuple[str, dict]]:
        """(file name, contents) of this rank's own optimizer state, which the checkpointer writes into the
        tag directory beside the shared files: state that differs between ranks and that the shared files
        (rank 0's) cannot hold, such as the 1-bit optimizers' compression errors. None: nothing of the kind."""
        return None

    def load_rank_checkpoint_file(self, saved: SavedCheckpoint) -> None:
        """After load_checkpoint_state: this rank's file (rank_checkpoint_file's) back, where the optimizer
        keeps one; it may be a collective over the optimizer's data-parallel group."""

    def partitioned_model_state(self, param_name: Callable[[torch.nn.Parameter], str],
                                exclude_frozen_parameters: bool) -> Optional[tuple[int, dict]]:
        """ZeRO-3: (data-parallel rank, the fields of its own model-states file that depend on the weight
        shards: param_shapes per sub-group, frozen_param_shapes, frozen_param_fragments); None where one
        model-states file holds whole weights. A collective where it is not None."""
        return None

    def load_module_state(self, module: torch.nn.Module, state_dict: dict) -> None:
        """A checked module state_dict (parameters a partitioned checkpoint left as placeholders removed)
        applied to the model; ZeRO-3 cuts whole parameter values into its shards."""
        module.load_state_dict(state_dict, strict=False)

    def load_checkpoint_weights(self, saved: SavedCheckpoint) -> None:
        """load_module_only: the weights the model-states file does not hold (a ZeRO-3 checkpoint's are its
        fp32 partitions), then the optimizer's own copy (masters) follows the model's weights."""
        if saved.partitioned_weights:
            raise NotImplementedError(f"load_checkpoint: {saved.tag_dir} is a ZeRO stage-3 checkpoint (its weights are "
                                      "partitioned over its ZeRO files); load it into a ZeRO engine, or recover "
                                      "whole weights with zero_to_fp32 and load those")
        self.refresh_masters()

    def refresh_masters(self) -> None:
        """The optimizer's own copy of the weights (fp32 masters) re-read from the model's."""

    def master_params(self) -> dict[int, torch.nn.Parameter]:
        """id(model parameter) -> the whole-parameter master this optimizer steps in its place (the stage-0
        mixed-precision optimizer's fp32 copies); empty where the model's parameters are stepped directly or
        the masters are flat partitions (ZeRO)."""
        return {}

    def state_dict(self) -> dict:
        raise NotImplementedError


class PlainOptimizer(EngineOptimizer):
    """A torch optimizer stepping the model's parameters directly (fp32, or torch autocast): global
    norm clipping and, with fp16 autocast, torch's GradScaler."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], clip_grad: float,
                 grad_scaler: Any = None, norm_across_ranks: Optional[Callable[[float], float]] = None) -> None:
        self.optimizer = optimizer
        self.params = list(params)
        self.clip_grad = clip_grad
        self.grad_scaler = grad_scaler
        # MoE: ranks hold different experts, so local norms differ; DeepSpeed averages them over the ranks
        self.norm_across_ranks = norm_across_ranks

    def _clip(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = float(global_norm(grads))
        if self.norm_across_ranks is not None:
            norm = self.norm_across_ranks(norm)
        self._global_grad_norm = norm
        scale_(grads, clip_coefficient(norm, self.clip_grad))

    def step(self, closure: Any = None) -> bool:
        self._global_grad_norm = None
        scaler = self.grad_scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        if self.clip_grad > 0.0:
            self._clip()
        if scaler is None:
            self.optimizer.step()
            client_norm = getattr(self.optimizer, "_global_grad_norm", None)  # a client optimizer may report one
            if client_norm is not None:
                self._global_grad_norm = client_norm
            return False
        before = scaler.get_scale()
        scaler.step(self.optimizer)
        scaler.update()
        return scaler.get_scale() < before

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def model_param_groups(self) -> list[list[torch.nn.Parameter]]:
        return [list(g["params"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_checkpoint_state(self, saved: SavedCheckpoint, load_optimizer_states: bool) -> None:
        state = saved.model_state.get("optimizer")
        if state is not None and load_optimizer_states:
            self.optimizer.load_state_dict(state)

    def rank_checkpoint_file(self) -> Optional[tuple[str, dict]]:
        return rank_file_of(self.optimizer)

    def load_rank_checkpoint_file(self, saved: SavedCheckpoint) -> None:
        load_rank_file_of(self.optimizer, saved)


def rank_file_of(optimizer: Any) -> Optional[tuple[str, dict]]:
    """The torch optimizer's own rank file where it keeps one: an optimizer whose state differs between
    ranks implements rank_checkpoint_file() -> (name, dict) and load_rank_checkpoint_file(tag_dir,
    manifest) (the 1-bit optimizers, runtime/fp16/onebit/rank_state.py); others have neither."""
    hook = getattr(optimizer, "rank_checkpoint_file", None)
    return hook() if hook is not None else None


def load_rank_file_of(optimizer: Any, saved: SavedCheckpoint) -> None:
    hook = getattr(optimizer, "load_rank_checkpoint_file", None)
    if hook is not None:
        hook(saved.tag_dir, saved.manifest)


def engine_optimizer(optimizer: Any, params: Sequence[torch.nn.Parameter], clip_grad: float,
                     grad_scaler: Any = None,
                     norm_across_ranks: Optional[Callable[[float], float]] = None) -> Optional[EngineOptimizer]:
    """The seam object for whatever optimizer the engine ended up with."""
    if optimizer is None:
        return None
    if isinstance(optimizer, EngineOptimizer):
        return optimizer
    return PlainOptimizer(optimizer, params, clip_grad, grad_scaler, norm_across_ranks)
