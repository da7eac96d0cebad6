"""The DeepSpeed config (`deepspeed.runtime.config`'s path), parsed once into typed objects: ds_config holds
DeepSpeedConfig; its sections live beside it (batch, precision, optim, zero, sections, no_effect) over the
pydantic base (utils)."""
from typing import Any

from deepspeed_c.runtime.config import ds_config
from deepspeed_c.runtime.config.ds_config import *  # noqa: F401,F403
from deepspeed_c.runtime.config.ds_config import __all__  # noqa: F401


def __getattr__(name: str) -> Any:
    # the rest of the former module's namespace (constants and helpers DeepSpeed's module also exposes),
    # then the optimizer-name constants (ADAM_OPTIMIZER, ...) that DeepSpeed's module defines itself
    from deepspeed_c.runtime.config import optim
    for module in (ds_config, optim):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
