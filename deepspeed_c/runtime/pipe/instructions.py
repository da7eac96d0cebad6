"""Pipeline instructions: what a schedule tells the PipelineEngine to do, one step at a time.

Names and fields follow DeepSpeed's (`deepspeed.runtime.pipe.schedule`): every keyword argument
becomes an attribute, and the repr reads like the call that made it (`ForwardPass(buffer_id=0)`).
Instructions made by the C core also carry `micro_batch_id` (not part of the repr, so streams
compare equal to DeepSpeed's), and `chunk_id` for interleaved schedules' model chunks.
"""
from __future__ import annotations

from typing import Any


class PipeInstruction:
    """Base of all instructions; keyword arguments are stored as attributes (like a namedtuple)."""

    def __init__(self, **kwargs: Any) -> None:
        self.name = self.__class__.__name__
        self.kwargs = kwargs
        self.micro_batch_id = -1
        for key, val in kwargs.items():
            setattr(self, key, val)

    def place(self, micro_batch_id: int, chunk: int) -> "PipeInstruction":
        """Where the C core's stream puts it: the micro-batch it serves and its model chunk (neither is part
        of the repr or of equality); returns the instruction."""
        self.micro_batch_id = micro_batch_id
        self.chunk = chunk
        return self

    def __repr__(self) -> str:
        return f"{self.name}(" + ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items()) + ")"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.kwargs == self.kwargs  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Step the optimizer and zero the gradients (after ReduceGrads and ReduceTiedGrads)."""


class ReduceGrads(PipeInstruction):
    """Reduce gradients among the data-parallel ranks of this stage."""


class ReduceTiedGrads(PipeInstruction):
    """All-reduce the gradients of tied modules among the stages that hold them."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on pipeline buffer `buffer_id`."""

    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Load the next micro-batch (inputs on the first stage, labels on the last) into a buffer."""


class ForwardPass(BufferOpInstruction):
    """Run the stage's layers on the buffer's inputs."""


class BackwardPass(BufferOpInstruction):
    """Back-propagate the buffer's outputs (the loss on the last stage, else the received grads)."""


class BackwardInputPass(BufferOpInstruction):
    """Zero-bubble schedules: the gradient of the stage's inputs only (sent upstream at once)."""


class BackwardWeightPass(BufferOpInstruction):
    """Zero-bubble schedules: the weight gradients of a micro-batch whose input grads are done."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's outputs to the next stage."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's activations into the buffer's inputs."""


class SendGrad(BufferOpInstruction):
    """Send the gradient of the buffer's inputs to the previous stage."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradient of the buffer's outputs from the next stage."""


# Opcodes of csrc/include/dsc/pipe_schedule.h, in order.
OPCODES: tuple[type, ...] = (
    LoadMicroBatch, ForwardPass, BackwardPass, SendActivation, RecvActivation, SendGrad, RecvGrad,
    ReduceTiedGrads, ReduceGrads, OptimizerStep, BackwardInputPass, BackwardWeightPass,
)
