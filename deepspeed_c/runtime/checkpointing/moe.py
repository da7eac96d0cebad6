"""Checkpoints of models with MoE layers in DeepSpeed's MoE layout (stage 0; fp32, bf16, fp16; at ZeRO 1/2
one file per data-parallel rank holds every MoE ZeRO member's groups, converted here from and to the
members' partition exports (the optimizer's MemberExports): save_members, load_members):

    mp_rank_00_model_states.pt                       the non-expert weights (rank 0), num_experts
    layer_{L}_expert_{E}_mp_rank_00_model_states.pt  expert E (global id) of the L-th MoE layer, its keys
                                                     named with the global id; written by the first rank of
                                                     the expert-data-parallel group that holds it
    expp_rank_{R}_mp_rank_00_optim_states.pt         {'optimizer': the optimizer state_dict} of expert-parallel
                                                     rank R of the largest expert group

Loading reads the experts a rank holds now (its ep_size may differ from the saver's): global expert
ep_rank * num_local_experts + j becomes local expert j. The optimizer files also carry `param_names`
(the model's name of every parameter index, with expert names in global ids; DeepSpeed's loader
ignores the key), so Adam's moments follow each expert to whichever rank holds it after a change of
ep_size or world size. AutoEP layers (checkpointing/autoep.py) share the layer counter and the files; their
fused tensors' optimizer state is named by the global expert range it holds."""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Optional, Sequence

import torch

from deepspeed_c.checkpoint import deepspeed_format, store
from deepspeed_c.runtime.checkpointing import autoep
from deepspeed_c.checkpoint.mapped_pages import MappedPages
from deepspeed_c.ops.partition import DEEPSPEED_ALIGNMENT, PartitionPlan
from deepspeed_c.runtime.checkpointing.zero import FP32_KEY, file_state, flat_state_keys, load_same_world
from deepspeed_c.runtime.optimizer_seam import SavedCheckpoint

EXPERTS_INFIX = ".deepspeed_moe.experts.deepspeed_experts."


def expert_file(layer: int, expert: int) -> str:
    return f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt"


def optim_file(expp_rank: int) -> str:
    return f"expp_rank_{expp_rank}_mp_rank_00_optim_states.pt"


def moe_layers(module: torch.nn.Module) -> list[tuple[str, Any]]:
    return [(n, m) for n, m in module.named_modules() if hasattr(m, "expert_group_name")
            and hasattr(m, "num_local_experts") and hasattr(m, "deepspeed_moe")]


def expert_layers(module: torch.nn.Module) -> list[tuple[str, Any, bool]]:
    """(path, layer, is AutoEP) of every layer whose experts have files of their own, in module order: DeepSpeed
    numbers native MoE and AutoEP layers with one counter."""
    native = {id(m) for _, m in moe_layers(module)}
    return [(n, m, id(m) not in native) for n, m in module.named_modules()
            if id(m) in native or autoep.is_autoep_experts(m)]


def _ranks(group_name: str) -> tuple[int, int]:
    """(expert-parallel rank, expert-data-parallel rank) of this rank in group_name (0, 0 undistributed)."""
    from deepspeed_c.utils import groups

    if not groups._get_expert_parallel_group_dict():
        return 0, 0
    return groups._get_expert_parallel_rank(group_name), groups._get_expert_data_parallel_rank(group_name)


def global_names(module: torch.nn.Module) -> dict[int, str]:
    """id(param) -> its name with expert ids global (local id + ep_rank * num_local_experts)."""
    out = {id(p): n for n, p in module.named_parameters()}
    for prefix, layer in moe_layers(module):
        ep_rank, _ = _ranks(layer.expert_group_name)
        head = f"{prefix}{EXPERTS_INFIX}" if prefix else EXPERTS_INFIX[1:]
        for n, p in module.named_parameters():
            if n.startswith(head):
                local, rest = n[len(head):].split(".", 1)
                out[id(p)] = f"{head}{ep_rank * layer.num_local_experts + int(local)}.{rest}"
    for path, layer, is_autoep in expert_layers(module):
        if is_autoep:  # a fused tensor of this rank's experts: named with their global range
            for name in (layer.w1_name, layer.w2_name):
                p = getattr(layer, name)
                out[id(p)] = autoep.ranged_name(path, name, layer)
    return out


