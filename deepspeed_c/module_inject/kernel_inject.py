"""Kernel injection (`replace_with_kernel_inject=True`): the decoder blocks of known architectures
are replaced by fused inference blocks that run our CUDA kernels on a GPU (a torch reference on
the host). `inject(model, config)` returns the injected model, or None when the architecture has
no kernels (the caller then falls back to AutoTP with a warning)."""
from __future__ import annotations

from typing import Any

import torch


def inject(model: torch.nn.Module, config: Any) -> torch.nn.Module | None:
    """Replace `model`'s transformer body in place; `config` is the parsed inference config (read
    duck-typed: dtype, enable_cuda_graph, max_out_tokens, tensor_parallel.tp_size)."""
    return None  # filled in by the kernel-injection work (issue 18 item 3)
