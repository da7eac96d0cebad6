"""Facts about the build and run environment the builders need: compilers, CPU ISA, the CUDA
toolkit, the driver, target architectures. Each is looked up once per process, on first use."""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

ISA_NEEDS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
    "scalar": (),
}


# DSC_SANITIZE=1 (scripts/sanitize_tests.sh): the core module and the C-compiled parts of every op are built
# with AddressSanitizer and UndefinedBehaviorSanitizer; any report aborts (no recovery from UB). The process
# needs libasan first in its link map: LD_PRELOAD=$(gcc -print-file-name=libasan.so).
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g"]


def sanitize_flags() -> list[str]:
    """The sanitizer compile and link flags when DSC_SANITIZE=1, else none."""
    value = os.environ.get("DSC_SANITIZE", "0")
    if value not in ("0", "1", ""):
        raise ValueError(f"DSC_SANITIZE must be 0 or 1, got {value!r}")
    return list(SANITIZE_FLAGS) if value == "1" else []


@lru_cache(maxsize=None)
def c_compiler() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


@lru_cache(maxsize=None)
def c_compiler_version() -> str:
    cc = c_compiler()
    if not cc:
        return "none"
    out = subprocess.run([cc, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


@lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """ISA flags of the running CPU, as the kernel reports them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def missing_isa(level: str) -> list[str]:
    flags = cpu_flags()
    return [f for f in ISA_NEEDS[level] if f not in flags]


@lru_cache(maxsize=None)
def detect_simd() -> str:
    for level in ("avx512", "avx2"):
        if not missing_isa(level):
            return level
    return "scalar"


@lru_cache(maxsize=None)
def cuda_home() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    nvcc_path = shutil.which("nvcc")
    if nvcc_path:
        return str(Path(nvcc_path).resolve().parent.parent)
    if Path("/usr/local/cuda/bin/nvcc").exists():
        return "/usr/local/cuda"
    return None


@lru_cache(maxsize=None)
def nvcc() -> str | None:
    home = cuda_home()
    if home and Path(home, "bin", "nvcc").exists():
        return str(Path(home, "bin", "nvcc"))
    return shutil.which("nvcc")


@lru_cache(maxsize=None)
def nvcc_version() -> str:
    exe = nvcc()
    if not exe:
        return "none"
    out = subprocess.run([exe, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    return lines[-1] if lines else "unknown"


def nvcc_cuda_version() -> tuple[int, int] | None:
    m = re.search(r"cuda_(\d+)\.(\d+)", nvcc_version())
    return (int(m.group(1)), int(m.group(2))) if m else None


def cuda_lib_dirs(home: str) -> list[str]:
    cands = [Path(home, "lib64"), Path(home, "lib"), Path(home, "targets", "x86_64-linux", "lib")]
    return [str(p) for p in cands if p.is_dir()]


def cudart_static_available() -> bool:
    home = cuda_home()
    return bool(home) and any(Path(d, "libcudart_static.a").exists() for d in cuda_lib_dirs(home))


@lru_cache(maxsize=None)
def cuda_driver_version() -> tuple[int, int] | None:
    """The CUDA version the installed driver supports, or None without a driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value // 1000, (version.value % 1000) // 10


def _archs_from_env() -> list[str] | None:
    raw = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not raw:
        return None
    archs = [a for a in re.split(r"[;\s,]+", raw.strip()) if a]
    for a in archs:
        if not re.fullmatch(r"\d+\.\d+[a]?(\+PTX)?", a):
            raise ValueError(f"TORCH_CUDA_ARCH_LIST entry {a!r} is not like '9.0' or '8.0+PTX'")
    return archs


def _archs_from_devices() -> list[str] | None:
    torch = sys.modules.get("torch")  # never import torch (or initialise CUDA) just for this
    if torch is not None and torch.cuda.is_available():
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return [f"{major}.{minor}" for major, minor in sorted(caps)]
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        caps = sorted({ln.strip() for ln in out.stdout.splitlines() if re.fullmatch(r"\d+\.\d+", ln.strip())})
        if caps:
            return caps
    return None


DEFAULT_ARCHS = ["9.0"]  # compile-only builds with no GPU visible (CI) target Hopper


@lru_cache(maxsize=None)
def cuda_archs() -> list[str]:
    return _archs_from_env() or _archs_from_devices() or list(DEFAULT_ARCHS)
