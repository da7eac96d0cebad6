"""`checkpoint: {"load_universal": true}`: the optimizer's state from a universal checkpoint
(deepspeed_c.checkpoint.ds_to_universal's or DeepSpeed's), at any data-parallel degree and ZeRO stage.

Each rank reads, one parameter at a time, only the parameters its partition overlaps: DeepSpeed's flat
layout at one rank (the parameters of a group back to back) is routed onto this rank's runtime partition
(ops.partition_route), and each routed range is filled from `zero/<param>/{fp32,exp_avg,...}.pt`. The
masters are always loaded (the universal checkpoint's weights are its fp32 values), the moments and step
unless load_optimizer_states is off, the hyperparameters of each group from zero/optimizer_state.pt.
Without ZeRO (stage 0, fp32) the optimizer's torch state is rebuilt per parameter instead."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional

import torch

from deepspeed_c.checkpoint import constants as C
from deepspeed_c.checkpoint import safe_load
from deepspeed_c.ops.partition import DEEPSPEED_ALIGNMENT, PartitionPlan
from deepspeed_c.ops.partition_route import layout_route
from deepspeed_c.runtime.optimizer_seam import MemberExports, SavedCheckpoint

_NOT_MOMENTS = (C.FP32_WEIGHT_KEY, C.UNIVERSAL_STEP)


class UniversalCheckpointError(ValueError):
    """A universal checkpoint folder that is not one, or lacks what this model needs."""


def check_folder(tag_dir: str) -> None:
    """Raises naming the folder unless it holds a universal checkpoint (zero/optimizer_state.pt)."""
    zero = os.path.join(tag_dir, C.UNIVERSAL_ZERO_FOLDER)
    if not os.path.isfile(os.path.join(zero, C.UNIVERSAL_OPTIMIZER_STATE_FILE)):
        held = ", ".join(sorted(os.listdir(tag_dir))) if os.path.isdir(tag_dir) else "<missing>"
        raise UniversalCheckpointError(
            f"load_checkpoint: checkpoint.load_universal is set but {tag_dir} is not a universal checkpoint (no "
            f"{C.UNIVERSAL_ZERO_FOLDER}/{C.UNIVERSAL_OPTIMIZER_STATE_FILE}; it holds: {held}); convert it with "
            f"`python -m deepspeed_c.checkpoint.ds_to_universal --input_folder {tag_dir} --output_folder "
            f"{tag_dir}_universal`, or turn load_universal off to load it as it is")


def _read(path: str) -> Any:
    return safe_load.load(path)


class _ParamStates:
    """zero/<name>/<state>.pt of one parameter at a time, flattened (the last one read is kept), cut to this
    tensor-parallel rank's shard where the parameter is split: along the file's cat_dim (each half
    separately for two sub-parameters), the vocabulary rows padded first to the engine's padded size."""

    def __init__(self, zero: str, keys: list[str], tp_rank: int = 0, tp_size: int = 1) -> None:
        self.zero, self.keys, self.tp_rank, self.tp_size = zero, keys, tp_rank, tp_size
        self.name: Optional[str] = None
        self.values: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int) -> dict[str, torch.Tensor]:
        if name != self.name:
            self.values = {}
            for key in [C.FP32_WEIGHT_KEY] + self.keys:
                obj = _read(os.path.join(self.zero, name, f"{key}.pt"))
                t = obj[C.PARAM] if isinstance(obj, dict) else obj
                if t.numel() != numel:
                    t = self._shard(name, obj if isinstance(obj, dict) else {}, t, numel)
                self.values[key] = t.reshape(-1)
            self.name = name
        return self.values

    def _shard(self, name: str, record: dict, full: torch.Tensor, numel: int) -> torch.Tensor:
        dim = int(record.get(C.CAT_DIM, 0))
        if self.tp_size > 1 and full.dim() > dim:
            if record.get(C.VOCAB_TENSOR) and dim == 0:
                rows = numel // max(1, full[0].numel())  # this rank's (padded) vocabulary rows
                pad = rows * self.tp_size - full.shape[0]
                if pad > 0:
                    full = torch.nn.functional.pad(full, (0, 0) * (full.dim() - 1) + (0, pad))
            if record.get(C.PARAM_N_SUB_PARAMS) == 2:
                halves = torch.chunk(full, 2, dim=dim)
                part = torch.cat([torch.chunk(h, self.tp_size, dim=dim)[self.tp_rank] for h in halves], dim=dim)
            else:
                part = torch.chunk(full, self.tp_size, dim=dim)[self.tp_rank]
            if part.numel() == numel:
                return part
        raise UniversalCheckpointError(
            f"load_checkpoint: universal checkpoint parameter {name!r} holds {full.numel()} elements "
            f"{tuple(full.shape)}; this rank's parameter has {numel} (tensor-parallel rank {self.tp_rank} of "
            f"{self.tp_size}): the checkpoint belongs to another model")


