"""`deepspeed_c --autotuning tune|run`: run short experiments of the user's script through our own
launcher, one per point of the search space (space.py), read each one's metrics.json (written by
the engine, metrics.py), and write DeepSpeed's results layout:

    <exps_dir>/<name>.json                        the experiment's description
    <results_dir>/<name>/{ds_config.json, exp.json, cmd.txt, stdout.log, stderr.log, metrics.json}
    <results_dir>/summary.txt                     one row per experiment, the best marked
    <results_dir>/ds_config_optimal.json, cmd_optimal.txt

When a memory budget is known (autotuning/memory.py), a probe run (stage 0, smallest micro-batch)
first writes <results_dir>/profile_model_info/model_info.json, and points whose estimated bytes
exceed the budget are skipped without being launched (listed in summary.txt). An experiment that
crashes, runs out of memory or writes no metrics is recorded as infeasible and the search goes on.
With `run`, the job is then relaunched with the optimal config."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

from deepspeed_c.autotuning import memory, space
from deepspeed_c.autotuning.config import AutotuningConfig, parse_autotuning

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed")
_METRIC_KEY = {"throughput": "throughput", "latency": "latency", "flops": "FLOPS_per_gpu"}


def split_argv(raw: Sequence[str], user_script: str) -> tuple[list[str], list[str]]:
    """The launcher's own flags (less --autotuning) and the script's arguments."""
    i = list(raw).index(user_script)
    launcher, user = list(raw[:i]), list(raw[i + 1:])
    out, skip = [], False
    for k, a in enumerate(launcher):
        if skip:
            skip = False
            continue
        if a == "--autotuning":
            skip = True
            continue
        if a.startswith("--autotuning="):
            continue
        out.append(a)
    return out, user


def find_config_arg(user_args: list[str]) -> tuple[int, str]:
    """(index of the value, path) of the script's --deepspeed_config (or --deepspeed <file>.json)."""
    for k, a in enumerate(user_args):
        if a in CONFIG_FLAGS and k + 1 < len(user_args) and not user_args[k + 1].startswith("--"):
            return k + 1, user_args[k + 1]
    raise ValueError("deepspeed_c --autotuning: the script's arguments name no DeepSpeed config "
                     "(--deepspeed_config ds.json): the tuner needs one to start from")


def _script_args(user_args: list[str], cfg_index: int, cfg_path: str, ds: dict[str, Any],
                 mappings: Optional[dict[str, str]]) -> list[str]:
    args = list(user_args)
    args[cfg_index] = cfg_path
    for key, flag in (mappings or {}).items():
        k = args.index(flag)
        args[k + 1] = str(ds[key])
    return args


def check_arg_mappings(mappings: Optional[dict[str, str]], user_args: list[str]) -> None:
    for key, flag in (mappings or {}).items():
        if flag not in user_args or user_args.index(flag) + 1 >= len(user_args):
            raise ValueError(f"autotuning.arg_mappings: {key!r} maps to {flag!r}, which is not among the "
                             f"script's arguments {user_args}")


