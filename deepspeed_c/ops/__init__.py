"""deepspeed_c.ops: optimizer and kernel front ends, and the op builders
(`deepspeed_c.ops.op_builder`, DeepSpeed's import path). `__compatible_ops__` maps each op name
to whether it can be built here; it is computed on first access (it probes compilers)."""
from __future__ import annotations

import os as _os
from typing import Any

from deepspeed_c._lazy import lazy_exports

# An installed package carries the builders as deepspeed_c/ops/op_builder; a plain checkout (used
# without `pip install`, e.g. after `setup.py build_ext --inplace`) has them at the top-level
# op_builder/ directory, so let this package's path reach it.
_here = _os.path.dirname(_os.path.abspath(__file__))
_checkout_root = _os.path.dirname(_os.path.dirname(_here))
if not _os.path.isdir(_os.path.join(_here, "op_builder")) and \
        _os.path.isfile(_os.path.join(_checkout_root, "op_builder", "builder.py")):
    __path__.append(_checkout_root)

_lazy_getattr, __dir__ = lazy_exports(__name__, {
    "op_builder": "deepspeed_c.ops.op_builder",
    "adam": "deepspeed_c.ops.adam",
    "adagrad": "deepspeed_c.ops.adagrad",
    "lion": "deepspeed_c.ops.lion",
    "lamb": "deepspeed_c.ops.lamb",
})


def _compatible_ops() -> dict[str, bool]:
    from deepspeed_c.ops.op_builder import ALL_OPS

    return {name: builder().is_compatible() for name, builder in ALL_OPS.items()}


def __getattr__(name: str) -> Any:
    if name == "__compatible_ops__":
        value = _compatible_ops()
        globals()[name] = value
        return value
    return _lazy_getattr(name)
