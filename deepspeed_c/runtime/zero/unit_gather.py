"""ZeRO-3's gather of parameter units, through deepspeed_c.comm.

Gather-on-use sits on the forward's critical path: a GPT forward gathers one unit per Linear. The units
of one fetch (a fetch-plan group: a step's missing units, or a batch of prefetches) go out as one
coalesced collective (deepspeed_c.comm.all_gather_coalesced, which NCCL runs as one launch), a lone
unit as one all_gather_into_tensor; both take deepspeed_c.comm's prebuilt call per group (comm/direct.py),
whose fallbacks (forced or learnt) and wrappers still apply.

While the comms logger is on, each unit is its own logged all_gather_into_tensor, as DeepSpeed's are
(deepspeed_c.comm's coalesced form is not logged, as DeepSpeed's is not)."""
from __future__ import annotations

from typing import Any, Sequence

import torch


class _Works:
    """The works of one fetch, waited on together (a unit's wait covers its whole fetch)."""

    __slots__ = ("works",)

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        works, self.works = self.works, []
        for w in works:
            if w is not None:
                w.wait()


class UnitGatherer:

    def __init__(self, group: Any) -> None:
        import deepspeed_c.comm as comm

        self._comm = comm  # the module: a function wrapped on it later (a collective counter) is still seen
        self.group = group
        self.collectives = 0

    def gather(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Any:
        """All-gathers each input (this rank's chunk) into its output (world_size x chunk), asynchronously;
        returns one waitable for all of them."""
        comm = self._comm
        self.collectives += 1
        if comm.comms_logger.enabled:
            return _Works([comm.all_gather_into_tensor(o, i, group=self.group, async_op=True)
                           for o, i in zip(outputs, inputs)])
        if len(outputs) == 1:
            return comm.all_gather_into_tensor(outputs[0], inputs[0], group=self.group, async_op=True)
        return comm.all_gather_coalesced(outputs, inputs, group=self.group, async_op=True)
