"""The events DeepSpeed's engine writes to its monitors, by tag, for the engine to reuse.

The step of every event is the engine's `global_samples` (samples seen so far, all ranks).
"""
from __future__ import annotations

from typing import Any, Callable

from deepspeed_c.monitor.monitor import Event

TRAIN_LOSS = "Train/Samples/train_loss"
LR = "Train/Samples/lr"
LOSS_SCALE = "Train/Samples/loss_scale"
EIGENVALUE = "Train/Eigenvalues/ModelBlockParam_{}"

# wall_clock_breakdown: event tag -> timer name (deepspeed_c.utils.timer's *_GLOBAL_TIMER values)
TIMER_EVENTS = (
    ("Train/Samples/elapsed_time_ms_forward", "fwd"),
    ("Train/Samples/elapsed_time_ms_backward", "bwd"),
    ("Train/Samples/elapsed_time_ms_backward_inner", "bwd_inner"),
    ("Train/Samples/elapsed_time_ms_backward_allreduce", "bwd_allreduce"),
    ("Train/Samples/elapsed_time_ms_step", "step"),
)


def loss_events(loss: Any, global_samples: int) -> list[Event]:
    return [(TRAIN_LOSS, loss, global_samples)]


def step_events(lr: float, global_samples: int, loss_scale: float | None = None) -> list[Event]:
    """lr after an optimizer step, and the loss scale when fp16 dynamic scaling is on."""
    events: list[Event] = [(LR, lr, global_samples)]
    if loss_scale is not None:
        events.append((LOSS_SCALE, loss_scale, global_samples))
    return events


def timer_events(elapsed_ms: Callable[[str], float], global_samples: int) -> list[Event]:
    """One event per breakdown timer; `elapsed_ms(name)` reads a timer without resetting it."""
    return [(tag, elapsed_ms(name), global_samples) for tag, name in TIMER_EVENTS]
