"""JIT op builder: one small class per op names its sources and flags; `load()` compiles them
with the system C compiler (and nvcc for .cu) on first use into a content-keyed cache and imports
the result. Several ranks starting at once compile exactly once (a file lock per build key). Sources
that do not depend on the op they are linked into (shared_sources(): tensor views, the multi-tensor
launch code, the CPU optimizers' argument parsing) are compiled once per content and command into
the cache's objects/ folder and linked by every op that uses them.

This module must not import torch: setup.py uses it for the opt-in ahead-of-time build
(DS_BUILD_OPS=1), where torch may not be importable.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

from . import toolchain

SIMD_LEVELS = ("avx512", "avx2", "scalar")
SIMD_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
               "-DDSC_SIMD_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DDSC_SIMD_AVX2"],
    "scalar": ["-DDSC_SIMD_SCALAR", "-fno-tree-vectorize"],
}
LIMITED_API_HEX = "0x030A0000"

_loaded: dict[str, ModuleType] = {}


class OpBuildError(RuntimeError):
    """A JIT build failed; the message quotes the compiler's first error line and the log path."""


def csrc_root() -> Path:
    """Sources ship inside an installed package as deepspeed_c/_csrc; a checkout has csrc/."""
    override = os.environ.get("DSC_CSRC_ROOT")
    if override:
        return Path(override)
    here = Path(__file__).resolve().parent
    for candidate in (here.parent.parent / "_csrc", here.parent / "csrc"):
        if (candidate / "include" / "dsc").is_dir():
            return candidate
    raise OpBuildError(f"cannot find deepspeed_c's C sources (looked for _csrc/ and csrc/ near {here})")


def cache_root() -> Path:
    return Path(os.environ.get("DSC_CACHE_DIR") or Path.home() / ".cache" / "deepspeed_c")


def prebuilt_root() -> Path:
    return Path(__file__).resolve().parent.parent.parent / "_prebuilt"


