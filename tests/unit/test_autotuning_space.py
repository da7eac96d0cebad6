"""The autotuner without launching anything: the search space (DeepSpeed's micro-batch list, gas
and train batch from max_train_batch_size and mp_size, the fast=false sub-knob space, arg mappings),
the memory model with activation checkpointing (per-combo largest micro-batch against the ZeRO
accounting written out here), the tuners (trials, early stopping, the model-based tuner against an
exhaustive argmax), and the search's two phases with experiments scored by a stand-in for the
launch (a function of the config; the launching itself is tests/distributed/test_autotuning.py)."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepspeed_c.autotuning import memory, space
from deepspeed_c.autotuning.autotuner import Autotuner, _script_args
from deepspeed_c.autotuning.config import parse_autotuning
from deepspeed_c.autotuning.tuner import Tuner

ROOT = Path(__file__).resolve().parents[2]


def _ds_rule_list(lo: int, hi: int, n: int, per_gpu: int) -> list[int]:
    """DeepSpeed's documented micro-batch list, enumerated the slow way: every size from
    max(lo, hi // 2) below hi on the constant-stride lattice, kept when its gas differs from hi's."""
    start = max(lo, hi // 2)
    stride = max((hi - start) // n, 1)
    lattice = set(range(start, hi, stride))
    return [m for m in range(1, hi) if m in lattice and per_gpu // m != per_gpu // hi] + [hi]


def test_micro_batch_list_gas_and_batch_sizes():
    for lo, hi, n in itertools.product((1, 2, 3), (1, 2, 5, 16, 37, 100), (1, 2, 3, 4)):
        if lo <= hi:
            for per_gpu in (hi, 3 * hi, 64):
                assert space.tuning_mbs_list(lo, hi, n, per_gpu) == _ds_rule_list(lo, hi, n, per_gpu)
    user = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}
    for mtbs, mp, world in itertools.product((None, 96), (1, 2), (2, 4)):
        cfg = parse_autotuning({"num_tuning_micro_batch_sizes": 3, "max_train_batch_size": mtbs, "mp_size": mp})
        exps, _ = space.sweep(user, cfg, world, [], lambda c: 20)
        hi = min(20, mtbs * mp // world) if mtbs else 20
        per_gpu = mtbs * mp // world if mtbs else hi // mp
        assert [e["ds_config"]["train_micro_batch_size_per_gpu"] for e in exps] == \
            _ds_rule_list(1, hi, 3, per_gpu)
        for e in exps:
            ds = e["ds_config"]
            mbs, gas = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
            assert gas == max(per_gpu // mbs, 1) and ds["train_batch_size"] == mbs * gas * world // mp
            assert e["name"] == f"z2_gas{gas}_tmbspg{mbs}"
            if mtbs:
                assert ds["train_batch_size"] <= mtbs
    # no memory model: powers of two; a list in the config is the sweep; an int fixes it
    cfg = parse_autotuning({"num_tuning_micro_batch_sizes": 3, "max_train_micro_batch_size_per_gpu": 6})
    assert space.sweep_sizes(user, cfg, 2, [], None)[0] == [1, 2, 4]
    assert space.sweep_sizes({**user, "train_micro_batch_size_per_gpu": [3, 1]}, cfg, 2, [], None)[0] == [1, 3]
    assert space.sweep_sizes({**user, "train_micro_batch_size_per_gpu": 5}, cfg, 2, [], 4)[0] == []


def test_memory_model_with_checkpointing_and_offload():
    """Per combo, the largest micro-batch the model lets fit is the largest m with
    states + m x activation bytes (with or without checkpointing) within the budget."""
    user = {"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": True},
            "zero_optimization": {"stage": "auto", "offload_optimizer": "auto"},
            "autotuning": {"arg_mappings": {"activation_checkpointing": "--ckpt"}}}
    args = ["--ckpt", "auto"]
    cfg = parse_autotuning({**user["autotuning"], "num_tuning_micro_batch_sizes": 2, "mp_size": 2})
    P, world, act, act_ck = 10_000, 8, 700.0, 90.0
    dp = world // 2
    info = {"num_params": P, "activation_mem_per_sample": act, "activation_mem_per_sample_ckpt": act_ck}
    states = {0: 16 * P, 1: 4 * P + 12 * P / dp, 2: 2 * P + 14 * P / dp, 3: 16 * P / dp}
    off_states = {1: 4 * P, 2: 2 * P + 2 * P / dp, 3: 4 * P / dp}  # bf16: params 2P, grads 2P, fp32 Adam 12P
    budget = 16 * P + 300
    combos = space.combos(user, cfg, args)
    assert [c.prefix for c in combos] == ["z0_nockpt", "z0_ckpt"] + [
        f"z{s}{o}{k}" for s in (1, 2, 3) for o in ("", "_offload") for k in ("_nockpt", "_ckpt")]
    for c in combos:
        ds = space.make_experiment(user, cfg, world, c, 1, 1)["ds_config"]
        want_states = off_states[c.stage] if c.offload else states[c.stage]
        per = act_ck if c.ckpt else act
        want = max(int((budget - want_states) // per), 0)
        got = memory.largest_micro_batch(ds, info, world, budget, mp_size=2, ckpt=c.ckpt)
        assert got == want, c
        for m in (got, got + 1):
            if m:
                ds["train_micro_batch_size_per_gpu"] = m
                assert (memory.estimate_bytes(ds, info, world, 2, c.ckpt) <= budget) == (m == got)
    exps, unfit = space.sweep(user, cfg, world, args, lambda c: memory.largest_micro_batch(
        space.make_experiment(user, cfg, world, c, 1, 1)["ds_config"], info, world, budget, 2, c.ckpt))
    assert unfit == ["z0_nockpt"]  # 16P + 700 > budget; with checkpointing 16P + 90 fits one sample
    for e in exps:  # every generated point fits; checkpointing points reach larger micro-batches
        assert memory.estimate_bytes(e["ds_config"], info, world, 2, e[space.CKPT_KEY]) <= budget
    top = {}
    for e in exps:
        top[e["combo"]] = max(top.get(e["combo"], 0), e["ds_config"]["train_micro_batch_size_per_gpu"])
    for c in top:
        if c.ckpt and space.Combo(c.stage, c.offload, False) in top:
            assert top[c] > top[space.Combo(c.stage, c.offload, False)]


def test_knob_space_fast_false_and_arg_mappings():
    user = {"zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": [1e6, 2e6]}}
    points = space.knob_points(user, 3)
    # DeepSpeed's stage-3 axes: reduce_scatter 2, allgather_partitions 2, allgather_bucket 3,
    # contiguous_gradients 2; overlap_comm fixed by the user; reduce_bucket from the user's list
    assert len(points) == 2 * 2 * 3 * 2 * 2 and {p["overlap_comm"] for p in points} == {True}
    assert {p["reduce_bucket_size"] for p in points} == {1e6, 2e6}
    assert len(space.knob_points({}, 2)) == 2 * 2 * 3 * 3 * 2 and len(space.knob_points({}, 1)) == 9
    cfg = parse_autotuning({})
    exps = space.knob_experiments(user, cfg, 4, space.Combo(3), ([2, 4], 8))
    assert len(exps) == 2 * len(points) and len({e["name"] for e in exps}) == len(exps)
    z = exps[0]["ds_config"]["zero_optimization"]
    assert z["stage3_prefetch_bucket_size"] == 5e8 and z["stage3_max_live_parameters"] == 1e9  # the template
    # arg mappings: the experiment's value replaces the flag's, booleans as true/false, absent flags appended
    exp = {"ds_config": {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
           "activation_checkpointing": True}
    got = _script_args(["--deepspeed_config", "a.json", "--mbs", "1", "--ckpt", "auto"], 1, "b.json", exp,
                       {"train_micro_batch_size_per_gpu": "--mbs", "activation_checkpointing": "--ckpt",
                        "gradient_accumulation_steps": "--gas"})
    assert got == ["--deepspeed_config", "b.json", "--mbs", "4", "--ckpt", "true", "--gas", "2"]
    assert space.user_gas({"gradient_accumulation_steps": "auto"}, parse_autotuning(
        {"arg_mappings": {"gradient_accumulation_steps": "--gas"}}), ["--gas", "3"]) == 3


def _landscape(exp: dict) -> float | None:
    """A throughput surface over stage x micro-batch x reduce bucket: a smooth hill, one crash."""
    ds = exp["ds_config"]
    m, s = ds["train_micro_batch_size_per_gpu"], ds["zero_optimization"]["stage"]
    b = ds["zero_optimization"].get("reduce_bucket_size", 5e8)
    if (s, m) == (3, 1):
        return None
    return 100.0 - (m - 6) ** 2 - 4 * (s - 2) ** 2 - 3 * (b / 5e8 - 1) ** 2


def _exps() -> list[dict]:
    cfg = parse_autotuning({})
    out = []
    for s in (1, 2, 3):
        zero = {"stage": s, "allgather_bucket_size": 5e8, "overlap_comm": False, "reduce_scatter": True,
                "contiguous_gradients": True, "allgather_partitions": True, "reduce_bucket_size": [2.5e8, 5e8, 1e9]}
        out += space.knob_experiments({"zero_optimization": zero},
                                      cfg, 2, space.Combo(s), (list(range(1, 11)), 10))
    return out


@pytest.mark.parametrize("kind", ["gridsearch", "random", "model_based"])
def test_tuners_trials_early_stopping_and_model_based(kind):
    exps = _exps()
    assert len(exps) == 90
    best_value = max(v for v in map(_landscape, exps) if v is not None)
    runs: list[str] = []

    def run(e):
        runs.append(e["name"])
        return _landscape(e)

    t = Tuner(exps, kind, "throughput", num_trials=7, early_stopping=None)
    assert t.tune(run) == 7 and len(runs) == 7 == len(set(runs))  # tuner_num_trials, no point twice
    runs.clear()
    t = Tuner(exps, kind, "throughput", num_trials=1000, early_stopping=4)
    n = t.tune(run)
    values = [v for _, v in t.history]
    best_at = max(range(n), key=lambda i: values[i] if values[i] is not None else -1e9)
    assert n == best_at + 4 < 90  # stopped after 4 runs counting the best (DeepSpeed's rule)
    if kind == "model_based":  # the cost model finds the exhaustive best in a fraction of the space
        t = Tuner(exps, kind, "throughput", num_trials=25, early_stopping=None)
        t.tune(_landscape)
        assert max(v for _, v in t.history if v is not None) == best_value
        lat = Tuner(exps, kind, "latency", num_trials=25, early_stopping=None)
        lat.tune(lambda e: None if _landscape(e) is None else 1.0 / _landscape(e))
        assert min(v for _, v in lat.history if v is not None) == 1.0 / best_value


class _Offline(Autotuner):
    """The search with each experiment scored by the landscape instead of a launch."""

    def run_experiment(self, exp, timeout, scored=True):
        value = _landscape(exp)
        rec = {"name": exp["name"], "exp": exp, "result_dir": "", "cmd": []}
        if value is None:
            rec["error"] = "crash"
        else:
            rec["metric"] = value
            if self.best is None or value > self.best["metric"]:
                self.best = rec
        self.records.append(rec)
        return value

    def _write_results(self, grid_size, seconds):
        self.grid_size = grid_size


@pytest.mark.parametrize("fast", [True, False])
def test_search_phases_fast_and_full(tmp_path, fast):
    cfg = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": "auto"},
           "autotuning": {"fast": fast, "results_dir": str(tmp_path / "r"), "exps_dir": str(tmp_path / "e"),
                          "num_tuning_micro_batch_sizes": 4, "max_train_micro_batch_size_per_gpu": 8,
                          "tuner_type": "model_based", "tuner_num_trials": 6, "tuner_early_stopping": 3}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    t = _Offline([], "train.py", ["--deepspeed_config", str(path)], 2)
    os.environ.pop(memory.BUDGET_ENV, None)
    t.tune()
    sweep = [r for r in t.records if "_rbs" not in r["name"]]
    knob = [r for r in t.records if "_rbs" in r["name"]]
    grid = {f"z{s}_gas{8 // m}_tmbspg{m}" for s in range(4) for m in (1, 2, 4, 8)}  # no memory model: 2^k
    assert {r["name"] for r in sweep} <= grid and len(sweep) <= 6
    assert len({r["name"] for r in t.records}) == len(t.records)
    if fast:
        assert not knob and t.grid_size == 16
        return
    # full: the sub-knob space of each stage whose sweep beat the stages below (here with a larger
    # micro-batch and a metric no worse), searched by the tuner with its trials and early stopping
    assert knob and {r["exp"]["combo"].stage for r in knob} <= {1, 2, 3}
    per_stage = {}
    for r in knob:
        per_stage.setdefault(r["exp"]["combo"].stage, []).append(r)
    for rs in per_stage.values():
        assert len(rs) <= 6
    assert t.grid_size == 16 + 4 * (9 + 72 + 144)  # the sweep + each stage's knob points x its 4 sizes


@pytest.mark.skipif(not os.environ.get("DSC_DEEPSPEED_REAL"), reason="set DSC_DEEPSPEED_REAL=1 to compare the "
                    "micro-batch lists with the real DeepSpeed's (at /tmp/ds_real)")
def test_micro_batch_lists_equal_real_deepspeed():
    script = ("import itertools, json, types\nfrom deepspeed.autotuning.autotuner import Autotuner\nout = []\n"
              "for lo, hi, n, mtbs, mp, world, gas in itertools.product((1, 2, 3), (2, 5, 16, 37, 100), (1, 2, 3), "
              "(None, 64), (1, 2), (1, 4), (1, 3)):\n"
              "    s = types.SimpleNamespace(max_train_batch_size=lambda: mtbs, mp_size=lambda: mp, exp_num_gpus=world,"
              " exp_num_nodes=1, get_gas_from_user_config=lambda: gas)\n"
              "    out.append([lo, hi, n, mtbs, mp, world, gas,\n"
              "                *Autotuner.get_tuning_micro_batch_size_list(s, lo, hi, n)])\n"
              "print(json.dumps(out))\n")
    env = dict(os.environ, PYTHONPATH="/tmp/ds_real:/tmp/ds_deps", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for lo, hi, n, mtbs, mp, world, gas, ls, per in json.loads(proc.stdout.strip().splitlines()[-1]):
        cfg = parse_autotuning({"max_train_batch_size": mtbs, "mp_size": mp})
        assert space.batch_per_gpu(cfg, world, hi, gas) == per
        if lo <= hi:  # (the sweep never asks for lo > hi: no micro-batch fits)
            assert space.tuning_mbs_list(lo, hi, n, per) == ls
