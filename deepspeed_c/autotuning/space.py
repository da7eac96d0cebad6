"""The search space: ZeRO stage x micro-batch size per GPU, each axis tuned only where the user's
config leaves it to the tuner ("auto" or absent) and fixed to the user's value otherwise; and,
beyond DeepSpeed's tuner, optimizer offload to CPU on and off (stages 1-3) when the user writes
`"offload_optimizer": "auto"` in zero_optimization (otherwise the user's value is kept)."""
from __future__ import annotations

import copy
import random
from typing import Any, Optional

from deepspeed_c.autotuning.config import AutotuningConfig

STAGES = (0, 1, 2, 3)


def _is_auto(value: Any) -> bool:
    return value is None or value == "auto"


def micro_batch_candidates(cfg: AutotuningConfig, world: int, gas: int) -> list[int]:
    """num_tuning_micro_batch_sizes powers of two from min_train_micro_batch_size_per_gpu, capped by
    max_train_micro_batch_size_per_gpu and by max_train_batch_size / (world x gas)."""
    cap = cfg.max_train_micro_batch_size_per_gpu
    if cfg.max_train_batch_size is not None:
        cap = min(cap, cfg.max_train_batch_size // max(world * gas, 1))
    out, mbs = [], max(cfg.min_train_micro_batch_size_per_gpu, 1)
    while mbs <= cap and len(out) < cfg.num_tuning_micro_batch_sizes:
        out.append(mbs)
        mbs *= 2
    if not out:
        raise ValueError(f"autotuning: no micro-batch size fits: min_train_micro_batch_size_per_gpu="
                         f"{cfg.min_train_micro_batch_size_per_gpu}, max_train_micro_batch_size_per_gpu="
                         f"{cfg.max_train_micro_batch_size_per_gpu}, max_train_batch_size={cfg.max_train_batch_size}")
    return out


def experiments(user: dict[str, Any], cfg: AutotuningConfig, world: int) -> list[dict[str, Any]]:
    """One {"name", "ds_config"} per point of the space, in grid order."""
    zero = user.get("zero_optimization") or {}
    stages = list(STAGES) if _is_auto(zero.get("stage")) else [int(zero["stage"])]
    gas_raw = user.get("gradient_accumulation_steps")
    gas = 1 if _is_auto(gas_raw) else int(gas_raw)
    mbs_raw = user.get("train_micro_batch_size_per_gpu")
    mbss = micro_batch_candidates(cfg, world, gas) if _is_auto(mbs_raw) else [int(mbs_raw)]
    tune_offload = zero.get("offload_optimizer") == "auto"
    out = []
    for stage in stages:
        for offload in ((False, True) if tune_offload and stage > 0 else (False,)):
            for mbs in mbss:
                ds = copy.deepcopy(user)
                ds.pop("train_batch_size", None)  # derived: micro x gas x world
                ds["train_micro_batch_size_per_gpu"] = mbs
                ds["gradient_accumulation_steps"] = gas
                ds["zero_optimization"] = {k: v for k, v in dict(zero).items() if v != "auto"}
                ds["zero_optimization"]["stage"] = stage
                if offload:
                    ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
                out.append({"name": f"z{stage}{'_offload' if offload else ''}_mbs{mbs}", "ds_config": ds})
    return out


def order(exps: list[dict[str, Any]], cfg: AutotuningConfig, seed: Optional[int] = 0) -> list[dict[str, Any]]:
    """The tuner's visiting order: grid order, or a random permutation cut to tuner_num_trials."""
    if cfg.tuner_type == "gridsearch":
        return list(exps)
    if cfg.tuner_type == "random":
        picked = list(exps)
        random.Random(seed).shuffle(picked)
        return picked[:cfg.tuner_num_trials]
    raise NotImplementedError("autotuning.tuner_type 'model_based': the cost-model tuner is not built in "
                              "deepspeed_c yet (use 'gridsearch' or 'random')")
