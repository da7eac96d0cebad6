"""The largest GPT that trains on one GPU with ZeRO-3 + offload_param + offload_optimizer to CPU,
deepspeed_c against the real DeepSpeed, by depth (the issue's bisect). Each trial is a fresh process
running `benchmarks/zero3.py --offload --zero_init --engines <one engine> --n_layer L` (build under
zero.Init(remote_device='cpu'), --check steps, then timed steps); a trial fails on an OOM line, a
non-zero exit (the host's OOM killer included) or its time limit. Depth doubles from --start until a
trial fails, then bisects between the last success and the first failure, per engine, until the gap is
--resolution layers or --budget_s seconds have gone. Prints each trial and a table: largest depth that
trained, its parameters, tokens/s and device peak, and the smallest depth that failed.

    python benchmarks/zero3_offload_bisect.py [--start 24] [--resolution 8] [--budget_s 900]
                                             [--engines dsc-z3,ds-z3] [-- extra zero3.py args]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OK = re.compile(r"^OK\s+(\S+)\s+offload, ([\d.]+)M params:\s+([\d.]+) ms/step\s+(\d+) tokens/s.*device peak\s+([\d.]+) GiB",
                re.M)


def trial(engine: str, layers: int, extra: list[str], limit: float) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "zero3.py"), "--offload", "--zero_init", "--engines", engine,
           "--n_layer", str(layers), "--check", "1", "--blocks", "1", "--steps", "2", *extra]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    m = OK.search(out)
    res = {"engine": engine, "layers": layers, "ok": bool(m) and rc == 0, "rc": rc, "s": time.time() - t0}
    if m:
        res.update(params_m=float(m.group(2)), ms=float(m.group(3)), tok_s=int(m.group(4)), peak=float(m.group(5)))
    else:
        tail = [ln for ln in out.splitlines() if ln.strip()][-2:]
        res["why"] = " | ".join(tail)[-200:]
    print(f"trial {engine:6s} L={layers:4d}: {'OK ' if res['ok'] else 'FAIL'} rc={rc} {res['s']:.0f}s "
          + (f"{res['params_m']:.0f}M params {res['tok_s']} tok/s peak {res['peak']} GiB" if m else res.get("why", "")),
          flush=True)
    return res


def search(engine: str, args: argparse.Namespace, extra: list[str], deadline: float) -> tuple[dict | None, int | None]:
    best, fail, layers = None, None, args.start
    while fail is None and time.time() < deadline:  # doubling
        r = trial(engine, layers, extra, min(args.trial_s, max(30.0, deadline - time.time())))
        if r["ok"]:
            best, layers = r, layers * 2
        else:
            fail = layers
    lo = best["layers"] if best else 0
    while fail is not None and fail - lo > args.resolution and time.time() < deadline:  # bisect
        mid = (lo + fail) // 2
        r = trial(engine, mid, extra, min(args.trial_s, max(30.0, deadline - time.time())))
        if r["ok"]:
            best, lo = r, mid
        else:
            fail = mid
    return best, fail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--start", type=int, default=24)
    ap.add_argument("--resolution", type=int, default=8)
    ap.add_argument("--budget_s", type=float, default=900.0, help="for all engines together")
    ap.add_argument("--trial_s", type=float, default=300.0)
    ap.add_argument("--engines", default="dsc-z3,ds-z3")
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    engines = args.engines.split(",")
    t0 = time.time()
    rows = []
    for k, engine in enumerate(engines):
        share = (args.budget_s - (time.time() - t0)) / (len(engines) - k)
        rows.append((engine, *search(engine, args, extra, time.time() + share)))
    print("\nengine  largest depth that trained  params  tokens/s  device peak GiB  smallest failing depth")
    for engine, best, fail in rows:
        if best:
            print(f"{engine:7s} {best['layers']:>27d}  {best['params_m']:5.0f}M  {best['tok_s']:8d}  "
                  f"{best['peak']:15.2f}  {fail if fail is not None else 'none tried'}")
        else:
            print(f"{engine:7s} {'none':>27s}  {'-':>6s}  {'-':>8s}  {'-':>15s}  {fail}")


if __name__ == "__main__":
    main()
