"""The Evoformer tensor-core (mma.sync) kernels checked without a GPU: g++ compiles
csrc/cuda/evoformer_{fwd,bwd}_mma.cu with -DDSC_EVO_EMULATE, which runs each CUDA thread as a host
thread and emulates ldmatrix / mma.sync / shuffles after the PTX ISA's fragment layouts
(csrc/cuda/evoformer_emulate.cuh). tests/unit/evoformer_emulate_driver.cpp runs the forward and the
three backward kernels and compares O, the log-sum-exp, dQ, dK, dV and both bias gradients with
float64 math on the same rounded inputs. Shapes cover partial tiles, D below the padded width and
not a multiple of 8 (element-wise loads), L not a multiple of 8 (element-wise bias loads), several
heads and batches, and the stack split over two blocks for the pair-bias gradient."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from op_builder import toolchain

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("evoformer_emulate_driver.cpp")
CXX = shutil.which("g++") or shutil.which("c++")


def _cuda_include() -> Path | None:
    home = toolchain.cuda_home()
    inc = Path(home) / "include" if home else None
    return inc if inc is not None and (inc / "cuda_bf16.h").exists() else None


pytestmark = pytest.mark.skipif(CXX is None or _cuda_include() is None,
                                reason="a C++ compiler and the CUDA headers are needed")


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("evo_emu") / "evo_emu"
    cmd = [CXX, "-std=c++20", "-O1", "-DDSC_EVO_EMULATE", f"-I{ROOT / 'csrc' / 'include'}",
           f"-I{ROOT / 'csrc' / 'cuda'}", f"-I{_cuda_include()}", "-Wno-attributes", "-x", "c++", str(DRIVER),
           "-o", str(exe), "-pthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return exe


@pytest.mark.parametrize("dtype,B,N,L,H,D,mask,pair", [
    ("bf16", 1, 2, 17, 2, 8, 1, 1),   # one partial tile, D padded 8 -> 32
    ("f16", 1, 3, 45, 1, 12, 1, 1),   # D % 8 != 0 and L % 8 != 0: element-wise loads; uneven stack split
    ("bf16", 1, 1, 20, 1, 64, 1, 1),  # D 64
    ("bf16", 1, 1, 70, 1, 16, 0, 0),  # two row blocks and two key tiles, the second partial; no biases
    ("f16", 2, 1, 24, 2, 32, 1, 0),   # mask bias only, two batches
])
def test_mma_kernels_match_float64(driver, dtype, B, N, L, H, D, mask, pair):
    proc = subprocess.run([str(driver), dtype, *map(str, (B, N, L, H, D, mask, pair)), str(L + D)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    errs = dict(zip(words[::2], map(float, words[1::2])))
    assert set(errs) == {"out", "lse", "dq", "dk", "dv", "dmask", "dpair"}, proc.stdout
    tol = 2e-2 if dtype == "bf16" else 5e-3  # the GPU benchmark's tolerances for the same comparison
    for name, err in errs.items():
        used = not ((name == "dmask" and not mask) or (name == "dpair" and not pair))
        if not used:
            assert err == -1.0
            continue
        assert 0.0 <= err < (1e-5 if name == "lse" else tol), f"{name}: {err:.3e} (tol {tol})"
