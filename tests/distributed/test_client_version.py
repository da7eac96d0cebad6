"""Version identity under the alias, as the clients read it: `deepspeed.__version__` is the installed
distribution's version (clients parse one or the other against a minimum), the parts DeepSpeed exposes
(`__version_major__/minor/patch` as ints, `__git_hash__`, `__git_branch__`) agree with it, and the
gates the clients apply pass: packaging's `>= 0.9.3` (accelerate, transformers), Lightning's
RequirementCache("deepspeed>=0.16.0"). deepspeed_c's own `__version__` is the same string (the DeepSpeed
release matched, then ours after `+dsc.`), and its own distribution carries it too."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("lightning_utilities", reason="lightning is in requirements-lock.txt; install it to run this test")
ROOT = pathlib.Path(__file__).resolve().parents[2]

PROBE = r"""
import importlib.metadata, json
from packaging.version import Version, parse
import deepspeed, deepspeed_c
dist = importlib.metadata.version("deepspeed")
v = parse(deepspeed.__version__)
out = {
    "version": deepspeed.__version__, "dist": dist, "dsc": deepspeed_c.__version__,
    "dsc_dist": importlib.metadata.version("deepspeed_c"),
    "parts": [deepspeed.__version_major__, deepspeed.__version_minor__, deepspeed.__version_patch__],
    "parsed": [v.major, v.minor, v.micro], "local": v.local,
    "git": [deepspeed.__git_hash__, deepspeed.__git_branch__],
    "gate_093": v >= Version("0.9.3"), "gate_dist_093": parse(dist) >= Version("0.9.3"),
}
from lightning_utilities.core.imports import RequirementCache  # Lightning's gate on its DeepSpeed strategy
out["lightning_gate"] = bool(RequirementCache("deepspeed>=0.16.0"))
print("VERSION_PROBE", json.dumps(out))
"""


def test_alias_version_is_the_distributions(compat_alias):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(compat_alias), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout
    import json

    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("VERSION_PROBE "))
    out = json.loads(line[len("VERSION_PROBE "):])
    assert out["version"] == out["dist"], out  # what clients parse is what pip reports
    assert out["dsc"] == out["version"] == out["dsc_dist"], out
    assert out["parts"] == out["parsed"] and all(isinstance(p, int) for p in out["parts"]), out
    assert out["local"] is not None and out["local"].startswith("dsc."), out  # ours, after the DeepSpeed release
    assert all(isinstance(g, str) and g for g in out["git"]), out
    assert out["gate_093"] and out["gate_dist_093"], out
    assert out["lightning_gate"] is True, out
