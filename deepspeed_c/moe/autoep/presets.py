"""AutoEP presets: where a Hugging Face model family keeps its MoE blocks and their parts.

A preset names the MoE blocks (a regular expression over module names), the router and experts children of
a block, the experts' weight attributes and the model-config fields that hold the expert count and top k.
The built presets describe transformers 5's fused expert layout: one [E, 2F, H] gate-and-up tensor and one
[E, H, F] down tensor per block (expert_w3 null: gate and up live in w1)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class Preset:
    name: str
    moe_layer_pattern: str
    router_pattern: str
    expert_pattern: str
    expert_w1: str  # gate and up, [E, 2F, H]
    expert_w2: str  # down, [E, H, F]
    expert_w3: Optional[str]  # None: fused into expert_w1
    num_experts_attr: str
    model_types: tuple[str, ...]


_LAYERS = r"model\.layers\.\d+\.mlp"

PRESETS: dict[str, Preset] = {
    "mixtral": Preset("mixtral", _LAYERS, "gate", "experts", "gate_up_proj", "down_proj", None,
                      "num_local_experts", ("mixtral",)),
    # Qwen2-MoE has the same routed-expert layout; its shared expert (and gate) stay in the block, replicated
    "qwen3_moe": Preset("qwen3_moe", _LAYERS, "gate", "experts", "gate_up_proj", "down_proj", None,
                        "num_experts", ("qwen3_moe", "qwen2_moe")),
    # DeepSeek's group-limited, bias-corrected routing stays in its Hugging Face router (replicated), and so do
    # the shared experts; the dense first layers (first_k_dense_replace) have no experts child and are skipped
    "deepseek_v2": Preset("deepseek_v2", _LAYERS, "gate", "experts", "gate_up_proj", "down_proj", None,
                          "n_routed_experts", ("deepseek_v2",)),
    "deepseek_v3": Preset("deepseek_v3", _LAYERS, "gate", "experts", "gate_up_proj", "down_proj", None,
                          "n_routed_experts", ("deepseek_v3",)),
    # the text backbone (Qwen3_5MoeForCausalLM), as DeepSpeed's preset; its gated shared expert stays in the block
    "qwen3_5_moe": Preset("qwen3_5_moe", _LAYERS, "gate", "experts", "gate_up_proj", "down_proj", None,
                          "num_experts", ("qwen3_5_moe_text",)),
    # the text model (MiniMaxM3VLForCausalLM); its experts' clamped SwiGLU is their own _apply_gate
    "minimax_m3": Preset("minimax_m3", _LAYERS, "gate", "experts", "gate_up_proj", "down_proj", None,
                         "num_local_experts", ("minimax_m3_vl_text",)),
}

# presets deepspeed_c knows by name but has not built (Llama 4's experts take pre-weighted, expert-major inputs)
UNBUILT_PRESETS = {"llama4"}


def preset_for_model_type(model_type: Optional[str]) -> Optional[Preset]:
    for preset in PRESETS.values():
        if model_type in preset.model_types:
            return preset
    return None


def resolve_preset(preset_model: Optional[str], model_type: Optional[str], overrides: dict[str, Optional[str]]
                   ) -> Preset:
    """The preset named by expert_parallel.preset_model (else the one of model.config.model_type), with the
    config's pattern overrides applied. Raises naming the key when nothing describes the model."""
    if preset_model is not None:
        if preset_model in UNBUILT_PRESETS:
            raise NotImplementedError(f"expert_parallel.preset_model={preset_model!r} is not built in deepspeed_c; "
                                      f"built presets: {sorted(PRESETS)}")
        if preset_model not in PRESETS:
            raise ValueError(f"expert_parallel.preset_model={preset_model!r} is not a known preset; expected one of "
                             f"{sorted(PRESETS)}")
        base: Optional[Preset] = PRESETS[preset_model]
    else:
        base = preset_for_model_type(model_type)
    given = {k: v for k, v in overrides.items() if v is not None}
    if base is None:
        needed = ("moe_layer_pattern", "expert_w1", "expert_w2")
        missing = [k for k in needed if k not in given]
        if missing:
            raise ValueError(f"expert_parallel: no preset matches model_type={model_type!r} (built presets: "
                             f"{sorted(PRESETS)}); set expert_parallel.preset_model, or give "
                             f"expert_parallel.{', expert_parallel.'.join(missing)}")
        base = Preset("custom", given["moe_layer_pattern"], "gate", "experts", given["expert_w1"],
                      given["expert_w2"], None, "num_experts", ())
    return replace(base, **given)
