"""The whole 16-bit model of a ZeRO-3 engine on rank 0 (engine._zero3_consolidated_16bit_state_dict), one
module's parameters gathered at a time so no rank ever holds more than one module's values beyond the
copy rank 0 is assembling on the host."""
from __future__ import annotations

from collections import OrderedDict

import torch

from deepspeed_c.runtime.zero.partition_parameters import GatheredParameters


def consolidated_16bit_state_dict(module: torch.nn.Module, rank: int,
                                  exclude_frozen_parameters: bool = False) -> "OrderedDict[str, torch.Tensor]":
    """Collective (every rank calls it); the state dict is filled on rank 0 only, empty elsewhere. A
    parameter shared by several modules appears under each of its names as the same tensor."""
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    seen: dict[int, str] = {}

    def walk(m: torch.nn.Module, prefix: str) -> None:
        own = [(n, p) for n, p in dict.items(m._parameters) if p is not None]
        with GatheredParameters([p for _, p in own]):
            if rank == 0:
                for name, p in own:
                    if exclude_frozen_parameters and not p.requires_grad:
                        continue
                    key = prefix + name
                    if id(p) in seen:
                        out[key] = out[seen[id(p)]]
                        continue
                    out[key] = p.detach().to("cpu", copy=True)
                    seen[id(p)] = key
        if rank == 0:
            for name, buf in m._buffers.items():
                if buf is not None and name not in m._non_persistent_buffers_set:
                    out[prefix + name] = buf.detach().to("cpu", copy=True)
        for name, child in m._modules.items():
            if child is not None:
                walk(child, prefix + name + ".")

    walk(module, "")
    return out
