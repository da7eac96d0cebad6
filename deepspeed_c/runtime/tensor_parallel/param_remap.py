"""Parameters replaced by AutoTP's sharding, followed in what the caller built before deepspeed.initialize.

The Hugging Face Trainer (and any script that builds its optimizer first) hands initialize an optimizer and
a parameter list made from the whole model; AutoTP then swaps each column/row-parallel Linear for a layer that
holds this rank's shard as a new Parameter. Left alone, the optimizer would step the discarded whole weights
while the model trains nothing but its replicated parts. As DeepSpeed does, each replaced parameter is swapped
for its shard in the client optimizer's groups and in model_parameters; an optimizer that already holds state
for a replaced parameter cannot be carried over and is refused."""
from __future__ import annotations

from typing import Any

import torch


def named(model: torch.nn.Module) -> dict[int, tuple[str, torch.nn.Parameter]]:
    """id -> (name, parameter), every name a parameter has (tied ones included), before the replacement."""
    return {id(p): (n, p) for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}


def replacements(before: dict[int, tuple[str, torch.nn.Parameter]], model: torch.nn.Module) -> dict[int, Any]:
    """id of a parameter the model no longer holds -> the parameter now at its name."""
    after = dict(model.named_parameters(remove_duplicate=False))
    return {pid: after[name] for pid, (name, old) in before.items() if name in after and after[name] is not old}


def refuse_held_state(optimizer: Any, doomed: set[int]) -> None:
    """Raises when the optimizer holds state (it has stepped) for a parameter about to be replaced by its shard."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return
    held = [p for g in optimizer.param_groups for p in g["params"] if id(p) in doomed and optimizer.state.get(p)]
    if held:
        raise RuntimeError(f"deepspeed_c.initialize: the optimizer already holds state for {len(held)} parameter(s) "
                           "that tensor_parallel.autotp_size shards (first shape "
                           f"{tuple(held[0].shape)}); that state cannot follow them to their shards: build the "
                           "optimizer without stepping it, or pass an optimizer callable or the config's 'optimizer'")


def remap_optimizer(optimizer: Any, mapping: dict[int, Any]) -> None:
    if not mapping or not isinstance(optimizer, torch.optim.Optimizer):
        return  # none given, or a callable that initialize calls on the shards
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(id(p), p) for p in group["params"]]


def remap_parameters(model_parameters: Any, mapping: dict[int, Any]) -> Any:
    """model_parameters (a list of parameters or of param-group dicts, as _require_trainable leaves it) with the
    replaced parameters swapped; anything else is returned as it is."""
    if not mapping or not isinstance(model_parameters, (list, tuple)):
        return model_parameters

    def swap(entry: Any) -> Any:
        if isinstance(entry, dict) and "params" in entry:
            params = entry["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            return {**entry, "params": [mapping.get(id(p), p) for p in params]}
        return mapping.get(id(entry), entry)

    return [swap(e) for e in model_parameters]
