"""`graph_harvesting`: the stage-0 bf16 optimizer step replayed from a CUDA graph (DeepSpeed 0.19.6's key).

DeepSpeed's BF16_Optimizer, with `"graph_harvesting": true`, records the device work of its step's separate
passes (the fp32 gradient accumulation, the global norm's partial sums, the clipping multiply) in CUDA graphs
the first time and replays them afterwards, so the host stops launching their kernels one by one. deepspeed_c's
stage-0 mixed-precision step on CUDA is already fused (runtime/fused_epilogue.py: one multi-tensor l2norm, then
one Adam epilogue kernel per param group that unscales, clips, steps the fp32 masters and writes the bf16
weights); with graph_harvesting that whole device part (norm + epilogue) is one graph, replayed while
everything it depends on stays the same: the tensors' addresses (gradients, masters, moments, weights, step
counters) and the hyperparameters the kernels take by value (lr, betas, eps, weight decay, clipping, loss
scale). A step whose key differs runs eagerly; a key seen on two steps in a row is recorded (that step runs
eagerly too, then the capture records the next ones' work without running it), so an lr schedule that moves
every step never pays for captures that would not be replayed, and a graph follows the schedule once it
settles. The host part of the step (the step counters, the scheduler) stays in Python.

bf16's overflow check (`bf16.check_grad_overflow`, on by default in 0.19.8) stays inside the recording: the
epilogue skips a step with a non-finite norm on the device, and the host reads the norm once after the replay
to count the skipped step. Where the key has no effect (fp16 or fp32, or ZeRO stages 1-3, which DeepSpeed's
BF16_Optimizer does not cover; MoE, whose norm is reduced across ranks on the host between the two halves; no
CUDA device; an optimizer without the fused epilogue) initialize says so once, naming the key and why."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from deepspeed_c.utils.logging import logger

KEY = "graph_harvesting"


def no_effect(reason: str) -> None:
    """The key is set but this engine's step is not recorded: said once per engine built."""
    logger.warning(f"Config key '{KEY}' = True has no effect in deepspeed_c here: {reason}.")


class HarvestedStep:
    """The device part of one optimizer step, eager or replayed from its CUDA graph by key."""

    def __init__(self) -> None:
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.key: Optional[tuple] = None  # the recorded graph's
        self.output: Optional[torch.Tensor] = None  # what the recorded launch returned (its own memory)
        self._last: Optional[tuple] = None  # the previous step's key
        self.captures = 0
        self.replays = 0
        self.eager = 0
        self.failed: Optional[str] = None  # why a recording failed (the step then stays eager)

    def run(self, key: tuple, launch: Callable[[], torch.Tensor]) -> torch.Tensor:
        """launch() enqueues the step's device work (no host side effects, no host reads) and returns a device
        tensor; the returned tensor holds its value once the current stream gets there."""
        if self.graph is not None and key == self.key:
            self.graph.replay()
            self.replays += 1
            assert self.output is not None
            return self.output
        stable, self._last = key == self._last, key
        out = launch()
        self.eager += 1
        if stable and self.failed is None:
            try:
                self._record(key, launch)
            except RuntimeError as e:  # a capture the driver refused: the step stays eager, as without the key
                self.failed = str(e).splitlines()[0] if str(e) else type(e).__name__
                self.graph, self.output, self.key = None, None, None
                logger.warning(f"'{KEY}': recording the optimizer step in a CUDA graph failed ({self.failed}); "
                               "the step runs eagerly from now on")
        return out

    def _record(self, key: tuple, launch: Callable[[], torch.Tensor]) -> None:
        """Records launch() (capture runs nothing); the previous graph and its memory are dropped first."""
        self.graph, self.output, self.key = None, None, None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = launch()
        self.graph, self.output, self.key = graph, output, key
        self.captures += 1

    def reset(self) -> None:
        """Forget the graph (states moved, or were loaded into new tensors)."""
        self.graph, self.output, self.key, self._last = None, None, None, None
