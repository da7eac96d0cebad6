"""What a checkpoint saves and restores, handed to the checkpointer by the engine at each
save_checkpoint / load_checkpoint: the stateful objects (module, optimizer protocol, LR scheduler,
gradient reducer, training counters) and the few facts about this rank the files are named and cut
by. The checkpointer works on these alone: it never sees the engine, and it restores the counters
through `train_state.load_state_dict`, never by writing engine fields.

Built at each call rather than once, because what it holds can change between saves (the batch size
through set_train_batch_size, AutoTP's whole view for the duration of a save or load)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from deepspeed_c.runtime.train_state import TrainState


@dataclass(frozen=True)
class CheckpointStates:
    """module_state_dict: the engine's module_state_dict (a subclass may override it, as DeepSpeed's
    allows); stepper: the optimizer protocol (runtime/optimizer_seam.py), None without one;
    has_optimizer: an optimizer exists (a ZeRO-3 engine built for evaluation has one and no stepper);
    samples_per_step: train_batch_size(), the samples of a step for a checkpoint without
    global_samples; dp_rank: this rank's data-parallel rank (0 without data parallelism);
    num_experts: per MoE layer, None without MoE layers; data_loader: the training data loader (its
    position is saved; None without one)."""
    module: torch.nn.Module
    module_state_dict: Callable[..., dict]
    stepper: Optional[Any]
    has_optimizer: bool
    lr_scheduler: Optional[Any]
    reducer: Optional[Any]
    train_state: TrainState
    samples_per_step: int
    dp_world_size: int
    dp_rank: int
    local_rank: int
    num_experts: Optional[list[int]]
    # a client mpu's model parallelism (runtime/parallel_dims.py): its rank names the mp_rank_XX files
    mp_rank: int = 0
    mp_world_size: int = 1
    data_loader: Optional[Any] = None  # the training data loader, whose position is saved (run_state.py)
    data_schedules: Optional[Any] = None  # legacy curriculum / PLD state (run_state.py)
    sparse_names: Optional[Any] = None  # sparse_gradients' names (runtime/sparse_names.py)

    @property
    def has_moe_layers(self) -> bool:
        return self.num_experts is not None


@dataclass(frozen=True)
class PipeCheckpointStates(CheckpointStates):
    """A pipeline stage's: its stage id, the number of stages and its rank in the stage's
    data-parallel group (the rank 0 of which writes the stage's model-states file)."""
    stage_id: int = 0
    num_stages: int = 1
    stage_dp_rank: int = 0