def non_expert_state(module: torch.nn.Module, sd: dict) -> dict:
    """The module state dict without the experts' entries (DeepSpeed's _get_non_moe_state_dict)."""
    heads = [f"{prefix}{EXPERTS_INFIX}" if prefix else EXPERTS_INFIX[1:] for prefix, _ in moe_layers(module)]
    fused = {k for path, layer, is_autoep in expert_layers(module) if is_autoep for k in autoep.fused_keys(path, layer)}
    return {k: v for k, v in sd.items() if k not in fused and not any(k.startswith(h) for h in heads)}


def autoep_layer_infos(module: torch.nn.Module) -> Optional[list[dict]]:
    """The model-states file's `ds_autoep_layers` (None without AutoEP layers, as DeepSpeed writes)."""
    from deepspeed_c.utils import groups

    out = []
    for layer_id, (path, layer, is_autoep) in enumerate(expert_layers(module)):
        if is_autoep:
            _, edp_rank = _ranks(layer.expert_group_name)
            edp_world = (groups._get_expert_data_parallel_world_size(layer.expert_group_name)
                         if groups._get_expert_parallel_group_dict() else 1)
            out.append(autoep.layer_info(layer_id, path, layer, layer.ep_rank, edp_rank, edp_world))
    return out or None


def save_files(module: torch.nn.Module, stepper: Any, zero: bool, stage_dir: str) -> dict[str, dict]:
    """This rank's expert and optimizer files (manifest entries by name). `stepper`: the optimizer
    protocol (None: no optimizer); `zero`: a ZeRO stage runs (its states are in the ZeRO files)."""
    from deepspeed_c.utils import groups

    sd = module.state_dict()
    files: dict[str, dict] = {}
    for layer_id, (prefix, layer, is_autoep) in enumerate(expert_layers(module)):
        ep_rank, edp_rank = _ranks(layer.expert_group_name)
        if edp_rank != 0:
            continue
        if is_autoep:
            for g, mine in autoep.expert_states(prefix, layer, sd).items():
                name = expert_file(layer_id, g)
                files[name] = store.save_file(mine, os.path.join(stage_dir, name))
            continue
        head = f"{prefix}{EXPERTS_INFIX}" if prefix else EXPERTS_INFIX[1:]
        for j in range(layer.num_local_experts):
            g = ep_rank * layer.num_local_experts + j
            mine = {f"{head}{g}.{k[len(f'{head}{j}.'):]}": v.detach().clone() for k, v in sd.items()
                    if k.startswith(f"{head}{j}.")}
            name = expert_file(layer_id, g)
            files[name] = store.save_file(mine, os.path.join(stage_dir, name))
    if stepper is not None and not zero:  # ZeRO: states in the ZeRO files
        largest = groups._get_max_expert_size_name() if groups._get_expert_parallel_group_dict() else None
        ep_rank, edp_rank = _ranks(largest) if largest else (0, 0)
        if edp_rank == 0:
            names = global_names(module)
            opt_sd = stepper.state_dict()  # torch's; in fp16/bf16 DeepSpeed's FP16 optimizer fields
            params = [p for g in stepper.model_param_groups() for p in g]
            state = {"optimizer": opt_sd, "param_names": [names[id(p)] for p in params]}
            name = optim_file(ep_rank)
            files[name] = store.save_file(state, os.path.join(stage_dir, name))
    return files


