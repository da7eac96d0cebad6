"""`deepspeed_c --autotuning run` on 2 CPU ranks over ZeRO stage (auto) x activation
checkpointing (auto, through the script's --ckpt flag) x micro-batch (auto, up to 2), with a memory
budget (DSC_AUTOTUNING_MEMORY_BUDGET_BYTES) of the stage-1 model states (12 bytes per parameter:
fp32 Adam over 2 ranks) plus 1.5 samples of activations without checkpointing. Two probe runs measure
the model: parameters, and the activation bytes per sample with and without checkpointing, which the
test counts itself (the tensors autograd saves in the script's Linear/GELU chain). From its own ZeRO
accounting the test derives what may be launched: nothing at stage 0 (16 bytes per parameter), at
stage 1 one sample without checkpointing but two with it, two elsewhere. The random tuner visits 3
points through our launcher, one of them crashing like an OOM. Checks: what the probes measured,
that exactly the 3 points ran, none outside the feasible set, the crash recorded as infeasible and
the search went on, DeepSpeed's results layout, the optimal config is the point with the best
throughput among the metrics.json files the experiments wrote, and `run` relaunched the script
with it (stage, micro-batch, gas and checkpointing flag). Bad autotuning input is refused with the
value named."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepspeed_c.autotuning import space
from deepspeed_c.autotuning.config import parse_autotuning
from deepspeed_c.autotuning.tuner import Tuner
from tests.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "distributed" / "autotuning_script.py"


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _config(tmp: Path, **autotuning) -> Path:
    cfg = {"train_micro_batch_size_per_gpu": "auto", "steps_per_print": 10**9, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": "auto"},
           "autotuning": {"enabled": True, "results_dir": str(tmp / "autotuning_results"),
                          "exps_dir": str(tmp / "autotuning_exps"), "start_profile_step": 1,
                          "end_profile_step": 3, "num_tuning_micro_batch_sizes": 2,
                          "max_train_micro_batch_size_per_gpu": 2, "tuner_early_stopping": 100,
                          "arg_mappings": {"train_micro_batch_size_per_gpu": "--mbs",
                                           "activation_checkpointing": "--ckpt"}, **autotuning}}
    path = tmp / "ds.json"
    path.write_text(json.dumps(cfg))
    return path


P = 3 * (32 * 32 + 32) + 33  # the script's 3 x Linear(32, 32) + Linear(32, 1)
ROW = 32 * 4  # one sample's 32 fp32 features
ACT = 7 * ROW  # saved per sample: the input, each Linear's output (GELU's input), each GELU's output
ACT_CKPT = 4 * ROW  # checkpointed blocks save only their inputs; the last Linear its input
STATES = {0: 16 * P, 1: 4 * P + 4 * P + 8 * P / 2, 2: 4 * P + 4 * P / 2 + 8 * P / 2, 3: 16 * P / 2}  # fp32 Adam, W=2
BUDGET = int(STATES[1] + 1.5 * ACT)


def _feasible() -> dict[str, tuple[int, int, int, bool]]:
    """name -> (stage, gas, mbs, ckpt) of every point the memory model lets launch: per combo, the
    largest micro-batch (<= 2) within the budget, then DeepSpeed's list below it (here: 1 and 2)."""
    out = {}
    for stage, ckpt in itertools.product(range(4), (False, True)):
        top = min(2, int((BUDGET - STATES[stage]) // (ACT_CKPT if ckpt else ACT)))
        for mbs in range(1, top + 1):
            gas = top // mbs
            out[f"z{stage}_{'ckpt' if ckpt else 'nockpt'}_gas{gas}_tmbspg{mbs}"] = (stage, gas, mbs, ckpt)
    return out


def _launch(tmp: Path, mode: str, cfg: Path, *extra: str, budget: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "deepspeed_c.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           "--autotuning", mode, str(SCRIPT), "--deepspeed_config", str(cfg), "--mbs", "1", "--ckpt", "auto",
           "--marker", str(tmp / "marker.json"), *extra]
    env = _env()
    if budget:
        env["DSC_AUTOTUNING_MEMORY_BUDGET_BYTES"] = str(budget)
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=420)


def test_autotuning_run_two_ranks(tmp_path):
    feasible = _feasible()
    assert len(feasible) == 11 and not any(n.startswith("z0_") for n in feasible)
    assert "z1_nockpt_gas1_tmbspg1" in feasible and "z1_ckpt_gas1_tmbspg2" in feasible
    cfg = _config(tmp_path, tuner_type="random", tuner_num_trials=3)
    # which 3 the seeded random tuner visits (the sweep in grid order, as the tuner receives it)
    at = parse_autotuning(json.loads(cfg.read_text())["autotuning"])
    user = json.loads(cfg.read_text())
    grid, _ = space.sweep(user, at, 2, ["--ckpt", "auto"], lambda c: int(
        (BUDGET - STATES[c.stage]) // (ACT_CKPT if c.ckpt else ACT)))
    assert sorted(e["name"] for e in grid) == sorted(feasible)
    order = Tuner(grid, "random", "throughput", 3, 100)
    order.tune(lambda e: 1.0)
    names = [e["name"] for e, _ in order.history]
    crash = names[1]  # a visited point dies like an out-of-memory run
    stage, mbs = feasible[crash][0], feasible[crash][2]
    done = _launch(tmp_path, "run", cfg, "--crash_stage", str(stage), "--crash_mbs", str(mbs), budget=BUDGET)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results, exps = tmp_path / "autotuning_results", tmp_path / "autotuning_exps"
    info = json.loads((results / "profile_model_info" / "model_info.json").read_text())
    assert (info["num_params"], info["activation_mem_per_sample"], info["activation_mem_per_sample_ckpt"]) == \
        (P, ACT, ACT_CKPT)
    launched = sorted(p.stem for p in exps.glob("*.json"))
    assert launched == sorted(names + ["profile_model_info", "profile_model_info_ckpt"])
    assert set(names) <= set(feasible)  # nothing outside what fits was launched
    measured = {}
    for name in names:
        d = results / name
        for f in ("ds_config.json", "exp.json", "cmd.txt", "stdout.log", "stderr.log"):
            assert (d / f).exists(), (name, f)
        assert ("--ckpt true" if feasible[name][3] else "--ckpt false") in (d / "cmd.txt").read_text()
        if feasible[crash][:3:2] == feasible[name][:3:2]:  # the crash point (either checkpointing value)
            assert not (d / "metrics.json").exists()
            assert "MemoryError" in (d / "stderr.log").read_text() + (d / "stdout.log").read_text()
            continue
        measured[name] = json.loads((d / "metrics.json").read_text())["throughput"]
    best = max(measured, key=measured.get)
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    stage, gas, mbs, ckpt = feasible[best]
    assert (optimal["zero_optimization"]["stage"], optimal["gradient_accumulation_steps"],
            optimal["train_micro_batch_size_per_gpu"]) == (stage, gas, mbs)
    assert "ds_config_optimal.json" in (results / "cmd_optimal.txt").read_text()
    summary = (results / "summary.txt").read_text()
    assert f"{best} is the optimal setup" in summary and "infeasible" in summary
    assert "Experiments run: 3 of the 11" in summary
    assert "Skipped without launching (memory model): 2 combos." in summary
    assert "z1_nockpt 1, z1_ckpt 2" in summary  # the largest micro-batch per combo
    marker = json.loads((tmp_path / "marker.json").read_text())  # written only by the relaunch
    assert (marker["stage"], marker["gas"], marker["mbs"], marker["ckpt"], marker["steps"]) == \
        (stage, gas, mbs, "true" if ckpt else "false", 6 // gas)


@pytest.mark.parametrize("autotuning,message", [
    ({"tuner_type": "bayes"}, "'bayes'"), ({"metric": "speed"}, "'speed'"),
    ({"arg_mappings": {"train_micro_batch_size_per_gpu": "--batch"}}, "'--batch'")])
def test_autotuning_bad_input(tmp_path, autotuning, message):
    """Refused before any experiment is launched (in-process: the launcher hands these to Autotuner)."""
    from deepspeed_c.autotuning.autotuner import Autotuner

    cfg = _config(tmp_path, **autotuning)
    with pytest.raises(ValueError, match=message):
        Autotuner([], str(SCRIPT), ["--deepspeed_config", str(cfg), "--mbs", "1"], 2)
    assert not (tmp_path / "autotuning_results").exists()


def test_autotuning_without_config(tmp_path):
    from deepspeed_c.autotuning.autotuner import Autotuner

    with pytest.raises(ValueError, match="--deepspeed_config"):
        Autotuner([], str(SCRIPT), ["--mbs", "1"], 2)


def test_space_with_offload_and_memory_model():
    """The search space and the memory model without launching anything: offload "auto" adds an
    offload point per stage >= 1 and micro-batch; per-rank bytes follow the ZeRO accounting
    (written out here for fp32 and bf16 Adam over P params, W ranks) plus activations."""
    from deepspeed_c.autotuning import memory

    user = {"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": True},
            "zero_optimization": {"stage": "auto", "offload_optimizer": "auto"}}
    cfg = parse_autotuning({"num_tuning_micro_batch_sizes": 2, "max_train_batch_size": 8})
    exps, _ = space.sweep(user, cfg, 4, [], lambda c: None)  # mbs capped at 8 / 4 = 2, gas = 2 / mbs
    names = [e["name"] for e in exps]
    assert names == [f"z{s}{o}_gas{2 // m}_tmbspg{m}" for s in (0, 1, 2, 3) for o in (("", "_offload") if s else ("",))
                     for m in (1, 2)]
    by = {e["name"].replace("_gas2_tmbspg1", "_mbs1").replace("_gas1_tmbspg2", "_mbs2"): e["ds_config"] for e in exps}
    assert by["z2_offload_mbs2"]["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert "offload_optimizer" not in by["z2_mbs2"]["zero_optimization"]
    P, W, act = 1000, 4, 10.0
    info = {"num_params": P, "activation_mem_per_sample": act}
    expect = {  # bf16: params 2P, grads 2P, optimizer 12P (fp32 master + 2 Adam states)
        "z0_mbs1": 16 * P + act, "z1_mbs2": 4 * P + 12 * P / W + 2 * act, "z1_offload_mbs1": 4 * P + act,
        "z2_mbs1": 2 * P + 14 * P / W + act, "z3_mbs2": 16 * P / W + 2 * act, "z3_offload_mbs1": 4 * P / W + act}
    for name, want in expect.items():
        assert memory.estimate_bytes(by[name], info, W) == pytest.approx(want)
    fp32 = dict(by["z1_mbs1"])
    fp32.pop("bf16")
    assert memory.estimate_bytes(fp32, info, W) == pytest.approx(8 * P + 8 * P / W + act)