class OpBuilder:
    """Base of every op builder. Subclasses set NAME and implement sources()."""

    NAME: str = ""
    # Limited API (abi3) unless a binding needs more of CPython; then the key carries the
    # interpreter's cache tag instead.
    LIMITED_API: bool = True

    def __init__(self) -> None:
        if not self.NAME:
            raise TypeError(f"{type(self).__name__} must set NAME")

    # --- what a subclass describes -------------------------------------------------------
    def sources(self) -> list[str]:
        """Source paths relative to csrc/ (.c and .cu)."""
        raise NotImplementedError

    def shared_sources(self) -> list[str]:
        """Those of this op's sources whose object does not depend on the op it is linked into (no
        DSC_MODULE_NAME, no module init): each is compiled once per content and command into the cache's
        objects/ folder and linked from there by every op built with the same flags."""
        return ["py/tensor_view.c"]

    def include_paths(self) -> list[str]:
        return [str(csrc_root() / "include"), sysconfig.get_paths()["include"]]

    def cxx_args(self) -> list[str]:
        """Flags for the C compiler (DeepSpeed's name; our sources are C11)."""
        # the sanitizer flags (DSC_SANITIZE=1) enter the build key through these: a sanitized op has its own
        # cache folder and never replaces the plain build
        return ["-O3", "-std=c11", "-fPIC", "-Wall", "-Wextra", "-Wno-unused-parameter",
                "-fno-math-errno", "-fvisibility=hidden", "-DNDEBUG", *toolchain.sanitize_flags()]

    def nvcc_args(self) -> list[str]:
        return []

    def extra_ldflags(self) -> list[str]:
        return []

    def variant(self) -> str:
        """A short tag distinguishing builds of one op (ISA, CUDA arch)."""
        return "generic"

    def incompatible_reason(self) -> str | None:
        """None when this op can be built and run here, else why not."""
        if not toolchain.c_compiler():
            return "no C compiler found (set CC or install gcc)"
        if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
            return f"Python headers not found in {sysconfig.get_paths()['include']} (install python3-dev)"
        return None

    # --- DeepSpeed's builder interface ---------------------------------------------------
    @staticmethod
    def is_rocm_pytorch() -> bool:
        """Whether torch was built for ROCm (DeepSpeed's query; Megatron-DeepSpeed reads it at import)."""
        import torch

        return getattr(torch.version, "hip", None) is not None

    @staticmethod
    def installed_rocm_version() -> tuple[int, int]:
        """(major, minor) of the ROCm torch was built for; (0, 0) without ROCm (DeepSpeed's query, which its
        1-bit optimizer tests read at import)."""
        import torch

        hip = getattr(torch.version, "hip", None)
        if not hip:
            return (0, 0)
        parts = str(hip).split(".")
        return (int(parts[0]), int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0)

    @staticmethod
    def is_sycl_enabled() -> bool:
        """DeepSpeed's query; deepspeed_c builds no SYCL ops."""
        return False

    def absolute_name(self) -> str:
        return f"deepspeed_c.ops.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        reason = self.incompatible_reason()
        if reason and verbose:
            print(f"[deepspeed_c] op {self.NAME} is not compatible here: {reason}", file=sys.stderr)
        return reason is None

    def module_name(self) -> str:
        return f"_dsc_{self.NAME}_{self.variant()}"

    def build_key(self) -> str:
        """Hash of everything that changes the binary: sources, headers, flags, toolchain, ABI."""
        h = hashlib.sha256()
        root = csrc_root()
        for rel in self.all_sources():
            h.update(rel.encode())
            h.update((root / rel).read_bytes())
        _hash_headers(h, root, self.all_sources())
        for part in (self.NAME, self.variant(), self.module_name(), " ".join(self.cxx_args()),
                     " ".join(self.nvcc_args()), " ".join(self.extra_ldflags()),
                     toolchain.c_compiler_version(), self._abi_tag()):
            h.update(part.encode())
            h.update(b"\0")
        if any(s.endswith(".cu") for s in self.all_sources()):
            h.update(toolchain.nvcc_version().encode())
        return h.hexdigest()[:20]

    def all_sources(self) -> list[str]:
        srcs = list(self.sources())
        if "py/tensor_view.c" not in srcs:
            srcs.append("py/tensor_view.c")
        return srcs

    def _abi_tag(self) -> str:
        return "abi3" if self.LIMITED_API else sys.implementation.cache_tag

    def build_dir(self) -> Path:
        return cache_root() / self.NAME / self.build_key()

    def built_path(self) -> Path:
        return self.build_dir() / f"{self.module_name()}.so"

    def is_built(self) -> bool:
        return self.built_path().exists() or self._prebuilt_path().exists()

    def _prebuilt_path(self) -> Path:
        return prebuilt_root() / self.NAME / self.build_key() / f"{self.module_name()}.so"

    def load(self, verbose: bool = False) -> ModuleType:
        """Build on first use (cached) and import the op's extension module."""
        key = f"{self.NAME}:{self.build_key()}"
        if key in _loaded:
            return _loaded[key]
        reason = self.incompatible_reason()
        if reason:
            raise OpBuildError(f"op '{self.NAME}' cannot be built here: {reason}")
        path = self._prebuilt_path()
        if not path.exists():
            path = self.built_path()
            if not path.exists():
                self._build_locked(verbose)
        module = _import_extension(self.module_name(), path)
        _loaded[key] = module
        return module

    def jit_load(self, verbose: bool = True) -> ModuleType:
        return self.load(verbose=verbose)

    # --- building ---------------------------------------------------------------------
    def _build_locked(self, verbose: bool) -> None:
        from filelock import FileLock

        out_dir = self.build_dir()
        out_dir.mkdir(parents=True, exist_ok=True)
        with FileLock(str(out_dir) + ".lock"):
            if self.built_path().exists():
                return  # another rank built it while we waited
            start = time.perf_counter()
            self.build_into(out_dir)
            if verbose:
                print(f"[deepspeed_c] built op {self.NAME} ({self.variant()}) in "
                      f"{time.perf_counter() - start:.2f}s -> {self.built_path()}", file=sys.stderr)

    def build_into(self, out_dir: Path, objects_dir: Path | None = None) -> Path:
        """Compile and link into out_dir/<module>.so atomically; returns the path. The shared sources'
        objects are taken from (or compiled into) objects_dir, by default the cache's objects/."""
        out_dir.mkdir(parents=True, exist_ok=True)
        log_path = out_dir / "build.log"
        tmp = out_dir / f"tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        root = csrc_root()
        objects_dir = objects_dir or cache_root() / "objects"
        shared = set(self.shared_sources())
        objects: list[Path] = []  # in link order
        jobs: list[tuple[list[str], Path, Path | None]] = []  # (command, its output, where a shared object goes)
        log: list[str] = []
        for rel in self.all_sources():
            obj = tmp / (rel.replace("/", "__") + ".o")
            if rel not in shared:
                jobs.append((self.compile_command(root / rel, obj), obj, None))
                objects.append(obj)
                continue
            cmd = self.compile_command(root / rel, obj, per_op=False)
            kept = objects_dir / f"{obj.stem}-{_object_key(root, rel, cmd, obj)}.o"
            objects.append(kept)
            if kept.exists() and kept.with_suffix(".log").exists():  # compiled before (this op or another)
                log.append(f"# {rel}: compiled object reused from {kept}\n" + kept.with_suffix(".log").read_text())
            else:
                jobs.append((cmd, obj, kept))
        try:
            with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
                results = list(pool.map(lambda job: _run(job[0]), jobs))
            for (cmd, obj, kept), (code, output) in zip(jobs, results):
                entry = "$ " + " ".join(cmd) + "\n" + output
                log.append(entry)
                if code == 0 and kept is not None:
                    _keep_object(obj, kept, entry)
            failed = [output for code, output in results if code != 0]
            if failed:
                self._fail(log_path, log, failed[0])
            target = out_dir / f"{self.module_name()}.so"
            link = self.link_command(objects, tmp / target.name)
            code, output = _run(link)
            log.append("$ " + " ".join(link) + "\n" + output)
            if code != 0:
                self._fail(log_path, log, output)
            os.replace(tmp / target.name, target)  # atomic: readers see a whole file or none
            log_path.write_text("\n".join(log))
            return target
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _fail(self, log_path: Path, log: list[str], output: str) -> None:
        log_path.write_text("\n".join(log))
        raise OpBuildError(f"building op '{self.NAME}' failed: {_first_error_line(output)}\n"
                           f"  full log: {log_path}")

    def common_defines(self, per_op: bool = True) -> list[str]:
        """per_op False: for a shared source, which must not depend on the op's module name."""
        flags = [f"-DDSC_MODULE_NAME={self.module_name()}"] if per_op else []
        if self.LIMITED_API:
            flags.append(f"-DPy_LIMITED_API={LIMITED_API_HEX}")
        return flags

    def compile_command(self, src: Path, obj: Path, per_op: bool = True) -> list[str]:
        includes = [f"-I{p}" for p in self.include_paths()]
        return [toolchain.c_compiler(), *self.cxx_args(), *self.common_defines(per_op), *includes,
                "-c", str(src), "-o", str(obj)]

    def link_command(self, objects: list[Path], target: Path) -> list[str]:
        return [toolchain.c_compiler(), "-shared", *map(str, objects), "-o", str(target),
                *self.extra_ldflags(), *toolchain.sanitize_flags()]


