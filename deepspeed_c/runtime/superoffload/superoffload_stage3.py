"""SuperOffloadOptimizer_Stage3 (DeepSpeed's `deepspeed.runtime.superoffload.superoffload_stage3`): the ZeRO-3
optimizer with offload_optimizer.super_offload. Its host side is SpeculativeOffload (superoffload_utils.py):
the C CPU Adam steps each gradient chunk while backward still produces the next ones, and the step commits
those results or rolls them back (overflow, clipping) and steps the ordinary way. The CPU Adam's threads
come from offload_optimizer.cpuadam_cores_perc; pin them to the cores nearest the GPU with the launcher's
--bind_cores_to_rank."""
from __future__ import annotations

from typing import Any

import torch

from deepspeed_c.runtime.superoffload.superoffload_utils import SpeculativeOffload
from deepspeed_c.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3


class SuperOffloadOptimizer_Stage3(DeepSpeedZeroOptimizer_Stage3):  # noqa: N801 (DeepSpeed's class name)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("offload_device") != "cpu" or kwargs.get("nvme_offload") is not None:
            raise ValueError("zero_optimization.offload_optimizer.super_offload needs offload_optimizer.device 'cpu'")
        super().__init__(*args, **kwargs)
        assert isinstance(self.offload, SpeculativeOffload)
        # a snapshot for rollbacks only when a step can disagree with the speculation
        may_roll_back = self.clip_grad > 0.0 or self.loss_scaler is not None or self.check_overflow
        self.offload.set_speculation(lambda: 1.0 / self._scale_used, may_roll_back=may_roll_back)
        ratio = float(kwargs["zero_cfg"].offload_optimizer.ratio)
        if ratio < 1.0:  # the rest of the optimizer state is stepped on the device
            self.offload.set_device_share(ratio)
        # the step returns before the host is done: the next forward takes each bucket as it reaches its unit
        self.offload.attach_store(self.store)

    # whatever reads the shards or the masters outside a forward first lets the deferred step finish
    def lp_storage(self) -> list[torch.Tensor]:
        self.offload.settle()
        return super().lp_storage()

    def release_gathered_params(self) -> None:
        self.offload.settle()
        super().release_gathered_params()

    def _export(self) -> Any:
        self.offload.settle()
        return super()._export()

    def load_module_state(self, module: torch.nn.Module, state_dict: dict) -> None:
        self.offload.settle()
        super().load_module_state(module, state_dict)

    def destroy(self) -> None:
        super().destroy()
        assert isinstance(self.offload, SpeculativeOffload)
        self.offload.close()  # the deferred step finished, the worker stopped, the GIL switch interval given back

    def _offload_class(self) -> type:
        return SpeculativeOffload

    def speculation_stats(self) -> dict[str, Any]:
        """How many steps committed their speculative host step, how many rolled it back, how many were taken the
        ordinary way without speculating (the step before was clipped), how many of this rank's partition
        elements the device steps (offload_optimizer.ratio < 1), and the seconds the steps waited for the
        speculative host step still running; deferred_steps: steps that returned before the host was done (the
        next forward took their buckets)."""
        assert isinstance(self.offload, SpeculativeOffload)
        self.offload.settle()
        share = self.offload.share
        return {"commits": self.offload.commits, "rollbacks": self.offload.rollbacks,
                "plain_steps": self.offload.plain_steps, "device_elements": 0 if share is None else sum(share.cut),
                "deferred_steps": self.offload.deferred_steps, "drain_s": self.offload.drain_s}
