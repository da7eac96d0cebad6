"""Optimizer state of a pipeline checkpoint carried to another number of stages, parameter by name.

A stage's optimizer indexes its state by position, and positions change when the layers are
re-partitioned; names do not: PipelineModule registers layer i as module `str(i)` and a tied
module under `tied_modules.<key>` on every stage, so `3.weight` is the same parameter whatever
stage holds it. Each stage's `mp_rank_XX_model_states.pt` carries `param_shapes` (DeepSpeed's
field: per param group, name -> shape, in the order the optimizer steps them), which names the
positions of its `optimizer` state_dict. Loading on another degree reads every saved stage's
file, collects the per-parameter state by name and lays it out in this stage's optimizer order.

Built for a torch optimizer stepped directly (fp32, zero_optimization.stage 0): its state is
per parameter. ZeRO-1 (flat partitions) and the bf16/fp16 optimizers (masters held beside the
state) are not re-partitioned here; the caller says so and starts them fresh."""
from __future__ import annotations

import os
from typing import Any, Optional

import torch


def saved_state_by_name(tag_dir: str, stages: int) -> Optional[tuple[dict, list]]:
    """({parameter name: its optimizer state}, the saved param groups' hyperparameters) over every
    saved stage; None when a stage's file lacks the names or a torch optimizer state_dict."""
    by_name: dict = {}
    groups: list = []
    for s in range(stages):
        path = os.path.join(tag_dir, f"mp_rank_{s:02d}_model_states.pt")
        if not os.path.isfile(path):
            return None
        st = torch.load(path, map_location="cpu", weights_only=False)
        opt, shapes = st.get("optimizer"), st.get("param_shapes")
        if not isinstance(opt, dict) or "state" not in opt or "param_groups" not in opt or not shapes:
            return None
        if len(shapes) != len(opt["param_groups"]):
            return None
        for g, (names, group) in enumerate(zip(shapes, opt["param_groups"])):
            if len(names) != len(group["params"]):
                return None
            for name, idx in zip(names, group["params"]):
                # a tied weight is saved by each stage holding it, with equal states: the first is kept
                by_name.setdefault(name, (g, opt["state"].get(idx)))
            if g >= len(groups):  # hyperparameters (lr...) as the first stage holding the group saved them
                groups.append({k: v for k, v in group.items() if k != "params"})
    return by_name, groups


def restore_by_name(optimizer: torch.optim.Optimizer, names: list[list[str]], tag_dir: str,
                    stages: int) -> Optional[str]:
    """Loads `optimizer` (a torch optimizer over this stage's parameters; `names[g]` names group g's
    parameters in order) from the files of a `stages`-stage checkpoint. Returns None when done, else
    why it could not (the optimizer is then untouched)."""
    saved = saved_state_by_name(tag_dir, stages)
    if saved is None:
        return "the checkpoint's stage files do not name their optimizer states (param_shapes)"
    by_name, groups = saved
    if len(groups) != len(optimizer.param_groups):
        return f"the checkpoint has {len(groups)} param groups, this optimizer {len(optimizer.param_groups)}"
    current = optimizer.state_dict()
    state: dict = {}
    for g, (group_names, group) in enumerate(zip(names, current["param_groups"])):
        for name, idx in zip(group_names, group["params"]):
            if name not in by_name:
                return f"parameter {name!r} has no saved optimizer state"
            saved_g, st = by_name[name]
            if saved_g != g:
                return f"parameter {name!r} was in param group {saved_g}, here in group {g}"
            if st is not None:
                state[idx] = st
    param_groups = [dict(saved_hp, params=group["params"]) for saved_hp, group in zip(groups, current["param_groups"])]
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})
    return None
