"""`deepspeed_c --autotuning run` on 2 CPU ranks: ZeRO stage (auto) x micro-batch (auto, 2 sizes),
8 points, with a memory budget (DSC_AUTOTUNING_MEMORY_BUDGET_BYTES) of 14 bytes per parameter so
that the stage-0 points (16 bytes per parameter of fp32 Adam states) cannot fit: a probe run
measures the model, the 2 stage-0 points are never launched, and the random tuner visits 3 of the
6 others (to keep CI short) through our launcher, one of them crashing like an OOM. Checks: the
probe's parameter count, 3 experiments ran (the crash recorded as infeasible, the search went
on), DeepSpeed's results layout is
written, the optimal config is the point with the best throughput among the metrics.json files
the experiments wrote, and `run` relaunched the script with it. Bad autotuning input is refused
with the value named."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepspeed_c.autotuning import space
from deepspeed_c.autotuning.config import parse_autotuning
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
                          "end_profile_step": 3, "num_tuning_micro_batch_sizes": 2, "tuner_early_stopping": 100,
                          "arg_mappings": {"train_micro_batch_size_per_gpu": "--mbs"}, **autotuning}}
    path = tmp / "ds.json"
    path.write_text(json.dumps(cfg))
    return path


SCRIPT_PARAMS = 3 * (32 * 32 + 32) + 33  # the script's 3 x Linear(32, 32) + Linear(32, 1)


def _launch(tmp: Path, mode: str, cfg: Path, *extra: str, budget: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "deepspeed_c.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           "--autotuning", mode, str(SCRIPT), "--deepspeed_config", str(cfg), "--mbs", "1",
           "--marker", str(tmp / "marker.json"), *extra]
    env = _env()
    if budget:
        env["DSC_AUTOTUNING_MEMORY_BUDGET_BYTES"] = str(budget)
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=420)


def test_autotuning_run_two_ranks(tmp_path):
    grid = [f"z{s}_mbs{m}" for s in range(4) for m in (1, 2)]
    cfg = _config(tmp_path, tuner_type="random", tuner_num_trials=3)
    pruned = [n for n in grid if n.startswith("z0_")]  # 16 bytes/param of model states > 14
    names = [e["name"] for e in space.order([{"name": n} for n in grid if n not in pruned], parse_autotuning(
        json.loads(cfg.read_text())["autotuning"]))]
    assert len(names) == 3
    crash = names[1]  # a visited point dies like an out-of-memory run
    stage, mbs = crash[1], crash.split("mbs")[1]
    done = _launch(tmp_path, "run", cfg, "--crash_stage", stage, "--crash_mbs", mbs, budget=14 * SCRIPT_PARAMS)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results, exps = tmp_path / "autotuning_results", tmp_path / "autotuning_exps"
    info = json.loads((results / "profile_model_info" / "model_info.json").read_text())
    assert info["num_params"] == SCRIPT_PARAMS and 0 < info["activation_mem_per_sample"] < 2 * SCRIPT_PARAMS
    assert sorted(p.stem for p in exps.glob("*.json")) == sorted(names + ["profile_model_info"])
    for name in pruned:  # never launched
        assert not (results / name).exists()
    measured = {}
    for name in names:
        d = results / name
        for f in ("ds_config.json", "exp.json", "cmd.txt", "stdout.log", "stderr.log"):
            assert (d / f).exists(), (name, f)
        if name == crash:
            assert not (d / "metrics.json").exists()
            assert "MemoryError" in (d / "stderr.log").read_text() + (d / "stdout.log").read_text()
            continue
        measured[name] = json.loads((d / "metrics.json").read_text())["throughput"]
    best = max(measured, key=measured.get)
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert f"z{optimal['zero_optimization']['stage']}_mbs{optimal['train_micro_batch_size_per_gpu']}" == best
    assert "ds_config_optimal.json" in (results / "cmd_optimal.txt").read_text()
    summary = (results / "summary.txt").read_text()
    assert f"{best} is the optimal setup" in summary and "infeasible" in summary
    assert "Experiments run: 3 of the 8" in summary and "Skipped without launching (memory model): 2." in summary
    marker = json.loads((tmp_path / "marker.json").read_text())  # written only by the relaunch
    assert (f"z{marker['stage']}_mbs{marker['mbs']}", marker["steps"]) == (best, 6)


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


def test_autotuning_without_config_and_model_based(tmp_path):
    from deepspeed_c.autotuning.autotuner import Autotuner

    with pytest.raises(ValueError, match="--deepspeed_config"):
        Autotuner([], str(SCRIPT), ["--mbs", "1"], 2)
    tuner = Autotuner([], str(SCRIPT), ["--deepspeed_config", str(_config(tmp_path, tuner_type="model_based")),
                                        "--mbs", "1"], 2)
    with pytest.raises(NotImplementedError, match="model_based"):
        tuner.tune()


def test_space_with_offload_and_memory_model():
    """The search space and the memory model without launching anything: offload "auto" adds an
    offload point per stage >= 1 and micro-batch; per-rank bytes follow the ZeRO accounting
    (written out here for fp32 and bf16 Adam over P params, W ranks) plus activations."""
    from deepspeed_c.autotuning import memory

    user = {"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": True},
            "zero_optimization": {"stage": "auto", "offload_optimizer": "auto"}}
    cfg = parse_autotuning({"num_tuning_micro_batch_sizes": 2, "max_train_batch_size": 8})
    exps = space.experiments(user, cfg, world=4)  # mbs capped at 8 / 4 = 2
    names = [e["name"] for e in exps]
    assert names == ["z0_mbs1", "z0_mbs2"] + [f"z{s}{o}_mbs{m}" for s in (1, 2, 3) for o in ("", "_offload")
                                              for m in (1, 2)]
    by = {e["name"]: e["ds_config"] for e in exps}
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
