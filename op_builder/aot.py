"""Ahead-of-time builds (opt-in at install: DS_BUILD_OPS=1 pip install .). Each compatible op is
built into <prebuilt>/<op>/<key>/, where `load()` looks before its JIT cache. Per-op opt-out as
DeepSpeed: DS_BUILD_<OP>=0 (e.g. DS_BUILD_CPU_ADAM=0)."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from .all_ops import ALL_OPS


def build_all_ahead_of_time(prebuilt_dir: str, csrc_root: str | None = None) -> list[str]:
    if csrc_root:
        os.environ["DSC_CSRC_ROOT"] = csrc_root  # build from the copy shipped in the package
    built = []
    objects = Path(prebuilt_dir) / ".objects"  # the shared sources' objects, compiled once for the ops using them
    for name, cls in sorted(ALL_OPS.items()):
        if os.environ.get(f"DS_BUILD_{name.upper()}", "1") == "0":
            continue
        builder = cls()
        reason = builder.incompatible_reason()
        if reason:
            print(f"[deepspeed_c] skipping AOT build of {name}: {reason}", file=sys.stderr)
            continue
        out = Path(prebuilt_dir) / name / builder.build_key()
        builder.build_into(out, objects_dir=objects)
        built.append(name)
        print(f"[deepspeed_c] AOT-built {name} -> {out}", file=sys.stderr)
    shutil.rmtree(objects, ignore_errors=True)
    os.environ.pop("DSC_CSRC_ROOT", None)
    return built
