"""`zero_optimization.zenflow` (DeepSpeed's `deepspeed.runtime.zenflow.zenflow_config.ZenFlowConfig`): the
keys, defaults and value checks of DeepSpeed 0.19.8, plus the checks DeepSpeed makes later (when it builds
its engine and optimizer) made at parse time, so a bad config fails before any model is built.

`resolve_schedule` turns the knobs into the numbers the optimizer runs by, as DeepSpeed's configure_zenflow
does: select_strategy "auto" means "epoch" with select_interval 1; an epoch-based interval counts
steps_per_epoch steps per epoch (0, i.e. select once, when the epoch length is unknown); update_interval
"auto" lets the optimizer decide when the accumulated gradient is worth applying."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from pydantic import Field, model_validator

from deepspeed_c.runtime.config.utils import DeepSpeedConfigModel

ZENFLOW = "zero_optimization.zenflow"


class ZenFlowConfig(DeepSpeedConfigModel):
    # share of each matrix's columns stepped on the device; open interval as in DeepSpeed: 0 would select no column
    # (ZenFlow without its device step), 1 every column (nothing left for the host)
    topk_ratio: float = Field(0.1, gt=0.0, lt=1.0)
    select_strategy: str = "auto"  # auto, step, epoch
    select_interval: Union[str, int] = "auto"
    update_interval: Union[str, int] = "auto"  # steps between applications of the accumulated gradient
    overlap_step: bool = False  # the host step runs in a background thread, applied one interval later
    offload: bool = False  # the selected columns' moments kept in host memory between steps
    auto_ratio: float = Field(0.99, ge=0.0, le=1.0)
    full_warm_up_rounds: int = 0
    pt_reserved_cores_perc: float = Field(0.5, ge=0.0, le=1.0)
    steps_per_epoch: Optional[int] = Field(default=None, exclude=True)  # filled from the training data loader

    @model_validator(mode="after")
    def _check(self) -> "ZenFlowConfig":
        if self.select_strategy not in ("auto", "step", "epoch"):
            raise ValueError('select_strategy must be one of "auto", "step", or "epoch"')
        if isinstance(self.select_interval, str) and self.select_interval != "auto":
            raise ValueError('If select_interval is a string, it must be "auto"')
        if isinstance(self.update_interval, str) and self.update_interval != "auto":
            raise ValueError('If update_interval is a string, it must be "auto"')
        if not isinstance(self.update_interval, str) and self.update_interval < 1:
            raise ValueError(f"update_interval must be \"auto\" or an integer >= 1 (steps between host updates), "
                             f"got {self.update_interval}")
        if not isinstance(self.select_interval, str) and self.select_interval < 0:
            raise ValueError(f"select_interval must be \"auto\" or an integer >= 0, got {self.select_interval}")
        if self.full_warm_up_rounds < 0:
            raise ValueError(f"full_warm_up_rounds must be >= 0, got {self.full_warm_up_rounds}")
        # select_strategy "auto" with a numeric select_interval parses here, as in DeepSpeed's model (its tests build
        # it); a whole DeepSpeedConfig refuses it (config/zero.py), and so does resolve_schedule
        if self.select_strategy != "auto" and isinstance(self.select_interval, str):
            raise ValueError("If don't use auto select strategy, select_interval must be a number.")
        return self


@dataclass(frozen=True)
class ZenFlowSchedule:
    """What the ZenFlow optimizer runs by. select_interval 0: select once (at the first step after warm-up);
    update_interval 0 with auto_update: the optimizer applies when most matrices' left-out gradient has grown
    as large as their selected one (auto_ratio of them)."""
    topk_ratio: float
    select_interval: int
    update_interval: int
    auto_update: bool
    auto_ratio: float
    full_warm_up_rounds: int
    overlap_step: bool
    offload: bool
    pt_reserved_cores_perc: float


def resolve_schedule(cfg: ZenFlowConfig, steps_per_epoch: Optional[int] = None) -> ZenFlowSchedule:
    strategy = cfg.select_strategy
    if strategy == "auto":
        if not isinstance(cfg.select_interval, str):
            raise ValueError(f"{ZENFLOW}.select_interval is {cfg.select_interval!r} with select_strategy \"auto\", which "
                             "selects every epoch, so select_interval would be overwritten: "
                             "set select_strategy to \"step\" or \"epoch\", or select_interval to \"auto\"")
        strategy, select = "epoch", 1
    else:
        select = int(cfg.select_interval)
    spe = steps_per_epoch if steps_per_epoch is not None else cfg.steps_per_epoch
    if strategy == "epoch":
        select = select * int(spe) if spe else 0
    auto_update = isinstance(cfg.update_interval, str)
    update = 0 if auto_update else int(cfg.update_interval)
    if not auto_update and select != 0 and select < update:
        raise ValueError(f"Select interval must be greater or equal to update interval ({ZENFLOW}.select_interval "
                         f"resolves to {select} steps, {ZENFLOW}.update_interval is {update})")
    return ZenFlowSchedule(topk_ratio=float(cfg.topk_ratio), select_interval=select, update_interval=update,
                           auto_update=auto_update, auto_ratio=float(cfg.auto_ratio),
                           full_warm_up_rounds=int(cfg.full_warm_up_rounds), overlap_step=bool(cfg.overlap_step),
                           offload=bool(cfg.offload), pt_reserved_cores_perc=float(cfg.pt_reserved_cores_perc))