class CPUOpBuilder(OpBuilder):
    """An op for the CPU: OpenMP, and the widest SIMD path the running CPU executes
    (AVX-512, AVX2 or scalar; DSC_SIMD or the simd argument force one)."""

    def __init__(self, simd: str | None = None) -> None:
        super().__init__()
        chosen = simd or os.environ.get("DSC_SIMD") or toolchain.detect_simd()
        if chosen not in SIMD_LEVELS:
            raise ValueError(f"simd must be one of {SIMD_LEVELS}, got {chosen!r} "
                             f"(from {'the simd argument' if simd else 'DSC_SIMD'})")
        self.simd = chosen

    def variant(self) -> str:
        return self.simd

    def simd_width(self) -> str:
        return self.simd

    def cxx_args(self) -> list[str]:
        return [*super().cxx_args(), "-fopenmp", *SIMD_FLAGS[self.simd]]

    def extra_ldflags(self) -> list[str]:
        return ["-fopenmp"]

    def incompatible_reason(self) -> str | None:
        base = super().incompatible_reason()
        if base:
            return base
        missing = toolchain.missing_isa(self.simd)
        if missing:
            return f"this CPU lacks {', '.join(missing)} needed by the {self.simd} path (use DSC_SIMD=avx2 or scalar)"
        return None


