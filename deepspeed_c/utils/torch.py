"""DeepSpeed's `deepspeed.utils.torch`: small torch-version helpers that scripts and extensions import."""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from packaging import version as _version

__all__ = ["required_torch_version", "register_grad_hook"]


def required_torch_version(min_version: Optional[Union[str, float]] = None,
                           max_version: Optional[Union[str, float]] = None) -> bool:
    """Whether the running torch lies within [min_version, max_version] (either bound may be left out,
    not both: that is an AssertionError, as in DeepSpeed). Bounds may be numbers such as 2.1."""
    assert min_version or max_version, "required_torch_version needs min_version or max_version"
    running = _version.parse(torch.__version__)
    if min_version and running < _version.parse(str(min_version)):
        return False
    return not (max_version and running > _version.parse(str(max_version)))


def register_grad_hook(param: torch.nn.Parameter, hook: Callable[[torch.Tensor], Any]) -> Any:
    """Runs hook(param) once param.grad has been accumulated; returns the removable handle. The
    supported torch range (>= 2.1) always has the post-accumulate hook."""
    return param.register_post_accumulate_grad_hook(hook)
