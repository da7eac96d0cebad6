"""DeepSpeed's clients on one GPU with the `deepspeed` alias installed: PyTorch Lightning's DeepSpeed strategy
(the stock strategy names, which refuse CPUs) and accelerate, ZeRO stage 2, in fp32 (held to the same
bars as the CPU tests) and in bf16 (the closing note's flows). Prints a pass/fail table with the losses and
exits non-zero when a row fails. Offline: needs only what scripts/device_setup.sh sets up (torch, the
carried wheels in .whl/, the built core module) plus accelerate and lightning, which the GPU image holds
(the lead may carry lightning-2.6.6 and lightning_utilities-0.15.3 wheels in .whl/ to pin them).

    source scripts/device_setup.sh && PYTHONUNBUFFERED=1 python3 scripts/gpu_clients.py [--report DIR]

The runs work in a temporary directory; the table, gpu_clients.json and one log per row go to --report
(default: $OUT when set, so the device tool brings them back: 5 files, one folder). --cpu-smoke runs only
the accelerate rows on this machine's CPU, to check the script itself where there is no GPU.

Rows:
  lightning fp32   tests/distributed/test_client_lightning.py::test_lightning_on_gpu (deepspeed_stage_1, 2,
                   2_offload, 3, 3_offload, DeepSpeedStrategy(config=...) against strategy="ddp" within 1e-4,
                   resume at step 6, convert_zero_checkpoint_to_fp32_state_dict, the refused option)
  lightning bf16   deepspeed_stage_2 with precision="bf16-mixed" against ddp with bf16-mixed (autocast; the
                   DeepSpeed run keeps bf16 weights, so the bar is a 5% mean relative difference), resumed
  accelerate fp32  `accelerate launch --use_deepspeed --zero_stage 2 --gradient_accumulation_steps 2` against
                   the script without DeepSpeed (within 1e-4), load_state resume exact, get_state_dict
  accelerate bf16  the same with --mixed_precision bf16 (bar: 5% mean relative difference)
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "distributed"


def install_alias(where: pathlib.Path) -> dict:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(where), str(ROOT / "compat" / "deepspeed")], check=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(where), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def run(cmd: list[str], env: dict, cwd: pathlib.Path) -> tuple[bool, str]:
    proc = subprocess.run(cmd, env=env, cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=540)
    return proc.returncode == 0, proc.stdout


def mean_rel(a: list, b: list) -> float:
    return sum(abs(x - y) / abs(y) for x, y in zip(a, b)) / max(len(b), 1)


def max_rel(a: list, b: list) -> float:
    return max((abs(x - y) / abs(y) for x, y in zip(a, b)), default=float("inf"))


def lightning_fp32(env: dict, out: pathlib.Path, report: pathlib.Path) -> dict:
    ok, log = run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                   f"{TESTS / 'test_client_lightning.py'}::test_lightning_on_gpu"], env, ROOT)
    (report / "lightning_fp32.log").write_text(log)
    passed = ok and " passed" in log and "skipped" not in log
    return {"row": "lightning fp32 (stages 1-3, offload, config)", "ok": passed,
            "detail": "pytest test_lightning_on_gpu " + ("passed" if passed else "FAILED, see lightning_fp32.log")}


def lightning_bf16(env: dict, out: pathlib.Path, report: pathlib.Path) -> dict:
    work = out / "lightning_bf16"
    work.mkdir(exist_ok=True)
    ok, log = run([sys.executable, str(TESTS / "client_lightning_script.py"), str(work), "ddp,stage_2,resume_stage_2",
                   "--accelerator", "gpu", "--devices", "1", "--precision", "bf16-mixed"], env, work)
    (report / "lightning_bf16.log").write_text(log)
    if not ok:
        return {"row": "lightning bf16 deepspeed_stage_2", "ok": False, "detail": "script failed, see log"}
    ref = json.loads((work / "ddp" / "rank0.json").read_text())["losses"]
    ds = json.loads((work / "stage_2" / "rank0.json").read_text())
    res = json.loads((work / "resume_stage_2" / "rank0.json").read_text())["losses"]
    diff, resume = mean_rel(ds["losses"], ref), max_rel(res, ds["losses"][6:])
    falls = ds["losses"][-1] < 0.6 * ds["losses"][0]
    good = ds["engine"] == "deepspeed_c.runtime.engine" and ds["zero_stage"] == 2 and diff < 0.05 and falls \
        and resume < 1e-2
    return {"row": "lightning bf16 deepspeed_stage_2", "ok": good, "losses": ds["losses"], "ref": ref,
            "detail": f"vs ddp bf16-mixed mean rel {diff:.2e}; resumed vs straight max rel {resume:.2e}"}


def accelerate_run(env: dict, out: pathlib.Path, report: pathlib.Path, precision: str,
                   tol_max: float | None) -> dict:
    work = out / f"accelerate_{precision}"
    work.mkdir(exist_ok=True)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--dynamo_backend", "no",
              "--mixed_precision", precision, "--num_processes", "1"]
    script = str(TESTS / "client_accelerate_script.py")
    ok1, log1 = run([*launch, script, "--mode", "plain", "--out", "plain"], env, work)
    ok2, log2 = run([*launch, "--use_deepspeed", "--zero_stage", "2", "--gradient_accumulation_steps", "2", script,
                     "--mode", "launch", "--out", "ds"], env, work)
    (report / f"accelerate_{precision}.log").write_text(log1 + "\n" + log2)
    row = f"accelerate {precision if precision != 'no' else 'fp32'} zero_stage 2"
    if not (ok1 and ok2):
        return {"row": row, "ok": False, "detail": "launch failed, see log"}
    ref = json.loads((work / "plain" / "plain" / "result.json").read_text())
    ds = json.loads((work / "ds" / "launch" / "result.json").read_text())
    diff = max_rel(ds["losses"], ref["losses"]) if tol_max is not None else mean_rel(ds["losses"], ref["losses"])
    bar = tol_max if tol_max is not None else 0.05
    falls = sum(ds["losses"][-4:]) < 0.7 * sum(ds["losses"][:4])
    good = (ds["engine"] == "deepspeed_c.runtime.engine" and ds["distributed_type"] == "DistributedType.DEEPSPEED"
            and diff < bar and falls and ds["resumed"] == ds["losses"][12:] and ds["consolidated_equal"])
    kind = "max" if tol_max is not None else "mean"
    return {"row": row, "ok": good, "losses": ds["losses"], "ref": ref["losses"],
            "detail": f"vs no DeepSpeed {kind} rel {diff:.2e} (bar {bar:g}); resume exact "
                      f"{ds['resumed'] == ds['losses'][12:]}; get_state_dict equal {ds['consolidated_equal']}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", default=os.environ.get("OUT") or None)
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        raise SystemExit("gpu_clients.py needs a CUDA GPU (Lightning's DeepSpeed strategy refuses CPUs)")
    out = pathlib.Path(tempfile.mkdtemp(prefix="gpu_clients_"))
    report = pathlib.Path(args.report) if args.report else out
    report.mkdir(parents=True, exist_ok=True)
    env = install_alias(pathlib.Path(tempfile.mkdtemp(prefix="dsc_alias_")))
    rows = [] if args.cpu_smoke else [lightning_fp32(env, out, report), lightning_bf16(env, out, report)]
    rows += [accelerate_run(env, out, report, "no", 1e-4)]
    if not args.cpu_smoke:
        rows += [accelerate_run(env, out, report, "bf16", None)]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (smoke run)"
    lines = [f"{device}, torch {torch.__version__}",
             f"{'flow':48} {'result':6} {'first loss':>11} {'last loss':>10} {'ref last':>9}  detail"]
    for r in rows:
        losses, ref = r.get("losses") or [float("nan")], r.get("ref") or [float("nan")]
        lines.append(f"{r['row']:48} {'PASS' if r['ok'] else 'FAIL':6} {losses[0]:11.5f} {losses[-1]:10.5f} "
                     f"{ref[-1]:9.5f}  {r['detail']}")
    print("\n" + "\n".join(lines))
    with open(report / "gpu_clients.json", "w") as f:
        json.dump({"table": lines, "rows": rows}, f, indent=1)
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
