"""Cold JIT build time of every op, each into its own empty cache (nothing shared with another op's
build, no object reused), against torch's own JIT route (torch.utils.cpp_extension.load_inline with
<torch/extension.h>, the route DeepSpeed's op builders take) for a one-line op, built in the same run.
Each op is loaded (built and imported) and its binary checked to be in the empty cache.
Targets on a 2-core machine: a CPU op under 3 s, a CUDA op under 15 s (wall, "cold s"). "cpu s" is what the
compiler and linker processes used: the load of other processes on a shared machine inflates the wall figure,
not this one (an op's sources compile in parallel, so an idle 2-core build takes about cpu s / 2 or more).

    python benchmarks/build_time.py [--ops cpu_adam fused_adam ...] [--skip-torch]
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

from deepspeed_c.ops.op_builder import ALL_OPS, CUDAOpBuilder, builder as builder_mod

CPU_TARGET_S, CUDA_TARGET_S = 3.0, 15.0
TORCH_CPU_SRC = r"""
#include <torch/extension.h>
void scale_(torch::Tensor x, double s) { x.mul_(s); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("scale_", &scale_); }
"""


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cold_build(name: str) -> tuple[float, float]:
    """Wall seconds for one op's build and import from an empty cache, and the CPU seconds its compiler and
    linker processes used (the figure the load of other processes on a shared machine does not inflate)."""
    op = ALL_OPS[name]()
    with tempfile.TemporaryDirectory() as cache:
        old = os.environ.get("DSC_CACHE_DIR")
        os.environ["DSC_CACHE_DIR"] = cache
        builder_mod._loaded.clear()
        try:
            start, cpu0 = time.perf_counter(), _children_cpu()
            op.load()
            secs, cpu = time.perf_counter() - start, _children_cpu() - cpu0
            # a prebuilt or stale binary would make the time meaningless (looked up by folder, not by build key:
            # an edit to a shared header while this runs changes every key)
            if not any(Path(cache, op.NAME).rglob("*.so")):
                raise RuntimeError(f"op {name} was not built into the empty cache {cache}")
        finally:
            if old is None:
                os.environ.pop("DSC_CACHE_DIR")
            else:
                os.environ["DSC_CACHE_DIR"] = old
        return secs, cpu


def torch_cold_build() -> float:
    from torch.utils.cpp_extension import load_inline

    with tempfile.TemporaryDirectory() as build_dir:
        start = time.perf_counter()
        load_inline("dsc_bench_torch_ext", cpp_sources=[TORCH_CPU_SRC], build_directory=build_dir,
                    extra_cflags=["-O3"], verbose=False)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", nargs="*", help="op names (default: every op compatible here)")
    parser.add_argument("--skip-torch", action="store_true", help="skip torch's cpp_extension comparison")
    args = parser.parse_args()
    unknown = sorted(set(args.ops or ()) - set(ALL_OPS))
    if unknown:
        parser.error(f"--ops: unknown op(s) {unknown}; known: {sorted(ALL_OPS)}")
    load_before = os.getloadavg()[0]
    torch_s = None
    if not args.skip_torch and (_has_ninja_module() or shutil.which("ninja")):
        cpu0 = _children_cpu()
        torch_s = torch_cold_build()
        torch_cpu = _children_cpu() - cpu0
    rows, skipped = [], []
    for name in args.ops or sorted(ALL_OPS):
        op = ALL_OPS[name]()
        reason = op.incompatible_reason()
        if reason:
            skipped.append((name, reason))
            continue
        kind = "CUDA" if isinstance(op, CUDAOpBuilder) else "CPU"
        try:
            rows.append((name, kind, len(op.all_sources()), *cold_build(name)))
        except (builder_mod.OpBuildError, ImportError) as e:  # reported in the table, not hidden: the other ops still time
            rows.append((name, kind, len(op.all_sources()), None, None))
            skipped.append((name, f"BUILD OR IMPORT FAILED: {str(e).splitlines()[0]}"))
    print(f"{'op':<24}{'kind':<6}{'sources':>8}{'cold s':>9}{'cpu s':>8}{'target s':>10}{'met':>5}{'vs torch':>10}")
    for name, kind, n_src, secs, cpu in rows:
        target = CUDA_TARGET_S if kind == "CUDA" else CPU_TARGET_S
        if secs is None:
            print(f"{name:<24}{kind:<6}{n_src:>8}{'failed':>9}{'':>8}{target:>10.0f}{'NO':>5}")
            continue
        ratio = f"{torch_s / secs:8.1f}x" if torch_s else ""
        print(f"{name:<24}{kind:<6}{n_src:>8}{secs:>9.2f}{cpu:>8.2f}{target:>10.0f}{'yes' if secs < target else 'NO':>5}"
              f"{ratio:>10}")
    if torch_s:
        print(f"{'torch cpp_extension, 1-line CPU op (<torch/extension.h>)':<47}{torch_s:>9.2f}{torch_cpu:>8.2f}")
    for name, reason in skipped:
        print(f"(not built: {name}: {reason})")
    print(f"(cpus: {os.cpu_count()}; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after)")


def _has_ninja_module() -> bool:
    try:
        import ninja  # noqa: F401
    except ImportError:
        return False
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ["PATH"]
    return True


if __name__ == "__main__":
    main()
