"""The `ds_report` counterpart: `python -m deepspeed_c.env_report` or `dsc_report`.

Lists the toolchain and runtime versions and, for every op, whether it can be built here (and
why not), whether it is built, and where its cached binary lives. It builds nothing."""
from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Any

GREEN, RED, YELLOW, END = "\033[92m", "\033[91m", "\033[93m", "\033[0m"


def op_rows() -> list[dict[str, Any]]:
    from deepspeed_c.ops.op_builder import ALL_OPS

    rows = []
    for name, cls in sorted(ALL_OPS.items()):
        try:
            builder = cls()
            reason = builder.incompatible_reason()
            built = builder.is_built()
            path = str(builder.built_path())
        except Exception as exc:  # a broken builder is reported, not fatal to the report
            reason, built, path = f"builder error: {exc}", False, "-"
        rows.append({"op": name, "compatible": reason is None, "reason": reason or "",
                     "built": built, "path": path})
    return rows


def environment() -> dict[str, str]:
    from deepspeed_c.ops.op_builder import builder, toolchain
    import deepspeed_c

    info: dict[str, str] = {
        "deepspeed_c version": deepspeed_c.__version__,
        "deepspeed_c install path": os.path.dirname(deepspeed_c.__file__),
        "python version": platform.python_version(),
        "python executable": sys.executable,
        "C compiler": toolchain.c_compiler_version(),
        "nvcc": toolchain.nvcc_version(),
        "CUDA_HOME": str(toolchain.cuda_home()),
        "CUDA driver supports": ".".join(map(str, toolchain.cuda_driver_version() or ())) or "no driver",
        "CPU SIMD (detected)": toolchain.detect_simd(),
        "DSC_SIMD override": os.environ.get("DSC_SIMD", "(unset)"),
        "CUDA archs for builds": ";".join(toolchain.cuda_archs()),
        "op cache dir": str(builder.cache_root()),
    }
    from deepspeed_c.ops.op_builder.async_io import engine_description

    info["async_io engine"] = engine_description()
    try:
        import torch

        info["torch version"] = torch.__version__
        info["torch install path"] = os.path.dirname(torch.__file__)
        info["torch cuda version"] = str(torch.version.cuda)
        try:
            from deepspeed_c import _C

            version = _C.exchange_api_version()
            info["DLPack exchange API"] = f"{version[0]}.{version[1]}" if version else "absent (torch < 2.10)"
        except ImportError as exc:
            info["DLPack exchange API"] = f"deepspeed_c._C not importable: {exc}"
    except ImportError:
        info["torch version"] = "not installed"
    return info


def main(hide_operator_status: bool = False, hide_errors_and_warnings: bool = False, color: bool = True) -> None:
    g, r, y, e = (GREEN, RED, YELLOW, END) if color else ("", "", "", "")
    print("-" * 78)
    print("deepspeed_c C/CUDA op report")
    print("-" * 78)
    if not hide_operator_status:
        print(f"{'op name':<22}{'compatible':<14}{'built':<8}cache path / reason")
        print("-" * 78)
        for row in op_rows():
            ok = f"{g}[OKAY]{e}" if row["compatible"] else f"{r}[NO]{e}"
            built = f"{g}[YES]{e}" if row["built"] else f"{y}[NO]{e}"
            pad_ok = 14 + (len(ok) - len(ok.replace(g, "").replace(r, "").replace(e, "")))
            pad_built = 8 + (len(built) - len(built.replace(g, "").replace(y, "").replace(e, "")))
            detail = row["path"] if row["compatible"] else row["reason"]
            print(f"{row['op']:<22}{ok:<{pad_ok}}{built:<{pad_built}}{detail}")
        print("-" * 78)
    print("deepspeed_c general environment info:")
    for key, value in environment().items():
        print(f"{key + ' ':.<32} {value}")


def cli_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="deepspeed_c environment and op report")
    parser.add_argument("--hide_operator_status", action="store_true")
    parser.add_argument("--hide_errors_and_warnings", action="store_true")
    parser.add_argument("--no_color", action="store_true")
    args = parser.parse_args(argv)
    main(args.hide_operator_status, args.hide_errors_and_warnings, color=not args.no_color and sys.stdout.isatty())


if __name__ == "__main__":
    cli_main()
