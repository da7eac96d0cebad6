"""Autotuning against exhaustive search over the same space (issue 20's GPU bar):

    python benchmarks/autotuning_vs_exhaustive.py --device cuda --max_mbs 8 --start_step 2 --end_step 5
        # ~1B GPT (0.94B params), one GPU: 16 experiments + 2 probes
    python benchmarks/autotuning_vs_exhaustive.py --device cpu --d 64 --layers 2 --heads 2 --vocab 512 --seq 64 \\
        --max_mbs 4 --num_gpus 1 --memory_budget 6e6 --start_step 1 --end_step 3   # CPU smoke, ~6 min on 2 cores

Runs `deepspeed_c --autotuning tune` on benchmarks/autotuning_gpt_train.py exhaustively (gridsearch:
every point of the space is launched) over ZeRO stage x activation checkpointing x micro-batch
(x optimizer offload with --offload), with the memory model on (the GPU's memory, or
--memory_budget bytes per rank). Then each tuner (random and model_based, --trials experiments,
no early stopping) searches the same space with every launch answered by the exhaustive run's
measurement of that point: the configuration a tuner picks is compared with the exhaustive best on
one set of measurements (no run-to-run noise between the two), and the experiments it would have
launched are counted. Bar: the model-based pick reaches >= 0.95 of the exhaustive best's
throughput. `--phase tuned` also runs a real model_based `--autotuning tune` (its own launches) and
reports its pick as measured by the exhaustive run."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from deepspeed_c.autotuning.tuner import Tuner  # noqa: E402


def tune(work: Path, a: argparse.Namespace, tuner: dict) -> None:
    work.mkdir(parents=True, exist_ok=True)
    zero = {"stage": "auto", **({"offload_optimizer": "auto"} if a.offload else {})}
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "steps_per_print": 10**9, "bf16": {"enabled": a.device == "cuda"},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
           "zero_optimization": zero,
           "autotuning": {"enabled": True, "results_dir": str(work / "results"), "exps_dir": str(work / "exps"),
                          "start_profile_step": a.start_step, "end_profile_step": a.end_step, "metric": "throughput",
                          "num_tuning_micro_batch_sizes": a.mbs_sizes, "max_train_micro_batch_size_per_gpu": a.max_mbs,
                          "arg_mappings": {"train_micro_batch_size_per_gpu": "--mbs",
                                           "activation_checkpointing": "--checkpoint_activations"}, **tuner}}
    (work / "ds.json").write_text(json.dumps(cfg))
    # like DeepSpeed's launcher, ours ignores CUDA_VISIBLE_DEVICES once --num_gpus is given: a caller that pinned
    # the run to some GPUs (one GPU of a shared host) keeps them by passing neither
    pinned = a.device == "cuda" and os.environ.get("CUDA_VISIBLE_DEVICES", "") != ""
    gpus = [] if pinned else ["--num_gpus", str(a.num_gpus)]
    cmd = [sys.executable, "-m", "deepspeed_c.launcher.runner", *gpus, "--autotuning", "tune",
           str(ROOT / "benchmarks" / "autotuning_gpt_train.py"), "--deepspeed_config", str(work / "ds.json"),
           "--mbs", "1", "--checkpoint_activations", "auto", "--d", str(a.d), "--layers", str(a.layers),
           "--heads", str(a.heads), "--vocab", str(a.vocab), "--seq", str(a.seq), "--steps", str(a.end_step + 2)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if a.memory_budget:
        env["DSC_AUTOTUNING_MEMORY_BUDGET_BYTES"] = str(int(float(a.memory_budget)))
    if a.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    subprocess.run(cmd, cwd=work, env=env, check=False)


def collect(work: Path) -> dict:
    """The search's experiments in launch order (from summary.txt) with their throughput (None: failed)."""
    results = work / "results"
    order = []
    for line in (results / "summary.txt").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and (work / "exps" / f"{cells[0]}.json").exists():
            order.append(cells[0])
    runs, exps = {}, []
    for name in order:
        m = results / name / "metrics.json"
        runs[name] = json.loads(m.read_text())["throughput"] if m.exists() else None
        exps.append(json.loads((work / "exps" / f"{name}.json").read_text()))
    summary = (results / "summary.txt").read_text()
    skipped = summary.count("skipped: no micro-batch fits")
    best = max((k for k, v in runs.items() if v is not None), key=lambda k: runs[k], default=None)
    return {"runs": runs, "exps": exps, "skipped": skipped, "best": best}


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("d", 2048), ("layers", 16), ("heads", 16), ("vocab", 32000), ("seq", 1024),
                          ("num_gpus", 1), ("trials", 6), ("mbs_sizes", 2), ("max_mbs", 16), ("start_step", 3),
                          ("end_step", 6)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    ap.add_argument("--memory_budget", default=None, help="bytes per rank (default: the GPU's memory; none on CPU)")
    ap.add_argument("--offload", action="store_true", help="optimizer offload on/off joins the space")
    ap.add_argument("--work", default="/tmp/dsc_autotune_bench")
    ap.add_argument("--phase", default="all", choices=["all", "exhaustive", "tuned", "report"],
                    help="all = exhaustive + report; tuned = a real model_based search too")
    a = ap.parse_args()
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(a.work)
    if a.phase in ("all", "exhaustive"):
        tune(work / "exhaustive", a, {"tuner_type": "gridsearch", "tuner_early_stopping": 10**6})
    if a.phase == "tuned":
        tune(work / "tuned", a, {"tuner_type": "model_based", "tuner_num_trials": a.trials,
                                 "tuner_early_stopping": 10**6})
    if a.phase == "exhaustive":
        return
    full = collect(work / "exhaustive")
    if full["best"] is None:
        raise SystemExit(f"the exhaustive search measured nothing: see {work / 'exhaustive' / 'results'}")
    top = full["runs"][full["best"]]
    failed = sum(v is None for v in full["runs"].values())
    print(f"\n{a.device}, {a.num_gpus} rank(s), GPT d={a.d} layers={a.layers} heads={a.heads} vocab={a.vocab} "
          f"seq={a.seq}; space: stage x checkpointing x micro-batch{' x offload' if a.offload else ''}")
    print("\n| search | launched | skipped (memory model) | failed | pick | samples/s | vs exhaustive best |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: |")
    print(f"| exhaustive gridsearch | {len(full['runs'])} | {full['skipped']} combos | {failed} | {full['best']} | "
          f"{top:.2f} | 1.000 |")
    for kind in ("random", "model_based"):
        t = Tuner(full["exps"], kind, "throughput", a.trials, None)
        t.tune(lambda e: full["runs"][e["name"]])
        pick = max((e["name"] for e, v in t.history if v is not None), key=lambda n: full["runs"][n], default=None)
        val = full["runs"][pick] if pick else float("nan")
        print(f"| {kind}, {a.trials} trials (replayed) | {len(t.history)} | - | "
              f"{sum(v is None for _, v in t.history)} | {pick} | {val:.2f} | {val / top:.3f} |")
    if (work / "tuned" / "results" / "summary.txt").exists():
        real = collect(work / "tuned")
        if real["best"]:
            val = full["runs"].get(real["best"])
            ratio = f"{val / top:.3f}" if val else "n/a"
            print(f"| model_based, {a.trials} trials (real run) | {len(real['runs'])} | {real['skipped']} combos | "
                  f"{sum(v is None for v in real['runs'].values())} | {real['best']} | "
                  f"{real['runs'][real['best']]:.2f} (own run) | {ratio} (as measured exhaustively) |")
    print("\nbar: the model-based pick >= 0.95 of the exhaustive best")


if __name__ == "__main__":
    main()
