"""deepspeed.moe.utils: telling expert parameters apart and splitting optimizer param groups so
each expert group (`ep_size_{n}`) gets groups of its own (DeepSpeed's behaviour: one MoE group per
original group and expert group name, cut into pieces of at most max_group_size elements)."""
from __future__ import annotations

from typing import Any, Union

import torch
from torch import nn


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    from deepspeed_c.moe.layer import MoE

    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    return getattr(param, "allreduce", True) is False


def split_params_into_shared_and_expert_params(
        params: list[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    shared = [p for p in params if not is_moe_param(p)]
    expert = [p for p in params if is_moe_param(p)]
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
        group: list[nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(non-expert grads, expert grads), each in its parameter's dtype; parameters without a grad skipped."""
    shared, expert = [], []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def _numel(p: torch.Tensor) -> int:
    return getattr(p, "ds_numel", None) or p.numel()


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: Union[dict[str, Any], tuple[dict[str, Any], ...], list[dict[str, Any]]],
        max_group_size: Union[int, float, None] = 178956971) -> list[dict[str, Any]]:
    """The groups with their expert parameters moved out into new groups, one per (original group,
    expert group name), flagged 'moe': True and named after the expert group; appended after the
    originals. Original groups need a 'name' when they hold expert parameters."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    names: list[str] = []  # expert group names in first-seen order
    for g in param_groups:
        for p in g["params"]:
            if is_moe_param(p) and p.group_name not in names:
                names.append(p.group_name)
    moe_groups: list[tuple[dict[str, Any], dict[str, list]]] = []
    for g in param_groups:
        if names and "name" not in g:
            raise ValueError("split_params_into_different_moe_groups_for_optimizer: every param group needs a 'name' "
                             f"key when the model has expert parameters; got a group with keys {sorted(g)}")
        buckets: dict[str, list] = {n: [] for n in names}
        dense = []
        for p in g["params"]:
            if is_moe_param(p):
                buckets[p.group_name].append(p)
            else:
                dense.append(p)
        g["params"] = dense
        moe_groups.append((g, buckets))
    for g, buckets in moe_groups:
        for name in names:
            template = {**g, "name": name, "moe": True}
            params = buckets[name]
            if max_group_size is None:
                param_groups.append({**template, "params": params})
                continue
            cur: list = []
            size = 0
            pieces: list[list] = []
            for p in params:
                n = _numel(p)
                if size + n <= max_group_size:
                    cur.append(p)
                    size += n
                else:
                    pieces.append(cur)
                    cur, size = [p], n
            if cur:
                pieces.append(cur)
            for piece in pieces:
                param_groups.append({**template, "params": piece})
    return param_groups


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return param_group.get("moe", False)


def configure_moe_param_groups(model_parameters: list) -> list:
    """Model parameters (a list of parameters or of param groups) split into MoE-compatible groups."""
    if not isinstance(model_parameters, list):
        raise TypeError("model_parameters must be a list")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be an iterable of Tensors or "
                            f"dicts, but got {type(p)}")
    first = model_parameters[0]
    if isinstance(first, nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters,
                                                                      "name": "dense-params"})
    if not any("moe" in g for g in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters
