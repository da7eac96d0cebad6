"""The engine (`deepspeed.runtime.engine`'s path): engine.DeepSpeedEngine and what only it uses, the model and
data entry points (io), the timers and log report (report), the config accessors (accessors), the model's placement
across ranks (model_setup), the optimizer, scheduler and reducer setup (optimizer_setup), the ZeRO optimizer setup
(zero_setup) and the flops profiler and autotuning setup (profile_setup). The engine
module loads on first use of one of its names, so its collaborators can import report without it."""
from typing import Any

__all__ = ["DeepSpeedEngine", "ROUTE_TRAIN", "ROUTE_EVAL", "ROUTE_PREDICT", "ROUTE_ENCODE"]


_SUBMODULES = frozenset({"engine", "io", "report", "accessors", "model_setup", "optimizer_setup", "zero_setup",
                         "profile_setup", "data_schedules", "dynamic_batching"})


def __getattr__(name: str) -> Any:
    # DeepSpeedEngine and the rest of the former module's namespace; a submodule not imported yet is left to
    # the import system (`from deepspeed_c.runtime.engine import report` must not load the engine)
    if name in _SUBMODULES or name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module("deepspeed_c.runtime.engine.engine"), name)
