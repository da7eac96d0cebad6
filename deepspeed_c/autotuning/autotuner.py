"""`deepspeed_c --autotuning tune|run`: run short experiments of the user's script through our own
launcher, one per point of the search space (space.py), read each one's metrics.json (written by
the engine, metrics.py), and write DeepSpeed's results layout:

    <exps_dir>/<name>.json                        the experiment's description
    <results_dir>/<name>/{ds_config.json, exp.json, cmd.txt, stdout.log, stderr.log, metrics.json}
    <results_dir>/summary.txt                     one row per experiment, the best marked
    <results_dir>/ds_config_optimal.json, cmd_optimal.txt

The search (space.py for its shape, tuner.py for the tuners): when a memory budget is known
(memory.py), a probe run (lowest stage, smallest micro-batch) first writes
<results_dir>/profile_model_info/model_info.json (parameters, activation bytes per sample; a second
probe with activation checkpointing on when that axis is tuned), and each combo's micro-batch sizes
stop at the largest the memory model lets fit, so points that cannot fit are never launched (the
combos where nothing fits are listed in summary.txt). Then the micro-batch sweep of every stage,
and with `fast: false` the sub-knob space of each stage that beats the stages below it. An
experiment that crashes, runs out of memory or writes no metrics is recorded as infeasible and the
search goes on. With `run`, the job is then relaunched with the optimal config."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

from deepspeed_c.autotuning import memory, space
from deepspeed_c.autotuning.tuner import Tuner
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


def _lookup(exp: dict[str, Any], key: str) -> Any:
    """An arg mapping's value: the experiment's own key (e.g. activation_checkpointing), else the
    first match in its ds_config, searched depth first (DeepSpeed's lookup)."""
    if key in exp:
        return exp[key]

    def find(d: dict[str, Any]) -> Any:
        if key in d:
            return d[key]
        for v in d.values():
            if isinstance(v, dict):
                r = find(v)
                if r is not None:
                    return r
        return None

    return find(exp.get("ds_config") or {})


def _script_args(user_args: list[str], cfg_index: int, cfg_path: str, exp: dict[str, Any],
                 mappings: Optional[dict[str, str]]) -> list[str]:
    args = list(user_args)
    args[cfg_index] = cfg_path
    for key, flag in (mappings or {}).items():
        val = _lookup(exp, key)
        if val is None or val == "auto" or isinstance(val, (dict, list)):
            continue
        text = ("true" if val else "false") if isinstance(val, bool) else str(val)
        if flag in args:
            args[args.index(flag) + 1] = text
        else:
            args += [flag, text]
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
        self.pruned: list[str] = []  # combos where not even the smallest micro-batch fits
        self.largest: dict[str, int] = {}  # combo -> the largest micro-batch the memory model lets fit
        self.budget: Optional[int] = None
        self.model_info: Optional[dict[str, Any]] = None

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
               *_script_args(self.user_args, self.cfg_index, cfg_path, {**exp, "ds_config": ds}, self.cfg.arg_mappings)]
        desc = {"name": exp["name"], "ds_config": ds, "num_gpus": self.world, "result_dir": result_dir}
        if space.CKPT_KEY in exp:
            desc[space.CKPT_KEY] = exp[space.CKPT_KEY]
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
        record: dict[str, Any] = {"name": exp["name"], "rc": rc, "result_dir": result_dir, "cmd": cmd, "exp": exp}
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

    def _probe(self, name: str, ckpt: Optional[bool], timeout: float) -> Optional[dict[str, Any]]:
        """One short run (smallest micro-batch, gas 1, the highest of the user's stages below 3: the
        least memory without ZeRO-3's gathered parameters among the saved tensors) that measures
        the parameters a rank holds and the activation bytes per sample of its first forward."""
        result_dir = os.path.join(self.results_dir, name)
        info_path = os.path.join(result_dir, "model_info.json")
        stages = space.user_stages(self.user_config)
        combo = space.Combo(max([s for s in stages if s < 3], default=stages[-1]), False, ckpt)
        mbs = max(self.cfg.min_train_micro_batch_size_per_gpu, 1)
        probe = space.make_experiment(self.user_config, self.cfg, self.world, combo, mbs, mbs)
        probe["name"] = name
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

    def probe_model_info(self, timeout: float) -> Optional[dict[str, Any]]:
        """DeepSpeed's profile_model_info/model_info.json; with the checkpointing axis tuned, a
        second probe with checkpointing on adds activation_mem_per_sample_ckpt to it."""
        tuned_ckpt = space.ckpt_choices(self.cfg, self.user_args) != [None]
        info = self._probe("profile_model_info", False if tuned_ckpt else None, timeout)
        if info is None or not tuned_ckpt:
            return info
        with_ckpt = self._probe("profile_model_info_ckpt", True, timeout)
        if with_ckpt is None:
            return None
        info["activation_mem_per_sample_ckpt"] = with_ckpt["activation_mem_per_sample"]
        with open(os.path.join(self.results_dir, "profile_model_info", "model_info.json"), "w") as f:
            json.dump(info, f)
        return info

    def _largest_fit(self, combo: space.Combo) -> Optional[int]:
        if self.model_info is None or self.budget is None:
            return None
        ds = space.make_experiment(self.user_config, self.cfg, self.world, combo, 1, 1)["ds_config"]
        fit = memory.largest_micro_batch(ds, self.model_info, self.world, self.budget, self.cfg.mp_size, combo.ckpt)
        self.largest[combo.prefix] = fit
        return fit

    def _run_tuner(self, exps: list[dict[str, Any]], timeout: float, whole: bool) -> None:
        """`whole`: every experiment in order (gridsearch over the micro-batch sweep, as DeepSpeed
        runs its sweep); else the configured tuner with its trials and early stopping."""
        kind = "gridsearch" if whole else self.cfg.tuner_type
        trials = len(exps) if whole else self.cfg.tuner_num_trials
        stopping = None if whole else self.cfg.tuner_early_stopping
        Tuner(exps, kind, self.cfg.metric, trials, stopping).tune(lambda e: self.run_experiment(e, timeout))

    def _stage_best(self, stage: int) -> Optional[dict[str, Any]]:
        best = None
        for r in self.records:
            if "metric" in r and r["exp"]["combo"].stage == stage and (best is None
                                                                      or self._better(r["metric"], best["metric"])):
                best = r
        return best

    def tune(self, timeout: float = 600.0) -> Optional[dict[str, Any]]:
        if self.cfg.overwrite:
            shutil.rmtree(self.results_dir, ignore_errors=True)
            shutil.rmtree(self.exps_dir, ignore_errors=True)
        os.makedirs(self.results_dir, exist_ok=True)
        os.makedirs(self.exps_dir, exist_ok=True)
        start = time.time()
        self.budget = memory.budget_bytes()
        self.model_info = self.probe_model_info(timeout) if self.budget is not None else None
        sweep, self.pruned = space.sweep(self.user_config, self.cfg, self.world, self.user_args, self._largest_fit)
        grid_size = len(sweep)
        if not self.cfg.fast:
            grid_size += sum(len(space.knob_points(self.user_config, e["combo"].stage))
                             for e in sweep if e["combo"].stage > 0)
        # the sweep: all of it under gridsearch (DeepSpeed's sweep), else the tuner picks among it
        self._run_tuner(sweep, timeout, whole=self.cfg.tuner_type == "gridsearch")
        if not self.cfg.fast:
            # DeepSpeed: a stage's sub-knobs are tuned only when its sweep reached a larger
            # micro-batch than the stages below at a metric no worse; stage 0 has none
            prev_mbs, prev_best = 0, None
            for stage in space.user_stages(self.user_config):
                best = self._stage_best(stage)
                if best is None:
                    continue
                mbs = best["exp"]["ds_config"]["train_micro_batch_size_per_gpu"]
                worse = prev_best is not None and self._better(prev_best, best["metric"])
                if stage > 0 and mbs > prev_mbs and not worse:
                    combo = best["exp"]["combo"]
                    sizes = space.sweep_sizes(self.user_config, self.cfg, self.world, self.user_args,
                                              self._largest_fit(combo))
                    self._run_tuner(space.knob_experiments(self.user_config, self.cfg, self.world, combo, sizes),
                                    timeout, whole=False)
                if mbs > prev_mbs:
                    prev_mbs, prev_best = mbs, best["metric"]
        self._write_results(grid_size, time.time() - start)
        return self.best

    def _write_results(self, grid_size: int, seconds: float) -> None:
        lines = [f"| {'experiment':<16} | {self.cfg.metric:>14} | status |", "|---|---|---|"]
        for r in self.records:
            val = f"{r['metric']:.6g}" if "metric" in r else "-"
            status = "best" if r is self.best else ("ok" if "metric" in r else "infeasible: " + r["error"])
            lines.append(f"| {r['name']:<16} | {val:>14} | {status} |")
        for name in self.pruned:
            lines.append(f"| {name:<16} | {'-':>14} | skipped: no micro-batch fits the memory budget |")
        lines.append("")
        if self.largest:
            lines.append("Largest micro-batch within the memory budget (memory model): "
                         + ", ".join(f"{k} {v}" for k, v in self.largest.items()) + ".")
        if self.pruned:
            lines.append(f"Skipped without launching (memory model): {len(self.pruned)} combos.")
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
                   *_script_args(self.user_args, self.cfg_index, opt_path, {**self.best["exp"], "ds_config": optimal},
                                 self.cfg.arg_mappings)]
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