def _moment_keys(zero: str, names: list[str]) -> list[str]:
    missing = [n for n in names if not os.path.isfile(os.path.join(zero, n, f"{C.FP32_WEIGHT_KEY}.pt"))]
    if missing:
        raise UniversalCheckpointError(
            f"load_checkpoint: universal checkpoint {os.path.dirname(zero)} has no state for parameters {missing} (no "
            f"{C.UNIVERSAL_ZERO_FOLDER}/<name>/fp32.pt); it was converted from another model")
    keys = None
    for n in names:
        have = sorted(f[:-3] for f in os.listdir(os.path.join(zero, n))
                      if f.endswith(".pt") and f[:-3] not in _NOT_MOMENTS)
        if keys is None:
            keys = have
        elif have != keys:
            raise UniversalCheckpointError(
                f"load_checkpoint: universal checkpoint parameter {n!r} holds states {have}, others {keys}")
    return keys or []


def _step(zero: str, names: list[str], optim_sd: Optional[dict] = None) -> Any:
    """The optimizer step: a parameter's step.pt, else (DeepSpeed's stage-3 conversion writes none) the step
    of optimizer_state.pt's optimizer_state_dict, where DeepSpeed's stage-3 loader reads it."""
    for n in names:
        path = os.path.join(zero, n, f"{C.UNIVERSAL_STEP}.pt")
        if os.path.isfile(path):
            return _read(path)
    inner = (optim_sd or {}).get(C.OPTIMIZER_STATE_DICT)
    if isinstance(inner, dict):
        for entry in inner.get("state", {}).values():
            if isinstance(entry, dict) and C.UNIVERSAL_STEP in entry:
                return entry[C.UNIVERSAL_STEP]
    return None


def _fill_group(ex: Any, g: int, names: list[str], zero: str, keys: list[str],
                moments: Optional[dict[str, torch.Tensor]], tp_rank: int, tp_size: int) -> None:
    plan = ex.plans[g]
    numels = list(plan.numels)
    whole = PartitionPlan.build(numels, 1, max(max(numels, default=1), 1), DEEPSPEED_ALIGNMENT)
    starts = {row[0]: row[3] for row in whole.slices("deepspeed", 0)}
    bounds = [(starts[i], starts[i] + numels[i], names[i]) for i in range(len(numels))]
    routes = layout_route(whole, "deepspeed", plan, "runtime")
    rows = sorted(routes[routes[:, 2] == ex.rank].tolist(), key=lambda r: r[1])
    reader = _ParamStates(zero, keys, tp_rank, tp_size)
    master = ex.masters[g]
    with torch.no_grad():
        for _, a, _, b, n in rows:
            for lo, hi, name in bounds:  # the parameters this range overlaps
                s, e = max(a, lo), min(a + n, hi)
                if s >= e:
                    continue
                vals = reader.get(name, hi - lo)
                dst = slice(b + s - a, b + e - a)
                master[dst].copy_(vals[C.FP32_WEIGHT_KEY][s - lo:e - lo])
                if moments is not None:
                    for k in keys:
                        moments[k][dst].copy_(vals[k][s - lo:e - lo])


