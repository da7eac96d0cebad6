"""`tensor_parallel.preset_model`: the AutoTP layer plans DeepSpeed 0.19.8 names for common architectures, in the
form of `tensor_parallel.partition_config` (rules tried in order; a Linear no rule names falls to the built-in name
detection). A `partition_config` given as well comes first, and replaces the preset when it says
`use_default_specs: false`, as DeepSpeed merges them. An unknown name raises (DeepSpeed goes on without a preset)."""
from __future__ import annotations

from typing import Any, Optional


def _spec(pattern: str, kind: str, shape: Any = None) -> dict:
    spec: dict[str, Any] = {"patterns": [pattern], "partition_type": kind}
    if shape is not None:
        spec["shape"] = shape
    return spec


_ATTN_LLAMA = [_spec(r".*\.self_attn\.o_proj\.weight$", "row"), _spec(r".*\.self_attn\.[qkv]_proj\.weight$", "column")]
_MLP_LLAMA = [_spec(r".*\.mlp\.down_proj\.weight$", "row"), _spec(r".*\.mlp\.(up|gate)_proj\.weight$", "column")]

PRESETS: dict[str, list[dict]] = {
    "llama": _ATTN_LLAMA + _MLP_LLAMA,
    "qwen2": _ATTN_LLAMA + _MLP_LLAMA,
    "bloom": [
        _spec(r".*\.self_attention\.dense\.weight$", "row"),
        _spec(r".*\.self_attention\.query_key_value\.weight$", "column"),  # heads interleaved: no split
        _spec(r".*\.mlp\.dense_4h_to_h\.weight$", "row"),
        _spec(r".*\.mlp\.dense_h_to_4h\.weight$", "column"),
    ],
    "chatglm": [
        _spec(r".*\.self_attention\.dense\.weight$", "row"),
        _spec(r".*\.self_attention\.query_key_value\.weight$", "column", [3, -1]),  # [Q, K, V] stacked
        _spec(r".*\.mlp\.dense_4h_to_h\.weight$", "row"),
        _spec(r".*\.mlp\.dense_h_to_4h\.weight$", "column", [2, -1]),  # [gate, up] stacked
    ],
    "mixtral": _ATTN_LLAMA + [
        _spec(r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight$", "row"),
        _spec(r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$", "column"),
        _spec(r".*\.block_sparse_moe\.gate\.weight$", "skip"),
    ],
    "deepseek_v2": [
        _spec(r".*\.self_attn\.o_proj\.weight$", "row"),
        _spec(r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$", "skip"),  # MLA's low-rank projections
        _spec(r".*\.self_attn\.(q_b_proj|kv_b_proj)\.weight$", "column"),
        _spec(r".*\.mlp\.experts\.\d+\.down_proj\.weight$", "row"),
        _spec(r".*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$", "column"),
        _spec(r".*\.mlp\.gate\.weight$", "skip"),
        _spec(r".*\.mlp\.shared_experts\.down_proj\.weight$", "row"),
        _spec(r".*\.mlp\.shared_experts\.(up|gate)_proj\.weight$", "column"),
    ],
    # phi3's fused qkv_proj / gate_up_proj are left to the built-in detection, which splits them by the model
    # config ([q | k | v] sizes from the head counts: right under GQA too, where DeepSpeed's preset takes thirds)
    "phi3": [
        _spec(r".*\.self_attn\.o_proj\.weight$", "row"),
        _spec(r".*\.mlp\.down_proj\.weight$", "row"),
    ],
}


def resolve(preset_model: Optional[str], partition_config: Optional[dict]) -> Optional[dict]:
    """The partition_config AutoTP applies: the preset's rules, the given partition_config's before them (or
    instead of them with use_default_specs false). An unknown preset name raises, naming the known ones."""
    if not preset_model:
        return partition_config
    if not isinstance(preset_model, str) or preset_model.lower() not in PRESETS:
        raise ValueError(f"tensor_parallel.preset_model={preset_model!r} is not a preset; known: {sorted(PRESETS)}")
    preset = [dict(s) for s in PRESETS[preset_model.lower()]]
    if not partition_config:
        return {"use_default_specs": True, "layer_specs": preset}
    if not isinstance(partition_config, dict):
        return partition_config  # auto_tp names the bad type
    if partition_config.get("use_default_specs", True) is False:
        return partition_config
    return {**partition_config, "layer_specs": list(partition_config.get("layer_specs", [])) + preset}
