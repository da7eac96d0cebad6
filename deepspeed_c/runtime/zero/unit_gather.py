"""ZeRO-3's gather of parameter units, issued straight on the process group.

Gather-on-use sits on the forward's critical path: a GPT forward gathers one unit per Linear, and
going through torch.distributed's Python front (group lookup, argument checks, options) plus our
comm layer costs tens of microseconds a unit before anything is enqueued. The units of one fetch
(a fetch-plan group: a step's missing units, or a batch of prefetches) also go out as one coalesced
collective, which NCCL runs as one launch. Both are the same collective the comm layer would issue
(all-gather into a tensor), so byte counters that wrap the process group still see them.

While the comms logger is on, gathers go through deepspeed_c.comm (one per unit) so that it records
them, as DeepSpeed's does. A backend that refuses the direct call (no `_allgather_base` / coalesced
form) is remembered and served by deepspeed_c.comm, one collective per unit, as before."""
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
        import torch.distributed as dist

        import deepspeed_c.comm as comm

        self._comm = comm
        self.group = group
        self._pg = group if group is not None else dist.distributed_c10d._get_default_group()
        self._direct = hasattr(self._pg, "_allgather_base")
        self.collectives = 0

    def gather(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Any:
        """All-gathers each input (this rank's chunk) into its output (world_size x chunk), asynchronously;
        returns one waitable for all of them."""
        comm = self._comm
        self.collectives += 1
        if self._direct and not comm.comms_logger.enabled:  # the logger sees what goes through deepspeed_c.comm
            try:
                if len(outputs) == 1:
                    return self._pg._allgather_base(outputs[0], inputs[0])
                return self._pg.allgather_into_tensor_coalesced(list(outputs), list(inputs))
            except (RuntimeError, NotImplementedError) as err:
                if "not supported" not in str(err).lower() and "not implemented" not in str(err).lower():
                    raise
                self._direct = False
        return _Works([comm.all_gather_into_tensor(o, i, group=self.group, async_op=True)
                       for o, i in zip(outputs, inputs)])
