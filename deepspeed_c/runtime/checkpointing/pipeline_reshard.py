"""Optimizer state of a pipeline checkpoint carried to another number of stages, parameter by name.

A stage's optimizer indexes its state by position, and positions change when the layers are
re-partitioned; names do not: PipelineModule registers layer i as module `str(i)` and a tied
module under `tied_modules.<key>` on every stage, so `3.weight` is the same parameter whatever
stage holds it. Each stage's `mp_rank_XX_model_states.pt` carries `param_shapes` (DeepSpeed's
field: per param group, name -> shape, in the order the optimizer steps them), which names the
positions of its `optimizer` state_dict. Loading on another degree reads every saved stage's
file, collects the per-parameter state by name and lays it out in this stage's optimizer order.

At ZeRO stage 0 the state is per parameter (restore_by_name): a torch optimizer stepped directly
(fp32), or the bf16/fp16 optimizer's torch optimizer over fp32 masters, which come by name too.
ZeRO-1 keeps flat partitions (restore_zero_by_name): each saved stage's ZeRO files, one per
data-parallel rank, are put back together into whole parameters' masters and moments (DeepSpeed's
layout of that stage's groups, named by its param_shapes), and this rank's partitions are cut
from them, whatever the new data-parallel degree."""
from __future__ import annotations

import math
import os
from typing import Any, Optional

import torch

FP32_KEY = "single_partition_of_fp32_groups"


def saved_state_by_name(tag_dir: str, manifest: Optional[dict], stages: int) -> Optional[tuple[dict, list, dict]]:
    """({parameter name: (param group, its optimizer state, its fp32 master or None)}, the saved
    param groups' hyperparameters, the first stage's other optimizer fields (loss scaler...)) over
    every saved stage; None when a stage's file lacks the names or an optimizer state_dict. The files
    are read weights_only and verified against the tag's `manifest` (None: a checkpoint without one)."""
    from deepspeed_c.checkpoint import store
    from deepspeed_c.checkpoint.deepspeed_format import normalize_mixed_state

    by_name: dict = {}
    groups: list = []
    extras: dict = {}
    for s in range(stages):
        name = f"mp_rank_{s:02d}_model_states.pt"
        if not os.path.isfile(os.path.join(tag_dir, name)):
            return None
        st = store.load_file(tag_dir, name, manifest)
        opt, shapes, masters = st.get("optimizer"), st.get("param_shapes"), None
        if isinstance(opt, dict) and "optimizer_state_dict" in opt:  # bf16/fp16: masters beside the state
            mixed = normalize_mixed_state(opt)
            opt, masters = mixed["optimizer_state_dict"], mixed.get("fp32_groups")
            if s == 0:
                extras = {k: v for k, v in mixed.items() if k not in ("optimizer_state_dict", "fp32_groups")}
        if not isinstance(opt, dict) or "state" not in opt or "param_groups" not in opt or not shapes:
            return None
        if len(shapes) != len(opt["param_groups"]) or (masters is not None and len(masters) != len(shapes)):
            return None
        for g, (names, group) in enumerate(zip(shapes, opt["param_groups"])):
            if len(names) != len(group["params"]) or (masters is not None and len(masters[g]) != len(names)):
                return None
            for i, (name, idx) in enumerate(zip(names, group["params"])):
                # a tied weight is saved by each stage holding it, with equal states: the first is kept
                by_name.setdefault(name, (g, opt["state"].get(idx), None if masters is None else masters[g][i]))
            if g >= len(groups):  # hyperparameters (lr...) as the first stage holding the group saved them
                groups.append({k: v for k, v in group.items() if k != "params"})
    return by_name, groups, extras


def restore_by_name(stepper: Any, names: list[list[str]], tag_dir: str, manifest: Optional[dict],
                    stages: int) -> Optional[str]:
    """Loads `stepper` (a torch optimizer stepped directly, runtime/optimizer_seam.PlainOptimizer, or
    the bf16/fp16 MixedPrecisionOptimizer; `names[g]` names group g's model parameters in order)
    from the files of a `stages`-stage checkpoint. Returns None when done, else why it could not
    (the optimizer is then untouched)."""
    saved = saved_state_by_name(tag_dir, manifest, stages)
    if saved is None:
        return "the checkpoint's stage files do not name their optimizer states (param_shapes)"
    by_name, groups, extras = saved
    mixed = hasattr(stepper, "fp32_groups")
    optimizer = stepper.optimizer
    if len(groups) != len(optimizer.param_groups):
        return f"the checkpoint has {len(groups)} param groups, this optimizer {len(optimizer.param_groups)}"
    current = optimizer.state_dict()
    state: dict = {}
    masters: list = []
    for g, (group_names, group) in enumerate(zip(names, current["param_groups"])):
        masters.append([])
        for name, idx in zip(group_names, group["params"]):
            if name not in by_name:
                return f"parameter {name!r} has no saved optimizer state"
            saved_g, st, master = by_name[name]
            if saved_g != g:
                return f"parameter {name!r} was in param group {saved_g}, here in group {g}"
            if mixed and master is None:
                return f"parameter {name!r} has no saved fp32 master"
            if st is not None:
                state[idx] = st
            masters[-1].append(master)
    param_groups = [dict(saved_hp, params=group["params"]) for saved_hp, group in zip(groups, current["param_groups"])]
    torch_state = {"state": state, "param_groups": param_groups}
    if mixed:
        stepper.load_state_dict(dict(extras, optimizer_state_dict=torch_state, fp32_groups=masters))
    else:
        optimizer.load_state_dict(torch_state)
    return None


