"""ZenFlowZeroOptimizer (DeepSpeed's `deepspeed.runtime.zenflow.zenflow_stage_1_and_2`): ZeRO stage 1/2 with
ZeRO-Offload whose step is ZenFlowStep (zenflow_step.py). The partitioning, reduction, overflow check,
clipping and weight gathers are the stage 1/2 optimizer's; the host side keeps the offload's side stream
but stages nothing per step (the accumulator lives on the device and goes to the host once per update).
Checkpoints carry ZenFlow's state (`zenflow` in the optimizer state: the accumulated gradient, the
selected columns and their device moments). ZenFlowMixin is what stage 3 (engine_stage3.py) shares."""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from deepspeed_c.ops.cpu_optimizer_base import CPUOptimizerBase
from deepspeed_c.runtime.zenflow.zenflow_config import ZenFlowSchedule
from deepspeed_c.runtime.zenflow.zenflow_step import ZenFlowStep
from deepspeed_c.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed_c.runtime.zero.step_strategy import ZeroStepStrategy
from deepspeed_c.utils.logging import logger

ZENFLOW_STATE = "zenflow"


class ZenFlowMixin:
    """ZenFlow over a ZeRO optimizer (DeepSpeedZeroOptimizer or its stage 3): put first in the bases."""

    def __init__(self, *args: Any, zenflow: ZenFlowSchedule, **kwargs: Any) -> None:
        if kwargs.get("offload_device") != "cpu" or kwargs.get("nvme_offload") is not None:
            raise ValueError("Zenflow must be used with cpu offload (zero_optimization.offload_optimizer.device "
                             "'cpu')")
        opt = next((a for a in args if isinstance(a, torch.optim.Optimizer)), None)
        if not isinstance(opt, CPUOptimizerBase) or opt.MOMENTS != ("exp_avg", "exp_avg_sq"):
            raise ValueError(f"zero_optimization.zenflow steps with the C CPU Adam (DeepSpeedCPUAdam: optimizer type "
                             f"Adam or AdamW with offload_optimizer); got {type(opt).__name__}")
        self.zenflow_schedule = zenflow
        self.zenflow_step: Optional[ZenFlowStep] = None
        kwargs["offload_stage_on_host"] = False  # no per-step gradient copy: the accumulator is on the device
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]

    def _step_strategy(self, epilogue: Any) -> ZeroStepStrategy:
        if self.zenflow_step is None:
            shapes = [[getattr(p, "ds_shape", p.shape) for p in ps] for ps in self.bit16_groups]
            self.zenflow_step = ZenFlowStep(self.optimizer, self.fp32_partitions, self.partition_plans, shapes,
                                            self.gatherer, self.zenflow_schedule, rank=self.rank,
                                            world_size=self.world_size, group=self.dp_process_group,
                                            device=self.bit16_groups[0][0].device,
                                            lp_dtype=self.bit16_groups[0][0].dtype, pin_memory=True,
                                            host_lp=None if self.offload is None else self.offload.host_lp)
        return self.zenflow_step

    @contextlib.contextmanager
    def _resident(self) -> Any:
        if self.zenflow_step is not None:
            self.zenflow_step.settle()
        with super()._resident():  # type: ignore[misc]
            yield

    def state_dict(self, clone_masters: bool = True) -> dict[str, Any]:
        sd = super().state_dict(clone_masters=clone_masters)  # type: ignore[misc]  (settles first)
        assert self.zenflow_step is not None
        sd[ZENFLOW_STATE] = dict(self.zenflow_step.state_dict(), rank=self.rank, world_size=self.world_size)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], load_optimizer_states: bool = True,
                        load_from_fp32_weights: bool = True) -> None:
        assert self.zenflow_step is not None
        self.zenflow_step.forget()
        super().load_state_dict(state_dict, load_optimizer_states=load_optimizer_states,  # type: ignore[misc]
                                load_from_fp32_weights=load_from_fp32_weights)
        saved = state_dict.get(ZENFLOW_STATE) if load_optimizer_states else None
        if saved is not None and (saved.get("rank"), saved.get("world_size")) != (self.rank, self.world_size):
            logger.warning("zero_optimization.zenflow: the checkpoint's ZenFlow state (accumulated gradient, selected "
                           "columns) was saved at another data-parallel layout; starting it afresh")
            saved = None
        self.zenflow_step.load_state_dict(saved)

    def destroy(self) -> None:
        if self.zenflow_step is not None:
            self.zenflow_step.close()
        super().destroy()  # type: ignore[misc]


class ZenFlowZeroOptimizer(ZenFlowMixin, DeepSpeedZeroOptimizer):
    """ZeRO stage 1/2 with ZenFlow."""
