"""Lazy attribute exports, so `import deepspeed_c` stays cheap (no builds, no subprocesses,
no CUDA or torch.distributed initialisation) while `deepspeed_c.initialize` and friends resolve
to the real objects on first use."""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable


def lazy_exports(module_name: str, table: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """table maps an exported name to "package.module:attr" (or "package.module" for a module)."""

    def __getattr__(name: str) -> Any:
        target = table.get(name)
        if target is None:
            # a submodule, as after DeepSpeed's eager imports: accelerate reads
            # `deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES` having only imported `deepspeed`
            if name.startswith("_") or importlib.util.find_spec(f"{module_name}.{name}") is None:
                raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
            target = f"{module_name}.{name}"
        mod_name, _, attr = target.partition(":")
        mod = importlib.import_module(mod_name)
        value = getattr(mod, attr) if attr else mod
        import sys

        setattr(sys.modules[module_name], name, value)
        return value

    def __dir__() -> list[str]:
        import sys

        return sorted(set(vars(sys.modules[module_name])) | set(table))

    return __getattr__, __dir__