def _zero_stage_by_name(tag_dir: str, manifest: Optional[dict], stage: int, bf16: bool, out: dict) -> Optional[str]:
    """Adds one saved stage's ZeRO-1 state to `out` (masters, flat moments and per-group scalars by
    parameter name; the stage's param groups' hyperparameters and loss scaler)."""
    from deepspeed_c.checkpoint import deepspeed_format, store
    from deepspeed_c.ops.partition import DEEPSPEED_ALIGNMENT, PartitionPlan
    from deepspeed_c.runtime.checkpointing.zero import flat_state_keys

    model_file = f"mp_rank_{stage:02d}_model_states.pt"
    if not os.path.isfile(os.path.join(tag_dir, model_file)):
        return f"{model_file} is missing"
    st = store.load_file(tag_dir, model_file, manifest)
    shapes, world = st.get("param_shapes"), int(st.get("dp_world_size") or 1)
    if not shapes:
        return f"{model_file} does not name its parameters (param_shapes)"
    parts = []
    for r in range(world):
        name = deepspeed_format.find_zero_file(tag_dir, r, bf16, stage)
        if not os.path.isfile(os.path.join(tag_dir, name)):
            return f"{name} is missing"
        obj = store.load_file(tag_dir, name, manifest)
        parts.append(deepspeed_format.normalize_zero_state(obj["optimizer_state_dict"], None, world))
    if parts[0].get("layout") != "deepspeed":
        return f"the ZeRO files of stage {stage} are not in DeepSpeed's flat layout"
    out.setdefault("loss_scaler", parts[0].get("loss_scaler"))
    base0 = parts[0]["base_optimizer_state"]
    for g, group_names in enumerate(shapes):
        numels = [math.prod(tuple(shape)) for shape in group_names.values()]
        plan = PartitionPlan.build(numels, world, max(max(numels, default=1), 1), DEEPSPEED_ALIGNMENT)
        keys = flat_state_keys(base0, g, parts[0][FP32_KEY][g].numel())
        whole = {FP32_KEY: plan.gather_params([p[FP32_KEY][g].reshape(-1) for p in parts], "deepspeed")}
        for k in keys:
            whole[k] = plan.gather_params([p["base_optimizer_state"]["state"][g][k] for p in parts], "deepspeed")
        scalars = {k: v for k, v in base0["state"].get(g, {}).items() if k not in keys}
        if g >= len(out["groups"]):
            out["groups"].append({k: v for k, v in base0["param_groups"][g].items() if k != "params"})
        for i, name in enumerate(group_names):
            out["params"].setdefault(name, (g, {k: t[i] for k, t in whole.items()}, scalars))
    return None


def restore_zero_by_name(opt: Any, names: list[list[str]], tag_dir: str, manifest: Optional[dict], stages: int,
                         bf16: bool) -> Optional[str]:
    """Loads a ZeRO-1 optimizer (`names[g]` names its group g's parameters, in plan order) from the
    ZeRO files of a `stages`-stage checkpoint. Returns None when done, else why it could not (the
    optimizer is then untouched)."""
    saved: dict = {"params": {}, "groups": []}
    for s in range(stages):
        why = _zero_stage_by_name(tag_dir, manifest, s, bf16, saved)
        if why is not None:
            return why
    if len(saved["groups"]) != len(opt.partition_plans):
        return f"the checkpoint has {len(saved['groups'])} param groups, this optimizer {len(opt.partition_plans)}"
    masters, state = [], {}
    for g, (plan, group_names) in enumerate(zip(opt.partition_plans, names)):
        found = []
        for name in group_names:
            if name not in saved["params"] or saved["params"][name][0] != g:
                return f"parameter {name!r} has no saved optimizer state in param group {g}"
            found.append(saved["params"][name])
        dev = opt.fp32_partitions[g].device
        keys = sorted(found[0][1])

        def cut(k: str) -> torch.Tensor:
            return plan.scatter_params([f[1][k] for f in found], "runtime", opt.rank).to(dev)

        masters.append(cut(FP32_KEY))
        state[g] = {**found[0][2], **{k: cut(k) for k in keys if k != FP32_KEY}}
    base = {"state": state, "param_groups": [dict(hp, params=[g]) for g, hp in enumerate(saved["groups"])]}
    opt.load_state_dict({"group_numels": [list(p.numels) for p in opt.partition_plans],
                         "partition_count": opt.world_size, "base_optimizer_state": base, FP32_KEY: masters,
                         "loss_scaler": saved.get("loss_scaler"), "overflow": False, "clip_grad": opt.clip_grad},
                        load_optimizer_states=True, load_from_fp32_weights=True)
    return None
