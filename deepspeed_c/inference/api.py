"""deepspeed.init_inference(model, config=None, **kwargs) -> InferenceEngine."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import torch

from deepspeed_c.inference.config import build_config
from deepspeed_c.inference.engine import InferenceEngine


def init_inference(model: torch.nn.Module, config: Optional[Union[str, Mapping[str, Any]]] = None,
                   **kwargs: Any) -> InferenceEngine:
    """Prepares `model` for serving: dtype, tensor parallelism (AutoTP or an injection_policy), kernel
    injection, checkpoint loading. `config` is a dict or a JSON file path; keyword arguments are merged
    into it (a key in both with different values raises)."""
    from deepspeed_c.utils.logging import log_dist
    from deepspeed_c.version import __git_branch__, __git_hash__, __version__

    log_dist(f"DeepSpeed info: version={__version__}, git-hash={__git_hash__}, git-branch={__git_branch__}", ranks=[0])
    return InferenceEngine(model, config=build_config(config, kwargs))
