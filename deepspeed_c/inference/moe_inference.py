"""MoE inference: `init_inference(model, moe={"enabled": True, "ep_size": N, "moe_experts": [E], "type": ...})`
(or the deprecated top-level ep_size / moe_experts / moe_type) for models built from deepspeed.moe.layer.MoE.

The model arrives holding all E experts of each MoE layer (as built, or loaded, on one rank). Over the
expert-parallel group (N consecutive ranks: the ep_size_N group of deepspeed.utils.groups) each layer keeps:
- E divisible by N (expert parallelism): rank r keeps experts [r E/N, (r+1) E/N); tokens go to their experts'
  ranks and back through the MoE layer's own all-to-all (our C gating, dispatch and combine);
- N divisible by E (expert slicing: more ranks than experts): rank r holds slice r % (N/E) of expert
  r // (N/E) -- the expert's first Linear split by output rows, its last by input columns. The group's tokens
  are gathered, each rank runs its slice on the tokens routed to its expert, and one all-reduce sums the
  partial products (each slice's share of its expert's output, weighted by the gate); each rank keeps its rows.
The gate, and a residual MoE's dense MLP and coefficient, stay whole on every rank.

Hugging Face MoE blocks (transformers 5's fused expert tensors: Mixtral, Qwen2/3-MoE, ... -- a module with 3-D
`gate_up_proj` [E, 2F, H] and `down_proj` [E, H, F]): E divisible by N, rank r keeps experts [r E/N, (r+1) E/N)
of each; the group's tokens and their routing (the router stays whole) are gathered, each rank adds its
experts' weighted outputs, one all-reduce sums them and each rank keeps its rows (tokens need not be the same
on every rank)."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from deepspeed_c import comm as dist


def parse(cfg: Any) -> Optional[dict]:
    """{ep_size, experts, type} from the moe section and the deprecated keys; None when nothing is asked."""
    moe = cfg.moe
    section = {} if moe is True or moe is False else dict(moe or {})
    if moe is False or (section and not section.get("enabled", True)):
        return None
    known = {"enabled", "ep_size", "moe_experts", "num_experts", "type", "ep_mp_group", "ep_group", "expert_group"}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(f"init_inference: moe has unknown key(s) {unknown} (expected some of {sorted(known)})")
    ep = int(section.get("ep_size", cfg.ep_size))
    kind = str(section.get("type", cfg.moe_type))
    if ep < 1:
        raise ValueError(f"init_inference: moe.ep_size={ep} must be >= 1")
    if kind not in ("standard", "residual"):
        raise ValueError(f"init_inference: moe.type={kind!r} must be 'standard' or 'residual'")
    if moe is not True and not section and ep == 1:
        return None
    experts = section.get("moe_experts", section.get("num_experts", cfg.moe_experts))
    group = section.get("ep_group", section.get("expert_group", cfg.ep_group))
    return {"ep_size": ep, "experts": list(experts) if experts is not None else None, "type": kind, "group": group}


def _moe_layers(model: nn.Module) -> list[nn.Module]:
    from deepspeed_c.moe.layer import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


def _group(ep: int, given: Any) -> Any:
    if given is not None:
        return given
    if not dist.is_initialized():
        dist.init_distributed()
    world = dist.get_world_size()
    if world % ep != 0:
        raise ValueError(f"init_inference: moe.ep_size={ep} does not divide the world size {world}: launch a multiple "
                         f"of ep_size processes")
    from deepspeed_c.utils import groups

    groups._create_expert_and_data_parallel(ep)
    return groups._get_expert_parallel_group(f"ep_size_{ep}")


def _hf_experts(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, experts) of every Hugging Face fused-experts module."""
    out = []
    for parent in model.modules():
        for name, child in parent.named_children():
            gu, down = getattr(child, "gate_up_proj", None), getattr(child, "down_proj", None)
            if isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3:
                out.append((parent, name, child))
    return out


def _prepare_hf(model: nn.Module, found: list, spec: dict) -> int:
    ep = spec["ep_size"]
    for i, (_, _, experts) in enumerate(found):
        total = experts.gate_up_proj.shape[0]
        if total % ep != 0:
            raise ValueError(f"init_inference: moe.ep_size={ep} does not divide the {total} experts of MoE block {i} "
                             f"of {type(model).__name__} (expert slicing is built for deepspeed.moe layers only)")
    if ep == 1:
        return len(found)
    group = _group(ep, spec["group"])
    rank = dist.get_rank(group)
    for parent, name, experts in found:
        setattr(parent, name, HFExpertParallel(experts, group, ep, rank))
    return len(found)