def load_experts(module: torch.nn.Module, tag_dir: str, manifest: Any) -> dict:
    """The state-dict entries of the experts this rank holds, read from the expert files."""
    out: dict = {}
    for layer_id, (prefix, layer, is_autoep) in enumerate(expert_layers(module)):
        ep_rank = layer.ep_rank if is_autoep else _ranks(layer.expert_group_name)[0]
        head = f"{prefix}{EXPERTS_INFIX}" if prefix else EXPERTS_INFIX[1:]
        per_expert = {}
        for j in range(layer.num_local_experts):
            g = ep_rank * layer.num_local_experts + j
            name = expert_file(layer_id, g)
            if not os.path.isfile(os.path.join(tag_dir, name)):
                raise FileNotFoundError(f"load_checkpoint: {tag_dir} has no {name} (MoE layer {layer_id} "
                                        f"'{prefix}' expert {g}); was it saved with as many experts?")
            per_expert[g] = store.load_file(tag_dir, name, manifest)
        if is_autoep:
            out.update(autoep.local_state(prefix, layer, per_expert, f"{tag_dir} layer {layer_id}"))
            continue
        for g, entries in per_expert.items():
            j = g - ep_rank * layer.num_local_experts
            for k, v in entries.items():
                out[f"{head}{j}.{k[len(f'{head}{g}.'):]}"] = v
    return out


def _remap(saved_inner: list[tuple[dict, list[str]]], mine: dict, my_names: list[str]) -> dict:
    """A torch optimizer state_dict shaped as `mine` whose per-parameter states come, by name, from
    the saved ones (each with the model names of its parameter order)."""
    by_name: dict[str, Any] = {}
    for opt, names in saved_inner:
        order = [i for g in opt["param_groups"] for i in g["params"]]
        for pos, idx in enumerate(order):
            if idx in opt["state"]:
                by_name.setdefault(names[pos], opt["state"][idx])
    order = [i for g in mine["param_groups"] for i in g["params"]]
    state = {idx: by_name[my_names[pos]] for pos, idx in enumerate(order) if my_names[pos] in by_name}
    groups_saved = saved_inner[0][0]["param_groups"]
    if len(groups_saved) == len(mine["param_groups"]):  # hyperparameters (lr, betas, ...) as saved
        mine["param_groups"] = [{**old, "params": cur["params"]}
                                for old, cur in zip(groups_saved, mine["param_groups"])]
    mine["state"] = state
    return mine


