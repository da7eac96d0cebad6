"""The JIT op builder: cached builds keyed by content and flags, ISA selection, clear failures,
exactly one compile when several processes load at once, and CUDA builds that link."""
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from deepspeed_c.ops.op_builder import ALL_OPS, CPUOpBuilder, CUDAOpBuilder, OpBuildError, UtilsBuilder
from deepspeed_c.ops.op_builder import builder as builder_mod
from deepspeed_c.ops.op_builder import toolchain

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSC_CACHE_DIR", str(tmp_path / "cache"))
    builder_mod._loaded.clear()
    return tmp_path / "cache"


def test_build_load_and_run(cache):
    b = UtilsBuilder(simd="scalar")
    assert b.is_compatible() and not b.is_built()
    mod = b.load()
    assert b.is_built() and str(b.built_path()).startswith(str(cache))
    ts = [torch.randn(n) for n in (5, 0, 3)]
    out = torch.empty(8)
    mod.flatten(ts, out)
    torch.testing.assert_close(out, torch.cat(ts), rtol=0, atol=0)


def test_cache_hit_does_not_rebuild_and_key_tracks_flags(cache):
    b = UtilsBuilder(simd="scalar")
    b.load()
    stamp = b.built_path().stat().st_mtime_ns
    builder_mod._loaded.clear()
    UtilsBuilder(simd="scalar").load()
    assert b.built_path().stat().st_mtime_ns == stamp
    keys = {UtilsBuilder(simd=s).build_key() for s in ("scalar", "avx2")}
    assert len(keys) == 2


def test_key_tracks_headers_beside_the_sources(tmp_path, monkeypatch):
    import shutil

    from deepspeed_c.ops.op_builder import FusedAdamBuilder

    src = builder_mod.csrc_root()
    copy = tmp_path / "csrc"
    shutil.copytree(src, copy)
    monkeypatch.setenv("DSC_CSRC_ROOT", str(copy))
    before = FusedAdamBuilder().build_key()
    assert FusedAdamBuilder().build_key() == before
    cuh = copy / "cuda" / "adam_update.cuh"
    cuh.write_text(cuh.read_text() + "\n// edited\n")
    after = FusedAdamBuilder().build_key()
    assert after != before
    header = copy / "include" / "dsc" / "tensor_view.h"
    header.write_text(header.read_text() + "\n/* edited */\n")
    assert FusedAdamBuilder().build_key() != after


def test_simd_selection_env_and_validation(monkeypatch):
    monkeypatch.setenv("DSC_SIMD", "scalar")
    assert UtilsBuilder().simd == "scalar"
    assert "-DDSC_SIMD_SCALAR" in UtilsBuilder().cxx_args()
    monkeypatch.setenv("DSC_SIMD", "sse9")
    with pytest.raises(ValueError, match="simd must be one of.*'sse9'.*DSC_SIMD"):
        UtilsBuilder()
    monkeypatch.delenv("DSC_SIMD")
    assert UtilsBuilder().simd == toolchain.detect_simd()


