"""The distributed parity suites over NCCL, one process per GPU (DSC_TEST_BACKEND=nccl): ZeRO 0-3,
offload, checkpoint resume and resharding, pipeline, MoE, tensor and sequence parallel.

The tests are the CPU suites themselves; tests/harness.py gives each rank its own GPU and skips, naming
the shortfall, every run whose world size exceeds the visible GPUs (so 4-rank tests skip on 2 GPUs).
Suites run as separate pytest processes, a few at once (the models are tiny: the GPUs are shared
without contention worth measuring; no timing is asserted or reported as performance). Prints one
row per suite (passed, failed, skipped, seconds), the skip reasons, and the failures' heads; the
logs and JUnit files go to $OUT (or /tmp/gpu_parity). Exit status 1 when anything failed or errored,
or when nothing ran at all.

    bash scripts/gpu_parity.sh            # all suites, 4 at a time
    bash scripts/gpu_parity.sh -j 2 zero12 pipe
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D = "tests/distributed/"
# longest first, so the pool ends together
SUITES: dict[str, list[str]] = {
    "checkpoint-resume": [D + "test_lead_checkpoint_resume.py"],
    "zero12": [D + "test_zero_parity.py", D + "test_zero_direct_grads.py", D + "test_zero12_flat_params.py"],
    "zero3": [D + "test_zero3_parity.py", D + "test_zero3_dist.py", D + "test_zero3_unit_gather.py"],
    "moe": [D + "test_moe_parity.py"],
    "pipe": [D + "test_pipe_parity.py", D + "test_pipe_zb_traversal.py", D + "test_pipe_p2p_wait.py"],
    "checkpoint-reshard": [D + "test_checkpoint_zero.py", D + "test_checkpoint_reshard_matrix.py"],
    "offload": [D + "test_zero_offload.py"],
    "zero0": [D + "test_engine_parity.py", D + "test_engine_parity_gpu.py"],  # the latter: bf16, GPU only
    "sp": [D + "test_ulysses_attention.py", D + "test_ulysses_engine.py"],
    "tp": [D + "test_tp_autotp.py"],
    "harness": ["tests/unit/test_harness.py"],
    "comm": [D + "test_comm_collectives.py", "-k", "nccl"],  # pytest arguments: its NCCL case only
}
# what a suite needs beyond the harness's own modules (a suite whose module is missing is reported NOT RUN)
NEEDS: dict[str, list[str]] = {"tp": ["transformers"]}
# NVLink multicast stays off on shared GPU hosts
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class Result:
    suite: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    note: str = ""
    skips: dict[str, int] = field(default_factory=dict)
    failures: list[tuple[str, str]] = field(default_factory=list)


def _parse(res: Result, xml_path: str) -> None:
    root = ET.parse(xml_path).getroot()
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            res.failed += 1
            text = (bad.get("message") or "") + "\n" + (bad.text or "")
            res.failures.append((name, text))
        elif skip is not None:
            res.skipped += 1
            reason = (skip.get("message") or "").strip()
            res.skips[reason] = res.skips.get(reason, 0) + 1
        else:
            res.passed += 1


def _start(name: str, pytest_args: list[str], out: str, env: dict[str, str]) -> tuple[subprocess.Popen, float]:
    xml = os.path.join(out, f"{name}.xml")
    log = open(os.path.join(out, f"{name}.log"), "w")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}", *pytest_args]
    # its own session: on timeout the whole tree (pytest, fork server, ranks) is killed
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc, time.monotonic()


def _missing_modules() -> list[str]:
    missing = []
    for mod in ("torch", "numpy", "pytest", "psutil", "filelock", "deepspeed_c"):
        try:
            __import__(mod)
        except Exception as e:  # noqa: BLE001 - report any import failure by name
            missing.append(f"{mod} ({type(e).__name__}: {e})")
    return missing


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suites", nargs="*", help=f"subset of {list(SUITES)} (default: all)")
    ap.add_argument("-j", "--jobs", type=int, default=4, help="suites at once")
    ap.add_argument("--suite-timeout", type=float, default=300.0, help="seconds before a suite is killed")
    ap.add_argument("--budget", type=float, default=390.0,
                    help="seconds for the whole run: later suites are not started, running ones killed")
    args = ap.parse_args()
    names = args.suites or list(SUITES)
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        ap.error(f"unknown suite(s) {unknown}; choose from {list(SUITES)}")
    sys.path.insert(0, ROOT)
    missing = _missing_modules()
    if missing:
        print("cannot run: missing " + "; ".join(missing))
        return 2
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = torch.cuda.nccl.version() if gpus else None
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, {gpus} GPU(s): "
          + ", ".join(torch.cuda.get_device_name(i) for i in range(gpus)))
    if gpus < 2:
        print("note: fewer than 2 GPUs: every multi-rank test will skip (the harness names why)")
    out = os.environ.get("OUT") or "/tmp/gpu_parity"
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ)
    for k, v in SAFE_ENV.items():
        env.setdefault(k, v)
    env.update({"DSC_TEST_BACKEND": "nccl", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                "PYTHONPATH": ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")})
    if env.get("CUDA_VISIBLE_DEVICES") == "":
        del env["CUDA_VISIBLE_DEVICES"]  # an empty list would hide every GPU from the ranks

    pending = list(names)
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    results: dict[str, Result] = {}
    start = time.monotonic()
    while pending or running:
        while pending and len(running) < args.jobs:
            name = pending.pop(0)
            if time.monotonic() - start > args.budget - 30:
                results[name] = Result(name, note=f"NOT RUN: the {args.budget:.0f} s budget was spent")
                print(f"  skip {name:<20} {results[name].note}", flush=True)
                continue
            absent = [m for m in NEEDS.get(name, []) if importlib.util.find_spec(m) is None]
            if absent:
                results[name] = Result(name, note=f"NOT RUN: {', '.join(absent)} not installed")
                print(f"  skip {name:<20} {results[name].note}", flush=True)
                continue
            running[name] = _start(name, SUITES[name], out, env)
        time.sleep(0.5)
        for name, (proc, t0) in list(running.items()):
            elapsed = time.monotonic() - t0
            over_budget = time.monotonic() - start > args.budget
            timed_out = proc.poll() is None and (elapsed > args.suite_timeout or over_budget)
            if timed_out:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.poll() is None:
                continue
            del running[name]
            res = Result(name, seconds=elapsed)
            xml = os.path.join(out, f"{name}.xml")
            if os.path.exists(xml) and not timed_out:
                _parse(res, xml)
            if timed_out:
                res.note = f"killed after {elapsed:.0f} s" + (" (budget spent)" if over_budget else "")
            elif proc.returncode not in (0, 1) and not res.failed:
                res.note = f"pytest exit {proc.returncode}"  # collection error, crash: see the log
            print(f"  done {name:<20} {res.passed:>3} passed {res.failed:>3} failed {res.skipped:>3} skipped "
                  f"{elapsed:6.1f} s {res.note}", flush=True)
            results[name] = res
    total = time.monotonic() - start

    print(f"\n{'suite':<20} {'passed':>6} {'failed':>6} {'skipped':>7} {'seconds':>8}  note")
    for name in names:
        r = results[name]
        print(f"{name:<20} {r.passed:>6} {r.failed:>6} {r.skipped:>7} {r.seconds:>8.1f}  {r.note}")
    sums = [sum(getattr(r, k) for r in results.values()) for k in ("passed", "failed", "skipped")]
    print(f"{'total':<20} {sums[0]:>6} {sums[1]:>6} {sums[2]:>7} {total:>8.1f}  (wall, {args.jobs} at once)")
    reasons: dict[str, int] = {}
    for r in results.values():
        for k, v in r.skips.items():
            reasons[k] = reasons.get(k, 0) + v
    if reasons:
        print("\nskip reasons:")
        for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]):
            print(f"  {v:>3} x {k}")
    bad = [(r.suite, n, t) for r in results.values() for n, t in r.failures]
    if bad:
        print("\nfailures (full text in the logs):")
        for suite, n, text in bad:
            lines = [l for l in text.strip().splitlines() if l.strip()]
            err = [l for l in lines if l.lstrip().startswith("E ")]
            head = (err[:3] + (["    ..."] if len(err) > 11 else []) + err[max(3, len(err) - 8):]) if err else lines[-8:]
            print(f"--- [{suite}] {n}")
            print("\n".join("    " + l[:300] for l in head))
    noted = [r.suite for r in results.values() if r.note and not r.note.startswith("NOT RUN")]
    print(f"\nlogs and JUnit files: {out}")
    return 1 if bad or noted or sums[0] == 0 or any(r.note.startswith("NOT RUN") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
