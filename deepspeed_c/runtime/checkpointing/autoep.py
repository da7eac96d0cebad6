"""AutoEP experts in DeepSpeed's MoE checkpoint layout, at any expert_parallel.autoep_size.

DeepSpeed 0.19.8 writes an AutoEP layer's experts one file per global expert, next to the native MoE
layers' (one layer counter over both kinds, in module order):

    layer_{L}_expert_{E}_mp_rank_00_model_states.pt   {"<experts>.w1.E": gate [F, H], "<experts>.w2.E": down
                                                       [H, F], "<experts>.w3.E": up [F, H]}

written by the first rank of the expert-data-parallel group holding expert E, and lists the layers in the
model-states file's `ds_autoep_layers` (module path, experts, ep_size, ranks, key prefix). Here the experts
module keeps the Hugging Face block's fused tensors (gate_up_proj [L, 2F, H] = gate rows then up rows,
down_proj [L, H, F], this rank's L experts), so w1 / w3 are the two halves of a gate_up row block.

Expert files hold every expert once, so weights load at any autoep_size. An optimizer's state follows the
fused local tensors, so it loads only at the saved autoep_size (a clear error otherwise; weights-only loads
through load_optimizer_states=False or load_module_only=True)."""
from __future__ import annotations

from typing import Any, Optional

import torch

LAYERS_KEY = "ds_autoep_layers"  # DeepSpeed's model-states key
STATE_FORMAT_KEY = "autoep_zero3_expert_state_format"
PER_EXPERT_FILES = "per_expert_files"


def is_autoep_experts(m: Any) -> bool:
    return type(m).__name__ == "AutoEPExperts" and hasattr(m, "w1_name") and hasattr(m, "ep_rank")


def _prefix(path: str) -> str:
    return f"{path}." if path else ""


def fused_keys(path: str, layer: Any) -> tuple[str, str]:
    """The state-dict keys of the layer's fused gate_up and down tensors."""
    return f"{_prefix(path)}{layer.w1_name}", f"{_prefix(path)}{layer.w2_name}"


def expert_key(path: str, w: str, global_id: int) -> str:
    return f"{_prefix(path)}{w}.{global_id}"


def ranged_name(path: str, w: str, layer: Any) -> str:
    """A fused tensor's name in the optimizer files' param_names: with the global experts it holds, so that
    each expert-parallel rank's state is found by its own name."""
    start = layer.ep_rank * layer.num_local_experts
    return f"{_prefix(path)}{w}[experts {start}:{start + layer.num_local_experts}]"


def expert_states(path: str, layer: Any, sd: dict) -> dict[int, dict[str, torch.Tensor]]:
    """global expert id -> its file's entries, for the experts this rank holds."""
    gu_key, down_key = fused_keys(path, layer)
    gate_up, down = sd[gu_key], sd[down_key]
    ffn = gate_up.shape[1] // 2
    out = {}
    for j in range(layer.num_local_experts):
        g = layer.ep_rank * layer.num_local_experts + j
        out[g] = {expert_key(path, "w1", g): gate_up[j, :ffn].detach().clone(),
                  expert_key(path, "w2", g): down[j].detach().clone(),
                  expert_key(path, "w3", g): gate_up[j, ffn:].detach().clone()}
    return out


def local_state(path: str, layer: Any, per_expert: dict[int, dict[str, torch.Tensor]], where: str) -> dict:
    """The fused tensors of the experts this rank holds, from their files' entries (global id -> entries)."""
    gate_up, down = [], []
    for j in range(layer.num_local_experts):
        g = layer.ep_rank * layer.num_local_experts + j
        entries = per_expert[g]
        parts = []
        for w in ("w1", "w2", "w3"):
            key = expert_key(path, w, g)
            if key not in entries:
                raise KeyError(f"load_checkpoint: {where} expert {g} has no '{key}' (found {sorted(entries)[:6]}); "
                               "was it saved from this model?")
            if entries[key].dim() != 2:
                raise ValueError(f"load_checkpoint: '{key}' in {where} is {entries[key].dim()}-D, not a 2-D weight")
            parts.append(entries[key])
        w1, w2, w3 = parts
        gate_up.append(torch.cat([w1, w3], dim=0))
        down.append(w2)
    gu_key, down_key = fused_keys(path, layer)
    return {gu_key: torch.stack(gate_up), down_key: torch.stack(down)}


def layer_info(layer_id: int, path: str, layer: Any, ep_rank: int, edp_rank: int, edp_world: int) -> dict:
    """One `ds_autoep_layers` entry, with DeepSpeed's field names."""
    block = path.rsplit(".", 1)[0] if "." in path else ""
    return {
        "moe_layer_id": layer_id, "module_path": block, "num_experts": layer.num_experts,
        "num_local_experts": layer.num_local_experts, "ep_size": layer.ep_size,
        "expert_key_prefix": path, STATE_FORMAT_KEY: PER_EXPERT_FILES,
        "ep_group_name": layer.expert_group_name, "ep_rank": ep_rank, "expert_data_parallel_rank": edp_rank,
        "expert_data_parallel_world_size": edp_world, "global_expert_start": ep_rank * layer.num_local_experts,
        "global_expert_end": (ep_rank + 1) * layer.num_local_experts,
        # deepspeed_c's own field: the Hugging Face fused tensors w1/w3 and w2 come from (zero_to_fp32 rebuilds them)
        "expert_fused_names": [layer.w1_name, layer.w2_name],
    }


def saved_ep_size(model_state: dict) -> Optional[int]:
    layers = model_state.get(LAYERS_KEY) or []
    sizes = {entry.get("ep_size") for entry in layers if isinstance(entry, dict)}
    return sizes.pop() if len(sizes) == 1 else None


def check_optimizer_ep(model_state: dict, module: torch.nn.Module, where: str) -> None:
    """An optimizer's state of AutoEP experts is per rank's fused tensors: refuse another autoep_size."""
    mine = {m.ep_size for m in module.modules() if is_autoep_experts(m)}
    if not mine:
        return
    saved = saved_ep_size(model_state)
    now = mine.pop()
    if saved is not None and saved != now:
        raise NotImplementedError(
            f"load_checkpoint: {where} was saved at expert_parallel.autoep_size={saved}, this engine runs "
            f"autoep_size={now}: the AutoEP experts' weights load at any autoep_size, their optimizer state only at "
            "the saved one; pass load_optimizer_states=False (or load_module_only=True) to load the weights")