class HFExpertParallel(nn.Module):
    """This rank's experts of a Hugging Face fused-experts module; called as the original
    (hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]."""

    def __init__(self, experts: nn.Module, group: Any, ep: int, rank: int) -> None:
        super().__init__()
        total = experts.gate_up_proj.shape[0]
        local = total // ep
        self.first, self.local, self.group, self.ep = rank * local, local, group, ep
        keep = slice(self.first, self.first + local)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[keep].clone(), requires_grad=False)
        self.down_proj = nn.Parameter(experts.down_proj.detach()[keep].clone(), requires_grad=False)
        self.act_fn = experts.act_fn
        self.num_experts = total

    def _gather(self, t: Tensor) -> Tensor:
        parts = [torch.empty_like(t) for _ in range(self.ep)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        n = hidden_states.shape[0]
        x, idx, w = self._gather(hidden_states), self._gather(top_k_index), self._gather(top_k_weights)
        out = torch.zeros_like(x)
        for e in range(self.local):
            token, pos = torch.where(idx == self.first + e)
            if token.numel() == 0:
                continue
            gate, up = torch.nn.functional.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
            out.index_add_(0, token, (y * w[token, pos, None]).to(out.dtype))
        dist.all_reduce(out, group=self.group)
        me = dist.get_rank(self.group)
        return out[me * n:(me + 1) * n]


def prepare(model: nn.Module, spec: dict) -> int:
    """Shards every MoE layer of `model` over the expert-parallel group; returns the number of layers."""
    injected = _injected_moe_blocks(model)
    if injected:
        return _check_injected(injected, spec)
    layers = _moe_layers(model)
    found = _hf_experts(model) if not layers else []
    if found:
        _check_world(spec)
        return _prepare_hf(model, found, spec)
    if not layers:
        raise ValueError(f"init_inference: moe is enabled but {type(model).__name__} has no deepspeed.moe.layer.MoE "
                         "layer and no Hugging Face fused-experts block")
    ep = spec["ep_size"]
    _check_world(spec)
    if spec["experts"] is not None and spec["experts"] != [1] and len(spec["experts"]) not in (1, len(layers)):
        raise ValueError(f"init_inference: moe.moe_experts={spec['experts']} names {len(spec['experts'])} layer(s); "
                         f"the model has {len(layers)} MoE layers")
    for i, layer in enumerate(layers):
        total = layer.num_experts
        if layer.num_local_experts != total:
            raise ValueError(f"init_inference: MoE layer {i} holds {layer.num_local_experts} of its {total} experts; "
                             "MoE inference shards a model holding all experts (build it with ep_size=1)")
        want = spec["experts"]
        if want and want != [1] and want[min(i, len(want) - 1)] != total:
            said = want[min(i, len(want) - 1)]
            raise ValueError(f"init_inference: moe.moe_experts says {said} experts for MoE layer {i}, which has "
                             f"{total}")
        if (spec["type"] == "residual") != bool(layer.use_residual):
            raise ValueError(f"init_inference: moe.type={spec['type']!r} but MoE layer {i} was built with "
                             f"use_residual={layer.use_residual}")
        if total % ep != 0 and ep % total != 0:
            raise ValueError(f"init_inference: moe.ep_size={ep} and the {total} experts of MoE layer {i}: one must "
                             "divide the other (expert parallelism or expert slicing)")
    if ep == 1:
        return len(layers)
    group = _group(ep, spec["group"])
    rank = dist.get_rank(group)
    for layer in layers:
        if layer.num_experts % ep == 0:
            _expert_parallel(layer, group, ep, rank)
        else:
            _expert_slicing(layer, group, ep, rank)
    return len(layers)


def _injected_moe_blocks(model: nn.Module) -> list[nn.Module]:
    from deepspeed_c.module_inject.fused_moe_block import FusedMoEDecoderBlock

    return [m for m in model.modules() if isinstance(m, FusedMoEDecoderBlock)]


def _check_injected(blocks: list[nn.Module], spec: dict) -> int:
    """Kernel-injected MoE blocks (replace_with_kernel_inject=True ran first) hold every expert on this rank."""
    if spec["ep_size"] != 1:
        raise NotImplementedError(f"init_inference: moe.ep_size={spec['ep_size']} with replace_with_kernel_inject=True "
                                  "is not built (kernel-injected MoE blocks keep every expert on one rank); for "
                                  "experts over several ranks pass replace_with_kernel_inject=False")
    if spec["type"] != "standard":
        raise ValueError(f"init_inference: moe.type={spec['type']!r}, but the injected blocks are standard "
                         "(non-residual) MoE")
    want = spec["experts"]
    for i, block in enumerate(blocks):
        total = block.router.shape[0]
        if want and want != [1] and want[min(i, len(want) - 1)] != total:
            raise ValueError(f"init_inference: moe.moe_experts says {want[min(i, len(want) - 1)]} experts for MoE "
                             f"layer {i}, which has {total}")
    return len(blocks)


def _check_world(spec: dict) -> None:
    ep = spec["ep_size"]
    if ep > 1 and spec["group"] is None:
        if not dist.is_initialized():
            dist.init_distributed()
        if dist.get_world_size() % ep != 0:
            raise ValueError(f"init_inference: moe.ep_size={ep} does not divide the world size "
                             f"{dist.get_world_size()}: launch a multiple of ep_size processes")


def _expert_parallel(layer: nn.Module, group: Any, ep: int, rank: int) -> None:
    local = layer.num_experts // ep
    experts = layer.deepspeed_moe.experts
    experts.deepspeed_experts = nn.ModuleList(list(experts.deepspeed_experts)[rank * local:(rank + 1) * local])
    experts.num_local_experts = local
    layer.ep_size = layer.deepspeed_moe.ep_size = ep
    layer.num_local_experts = layer.deepspeed_moe.num_local_experts = local
    layer.deepspeed_moe._set_ep_group(group)


def _linears(expert: nn.Module) -> list[nn.Linear]:
    return [m for m in expert.modules() if isinstance(m, nn.Linear)]


@torch.no_grad()
def _expert_slicing(layer: nn.Module, group: Any, ep: int, rank: int) -> None:
    total = layer.num_experts
    slices = ep // total
    mine, part = rank // slices, rank % slices
    expert = layer.deepspeed_moe.experts.deepspeed_experts[mine]
    lins = _linears(expert)
    if len(lins) != 2:
        raise NotImplementedError(f"init_inference: expert slicing (moe.ep_size={ep} > {total} experts) splits an "
                                  f"expert of two Linear layers (up, down); {type(expert).__name__} has {len(lins)}")
    up, down = lins
    width = up.out_features
    if width % slices != 0:
        raise ValueError(f"init_inference: expert slicing over {slices} ranks: the expert's hidden width {width} does "
                         "not split evenly")
    k = width // slices
    rows = slice(part * k, (part + 1) * k)
    up.weight = nn.Parameter(up.weight[rows].clone(), requires_grad=False)
    if up.bias is not None:
        up.bias = nn.Parameter(up.bias[rows].clone(), requires_grad=False)
    up.out_features = k
    down.weight = nn.Parameter(down.weight[:, rows].clone(), requires_grad=False)
    if down.bias is not None and part != 0:  # the down bias is added once over the slices
        down.bias = nn.Parameter(torch.zeros_like(down.bias), requires_grad=False)
    down.in_features = k
    layer.deepspeed_moe = SlicedMoE(layer.deepspeed_moe.gate, expert, mine, group, ep)
    layer.ep_size = ep


class SlicedMoE(nn.Module):
    """One expert slice of an MoE layer with more ranks than experts (see the module docstring)."""

    def __init__(self, gate: nn.Module, expert: nn.Module, expert_index: int, group: Any, ep: int) -> None:
        super().__init__()
        self.gate, self.expert, self.expert_index, self.group, self.ep = gate, expert, expert_index, group, ep
        self.l_aux = torch.zeros(())
        self.exp_counts = None

    def forward(self, hidden: Tensor, used_token: Optional[Tensor] = None) -> Tensor:
        from deepspeed_c.moe import gating_core as core

        d = hidden.shape[-1]
        x = hidden.reshape(-1, d).contiguous()
        gathered = [torch.empty_like(x) for _ in range(self.ep)]
        dist.all_gather(gathered, x, group=self.group)  # every rank's tokens (their counts are equal)
        xs = torch.cat(gathered)
        r = self.gate.route(xs, None)
        self.l_aux, self.exp_counts = r.l_aux, r.exp_counts
        e, c = r.num_experts, r.capacity
        dispatched = core.dispatch(xs, r.route_slot, r.slot_route).view(e, c, d)
        out = torch.zeros_like(dispatched)
        y = self.expert(dispatched[self.expert_index])
        out[self.expert_index] = y[0] if isinstance(y, tuple) else y
        combined = core.combine(out.reshape(e * c, d), r.weights, r.route_slot, r.slot_route)
        dist.all_reduce(combined, group=self.group)
        me = dist.get_rank(self.group)
        n = x.shape[0]
        return combined[me * n:(me + 1) * n].reshape(hidden.shape)
