"""The per-backward "round" that both gradient reducers run (runtime/reducer.py at stage 0,
runtime/zero/grad_partition.py at ZeRO stages 1 and 2).

The first post-accumulate-grad hook of a backward opens the round and asks `should_reduce()`
once, so every parameter of that backward is treated alike. Who closes it: the engine, when it has
claimed the round (`claim_round()`, from engine.backward or when a direct backward reaches the
model's outputs, i.e. in the outermost autograd graph task); otherwise the end-of-backward callback
of the graph task that opened it. The difference matters for reentrant activation checkpointing:
its recomputation runs a nested graph task, and a round closed at the end of that inner task would
reduce a partial set of gradients and open a second round for the rest.
Subclasses say what a reducing round does: `_start_reducing` (reset per-round state),
`_on_grad(index)` (a parameter's gradient is ready) and `_finish_round` (flush and wait)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch


class BucketOrderKeeping:
    """What runtime/checkpointing/reducer_order.py asks of a gradient reducer, so a resumed run reduces in the
    saved bucket order. The defaults keep no order (ZeRO's partitioners, stage 3's round)."""

    def order_keepers(self) -> list["BucketOrderKeeping"]:
        """The reducers whose orders a checkpoint keeps, in a fixed order (a composite: its members)."""
        return [self]

    def ordered_param_count(self) -> int:
        """How many parameters a saved order permutes (0: this reducer keeps no order)."""
        return 0

    def adopted_order(self) -> Optional[list[int]]:
        """The bucket order to save, or None (none re-planned yet, or none kept)."""
        return None

    def adopt_order(self, order: list[int]) -> None:
        """Takes a saved order; ignored by a reducer that keeps none."""


class BackwardRound(BucketOrderKeeping):
    should_reduce: Callable[[], bool]
    _inert_hook: Optional[Callable[[Any], bool]] = None

    def _attach_hooks(self, params: Sequence[torch.nn.Parameter]) -> None:
        self._round_open = False
        self._reducing = False
        self._claimed = False
        self.touched: set[int] = set()  # parameters that got a gradient since the last clear (step)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook_for(i)) for i, p in enumerate(params)]

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self.touched.add(index)
            # once per parameter per backward: _enter_round's open-round case inlined
            if self._reducing if self._round_open else self._enter_round():
                self._on_grad(index)
            else:
                self._on_local_grad(index)

        return hook

    def _enter_round(self) -> bool:
        """Opens the round on its first hook; True when this backward reduces."""
        if not self._round_open:
            self._round_open = True
            self._reducing = bool(self.should_reduce())
            if self._reducing:
                self._start_reducing()
            if not self._claimed:
                torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
        return self._reducing

    def claim_round(self) -> None:
        """The caller will call end_backward() once this backward is over (no callback is queued)."""
        self._claimed = True

    def end_backward(self) -> None:
        """Flush and await the round (idempotent: a no-op outside a reducing backward)."""
        self._claimed = False
        if not self._round_open:
            return
        try:
            if self._reducing:
                self._finish_round()
        finally:
            self._round_open = False
            self._reducing = False

    def register_inert_hook_test(self, is_inert: Callable[[Any], bool]) -> None:
        """`is_inert(hook)` says a tensor hook on a parameter leaves its gradient unchanged right now (the
        engine's accumulation scaler while it would not scale): a fast path that bypasses tensor hooks
        (ZeRO's in-bucket Linear weight gradients) may still run on a parameter carrying only such hooks."""
        self._inert_hook = is_inert

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- what a reducing round does ------------------------------------------------------------
    def _start_reducing(self) -> None:
        raise NotImplementedError

    def _on_grad(self, index: int) -> None:
        raise NotImplementedError

    def _on_local_grad(self, index: int) -> None:
        """A parameter's gradient arrived in a backward that does not reduce (accumulation only)."""

    def _finish_round(self) -> None:
        raise NotImplementedError