def load_optimizer(module: torch.nn.Module, stepper: Any, tag_dir: str, manifest: Any) -> None:
    """This rank's optimizer state gathered by parameter name from every expp_rank file: the torch
    optimizer's moments and, in fp16/bf16, the fp32 masters and the loss scaler."""
    pattern = re.compile(r"^expp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
    saved = sorted((int(m.group(1)), f) for f in os.listdir(tag_dir) if (m := pattern.match(f)))
    if not saved:
        raise FileNotFoundError(f"load_checkpoint: {tag_dir} has no expp_rank_*_optim_states.pt files")
    blobs = []
    for _, f in saved:
        blob = store.load_file(tag_dir, f, manifest)
        if blob.get("param_names") is None:
            raise ValueError(f"load_checkpoint: {f} has no param_names (not written by deepspeed_c); load it with "
                             "the same ep_size and world size through load_optimizer_states=False, or re-save")
        blobs.append(blob)
    names = global_names(module)
    my_names = [names[id(p)] for g in stepper.model_param_groups() for p in g]
    mixed = "optimizer_state_dict" in blobs[0]["optimizer"]  # MixedPrecisionOptimizer's (DeepSpeed FP16 fields)
    if not mixed:
        inner = [(b["optimizer"], b["param_names"]) for b in blobs]
        stepper.optimizer.load_state_dict(_remap(inner, stepper.optimizer.state_dict(), my_names))
        return
    from deepspeed_c.checkpoint.deepspeed_format import normalize_mixed_state

    states = [normalize_mixed_state(b["optimizer"]) for b in blobs]
    inner = [(st["optimizer_state_dict"], b["param_names"]) for st, b in zip(states, blobs)]
    masters: dict[str, torch.Tensor] = {}
    for st, b in zip(states, blobs):
        flat = [t for g in st["fp32_groups"] for t in g]
        for name, value in zip(b["param_names"], flat):
            masters.setdefault(name, value)
    mine = stepper.state_dict()
    mine["optimizer_state_dict"] = _remap(inner, mine["optimizer_state_dict"], my_names)
    pos = 0
    for group in mine["fp32_groups"]:
        for i in range(len(group)):
            group[i] = masters[my_names[pos]]
            pos += 1
    for key, value in states[0].items():  # loss scaler, cur_iter: one value for every rank
        if key not in ("optimizer_state_dict", "fp32_groups"):
            mine[key] = value
    stepper.load_state_dict(mine, load_optimizer_states=True)


def check_stage(zero_stage: int, module: Any = None) -> None:
    """MoE checkpoints are built for stages 0, 1 and 2; others raise before any file is written. So do
    expert-parallel layers this layout does not know (split over more than one rank): rank 0's model file
    would carry only its own experts and every rank would load those."""
    if zero_stage > 2:
        raise NotImplementedError("save_checkpoint/load_checkpoint of a model with MoE layers at "
                                  f"zero_optimization.stage {zero_stage} is not built")
    known = {id(m) for _, m, _ in expert_layers(module)} if module is not None else set()
    for name, m in module.named_modules() if module is not None else ():
        if hasattr(m, "expert_group_name") and id(m) not in known and getattr(m, "ep_size", 1) > 1:
            raise NotImplementedError(f"save_checkpoint/load_checkpoint of expert-parallel layer '{name}' "
                                      f"({type(m).__name__}, ep_size {m.ep_size}) is not built: its experts have no "
                                      "files of their own in DeepSpeed's MoE layout")


# -- ZeRO 1/2: the MoE ZeRO members' groups in one file per data-parallel rank ----------------------
LISTS = ("partition_count", "group_numels", "single_partition_of_fp32_groups", "ds_partition_sizes", "group_paddings",
         "param_alignment_paddings", "param_slice_mappings")


def merge_member_states(states: Sequence[dict]) -> dict:
    out = dict(states[0])
    for key in LISTS:
        out[key] = [v for st in states for v in st[key]]
    base_state: dict = {}
    base_groups: list = []
    offset = 0
    for st in states:
        base = st["base_optimizer_state"]
        for g, group in enumerate(base["param_groups"]):
            base_groups.append(dict(group, params=[offset + g]))
            if g in base["state"]:
                base_state[offset + g] = base["state"][g]
        offset += len(base["param_groups"])
    out["base_optimizer_state"] = {"state": base_state, "param_groups": base_groups}
    return out


def _slice(full: dict, offset: int, n: int) -> dict:
    part = dict(full)
    for key in LISTS:
        if key in full:
            part[key] = full[key][offset:offset + n]
    base = full["base_optimizer_state"]
    part["base_optimizer_state"] = {
        "state": {g - offset: v for g, v in base["state"].items() if offset <= g < offset + n},
        "param_groups": [dict(grp, params=[i]) for i, grp in enumerate(base["param_groups"][offset:offset + n])],
    }
    return part


class MemberFiles:
    """checkpointing/zero.py's saved-files interface for one member: its rank r is global rank ranks[r]; its
    groups are [offset, offset + n) of each file."""

    layout = "deepspeed"

    def __init__(self, ex: Any, ranks: list[int], offset: int, saved: SavedCheckpoint) -> None:
        self.tag_dir, self.manifest, self.bf16 = saved.tag_dir, saved.manifest, saved.bf16
        self.ranks, self.offset, self.n = ranks, offset, len(ex.plans)
        self.world = ex.world_size
        self.numels = [list(plan.numels) for plan in ex.plans]
        self.plans = [PartitionPlan.build(plan.numels, self.world, max(max(plan.numels, default=1), 1),
                                          DEEPSPEED_ALIGNMENT) for plan in ex.plans]

    def open(self, r: int) -> tuple[dict, MappedPages]:
        name = deepspeed_format.find_zero_file(self.tag_dir, self.ranks[r], self.bf16)
        obj, mapped = store.load_file_mapped(self.tag_dir, name, self.manifest)
        part = _slice(obj["optimizer_state_dict"], self.offset, self.n)
        if part.get("layout") != "deepspeed":
            raise NotImplementedError(f"load_checkpoint: {name} was not written by deepspeed_c; DeepSpeed-written "
                                      "MoE ZeRO files are not read yet")
        if part.get("group_numels") != self.numels or part.get("partition_count") != [self.world] * self.n:
            raise NotImplementedError(
                f"load_checkpoint: {name} holds groups of sizes {part.get('group_numels')} partitioned over "
                f"{part.get('partition_count')} ranks where this model's MoE ZeRO member has {self.numels} over "
                f"{self.world}: another ep_size (or model). A model with MoE layers at ZeRO stage 1/2 loads its ZeRO "
                "files only at the same world size and ep_size, as DeepSpeed; checkpoints saved at stage 0 load at any")
        return deepspeed_format.normalize_zero_state(part, None, self.world), MappedPages(obj, mapped)

    def keys(self, part: dict) -> list[list[str]]:
        base = part["base_optimizer_state"]
        return [flat_state_keys(base, g, part[FP32_KEY][g].numel()) for g in range(self.n)]


def member_file_state(ex: Any, param_name: Callable[[torch.nn.Parameter], str]) -> dict:
    """One MoE ZeRO member's groups of this rank's ZeRO file (DeepSpeed's flat layout; collective over the
    member's group). `ex`: the member's PartitionExport."""
    leader = getattr(ex.loss_scaler, "leader", ex.loss_scaler)  # followers save the leader's scale
    return file_state(dataclasses.replace(ex, loss_scaler=leader), param_name)


def check_zero_world(saved: SavedCheckpoint, dp_world_size: int) -> None:
    saved_world = saved.model_state.get("dp_world_size") or 1
    if saved.partitioned_weights or saved_world != dp_world_size:
        raise NotImplementedError(
            f"load_checkpoint: {saved.tag_dir} was saved by {saved_world} data-parallel ranks"
            f"{' at ZeRO stage 3' if saved.partitioned_weights else ''}; a model with MoE layers at ZeRO stage 1/2 "
            f"loads its ZeRO files only at the same world size and ep_size ({dp_world_size} ranks now), as "
            "DeepSpeed; checkpoints saved at stage 0 load at any")


def read_member_state(ex: Any, ranks: list[int], offset: int, saved: SavedCheckpoint, masters: bool,
                      states: bool) -> dict:
    """One member's runtime-layout state (its masters filled in place) from groups [offset, offset + n) of
    the ZeRO files of global ranks `ranks` (collective over the member's group)."""
    return load_same_world(ex, MemberFiles(ex, ranks, offset, saved), masters, states)


def save_members(mex: Any, param_name: Callable[[torch.nn.Parameter], str]) -> tuple[int, dict]:
    """(data-parallel rank, its ZeRO file's optimizer_state_dict): every member's groups in DeepSpeed's flat
    layout, one member after the other. `mex`: the MoE ZeRO optimizer's MemberExports. Collective over each
    member's group."""
    return mex.rank, merge_member_states([member_file_state(ex, param_name) for ex, _ in mex.members])


def load_members(mex: Any, saved: SavedCheckpoint, load_optimizer_states: bool) -> list[dict]:
    """One runtime-layout state per member (masters filled in place) from the ZeRO files, for the MoE ZeRO
    optimizer's import_partition_state; the same world size and ep_size only. Collective over each member's
    group."""
    check_zero_world(saved, mex.world_size)
    masters, states = bool(saved.load_from_fp32_weights), bool(load_optimizer_states)
    out, offset = [], 0
    for ex, ranks in mex.members:
        out.append(read_member_state(ex, ranks, offset, saved, masters, states))
        offset += len(ex.plans)
    return out