class Autotuner:

    def __init__(self, launcher_args: list[str], user_script: str, user_args: list[str], world: int) -> None:
        self.launcher_args, self.user_script, self.user_args, self.world = launcher_args, user_script, user_args, world
        self.cfg_index, cfg_path = find_config_arg(user_args)
        with open(cfg_path) as f:
            self.user_config: dict[str, Any] = json.load(f)
        self.cfg: AutotuningConfig = parse_autotuning(self.user_config.get("autotuning"))
        check_arg_mappings(self.cfg.arg_mappings, user_args)
        self.results_dir, self.exps_dir = os.path.abspath(self.cfg.results_dir), os.path.abspath(self.cfg.exps_dir)
        self.records: list[dict[str, Any]] = []
        self.best: Optional[dict[str, Any]] = None
        self.pruned: list[str] = []

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.cfg.metric == "latency" else a > b

    def _experiment_config(self, exp: dict[str, Any], result_dir: str) -> dict[str, Any]:
        ds = dict(exp["ds_config"])
        at = dict(ds.get("autotuning") or {})
        at.update({"enabled": True, "metric_path": os.path.join(result_dir, "metrics.json")})
        ds["autotuning"] = at
        return ds

    def run_experiment(self, exp: dict[str, Any], timeout: float, scored: bool = True) -> Optional[float]:
        result_dir = os.path.join(self.results_dir, exp["name"])
        os.makedirs(result_dir, exist_ok=True)
        ds = self._experiment_config(exp, result_dir)
        cfg_path = os.path.join(result_dir, "ds_config.json")
        with open(cfg_path, "w") as f:
            json.dump(ds, f)
        cmd = [sys.executable, "-m", "deepspeed_c.launcher.runner", *self.launcher_args, self.user_script,
               *_script_args(self.user_args, self.cfg_index, cfg_path, ds, self.cfg.arg_mappings)]
        desc = {"name": exp["name"], "ds_config": ds, "num_gpus": self.world, "result_dir": result_dir}
        for path in (os.path.join(self.exps_dir, exp["name"] + ".json"), os.path.join(result_dir, "exp.json")):
            with open(path, "w") as f:
                json.dump(desc, f)
        with open(os.path.join(result_dir, "cmd.txt"), "w") as f:
            f.write(" ".join(cmd))
        with open(os.path.join(result_dir, "stdout.log"), "wb") as out, \
                open(os.path.join(result_dir, "stderr.log"), "wb") as err:
            try:
                rc = subprocess.run(cmd, stdout=out, stderr=err, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = -1
        if not scored:
            return None
        metric_file = os.path.join(result_dir, "metrics.json")
        record: dict[str, Any] = {"name": exp["name"], "rc": rc, "result_dir": result_dir, "cmd": cmd}
        if rc != 0 or not os.path.exists(metric_file):
            record["error"] = f"exit status {rc}" if rc != 0 else "no metrics.json written"
            self.records.append(record)
            return None
        with open(metric_file) as f:
            value = float(json.load(f)[_METRIC_KEY[self.cfg.metric]])
        record["metric"] = value
        self.records.append(record)
        if self.best is None or self._better(value, self.best["metric"]):
            self.best = record
        return value

    def probe_model_info(self, grid: list[dict[str, Any]], timeout: float) -> Optional[dict[str, Any]]:
        """One short run that measures the parameter count and activation bytes per sample."""
        result_dir = os.path.join(self.results_dir, "profile_model_info")
        info_path = os.path.join(result_dir, "model_info.json")
        first = min(grid, key=lambda e: (e["ds_config"]["zero_optimization"]["stage"],
                                         e["ds_config"]["train_micro_batch_size_per_gpu"]))
        probe = {"name": "profile_model_info", "ds_config": dict(first["ds_config"])}
        at = dict(probe["ds_config"].get("autotuning") or {})
        at.update({"model_info": {"profile": True}, "model_info_path": info_path})
        probe["ds_config"]["autotuning"] = at
        self.run_experiment(probe, timeout, scored=False)
        if not os.path.exists(info_path):
            print(f"Autotuning: the model-info probe wrote no {info_path} (see its stderr.log): "
                  "no memory pruning", flush=True)
            return None
        with open(info_path) as f:
            return json.load(f)

    def tune(self, timeout: float = 600.0) -> Optional[dict[str, Any]]:
        if self.cfg.overwrite:
            shutil.rmtree(self.results_dir, ignore_errors=True)
            shutil.rmtree(self.exps_dir, ignore_errors=True)
        os.makedirs(self.results_dir, exist_ok=True)
        os.makedirs(self.exps_dir, exist_ok=True)
        start = time.time()
        grid = space.experiments(self.user_config, self.cfg, self.world)
        budget = memory.budget_bytes()
        info = self.probe_model_info(grid, timeout) if budget is not None else None
        feasible = []
        for exp in grid:
            if info is not None and memory.estimate_bytes(exp["ds_config"], info, self.world) > budget:
                self.pruned.append(exp["name"])  # cannot fit: never launched
            else:
                feasible.append(exp)
        since_best = 0
        for exp in space.order(feasible, self.cfg):
            before = self.best
            self.run_experiment(exp, timeout)
            since_best = 0 if self.best is not before else since_best + 1
            if since_best >= self.cfg.tuner_early_stopping:
                break
        self._write_results(len(grid), time.time() - start)
        return self.best

    def _write_results(self, grid_size: int, seconds: float) -> None:
        lines = [f"| {'experiment':<16} | {self.cfg.metric:>14} | status |", "|---|---|---|"]
        for r in self.records:
            val = f"{r['metric']:.6g}" if "metric" in r else "-"
            status = "best" if r is self.best else ("ok" if "metric" in r else "infeasible: " + r["error"])
            lines.append(f"| {r['name']:<16} | {val:>14} | {status} |")
        for name in self.pruned:
            lines.append(f"| {name:<16} | {'-':>14} | skipped: over the memory budget |")
        lines.append("")
        if self.pruned:
            lines.append(f"Skipped without launching (memory model): {len(self.pruned)}.")
        lines.append(f"Tuning completed in {seconds:.1f}s. Experiments run: {len(self.records)} of the "
                     f"{grid_size} a grid search over the same space runs.")
        if self.best is not None:
            lines.append(f"{self.best['name']} is the optimal setup after tuning. The exp result is at "
                         f"{self.best['result_dir']}.")
            with open(os.path.join(self.best["result_dir"], "ds_config.json")) as f:
                optimal = json.load(f)
            optimal.pop("autotuning", None)
            if isinstance(self.user_config.get("autotuning"), dict):
                optimal["autotuning"] = {**self.user_config["autotuning"], "enabled": False}
            with open(os.path.join(self.results_dir, "ds_config_optimal.json"), "w") as f:
                json.dump(optimal, f)
            opt_path = os.path.join(self.results_dir, "ds_config_optimal.json")
            cmd = [sys.executable, "-m", "deepspeed_c.launcher.runner", *self.launcher_args, self.user_script,
                   *_script_args(self.user_args, self.cfg_index, opt_path, optimal, self.cfg.arg_mappings)]
            with open(os.path.join(self.results_dir, "cmd_optimal.txt"), "w") as f:
                f.write(" ".join(cmd))
            self.best["optimal_cmd"] = cmd
        else:
            lines.append("No optimal setup is found. Please check that experiments were run successfully.")
        text = "\n".join(lines)
        print(text, flush=True)
        with open(os.path.join(self.results_dir, "summary.txt"), "w") as f:
            f.write(text + "\n")


def main(mode: str, raw_argv: Sequence[str], user_script: str, world: int) -> int:
    launcher_args, user_args = split_argv(raw_argv, user_script)
    tuner = Autotuner(launcher_args, user_script, user_args, world)
    best = tuner.tune()
    if mode == "run" and best is not None:
        print(f"Autotuning: relaunching with the optimal configuration: {' '.join(best['optimal_cmd'])}", flush=True)
        return subprocess.run(best["optimal_cmd"]).returncode
    return 0 if best is not None else 1
