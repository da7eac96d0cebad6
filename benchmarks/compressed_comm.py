"""Communication compression: bytes per step and step time with and without it, side by side in
one run (issue 19). Each section is one function registered in SECTIONS; pick them with
`--sections` (comma-separated, all by default).

    onebit  1-bit Adam against Adam on the same ranks (gloo on CPU, NCCL on GPUs): bytes handed to
            collectives per step after the warm-up (the comms logger's counts) and ms per step,
            correctness first (1-bit Adam's warm-up steps equal Adam-without-bias-correction's).
    zeropp  ZeRO++ against ZeRO-3 (added by the ZeRO++ work).

    python benchmarks/compressed_comm.py [--sections onebit,zeropp] [--world 2]

The GPU kernel throughput of sign pack/unpack against copy bandwidth is scripts/onebit_gpu_check.py.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# --- section: onebit ----------------------------------------------------------------------------
def onebit_section(args: argparse.Namespace) -> None:
    raise NotImplementedError("the onebit section lands with the 1-bit optimizers")


# --- section registry (one line per section) ----------------------------------------------------
SECTIONS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "onebit": onebit_section,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}")
    ap.add_argument("--world", type=int, default=2, help="ranks (gloo on CPU, one GPU each with NCCL)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run")
    args = ap.parse_args()
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; known: {list(SECTIONS)}")
    for name in chosen:
        print(f"== {name} ==")
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
