"""An interleaved schedule rebuilds this rank's layers (PipelineModule.set_virtual_stages) inside
initialize(), after the caller took `model_parameters` from the model it built: those tensors are
no longer the model's, and an optimizer over them would step nothing the model uses. This maps
them, by parameter name, onto the rebuilt model; what cannot be mapped raises naming
`model_parameters` instead of training silently on dead tensors."""
from __future__ import annotations

from typing import Any

import torch


def rebind_model_parameters(given: Any, names_before: dict[int, str], model: torch.nn.Module) -> list[Any]:
    """`given`: model_parameters as passed (tensors, or param-group dicts); `names_before`: id of each
    parameter of the model before the rebuild -> its name. Returns the same structure over the
    rebuilt model's parameters."""
    items = list(given)
    after = dict(model.named_parameters())
    ids_after = {id(p): n for n, p in after.items()}
    groups = [g for g in items if isinstance(g, dict)]
    if groups and len(groups) != len(items):
        raise TypeError("model_parameters mixes parameter-group dicts and tensors")

    def names_of(params: Any) -> list[str]:
        out = []
        for p in ([params] if isinstance(params, torch.Tensor) else list(params)):
            name = names_before.get(id(p), ids_after.get(id(p)))
            if name is None:
                raise ValueError("model_parameters holds a tensor that is not a parameter of the PipelineModule; "
                                 "with pipeline.virtual_stages > 1 the layers are rebuilt in initialize(), so "
                                 "only the module's own parameters can be carried over")
            out.append(name)
        return out

    if not groups:
        covered = set(names_of(items))
        if covered >= set(names_before.values()):  # every parameter: every parameter of the rebuilt model
            return list(model.parameters())
        groups = [{"params": items}]
        flat = True
    else:
        flat = False
    rebound = []
    covered = set()
    for g in groups:
        names = names_of(g["params"])
        covered.update(names)
        rebound.append({**g, "params": [after[n] for n in names if n in after]})
    unplaced = sorted(n for n, p in after.items() if p.requires_grad and n not in covered)
    if unplaced and len(rebound) == 1 and covered >= set(names_before.values()):
        # one group over every parameter (an optimizer built on model.parameters()): the new ones join it
        rebound[0]["params"] += [after[n] for n in unplaced]
        unplaced = []
    if unplaced:
        raise ValueError(
            f"model_parameters: pipeline.virtual_stages > 1 rebuilt this rank's layers, and {len(unplaced)} of the "
            f"rebuilt model's trainable parameters ({', '.join(unplaced[:4])}{', ...' if len(unplaced) > 4 else ''}) "
            "belong to no group given (they were on another rank before). Pass model_parameters=None (all of "
            "them), all of the module's parameters, or groups built after calling "
            "model.set_virtual_stages(virtual_stages) yourself")
    return rebound[0]["params"] if flat else rebound


def rebind_optimizer(optimizer: torch.optim.Optimizer, names_before: dict[int, str], model: torch.nn.Module) -> None:
    """The same for an optimizer the caller built before initialize(): its groups are pointed at the
    rebuilt parameters in place (it must not have stepped yet: its state belongs to the old tensors)."""
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError("optimizer: pipeline.virtual_stages > 1 rebuilds this rank's layers in initialize(); an "
                         "optimizer that has already stepped cannot follow them (build it after initialize, or "
                         "pass a callable)")
    groups = rebind_model_parameters([dict(g) for g in optimizer.param_groups], names_before, model)
    optimizer.state.clear()
    for group, new in zip(optimizer.param_groups, groups):
        group["params"] = new["params"]
