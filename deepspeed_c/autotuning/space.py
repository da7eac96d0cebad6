"""The search space, as DeepSpeed's autotuner shapes it, plus two axes of our own.

Per ZeRO stage (the user's `zero_optimization.stage`: "auto"/absent/"all" = 0..3, a list, or one
stage), the *micro-batch sweep*: `num_tuning_micro_batch_sizes` micro-batch sizes between half the
largest that fits and the largest that fits (DeepSpeed's list: constant stride, sizes whose
gradient-accumulation count equals the largest's dropped), each with
gas = max_train_batch_size_per_gpu // mbs, where max_train_batch_size_per_gpu is
max_train_batch_size x mp_size / world when `max_train_batch_size` is set, else the largest
micro-batch x the user's gas / mp_size; train_batch_size = mbs x gas x world / mp_size. The largest
micro-batch that fits comes from the memory model (memory.py): DeepSpeed finds it by launching runs
until one fails; we compute it, capped by max_train_micro_batch_size_per_gpu (and max_train_batch_size
x mp_size / world). Without a memory budget (a CPU run with no DSC_AUTOTUNING_MEMORY_BUDGET_BYTES)
the sizes are powers of two from min_train_micro_batch_size_per_gpu under the same caps. A list in
train_micro_batch_size_per_gpu is the sweep, an int fixes it.

Beyond DeepSpeed, each stage's sweep also crosses (a "combo"): optimizer offload to CPU on/off
(stages 1-3, when zero_optimization.offload_optimizer is "auto") and activation checkpointing on/off
(when autotuning.arg_mappings maps "activation_checkpointing" to a script flag whose value on the
command line is "auto"; the script gets "true"/"false" there). Each combo has its own largest
micro-batch: checkpointing and offload free memory for larger ones.

With `fast: false` a stage also gets DeepSpeed's sub-knob space (reduce/allgather bucket sizes,
overlap_comm, reduce_scatter, contiguous_gradients, allgather_partitions; the rest of the stage's
template, e.g. stage-3 prefetch and max-live sizes, fixed), crossed with the stage's swept
micro-batch sizes. The user's own zero_optimization value for a knob fixes it; a list makes it the
axis."""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Optional

from deepspeed_c.autotuning.config import AutotuningConfig

STAGES = (0, 1, 2, 3)
CKPT_KEY = "activation_checkpointing"  # the arg_mappings key of the checkpointing axis

_BUCKETS = [5e7, 5e8, 1e9]
# DeepSpeed's default sub-knob spaces per stage (values to try), and each stage's fixed template.
KNOB_SPACE: dict[int, dict[str, list[Any]]] = {
    1: {"reduce_bucket_size": _BUCKETS, "allgather_bucket_size": _BUCKETS},
    2: {"overlap_comm": [True, False], "reduce_scatter": [False, True], "reduce_bucket_size": _BUCKETS,
        "allgather_bucket_size": _BUCKETS, "contiguous_gradients": [False, True]},
    3: {"overlap_comm": [True, False], "reduce_scatter": [False, True], "reduce_bucket_size": _BUCKETS,
        "allgather_partitions": [True, False], "allgather_bucket_size": _BUCKETS,
        "contiguous_gradients": [False, True]},
}
TEMPLATE: dict[int, dict[str, Any]] = {
    1: {"reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
    2: {"allgather_partitions": True, "allgather_bucket_size": 5e8, "overlap_comm": False, "reduce_scatter": True,
        "reduce_bucket_size": 5e8, "contiguous_gradients": False},
    3: {"allgather_partitions": True, "allgather_bucket_size": 5e8, "overlap_comm": False, "reduce_scatter": True,
        "reduce_bucket_size": 5e8, "contiguous_gradients": False, "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 5e8,
        "stage3_param_persistence_threshold": 1e6, "stage3_gather_16bit_weights_on_model_save": False,
        "sub_group_size": 1e12},
}


def _is_auto(value: Any) -> bool:
    return value is None or value == "auto"


@dataclass(frozen=True)
class Combo:
    """A point of the space less its micro-batch size (and sub-knobs)."""
    stage: int
    offload: bool = False
    ckpt: Optional[bool] = None  # None: not tuned, the script's own flag stands

    @property
    def prefix(self) -> str:
        ck = "" if self.ckpt is None else ("_ckpt" if self.ckpt else "_nockpt")
        return f"z{self.stage}{'_offload' if self.offload else ''}{ck}"


def user_stages(user: dict[str, Any]) -> list[int]:
    raw = (user.get("zero_optimization") or {}).get("stage")
    if _is_auto(raw) or raw == "all":
        return list(STAGES)
    stages = raw if isinstance(raw, list) else [raw]
    if any(s not in STAGES for s in stages):
        raise ValueError(f"autotuning: zero_optimization.stage {raw!r}: expected 0-3, a list of them, 'all' or 'auto'")
    return sorted(int(s) for s in stages)


def user_value(user_args: list[str], flag: str) -> Optional[str]:
    return user_args[user_args.index(flag) + 1] if flag in user_args and user_args.index(flag) + 1 < len(user_args) \
        else None


def ckpt_choices(cfg: AutotuningConfig, user_args: list[str]) -> list[Optional[bool]]:
    flag = (cfg.arg_mappings or {}).get(CKPT_KEY)
    return [False, True] if flag is not None and user_value(user_args, flag) == "auto" else [None]


def combos(user: dict[str, Any], cfg: AutotuningConfig, user_args: list[str]) -> list[Combo]:
    tune_offload = (user.get("zero_optimization") or {}).get("offload_optimizer") == "auto"
    return [Combo(s, off, ck) for s in user_stages(user) for off in ((False, True) if tune_offload and s > 0
                                                                      else (False,))
            for ck in ckpt_choices(cfg, user_args)]


def user_gas(user: dict[str, Any], cfg: AutotuningConfig, user_args: list[str]) -> int:
    """The user's gradient_accumulation_steps; "auto" reads it from the script's mapped argument."""
    raw = user.get("gradient_accumulation_steps")
    if isinstance(raw, int) and raw > 0:
        return raw
    flag = (cfg.arg_mappings or {}).get("gradient_accumulation_steps")
    val = user_value(user_args, flag) if flag else None
    return int(val) if val is not None and val.isnumeric() and int(val) > 0 else 1


def mbs_cap(cfg: AutotuningConfig, world: int) -> int:
    cap = cfg.max_train_micro_batch_size_per_gpu
    if cfg.max_train_batch_size:
        cap = min(cap, cfg.max_train_batch_size * cfg.mp_size // world)
    return cap


def batch_per_gpu(cfg: AutotuningConfig, world: int, max_mbs: int, gas: int) -> int:
    """DeepSpeed's max_train_batch_size_per_gpu, from which each point's gas follows."""
    if cfg.max_train_batch_size:
        return cfg.max_train_batch_size * cfg.mp_size // world
    return max_mbs * gas // cfg.mp_size


def tuning_mbs_list(lo: int, hi: int, n: int, per_gpu: int) -> list[int]:
    """n sizes with a constant stride from max(lo, hi // 2) to hi, less those whose gas equals hi's."""
    lo = max(lo, hi // 2)
    stride = max((hi - lo) // max(n, 1), 1)
    top_gas = per_gpu // hi
    return [m for m in range(lo, hi, stride) if per_gpu // m != top_gas] + [hi]


def _powers_of_two(cfg: AutotuningConfig, cap: int) -> list[int]:
    out, mbs = [], max(cfg.min_train_micro_batch_size_per_gpu, 1)
    while mbs <= cap and len(out) < cfg.num_tuning_micro_batch_sizes:
        out.append(mbs)
        mbs *= 2
    return out


def sweep_sizes(user: dict[str, Any], cfg: AutotuningConfig, world: int, user_args: list[str],
                largest_fit: Optional[int]) -> tuple[list[int], int]:
    """(micro-batch sizes, max_train_batch_size_per_gpu) of one combo; largest_fit is the memory
    model's largest micro-batch that fits (None: no memory model). Empty when none fits."""
    gas = user_gas(user, cfg, user_args)
    raw = user.get("train_micro_batch_size_per_gpu")
    if isinstance(raw, list) or (not _is_auto(raw)):
        sizes = sorted(int(s) for s in (raw if isinstance(raw, list) else [raw]) if isinstance(s, int))
        if largest_fit is not None:
            sizes = [s for s in sizes if s <= largest_fit]
        return sizes, (max(sizes) * gas if sizes else 0)
    cap = mbs_cap(cfg, world)
    if largest_fit is None:
        sizes = _powers_of_two(cfg, cap)
        return sizes, batch_per_gpu(cfg, world, max(sizes), gas) if sizes else 0
    hi = min(cap, largest_fit)
    if hi < max(cfg.min_train_micro_batch_size_per_gpu, 1):
        return [], 0
    per_gpu = batch_per_gpu(cfg, world, hi, gas)
    return tuning_mbs_list(cfg.min_train_micro_batch_size_per_gpu, hi, cfg.num_tuning_micro_batch_sizes,
                           per_gpu), per_gpu


def _num(v: Any) -> str:
    if isinstance(v, bool):
        return "T" if v else "F"
    if isinstance(v, float) and v.is_integer() and abs(v) >= 1e4:
        return f"{v:.0e}".replace("+0", "").replace("+", "")
    return str(v)


def _abbrev(key: str) -> str:
    return "".join(w[0] for w in key.split("_"))


def make_experiment(user: dict[str, Any], cfg: AutotuningConfig, world: int, combo: Combo, mbs: int, per_gpu: int,
                    knobs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    zero = {k: v for k, v in dict(user.get("zero_optimization") or {}).items()
            if v != "auto" and not isinstance(v, list)}
    if knobs is not None:  # the sub-knob space: the stage's template, then the user's values, then the point
        zero = {**TEMPLATE.get(combo.stage, {}), **zero, **knobs}
    zero["stage"] = combo.stage
    if combo.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    ds = copy.deepcopy(user)
    gas = max(per_gpu // mbs, 1)
    ds.update({"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": gas,
               "train_batch_size": mbs * gas * world // cfg.mp_size, "zero_optimization": zero})
    knob_name = "".join(f"_{_abbrev(k)}{_num(v)}" for k, v in sorted((knobs or {}).items()))
    exp = {"name": f"{combo.prefix}{knob_name}_gas{gas}_tmbspg{mbs}", "ds_config": ds, "combo": combo}
    if combo.ckpt is not None:
        exp[CKPT_KEY] = combo.ckpt
    return exp


def knob_points(user: dict[str, Any], stage: int) -> list[dict[str, Any]]:
    """The stage's sub-knob assignments (fast=false): DeepSpeed's default values per knob, the
    user's scalar fixing a knob and a user list replacing its values."""
    zero = user.get("zero_optimization") or {}
    axes = {k: (zero[k] if isinstance(zero.get(k), list) else ([zero[k]] if k in zero and zero[k] != "auto" else vals))
            for k, vals in KNOB_SPACE.get(stage, {}).items()}
    keys = sorted(axes)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(axes[k] for k in keys))]


def sweep(user: dict[str, Any], cfg: AutotuningConfig, world: int, user_args: list[str],
          largest_fit: Callable[[Combo], Optional[int]]) -> tuple[list[dict[str, Any]], list[str]]:
    """(the micro-batch sweep's experiments of every combo, the combos where no size fits)."""
    exps, unfit = [], []
    for combo in combos(user, cfg, user_args):
        sizes, per_gpu = sweep_sizes(user, cfg, world, user_args, largest_fit(combo))
        if not sizes:
            unfit.append(combo.prefix)
        exps.extend(make_experiment(user, cfg, world, combo, m, per_gpu) for m in sizes)
    return exps, unfit


def knob_experiments(user: dict[str, Any], cfg: AutotuningConfig, world: int, combo: Combo,
                     sizes_and_batch: tuple[list[int], int]) -> list[dict[str, Any]]:
    sizes, per_gpu = sizes_and_batch
    return [make_experiment(user, cfg, world, combo, m, per_gpu, knobs)
            for knobs in knob_points(user, combo.stage) for m in sizes]
