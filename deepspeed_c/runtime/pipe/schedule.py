"""Pipeline schedules (`deepspeed.runtime.pipe.schedule`'s names): generators of per-step
instruction lists for one stage. The built-in schedules come from the C core
(csrc/core/pipe_schedule.c): Python only turns its opcodes into instruction objects.

A user schedule subclasses PipeSchedule and implements `steps()` (and `num_pipe_buffers()`),
exactly as in DeepSpeed.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator, Optional

from .instructions import (OPCODES, BackwardInputPass, BackwardPass, BackwardWeightPass, BufferOpInstruction,
                           ForwardPass, LoadMicroBatch, OptimizerStep, PipeInstruction, RecvActivation, RecvGrad,
                           ReduceGrads, ReduceTiedGrads, SendActivation, SendGrad)

__all__ = [
    "PipeSchedule", "TrainSchedule", "InferenceSchedule", "DataParallelSchedule", "InterleavedSchedule",
    "ZeroBubbleH1Schedule", "ForwardOnlySchedule", "PipeInstruction", "OptimizerStep", "ReduceGrads", "ReduceTiedGrads",
    "BufferOpInstruction", "LoadMicroBatch", "ForwardPass", "BackwardPass", "BackwardInputPass",
    "BackwardWeightPass", "SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "bubble_fraction",
]

# enum dsc_pipe_kind
KIND_TRAIN, KIND_INFERENCE, KIND_DATA_PARALLEL, KIND_INTERLEAVED, KIND_ZB_H1 = range(5)


class PipeSchedule(ABC):
    """Directs a pipeline engine: `steps()` yields, for each step, the list of instructions of
    stage `stage_id`. Each step is atomic: a barrier between steps cannot deadlock."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        super().__init__()
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = self.stage_id - 1
        self.next_stage = self.stage_id + 1

    @abstractmethod
    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yield a list of instructions for each step."""

    def num_pipe_buffers(self) -> int:
        """Buffers the engine allocates for this stage (default: one per micro-batch)."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def _buffer_idx(self, micro_batch_id: int) -> int:
        """Cyclic buffer of a micro-batch."""
        assert self._valid_micro_batch(micro_batch_id)
        return micro_batch_id % self.num_pipe_buffers()

    def __iter__(self) -> "PipeSchedule":
        self.it = None
        return self

    def __next__(self) -> list[PipeInstruction]:
        if self.it is None:
            self.it = self.steps()
        return next(self.it)


class _CoreSchedule(PipeSchedule):
    """A schedule whose steps the C core generates (built once, replayed per batch)."""

    KIND = KIND_TRAIN
    virtual_stages = 1

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        super().__init__(micro_batches, stages, stage_id)
        for name, val in (("micro_batches", micro_batches), ("stages", stages), ("stage_id", stage_id)):
            if not isinstance(val, int) or isinstance(val, bool):
                raise TypeError(f"{type(self).__name__}: {name} must be an int, got {val!r}")
        from deepspeed_c import _C

        raw, self._num_buffers = _C.pipe_schedule(self.KIND, micro_batches, stages, stage_id, self.virtual_stages)
        self._raw = raw

    def _make(self, op: int, buffer_id: int, micro_batch: int, chunk: int) -> PipeInstruction:
        cls = OPCODES[op]
        if buffer_id < 0:
            inst = cls()
        elif self.virtual_stages > 1:
            inst = cls(buffer_id, chunk_id=chunk)
        else:
            inst = cls(buffer_id)
        return inst.place(micro_batch, max(chunk, 0))

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step in self._raw:
            yield [self._make(*t) for t in step]

    def num_pipe_buffers(self) -> int:
        return self._num_buffers

    def bubble_fraction(self) -> float:
        """Idle share of stages x time when every stage runs this schedule (forward 1, backward 2
        per stage's layers; split backward 1 + 1)."""
        return bubble_fraction(self.KIND, self.micro_batches, self.stages, self.virtual_stages)


class TrainSchedule(_CoreSchedule):
    """Synchronous 1F1B training (DeepSpeed's TrainSchedule): at most
    max(2, min(stages - stage_id, micro_batches)) micro-batches in flight on a stage."""

    KIND = KIND_TRAIN


class InferenceSchedule(_CoreSchedule):
    """Forward only, two buffers per stage."""

    KIND = KIND_INFERENCE


class DataParallelSchedule(_CoreSchedule):
    """Gradient accumulation without a pipeline: load, forward, backward per micro-batch."""

    KIND = KIND_DATA_PARALLEL


class InterleavedSchedule(_CoreSchedule):
    """Interleaved 1F1B: each rank holds `virtual_stages` model chunks (chunk c of rank r is
    virtual stage c * stages + r); instructions carry `chunk_id`. micro_batches must be a multiple
    of stages."""

    KIND = KIND_INTERLEAVED

    def __init__(self, micro_batches: int, stages: int, stage_id: int, virtual_stages: int = 2) -> None:
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"pipeline.virtual_stages must be an int >= 1, got {virtual_stages!r}")
        self.virtual_stages = virtual_stages
        super().__init__(micro_batches, stages, stage_id)


class ZeroBubbleH1Schedule(_CoreSchedule):
    """ZB-H1: backward split into BackwardInputPass (sent upstream at once) and
    BackwardWeightPass (deferred into the idle slots), activation memory about 1F1B's."""

    KIND = KIND_ZB_H1


class ForwardOnlySchedule(PipeSchedule):
    """The forward part of a training schedule (loads, activation transfers, forward passes), for
    evaluating with model chunks: a receive never waits longer than in the training schedule, so
    it cannot deadlock either; buffers are those of the training schedule."""

    KEEP = (LoadMicroBatch, RecvActivation, ForwardPass, SendActivation)

    def __init__(self, train: PipeSchedule) -> None:
        super().__init__(train.micro_batches, train.stages, train.stage_id)
        self.train = train

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step in self.train.steps():
            kept = [i for i in step if isinstance(i, self.KEEP)]
            if kept:
                yield kept

    def num_pipe_buffers(self) -> int:
        return self.train.num_pipe_buffers()


def bubble_fraction(kind: int, micro_batches: int, stages: int, virtual_stages: int = 1) -> float:
    """Simulated idle fraction of a schedule kind (see csrc/include/dsc/pipe_schedule.h)."""
    from deepspeed_c import _C

    return _C.pipe_simulate(kind, micro_batches, stages, virtual_stages)[1]


def schedule_for(name: str, micro_batches: int, stages: int, stage_id: int,
                 virtual_stages: Optional[int] = None) -> PipeSchedule:
    """The training schedule named by the config's `pipeline.schedule`."""
    if name in ("1f1b", "train"):
        return TrainSchedule(micro_batches, stages, stage_id)
    if name == "interleaved":
        return InterleavedSchedule(micro_batches, stages, stage_id, virtual_stages or 2)
    if name in ("zb_h1", "zero_bubble", "zb-h1"):
        return ZeroBubbleH1Schedule(micro_batches, stages, stage_id)
    raise ValueError(f"pipeline.schedule must be one of '1f1b', 'interleaved', 'zb_h1', got {name!r}")
