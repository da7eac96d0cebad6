"""deepspeed_c.zero (alias of deepspeed_c.runtime.zero): ZeRO's public names.

Stages 1 and 2 (with CPU optimizer offload) run: see stage_1_and_2.py. Stage 3 is not built, so
`GatheredParameters` does what DeepSpeed does for parameters that are not ZeRO-3 partitioned (a
no-op context), and `Init` is a no-op when disabled and refuses to partition when enabled."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from deepspeed_c.runtime.config_zero import ZeroStageEnum  # noqa: F401  (DeepSpeed exposes it here)

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter"]


class Init(contextlib.AbstractContextManager):
    """zero.Init(...): building a model partitioned across ranks needs ZeRO stage 3."""

    def __init__(self, module: Any = None, *args: Any, enabled: bool = True, **kwargs: Any) -> None:
        self.enabled = enabled
        if enabled:
            raise NotImplementedError("deepspeed_c: zero.Init (ZeRO stage 3 parameter partitioning) is not built "
                                      "yet; pass enabled=False or build the model without it")
        self.module = module

    def __exit__(self, *exc: Any) -> None:
        return None


@contextlib.contextmanager
def GatheredParameters(params: Any, modifier_rank: Any = None, fwd_module: Any = None,
                       enabled: bool = True) -> Iterator[None]:
    """Parameters that are not ZeRO-3 partitioned are left as they are, as in DeepSpeed."""
    yield


def register_external_parameter(module: Any, parameter: Any) -> None:
    import torch

    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")


def unregister_external_parameter(module: Any, parameter: Any) -> None:
    import torch

    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")

from deepspeed_c._lazy import lazy_exports as _lazy_exports

# submodules resolve on attribute access, as after DeepSpeed's eager imports
__getattr__, __dir__ = _lazy_exports(__name__, {})