def test_missing_isa_makes_op_incompatible_with_reason(monkeypatch):
    monkeypatch.setattr(toolchain, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    b = UtilsBuilder(simd="avx512")
    assert not b.is_compatible()
    assert "avx512f" in b.incompatible_reason()
    with pytest.raises(OpBuildError, match="cannot be built here.*avx512f"):
        b.load()
    assert UtilsBuilder(simd="avx2").is_compatible()


def test_shared_sources_compile_once_for_every_op_using_them(cache, monkeypatch):
    from deepspeed_c.ops.op_builder import CPUAdamBuilder, CPULionBuilder

    compiled: list[str] = []
    real_run = builder_mod._run

    def recording(cmd):
        if "-c" in cmd:
            compiled.append(cmd[cmd.index("-c") + 1].split("csrc/")[-1])
        return real_run(cmd)

    monkeypatch.setattr(builder_mod, "_run", recording)
    adam, lion = CPUAdamBuilder(simd="scalar"), CPULionBuilder(simd="scalar")
    assert {"cpu/norm.c", "py/cpu_optim_args.c", "py/tensor_view.c"} <= set(adam.shared_sources())
    adam.load()
    lion.load()
    # the objects both ops link are compiled by the first only; each op's own sources by itself
    for shared in ("cpu/norm.c", "py/cpu_optim_args.c", "py/tensor_view.c"):
        assert compiled.count(shared) == 1, (shared, compiled)
    assert compiled.count("cpu/adam.c") == compiled.count("cpu/lion.c") == 1, compiled
    # the second op's log carries the compiler output of the objects it reused (warnings stay visible)
    log = (lion.build_dir() / "build.log").read_text()
    assert "compiled object reused from" in log and "cpu/norm.c" in log
    # other flags, other objects: the avx2 path's shared sources compile again
    compiled.clear()
    if CPULionBuilder(simd="avx2").is_compatible():
        CPULionBuilder(simd="avx2").load()
        assert "cpu/norm.c" in compiled and "py/tensor_view.c" in compiled, compiled
    builder_mod._loaded.clear()
    assert adam.load() is not lion.load()  # cached builds import again, each with its own copy of the objects


class BrokenBuilder(CPUOpBuilder):
    NAME = "broken_test_op"
    SOURCE = ""

    def sources(self):
        return [self.SOURCE]


def test_failed_build_quotes_first_error_and_keeps_log(cache, tmp_path):
    src = tmp_path / "broken.c"
    src.write_text("int f(void) { return undefined_symbol_xyz; }\n")
    BrokenBuilder.SOURCE = str(src)
    with pytest.raises(OpBuildError) as info:
        BrokenBuilder(simd="scalar").load()
    msg = str(info.value)
    assert "building op 'broken_test_op' failed" in msg and "undefined_symbol_xyz" in msg and "error" in msg
    log = pathlib.Path(msg.split("full log: ")[1].strip())
    assert log.exists() and "undefined_symbol_xyz" in log.read_text()


CONCURRENT_LOADER = textwrap.dedent("""
    import os, sys
    from deepspeed_c.ops.op_builder import UtilsBuilder
    from deepspeed_c.ops.op_builder import builder
    real = builder.OpBuilder.build_into
    def counting(self, out_dir):
        with open(os.environ["BUILD_COUNT_FILE"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        return real(self, out_dir)
    builder.OpBuilder.build_into = counting
    mod = UtilsBuilder(simd="scalar").load()
    print("loaded", mod.__name__)
""")


def test_four_processes_compile_exactly_once(cache, tmp_path):
    count_file = tmp_path / "builds.txt"
    env = dict(os.environ, DSC_CACHE_DIR=str(cache), BUILD_COUNT_FILE=str(count_file))
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT_LOADER], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert all("loaded _dsc_utils_scalar" in o for o in outs), outs
    assert len(count_file.read_text().split()) == 1


def test_registry_lists_every_builder_under_deepspeed_names():
    from deepspeed_c.ops import op_builder

    assert ALL_OPS["utils"] is UtilsBuilder
    for name, cls in ALL_OPS.items():
        assert getattr(op_builder, cls.__name__) is cls
        assert cls.NAME == name


TINY_CU = r"""
#include <cuda_runtime.h>
__global__ void fill_kernel(float *x, int n, float v) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}
extern "C" int tiny_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) return -1;
    return n;
}
"""

TINY_BINDING = r"""
#include "dsc/module.h"
#include "dsc/tensor_view.h"
int tiny_device_count(void);
static PyObject *count(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self; (void)args; (void)nargs;
    return PyLong_FromLong(tiny_device_count());
}
static PyMethodDef methods[] = {{"device_count", (PyCFunction)(void (*)(void))count, METH_FASTCALL, ""},
                                {NULL, NULL, 0, NULL}};
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR, "", -1, methods,
                                 NULL, NULL, NULL, NULL};
PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&def); }
"""


class TinyCudaBuilder(CUDAOpBuilder):
    NAME = "tiny_cuda_test_op"
    DIR = ""

    def sources(self):
        return [f"{self.DIR}/tiny.cu", f"{self.DIR}/tiny_binding.c"]


@pytest.mark.skipif(toolchain.nvcc() is None, reason="nvcc is not installed on this machine")
def test_cuda_builder_compiles_links_and_loads_without_a_gpu(cache, tmp_path):
    (tmp_path / "tiny.cu").write_text(TINY_CU)
    (tmp_path / "tiny_binding.c").write_text(TINY_BINDING)
    TinyCudaBuilder.DIR = str(tmp_path)
    b = TinyCudaBuilder(archs=["9.0"])
    assert b.is_compatible(), b.incompatible_reason()
    start = time.perf_counter()
    mod = b.load()
    assert time.perf_counter() - start < 120
    n = mod.device_count()
    # the statically linked runtime answers for itself: -1 (no driver/device) or the GPU count
    assert n == (torch.cuda.device_count() if torch.cuda.is_available() else -1)
    assert "sm_90" in " ".join(b.nvcc_args()) and b.variant() == "sm90"


def test_cuda_arch_list_parsing(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    assert toolchain._archs_from_env() == ["8.0", "9.0+PTX"]
    b = CUDAOpBuilder.__new__(CUDAOpBuilder)
    b.archs = ["8.0", "9.0+PTX"]
    args = " ".join(CUDAOpBuilder.nvcc_args(b))
    assert "code=sm_80" in args and "code=sm_90" in args and "code=compute_90" in args
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "hopper")
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST entry 'hopper'"):
        toolchain._archs_from_env()
