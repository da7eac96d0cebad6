"""Autotuning against exhaustive search over the same space (issue 20's GPU bar):

    python benchmarks/autotuning_vs_exhaustive.py --mbs_sizes 2 --phase exhaustive   # ~1B GPT, one GPU
    python benchmarks/autotuning_vs_exhaustive.py --mbs_sizes 2 --phase tuned
    python benchmarks/autotuning_vs_exhaustive.py --mbs_sizes 2 --phase report
    python benchmarks/autotuning_vs_exhaustive.py --d 256 --layers 2 --vocab 4096 --seq 256 --num_gpus 2  # CPU smoke

Runs `deepspeed_c --autotuning tune` twice on benchmarks/autotuning_gpt_train.py over ZeRO stage x
micro-batch x optimizer offload (bf16, AdamW): once exhaustively (gridsearch, no early stopping)
and once with the random tuner limited to --trials experiments, both with the memory model on
(the GPU's memory, or DSC_AUTOTUNING_MEMORY_BUDGET_BYTES). Prints, per search, the experiments
launched, skipped by the memory model and failed, and the best throughput; then the tuned best
against the exhaustive best (the bar: within 5%). The tuned run's choice is re-measured inside the
exhaustive run's table (the same point), so the ratio compares measurements of one session."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tune(work: Path, a: argparse.Namespace, tuner: dict) -> None:
    work.mkdir(parents=True, exist_ok=True)
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "steps_per_print": 10**9, "bf16": {"enabled": a.device == "cuda"},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
           "zero_optimization": {"stage": "auto", "offload_optimizer": "auto"},
           "autotuning": {"enabled": True, "results_dir": str(work / "results"), "exps_dir": str(work / "exps"),
                          "start_profile_step": 3, "end_profile_step": 8, "metric": "throughput",
                          "num_tuning_micro_batch_sizes": a.mbs_sizes,
                          "arg_mappings": {"train_micro_batch_size_per_gpu": "--mbs"}, **tuner}}
    (work / "ds.json").write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "deepspeed_c.launcher.runner", "--num_gpus", str(a.num_gpus), "--autotuning", "tune",
           str(ROOT / "benchmarks" / "autotuning_gpt_train.py"), "--deepspeed_config", str(work / "ds.json"),
           "--mbs", "1", "--d", str(a.d), "--layers", str(a.layers), "--heads", str(a.heads), "--vocab", str(a.vocab),
           "--seq", str(a.seq)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(cmd, cwd=work, env=env, check=False)


def collect(work: Path) -> dict:
    results = work / "results"
    runs = {}
    for d in sorted(p for p in results.iterdir() if p.is_dir() and p.name != "profile_model_info"):
        m = d / "metrics.json"
        runs[d.name] = json.loads(m.read_text())["throughput"] if m.exists() else None
    summary = (results / "summary.txt").read_text()
    skipped = summary.count("skipped: over the memory budget")
    best = max((k for k, v in runs.items() if v is not None), key=lambda k: runs[k], default=None)
    return {"runs": runs, "skipped": skipped, "best": best}


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("d", 2048), ("layers", 16), ("heads", 16), ("vocab", 32000), ("seq", 1024),
                          ("num_gpus", 1), ("trials", 4), ("mbs_sizes", 4)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--work", default="/tmp/dsc_autotune_bench")
    ap.add_argument("--phase", default="all", choices=["all", "exhaustive", "tuned", "report"],
                    help="run the two searches in separate commands (each within a time limit), then report")
    a = ap.parse_args()
    import torch

    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.phase in ("all", "exhaustive"):
        tune(Path(a.work) / "exhaustive", a, {"tuner_type": "gridsearch", "tuner_early_stopping": 10**6})
    if a.phase in ("all", "tuned"):
        tune(Path(a.work) / "tuned", a, {"tuner_type": "random", "tuner_num_trials": a.trials})
    if a.phase not in ("all", "report"):
        return
    full, fast = collect(Path(a.work) / "exhaustive"), collect(Path(a.work) / "tuned")
    print("\n| search | launched | skipped (memory model) | failed | best | best samples/s |")
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    for name, r in (("exhaustive gridsearch", full), (f"random, {a.trials} trials", fast)):
        failed = sum(v is None for v in r["runs"].values())
        best = r["runs"][r["best"]] if r["best"] else float("nan")
        print(f"| {name} | {len(r['runs'])} | {r['skipped']} | {failed} | {r['best']} | {best:.2f} |")
    if full["best"] and fast["best"]:
        # the tuned choice as measured in the exhaustive run, against the exhaustive best
        tuned_in_full = full["runs"].get(fast["best"])
        ratio = tuned_in_full / full["runs"][full["best"]] if tuned_in_full else float("nan")
        print(f"\ntuned choice {fast['best']} reaches {ratio:.3f} of the exhaustive best {full['best']} "
              f"(bar: >= 0.95)")


if __name__ == "__main__":
    main()