def _first_state(ex: Any, optim_sd: dict, keys: list[list[str]], step: Any) -> dict:
    """The saved-state template zero.py's _runtime_state completes: global fields, the steps and the
    hyperparameters of each group (the live groups' parameters kept)."""
    from deepspeed_c.checkpoint.safe_load import scaler_state

    live = ex.state.get("base_optimizer_state", {})
    live_groups = live.get(C.PARAM_GROUPS, [])
    saved_groups = optim_sd.get(C.PARAM_GROUPS) or []
    groups = []
    for g, lg in enumerate(live_groups):
        hyper = saved_groups[min(g, len(saved_groups) - 1)] if saved_groups else {}
        groups.append({**lg, **{k: v for k, v in hyper.items() if k != "params"}})
    live_step = next((s.get(C.UNIVERSAL_STEP) for s in live.get("state", {}).values() if C.UNIVERSAL_STEP in s), None)
    if torch.is_tensor(live_step) and step is not None and not torch.is_tensor(step):
        step = torch.tensor(float(step), dtype=live_step.dtype)
    # a step tensor per group: torch's optimizers advance them in place
    state = {g: {**({C.UNIVERSAL_STEP: step.clone() if torch.is_tensor(step) else step} if step is not None else {}),
                 **{k: None for k in keys[g]}}
             for g in range(len(ex.plans))}
    out = {k: v for k, v in ex.state.items() if k not in ("base_optimizer_state", "single_partition_of_fp32_groups")}
    for k in ("dynamic_loss_scale", "overflow", C.CLIP_GRAD):
        if k in optim_sd:
            out[k] = optim_sd[k]
    if optim_sd.get(C.LOSS_SCALER) is not None:
        out[C.LOSS_SCALER] = scaler_state(optim_sd[C.LOSS_SCALER])
    out["overflow"] = False
    out["base_optimizer_state"] = {"state": state, C.PARAM_GROUPS: groups}
    return out


def load(stepper: Any, saved: SavedCheckpoint, name_of: Callable[[torch.nn.Parameter], str],
         load_optimizer_states: bool, module: torch.nn.Module, tp_rank: int = 0, tp_size: int = 1) -> None:
    """The optimizer's state (and masters, hence weights) from the universal folder saved.tag_dir; under a
    client's tensor parallelism (tp_size > 1) each split parameter's shard of rank tp_rank."""
    from deepspeed_c.runtime.checkpointing.zero import _runtime_state

    zero = os.path.join(saved.tag_dir, C.UNIVERSAL_ZERO_FOLDER)
    optim_sd = _read(os.path.join(zero, C.UNIVERSAL_OPTIMIZER_STATE_FILE))
    with stepper.partition_export() as ex:
        if ex is None:
            _load_unpartitioned(stepper, saved, zero, optim_sd, name_of, load_optimizer_states, tp_rank, tp_size)
            return
        if isinstance(ex, MemberExports):
            raise NotImplementedError("load_checkpoint: checkpoint.load_universal with MoE layers is not supported yet")
        if ex.stage == 3 and saved.partitioned_weights:  # frozen parameters' shards: from the model-states files
            from deepspeed_c.runtime.checkpointing.zero3 import load_frozen_shards

            load_frozen_shards(ex.store, saved.tag_dir, saved.manifest, saved.model_state, saved.model_rank,
                               saved.node_local)
        all_keys, step = [], None
        states = bool(load_optimizer_states)
        all_moments = []
        for g, params in enumerate(ex.params):
            names = [name_of(p) for p in params]
            keys = _moment_keys(zero, names)
            moments = ({k: torch.zeros_like(ex.masters[g]) for k in keys} if states else None)
            _fill_group(ex, g, names, zero, keys, moments, tp_rank, tp_size)
            all_keys.append(keys)
            all_moments.append(moments or {})
            step = step if step is not None else _step(zero, names, optim_sd)
        first = _first_state(ex, optim_sd, all_keys, step)
        state = _runtime_state(ex, first, all_keys, all_moments if states else None)
        stepper.import_partition_state(state, states, True)