class CUDAOpBuilder(OpBuilder):
    """An op with CUDA kernels: .cu through nvcc (no torch headers), C bindings through the C
    compiler, cudart linked statically so the module needs no runtime library path."""

    def __init__(self, archs: list[str] | None = None) -> None:
        super().__init__()
        self.archs = archs or toolchain.cuda_archs()

    def variant(self) -> str:
        return "sm" + "_".join(a.replace(".", "").replace("+PTX", "p") for a in self.archs)

    def nvcc_args(self) -> list[str]:
        args = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden", "-DNDEBUG",
                "--expt-relaxed-constexpr"]
        for arch in self.archs:
            num = arch.replace(".", "").replace("+PTX", "")
            args += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
            if arch.endswith("+PTX"):
                args += ["-gencode", f"arch=compute_{num},code=compute_{num}"]
        return args

    def cxx_args(self) -> list[str]:
        return [*super().cxx_args(), "-DDSC_WITH_CUDA"]

    def include_paths(self) -> list[str]:
        home = toolchain.cuda_home()
        return [*super().include_paths(), *([str(Path(home) / "include")] if home else [])]

    def extra_ldflags(self) -> list[str]:
        home = toolchain.cuda_home()
        libdirs = [f"-L{d}" for d in toolchain.cuda_lib_dirs(home)] if home else []
        return [*libdirs, "-lcudart_static", "-lstdc++", "-lpthread", "-ldl", "-lrt"]

    def compile_command(self, src: Path, obj: Path, per_op: bool = True) -> list[str]:
        if src.suffix != ".cu":
            return super().compile_command(src, obj, per_op)
        includes = [f"-I{p}" for p in self.include_paths()]
        module = [f"-DDSC_MODULE_NAME={self.module_name()}"] if per_op else []
        return [toolchain.nvcc(), *self.nvcc_args(), *module, *includes, "-c", str(src), "-o", str(obj)]

    def incompatible_reason(self) -> str | None:
        base = super().incompatible_reason()
        if base:
            return base
        if not toolchain.nvcc():
            return "nvcc not found (set CUDA_HOME or put the CUDA toolkit's bin/ on PATH)"
        if not toolchain.cudart_static_available():
            return f"libcudart_static.a not found under {toolchain.cuda_home()}"
        driver = toolchain.cuda_driver_version()
        toolkit = toolchain.nvcc_cuda_version()
        if driver is not None and toolkit is not None and driver < toolkit:
            return (f"the CUDA driver supports CUDA {driver[0]}.{driver[1]} but nvcc is CUDA "
                    f"{toolkit[0]}.{toolkit[1]}: update the driver or use an older toolkit (CUDA_HOME)")
        return None


def _hash_headers(h: "hashlib._Hash", root: Path, sources: list[str]) -> None:
    """Shared headers, and headers kept beside the sources (csrc/cpu/*.h, csrc/cuda/*.cuh): a change to any
    of them must rebuild, never reuse a stale binary or object."""
    dirs = {root / "include"} | {(root / rel).parent for rel in sources}
    headers = {f for d in dirs for pat in ("*.h", "*.cuh", "*.hpp") for f in d.rglob(pat)}
    for header in sorted(headers):
        h.update(str(header.relative_to(root)).encode())
        h.update(header.read_bytes())


def _object_key(root: Path, rel: str, cmd: list[str], obj: Path) -> str:
    """Hash of what one shared object depends on: its source, the headers it may include, the compile
    command (flags, defines, include paths; not where it writes) and the compiler's version."""
    h = hashlib.sha256()
    h.update(rel.encode())
    h.update((root / rel).read_bytes())
    _hash_headers(h, root, [rel])
    for part in cmd:
        h.update(b"<obj>" if part == str(obj) else part.encode())
        h.update(b"\0")
    h.update((toolchain.nvcc_version() if rel.endswith(".cu") else toolchain.c_compiler_version()).encode())
    return h.hexdigest()[:20]


def _keep_object(obj: Path, kept: Path, log_entry: str) -> None:
    """Moves a freshly compiled shared object into the objects folder, its compiler output beside it; both
    atomically, the log first, so whoever sees the object also sees its log (concurrent builds of the same
    object write the same bytes)."""
    kept.parent.mkdir(parents=True, exist_ok=True)
    log_tmp = kept.parent / f"{kept.stem}.{os.getpid()}.log.tmp"
    log_tmp.write_text(log_entry)
    os.replace(log_tmp, kept.with_suffix(".log"))
    obj_tmp = kept.parent / f"{kept.stem}.{os.getpid()}.o.tmp"
    shutil.copyfile(obj, obj_tmp)
    os.replace(obj_tmp, kept)


def _run(cmd: list[str]) -> tuple[int, str]:
    # the compilers never run with a sanitizer runtime preloaded (scripts/sanitize_tests.sh preloads libasan
    # into the Python process; nvcc crashes under it)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} if "LD_PRELOAD" in os.environ else None
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return proc.returncode, proc.stdout


def _first_error_line(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in lines:
        if "error" in ln.lower():
            return ln
    return lines[0] if lines else "(the compiler printed nothing)"


def _import_extension(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    if spec is None:
        raise OpBuildError(f"cannot import built op {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
