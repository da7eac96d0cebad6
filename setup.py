"""Builds deepspeed_c with setuptools alone: no pybind11, no torch C++ headers, and torch is
never imported here. The always-present core module `deepspeed_c._C` is plain C11 against the
CPython limited API (abi3, one build for every Python >= 3.10). Every other op is JIT-built on
first use by op_builder/; DS_BUILD_OPS=1 builds the compatible ones ahead of time instead."""
import glob
import os
import shutil
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
from op_builder.toolchain import sanitize_flags  # noqa: E402  (imports no torch)

SANITIZE = sanitize_flags()
SANITIZE_BUILD_LIB = os.path.join(ROOT, "build", "sanitize")
LIMITED_API = 0x030A0000  # Python 3.10


def core_sources() -> list[str]:
    srcs = sorted(glob.glob("csrc/core/*.c")) + ["csrc/py/tensor_view.c"]
    srcs += sorted(glob.glob("csrc/py/core_*.c"))
    return srcs


core = Extension(
    "deepspeed_c._C",
    sources=core_sources(),
    include_dirs=["csrc/include"],
    define_macros=[("Py_LIMITED_API", hex(LIMITED_API))],
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                        "-fvisibility=hidden", *SANITIZE],
    extra_link_args=SANITIZE,
    py_limited_api=True,
)


class BuildExtSanitizeApart(build_ext):
    """DSC_SANITIZE=1 builds `_C` into build/sanitize/deepspeed_c/ (the package's __path__ reaches it through
    DSC_CORE_DIR), never in place: the normal in-place `_C` is not overwritten by a sanitized one."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if SANITIZE:
            self.inplace = False
            self.build_lib = SANITIZE_BUILD_LIB
            self.build_temp = os.path.join(ROOT, "build", "sanitize-tmp")


class BuildPyWithSources(build_py):
    """Ships csrc/ inside the package (the JIT builder compiles from it at run time) and, when
    DS_BUILD_OPS=1, builds the compatible ops ahead of time into deepspeed_c/_prebuilt."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return  # an editable install compiles from the checkout's csrc/
        target = os.path.join(self.build_lib, "deepspeed_c", "_csrc")
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(os.path.join(ROOT, "csrc"), target)
        prebuilt = os.path.join(self.build_lib, "deepspeed_c", "_prebuilt")
        shutil.rmtree(prebuilt, ignore_errors=True)  # an earlier build's binaries must not ship
        if os.environ.get("DS_BUILD_OPS", "0") == "1":
            from op_builder.aot import build_all_ahead_of_time

            build_all_ahead_of_time(prebuilt, csrc_root=target)


setup(
    packages=[p for p in __import__("setuptools").find_packages(include=["deepspeed_c", "deepspeed_c.*"])]
    + ["deepspeed_c.ops.op_builder"],
    package_dir={"deepspeed_c.ops.op_builder": "op_builder"},
    ext_modules=[core],
    cmdclass={"build_py": BuildPyWithSources, "build_ext": BuildExtSanitizeApart},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
