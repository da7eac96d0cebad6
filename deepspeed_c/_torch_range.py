"""The PyTorch versions deepspeed_c supports, checked when deepspeed_c is imported.

The extension uses no torch C++ header (DLPack and the CPython API only), so one build serves every
torch in the range; CI runs the pinned torch and the oldest one (scripts/old_torch_tests.sh). Below the
range Python-side features are missing (and a C extension must not be where that shows up), so importing
raises one ImportError naming the range. The check reads torch's version file and does not import torch:
`import deepspeed_c` stays cheap.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys

MIN_TORCH = (2, 6)  # the oldest torch CI runs (scripts/requirements-old-torch.txt)
BELOW_TORCH = (3, 0)  # the first major version not supported
TESTED = ("2.6.0", "2.11.0")  # the versions CI imports the same built _C under
OVERRIDE_ENV = "DSC_ALLOW_ANY_TORCH"


def supported_range() -> str:
    return f"torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, < {BELOW_TORCH[0]}.{BELOW_TORCH[1]}"


def parse_version(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as '2.6.0+cu124' or '2.12.0a0+git1234'."""
    m = re.match(r"\s*(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"cannot read a torch version from {version!r}")
    return int(m.group(1)), int(m.group(2))


def installed_torch_version() -> str | None:
    """The version of the torch this process imports (or would import), without importing it;
    None when there is no torch to import."""
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__version__", None) is not None:
        return str(torch.__version__)
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "version.py")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                m = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", f.read(), re.MULTILINE)
            if m:
                return m.group(1)
    return None


def check_torch_version(version: str | None = None) -> None:
    """Raises ImportError naming the supported range when torch is outside it (DSC_ALLOW_ANY_TORCH=1
    skips the check). No torch at all is left to the first `import torch` to report."""
    if os.environ.get(OVERRIDE_ENV) == "1":
        return
    version = version if version is not None else installed_torch_version()
    if version is None:
        return
    try:
        found = parse_version(version)
    except ValueError:
        return  # an unreadable local build's version: let it through rather than guess
    if MIN_TORCH <= found < BELOW_TORCH:
        return
    raise ImportError(
        f"deepspeed_c supports {supported_range()} (tested: {', '.join(TESTED)}); this environment has "
        f"torch {version}. Install a supported torch (pip install 'torch>={MIN_TORCH[0]}.{MIN_TORCH[1]},"
        f"<{BELOW_TORCH[0]}'), or set {OVERRIDE_ENV}=1 to import it anyway, untested.")
