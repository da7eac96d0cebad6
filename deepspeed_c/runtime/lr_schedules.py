"""DeepSpeed's learning-rate schedules: LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR.

Each schedule is stepped once per batch. `last_batch_iteration` is the index of the last batch
trained (-1: none yet); `step()` advances it and writes the new lr (and, for OneCycle, momentum)
into every param group. Constructing a schedule with last_batch_iteration=-1 writes the starting
lr at once; constructing one to resume (last_batch_iteration >= 0) leaves the optimizer alone
until the first step(), and get_last_lr() asserts until then.

The formulas, constructor signatures, defaults and config key names are DeepSpeed's (0.19.x,
including its later fixes: OneCycle stair counts, per-group bounds, a clamped cosine tail).
"""
from __future__ import annotations

import argparse
import math
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch.optim import Optimizer

from deepspeed_c.utils.logging import logger

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"

EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"

CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"

CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"

CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"

WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"

WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"

TOTAL_NUM_STEPS = "total_num_steps"

FloatOrList = Union[float, Sequence[float]]
_NEED_STEP = "need to call step() first"


# ---- command-line arguments ---------------------------------------------------------------

def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's 'Convergence Tuning' LR-schedule flags to `parser`."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    group.add_argument("--lr_schedule", type=str, default=None, help="LR schedule for training.")
    # LR range test
    group.add_argument("--lr_range_test_min_lr", type=float, default=0.001, help="Starting lr value.")
    group.add_argument("--lr_range_test_step_rate", type=float, default=1.0, help="scaling rate for LR range test.")
    group.add_argument("--lr_range_test_step_size", type=int, default=1000, help="training steps per LR change.")
    group.add_argument("--lr_range_test_staircase", type=bool, default=False,
                       help="use staircase scaling for LR range test.")
    # OneCycle shape
    group.add_argument("--cycle_first_step_size", type=int, default=1000,
                       help="size of first step of 1Cycle schedule (training steps).")
    group.add_argument("--cycle_first_stair_count", type=int, default=-1, help="first stair count for 1Cycle schedule.")
    group.add_argument("--cycle_second_step_size", type=int, default=-1,
                       help="size of second step of 1Cycle schedule (default first_step_size).")
    group.add_argument("--cycle_second_stair_count", type=int, default=-1,
                       help="second stair count for 1Cycle schedule.")
    group.add_argument("--decay_step_size", type=int, default=1000,
                       help="size of intervals for applying post cycle decay (training steps).")
    # OneCycle lr and momentum
    group.add_argument("--cycle_min_lr", type=float, default=0.01, help="1Cycle LR lower bound.")
    group.add_argument("--cycle_max_lr", type=float, default=0.1, help="1Cycle LR upper bound.")
    group.add_argument("--decay_lr_rate", type=float, default=0.0, help="post cycle LR decay rate.")
    group.add_argument("--cycle_momentum", default=False, action="store_true", help="Enable 1Cycle momentum schedule.")
    group.add_argument("--cycle_min_mom", type=float, default=0.8, help="1Cycle momentum lower bound.")
    group.add_argument("--cycle_max_mom", type=float, default=0.9, help="1Cycle momentum upper bound.")
    group.add_argument("--decay_mom_rate", type=float, default=0.0, help="post cycle momentum decay rate.")
    # Warmup
    group.add_argument("--warmup_min_lr", type=float, default=0, help="WarmupLR minimum/initial LR value")
    group.add_argument("--warmup_max_lr", type=float, default=0.001, help="WarmupLR maximum LR value.")
    group.add_argument("--warmup_num_steps", type=int, default=1000, help="WarmupLR step count for LR warmup.")
    group.add_argument("--warmup_type", type=str, default=WARMUP_LOG_RATE,
                       help="WarmupLR increasing function during warmup")
    # Warmup cosine
    group.add_argument("--warmup_min_ratio", type=float, default=0.01, help="Cosine LR lower bound.")
    group.add_argument("--cos_min_ratio", type=float, default=0.01, help="Cosine LR lower bound.")
    return parser


def parse_arguments() -> tuple[argparse.Namespace, list[str]]:
    parser = add_tuning_arguments(argparse.ArgumentParser())
    return parser.parse_known_args()


def _copy_args(args: Any, params: dict[str, Any], keys: Sequence[str]) -> None:
    for key in keys:
        value = getattr(args, key, None)
        if value is not None:
            params[key] = value


