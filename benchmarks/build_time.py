"""Cold JIT build time of one CPU op and one CUDA op, each into an empty cache, against torch's
own JIT route (torch.utils.cpp_extension.load_inline with <torch/extension.h>, the route
DeepSpeed's op builders take) for an op of the same size, built in the same run.

    python benchmarks/build_time.py [--skip-torch]
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from deepspeed_c.ops.op_builder import ALL_OPS, builder as builder_mod

TORCH_CPU_SRC = r"""
#include <torch/extension.h>
void scale_(torch::Tensor x, double s) { x.mul_(s); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("scale_", &scale_); }
"""


def cold_build(name: str) -> float:
    cls = ALL_OPS[name]
    with tempfile.TemporaryDirectory() as cache:
        os.environ["DSC_CACHE_DIR"] = cache
        builder_mod._loaded.clear()
        start = time.perf_counter()
        cls().load()
        return time.perf_counter() - start


def torch_cold_build() -> float:
    from torch.utils.cpp_extension import load_inline

    with tempfile.TemporaryDirectory() as build_dir:
        start = time.perf_counter()
        load_inline("dsc_bench_torch_ext", cpp_sources=[TORCH_CPU_SRC], build_directory=build_dir,
                    extra_cflags=["-O3"], verbose=False)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-torch", action="store_true", help="skip torch's cpp_extension comparison")
    args = parser.parse_args()
    cpu_op = "cpu_adam" if "cpu_adam" in ALL_OPS else "utils"
    cuda_op = next((n for n in ("fused_adam", "multi_tensor_ops") if n in ALL_OPS), None)
    rows = [(f"deepspeed_c {cpu_op} (CPU, C11)", cold_build(cpu_op))]
    if cuda_op and ALL_OPS[cuda_op]().is_compatible():
        rows.append((f"deepspeed_c {cuda_op} (CUDA, nvcc)", cold_build(cuda_op)))
    torch_s = None
    if not args.skip_torch and (_has_ninja_module() or shutil.which("ninja")):
        torch_s = torch_cold_build()
        rows.append(("torch cpp_extension, 1-line op (<torch/extension.h>)", torch_s))
    print(f"{'build':<58}{'seconds':>9}{'vs torch':>10}")
    for label, secs in rows:
        ratio = f"{torch_s / secs:8.1f}x" if torch_s and not label.startswith("torch") else ""
        print(f"{label:<58}{secs:>9.2f}{ratio:>10}")
    print(f"(cpus: {os.cpu_count()}; targets: CPU op < 3 s, CUDA op < 15 s on a 2-core machine)")


def _has_ninja_module() -> bool:
    try:
        import ninja  # noqa: F401
    except ImportError:
        return False
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ["PATH"]
    return True


if __name__ == "__main__":
    main()