def _load_unpartitioned(stepper: Any, saved: SavedCheckpoint, zero: str, optim_sd: dict,
                        name_of: Callable[[torch.nn.Parameter], str], load_optimizer_states: bool,
                        tp_rank: int, tp_size: int) -> None:
    """Stage 0 (fp32): the weights from fp32.pt, the torch optimizer's state rebuilt per parameter."""
    groups = stepper.model_param_groups()
    masters_are_params = all(p.dtype == torch.float32 for ps in groups for p in ps)
    if not masters_are_params:
        raise NotImplementedError("load_checkpoint: checkpoint.load_universal without ZeRO is supported for fp32 "
                                  "training only (use ZeRO stage 1-3 for bf16/fp16)")
    state: dict[int, dict] = {}
    index = 0
    saved_groups = optim_sd.get(C.PARAM_GROUPS) or []
    live_groups = stepper.state_dict().get(C.PARAM_GROUPS, []) if hasattr(stepper, "state_dict") else []
    param_groups = []
    for g, params in enumerate(groups):
        names = [name_of(p) for p in params]
        keys = _moment_keys(zero, names)
        reader = _ParamStates(zero, keys, tp_rank, tp_size)
        step = _step(zero, names, optim_sd)
        ids = []
        for p, n in zip(params, names):
            vals = reader.get(n, p.numel())
            with torch.no_grad():
                p.copy_(vals[C.FP32_WEIGHT_KEY].view_as(p))
            entry = {k: vals[k].view_as(p).clone() for k in keys}
            if step is not None:
                # one tensor per parameter: torch's optimizers advance their step tensors in place
                entry[C.UNIVERSAL_STEP] = step.clone() if torch.is_tensor(step) else torch.tensor(float(step))
            state[index] = entry
            ids.append(index)
            index += 1
        hyper = saved_groups[min(g, len(saved_groups) - 1)] if saved_groups else {}
        live = live_groups[g] if g < len(live_groups) else {}
        param_groups.append({**live, **{k: v for k, v in hyper.items() if k != "params"}, "params": ids})
    if load_optimizer_states:
        model_state = dict(saved.model_state, optimizer={"state": state, "param_groups": param_groups})
        stepper.load_checkpoint_state(dataclasses.replace(saved, model_state=model_state), True)


def read_latest(load_dir: str) -> str:
    """The tag `latest_universal` names (ds_to_universal writes it beside its output); DeepSpeed raises when
    it is missing, and so does this."""
    path = os.path.join(load_dir, C.UNIVERSAL_LATEST)
    if not os.path.isfile(path):
        raise ValueError(f"Invalid for universal checkpoint: {path} does not exist (checkpoint.load_universal reads "
                         "the tag from latest_universal, which ds_to_universal writes; pass tag=... explicitly)")
    with open(path) as f:
        tag = f.read().strip()
    if not tag:
        raise ValueError(f"load_checkpoint: {path} is empty (expected the name of a universal checkpoint folder)")
    return tag


def untrained_entries(stepper: Any, module: torch.nn.Module, module_state: dict) -> dict:
    """The model-states file's entries a universal load applies: buffers and parameters the optimizer does
    not step (frozen ones). The trained parameters come from zero/<param>/fp32.pt, cut to this rank's
    shard: the copied model-states file holds the saving topology's shards of them."""
    if stepper is None:
        return module_state
    trained = {id(p) for group in stepper.model_param_groups() for p in group}
    names = {n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in trained}
    return {k: v for k, v in module_state.items() if k not in names}