def override_lr_range_test_params(args: Any, params: dict[str, Any]) -> None:
    _copy_args(args, params, [LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE, LR_RANGE_TEST_STEP_SIZE,
                              LR_RANGE_TEST_STAIRCASE])


def override_1cycle_params(args: Any, params: dict[str, Any]) -> None:
    _copy_args(args, params, [CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT, CYCLE_SECOND_STEP_SIZE,
                              CYCLE_SECOND_STAIR_COUNT, DECAY_STEP_SIZE, CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE,
                              CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE])


def override_warmupLR_params(args: Any, params: dict[str, Any]) -> None:
    _copy_args(args, params, [WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE])


def override_params(args: Any, params: dict[str, Any]) -> None:
    override_lr_range_test_params(args, params)
    override_1cycle_params(args, params)
    override_warmupLR_params(args, params)


def get_config_from_args(args: Any) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """(scheduler config dict, None) from parsed tuning flags, or (None, reason)."""
    schedule = getattr(args, LR_SCHEDULE, None)
    if schedule is None:
        return None, f"--{LR_SCHEDULE} not specified on command line"
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not supported LR schedule"
    config: dict[str, Any] = {"type": schedule, "params": {}}
    if schedule == LR_RANGE_TEST:
        override_lr_range_test_params(args, config["params"])
    elif schedule == ONE_CYCLE:
        override_1cycle_params(args, config["params"])
    else:
        override_warmupLR_params(args, config["params"])
    return config, None


def get_lr_from_config(config: dict[str, Any]) -> tuple[Optional[float], str]:
    """The lr a scheduler config starts training at (its peak for OneCycle and warmups)."""
    if "type" not in config:
        return None, "LR schedule type not defined in config"
    if "params" not in config:
        return None, "LR schedule params not defined in config"
    schedule, params = config["type"], config["params"]
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not a valid LR schedule"
    if schedule == LR_RANGE_TEST:
        return params[LR_RANGE_TEST_MIN_LR], ""
    if schedule == ONE_CYCLE:
        return params[CYCLE_MAX_LR], ""
    return params[WARMUP_MAX_LR], ""


# ---- shared helpers -----------------------------------------------------------------------

