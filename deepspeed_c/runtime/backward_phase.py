"""The engine's backward as a state machine: who drives the running backward and whether its round is open.

A backward reaches the engine two ways. `engine.backward(loss)` (and the pipeline executor's per-micro-batch
rounds) drives it: the engine claims the reducer's round, runs autograd and closes the round itself. A
user's direct `loss.backward()` is seen only when autograd reaches the model's outputs (the output hooks of
engine.forward); the round then closes in autograd's final callback. Between the two the round is "open":
the backward timers run and the reducer's round belongs to the engine, not to an inner graph task (reentrant
checkpointing runs nested graph tasks inside one backward).

    IDLE --drive()--> DRIVING --outputs reached--> DRIVEN_ROUND --close--> DRIVING --drive() ends--> IDLE
    IDLE --a training backward reaches the outputs--> DIRECT_ROUND --autograd's final callback--> IDLE

The two facts are independent (a direct backward that raised leaves its round open until the next forward,
and an engine backward started meanwhile adopts it), so the phase is their product, and every transition
maps (driven, open) exactly as the engine's former booleans did.

`engine.scale(loss)` grants the next direct backward its permission under fp16 loss scaling: a token held
across forward and backward, not a phase, so it is kept beside the phase."""
from __future__ import annotations

import contextlib
import enum
from typing import Any, Callable, Iterator, Sequence

import torch

from deepspeed_c.runtime.engine import report as rep
from deepspeed_c.runtime.autograd_paths import training_backward

__all__ = ["BackwardPhase", "EngineBackward"]


class BackwardPhase(enum.Enum):
    IDLE = "idle"                  # no backward of the engine's is running
    DRIVING = "driving"            # the engine drives a backward; its round is not open (or already closed)
    DRIVEN_ROUND = "driven_round"  # the engine drives a backward and its round is open
    DIRECT_ROUND = "direct_round"  # a user's direct backward opened the round; autograd's final callback closes it

    @property
    def driven(self) -> bool:
        return self in (BackwardPhase.DRIVING, BackwardPhase.DRIVEN_ROUND)

    @property
    def round_open(self) -> bool:
        return self in (BackwardPhase.DRIVEN_ROUND, BackwardPhase.DIRECT_ROUND)


def _phase(driven: bool, round_open: bool) -> BackwardPhase:
    if driven:
        return BackwardPhase.DRIVEN_ROUND if round_open else BackwardPhase.DRIVING
    return BackwardPhase.DIRECT_ROUND if round_open else BackwardPhase.IDLE


class EngineBackward:
    """The engine's backward: its phase, the round it opens and closes, and engine.backward's body.

    `reducer` is a getter (the engine builds its reducer after this object and drops it on destroy);
    `gas` returns the current gradient_accumulation_steps (set_train_batch_size may change it)."""

    def __init__(self, precision: Any, report: Any, reducer: Callable[[], Any], gas: Callable[[], int]) -> None:
        self._precision = precision
        self._report = report
        self._reducer = reducer
        self._gas = gas
        self._phase = BackwardPhase.IDLE
        self._user_scaled = False  # engine.scale(loss) ran since the last direct backward closed

    @property
    def phase(self) -> BackwardPhase:
        return self._phase

    @property
    def engine_driven(self) -> bool:
        """engine.backward or a pipeline round runs: the loss was divided by the accumulation steps already."""
        return self._phase.driven

    # -- events ----------------------------------------------------------------------------------
    def forward_started(self) -> None:
        """A backward that raised never ran its epilogue: its open round is forgotten, not closed."""
        self._phase = _phase(self._phase.driven, False)

    def user_scaled_loss(self) -> None:
        """engine.scale(loss): the next direct backward carries a scaled loss."""
        self._user_scaled = True

    def outputs_reached(self, params: Sequence[torch.Tensor]) -> None:
        """Backward reached the model's outputs (the outermost graph task of this backward). A user's
        `autograd.grad` or `backward(inputs=[x])` between steps also gets here: it accumulates into no
        parameter, so it is no training backward and opens no round (runtime/autograd_paths.py)."""
        if not self._phase.round_open and (self._phase.driven or training_backward(params)):
            self._open_round()

    @contextlib.contextmanager
    def drive(self) -> Iterator[None]:
        """The body runs one engine-driven backward round (no loss bookkeeping): the reducer's round is
        claimed before autograd starts and ended after the round closes, whichever graph tasks ran."""
        self._phase = _phase(True, self._phase.round_open)
        reducer = self._reducer()
        if reducer is not None:
            reducer.claim_round()
        try:
            yield
            self._close_round()
            reducer = self._reducer()
            if reducer is not None:
                reducer.end_backward()
        finally:
            self._phase = _phase(False, self._phase.round_open)

    def run_round(self, run: Callable[[], Any]) -> None:
        """One engine-driven backward round around `run` (the pipeline's micro-batch backwards)."""
        with self.drive():
            run()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """engine.backward's body: exactly the loss given is divided by the accumulation steps (when
        scale_wrt_gas) and scaled for the precision, whatever else the model returned."""
        with self.drive():
            gas_scaled_loss = loss / self._gas() if scale_wrt_gas else loss
            self._report.record_loss(loss.detach())
            self._precision.scale_loss(gas_scaled_loss).backward(retain_graph=retain_graph)
        return gas_scaled_loss

    # -- the round -------------------------------------------------------------------------------
    def _open_round(self) -> None:
        self._phase = _phase(self._phase.driven, True)
        reducer = self._reducer()
        if reducer is not None:
            reducer.claim_round()  # the engine, not an inner graph task, closes this round
        self._report.start(rep.BACKWARD_TIMERS)
        self._report.start(rep.BACKWARD_INNER_TIMERS)
        torch.autograd.Variable._execution_engine.queue_callback(self._close_round)

    def _close_round(self) -> None:
        if not self._phase.round_open:
            return
        self._phase = _phase(self._phase.driven, False)
        self._report.stop(rep.BACKWARD_INNER_TIMERS)
        self._report.start(rep.BACKWARD_REDUCE_TIMERS)
        reducer = self._reducer()
        if reducer is not None:
            reducer.end_backward()
        self._report.stop(rep.BACKWARD_REDUCE_TIMERS)
        self._report.stop(rep.BACKWARD_TIMERS)
        if not self._phase.driven:
            if self._precision.needs_scaler and not self._user_scaled:
                raise RuntimeError("Loss scaling is required for this configuration, but backward() was called "
                                   "directly without scaling the loss. Please use one of the following: "
                                   "1. engine.backward(loss) 2. engine.scale(loss).backward()")
            self._user_scaled = False