def update_lr(param_groups: list[dict[str, Any]], lrs: Sequence[Any]) -> list[Any]:
    """Write lrs into the groups; a tensor lr (for capturable/compiled optimizers) is filled in place."""
    for group, lr in zip(param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def get_torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer a schedule drives: the optimizer itself or the one a wrapper holds."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    if isinstance(getattr(optimizer, "param_groups", None), list):
        return optimizer  # an optimizer-like wrapper that exposes its groups
    raise TypeError(f"{type(optimizer).__name__} is not a subclass of torch.optim.Optimizer")


def _format_param(optimizer: Any, value: Any, name: str) -> list[Any]:
    """A scalar for every group, or a list/tuple with one value per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"expected {len(optimizer.param_groups)} value for {name}, got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _check_positive_int(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _checked_warmup_type(warmup_type: str) -> str:
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        logger.warning(f"Using unknown warmup_type: {warmup_type}. The increasing function is set to default (log)")
        return WARMUP_LOG_RATE
    return warmup_type


def _warmup_fraction(last_batch_iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """How far through warmup batch `last_batch_iteration` is: log(i+1)/log(W) or i/W."""
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(last_batch_iteration + 1) / math.log(warmup_num_steps)
    return last_batch_iteration / warmup_num_steps


class _BatchSchedule:
    """What every schedule shares: the batch counter, step(), get_last_lr() and the state dict."""

    optimizer: Any
    last_batch_iteration: int
    _last_lr: Optional[list[Any]] = None

    def get_lr(self) -> list[Any]:
        raise NotImplementedError

    def get_last_lr(self) -> list[Any]:
        """The lrs the last step() (or construction from scratch) wrote."""
        assert getattr(self, "_last_lr", None) is not None, _NEED_STEP
        return self._last_lr  # type: ignore[return-value]

    def _advance(self, last_batch_iteration: Optional[int]) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        self._advance(last_batch_iteration)

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]


# ---- the schedules ------------------------------------------------------------------------

class LRRangeTest(_BatchSchedule):
    """LR range test (Smith, arXiv:1803.09820): lr = min_lr * (1 + step_rate * interval), where
    interval = (i + 1) / step_size, floored when staircase. Used to find the largest stable lr."""

    def __init__(self, optimizer: Optimizer, lr_range_test_min_lr: FloatOrList = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        self.optimizer = get_torch_optimizer(optimizer)
        self.min_lr = _format_param(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        _check_positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.last_batch_iteration = last_batch_iteration
        self.staircase = lr_range_test_staircase
        self.interval_fn: Callable[[], float] = (self._staircase_interval if lr_range_test_staircase
                                                 else self._continuous_interval)
        if last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.min_lr)

    def _staircase_interval(self) -> float:
        return math.floor(float(self.last_batch_iteration + 1) / self.step_size)

    def _continuous_interval(self) -> float:
        return float(self.last_batch_iteration + 1) / self.step_size

    def _get_increase(self) -> float:
        return 1 + self.step_rate * self.interval_fn()

    def get_lr(self) -> list[float]:
        increase = self._get_increase()
        return [lr * increase for lr in self.min_lr]

    def step(self, batch_iteration: Optional[int] = None) -> None:  # DeepSpeed's parameter name here
        self._advance(batch_iteration)


class OneCycle(_BatchSchedule):
    """1Cycle (Smith, arXiv:1803.09820): lr rises from cycle_min_lr to cycle_max_lr over the first
    step size, falls back over the second, then decays as min_lr / (1 + decay_lr_rate * k /
    decay_step_size). Momentum (beta1 of optimizers with `betas`) moves inversely, between
    cycle_max_mom and cycle_min_mom, then grows by (1 + decay_mom_rate * k / decay_step_size).
    A stair count > 0 holds the value flat over that many equal stairs of a half cycle."""

    def __init__(self, optimizer: Optimizer, cycle_min_lr: FloatOrList, cycle_max_lr: FloatOrList,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: Optional[int] = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: Optional[int] = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: FloatOrList = 0.8, cycle_max_mom: FloatOrList = 0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        self.optimizer = get_torch_optimizer(optimizer)
        self._initialize_cycle(cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count,
                               cycle_second_stair_count, decay_step_size)
        self._initialize_lr(self.optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate, last_batch_iteration)
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            self._initialize_momentum(self.optimizer, cycle_min_mom, cycle_max_mom, decay_mom_rate,
                                      last_batch_iteration)
        self.last_batch_iteration = last_batch_iteration

    def _initialize_cycle(self, first_step_size: float, second_step_size: Optional[float], first_stair_count: int,
                          second_stair_count: Optional[int], decay_step_size: float) -> None:
        first = float(first_step_size)
        second = float(second_step_size) if second_step_size is not None else first
        # each half checked on its own: a zero first half would divide by a zero step ratio
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {first_step_size}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {second_step_size}")
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_step_size = first
        self.second_step_size = second
        self.first_stair_count = first_stair_count
        self.second_stair_count = first_stair_count if second_stair_count is None else second_stair_count
        self.decay_step_size = decay_step_size
        no_decay = math.isclose(self.decay_step_size, 0)
        self.skip_lr_decay = no_decay
        self.skip_mom_decay = no_decay

    def _initialize_lr(self, optimizer: Any, cycle_min_lr: FloatOrList, cycle_max_lr: FloatOrList,
                       decay_lr_rate: float, last_batch_iteration: int) -> None:
        # both bounds validated before the optimizer is touched
        self.min_lrs = _format_param(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _format_param(optimizer, cycle_max_lr, "cycle_max_lr")
        if last_batch_iteration == -1:
            update_lr(optimizer.param_groups, self.min_lrs)
        self.decay_lr_rate = decay_lr_rate
        if math.isclose(self.decay_lr_rate, 0):
            self.skip_lr_decay = True

    def _initialize_momentum(self, optimizer: Any, cycle_min_mom: FloatOrList, cycle_max_mom: FloatOrList,
                             decay_mom_rate: float, last_batch_iteration: int) -> None:
        if "betas" not in getattr(optimizer, "defaults", {}):
            logger.warning(f"cycle_momentum is disabled because optimizer {type(optimizer).__name__} does not "
                           "support momentum, no betas attribute in defaults")
            self.cycle_momentum = False
            return
        self.decay_mom_rate = decay_mom_rate
        # DeepSpeed pins beta2 to 0.99 while it cycles beta1
        self.min_moms = [(m, 0.99) for m in _format_param(optimizer, cycle_min_mom, "cycle_min_mom")]
        self.max_moms = [(m, 0.99) for m in _format_param(optimizer, cycle_max_mom, "cycle_max_mom")]
        if last_batch_iteration == -1:
            for betas, group in zip(self.min_moms, optimizer.param_groups):
                group["betas"] = betas
        if math.isclose(self.decay_mom_rate, 0):
            self.skip_mom_decay = True

    def _get_scale_factor(self) -> float:
        """Position in the cycle as a height in [0, 1]: 0 at min lr (max momentum), 1 at the peak."""
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale = x / self.step_ratio
            stairs = self.first_stair_count
        else:
            scale = (x - 1) / (self.step_ratio - 1)
            stairs = self.second_stair_count
        if stairs > 0:
            # quantise from the integer offset, not the float scale, which can sit 1 ulp under a stair
            in_cycle = batch_iteration % self.total_size
            if in_cycle <= self.first_step_size:
                position = in_cycle * stairs / self.first_step_size
            else:
                position = (self.total_size - in_cycle) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _get_cycle_lr(self) -> list[float]:
        scale = self._get_scale_factor()
        return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def _get_cycle_mom(self) -> list[tuple[float, float]]:
        scale = self._get_scale_factor()
        return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]

    def _get_decay_lr(self, decay_batch_iteration: int) -> list[float]:
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * (decay_batch_iteration / self.decay_step_size)
        return [lr / factor for lr in self.min_lrs]

    def _get_decay_mom(self, decay_batch_iteration: int) -> list[tuple[float, float]]:
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * (decay_batch_iteration / self.decay_step_size)
        return [(beta1 * factor, beta2) for beta1, beta2 in self.max_moms]

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            return self._get_cycle_lr()
        return self._get_decay_lr(self.last_batch_iteration - self.total_size + 1)

    def get_mom(self) -> Optional[list[tuple[float, float]]]:
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            return self._get_cycle_mom()
        return self._get_decay_mom(self.last_batch_iteration - self.total_size + 1)

    def step(self, batch_iteration: Optional[int] = None) -> None:  # DeepSpeed's parameter name here
        self._advance(batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom() or []):
                group["betas"] = betas


class WarmupLR(_BatchSchedule):
    """lr rises from warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear), then
    holds: lr = min + (max - min) * gamma, gamma = log(i+1)/log(W) or i/W while i < W, else 1.
    warmup_max_lr=None takes each param group's current lr."""

    def __init__(self, optimizer: Optimizer, warmup_min_lr: FloatOrList = 0.0,
                 warmup_max_lr: Optional[FloatOrList] = None, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1) -> None:
        _check_positive_int(warmup_num_steps, "warmup_num_steps")
        self.optimizer = get_torch_optimizer(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.min_lrs = _format_param(self.optimizer, warmup_min_lr, "min_lr")
        self.max_lrs = _format_param(self.optimizer, warmup_max_lr, "max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        # log(1) = 0 would make a one-step warmup divide by zero
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _checked_warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self._lrs())

    def _lrs(self) -> list[Any]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]

    def get_lr(self) -> list[Any]:
        if self.last_batch_iteration < 0:
            logger.warning("Attempting to get learning rate from scheduler before it has started")
        return self._lrs()

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps:
    gamma = max(0, (T - i) / max(1, T - W)) after warmup."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_lr: FloatOrList = 0.0,
                 warmup_max_lr: FloatOrList = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_BatchSchedule):
    """lr = base_lr * ratio, ratio rising from warmup_min_ratio to 1 over warmup_num_steps (log or
    linear), then following a half cosine from 1 down to cos_min_ratio at total_num_steps and
    staying there. base_lr is each group's lr when the schedule was built."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1) -> None:
        _check_positive_int(warmup_num_steps, "warmup_num_steps")
        self.optimizer = get_torch_optimizer(optimizer)
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = last_batch_iteration
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _checked_warmup_type(warmup_type)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")
        # a tensor lr is filled in place later, so keep a copy of where it started
        self.org_lrs = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in self.optimizer.param_groups]
        if last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, [0.0 for _ in self.org_lrs])

    def get_lr_ratio(self) -> float:
        if self.last_batch_iteration < 0:
            logger.warning("Attempting to get learning rate from scheduler before it has started")
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            rise = _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + rise * (1.0 - self.warmup_min_ratio)
        done = self.last_batch_iteration - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        # clamped: past the end (or with no decay window at all) the ratio stays at the floor
        progress = min(1.0, done / span)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[Any]:
        if self.last_batch_iteration < 0:
            logger.warning("Attempting to get learning rate from scheduler before it has started")
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


SCHEDULES: dict[str, type] = {
    LR_RANGE_TEST: LRRangeTest, ONE_CYCLE: OneCycle, WARMUP_LR: WarmupLR, WARMUP_DECAY_LR: WarmupDecayLR,
    WARMUP_COSINE_LR: WarmupCosineLR,
}
