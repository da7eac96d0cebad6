"""AutoTP's layer classification (deepspeed_c.module_inject.auto_tp.plan) on Hugging Face decoders built
from configs, a custom partition_config, and the errors for models and specs it cannot shard. The sharded
numerics are checked against the unsharded models in tests/distributed/test_tp_autotp.py."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.module_inject.auto_tp import plan
from tests.distributed import tp_models


def _kinds(model: torch.nn.Module, partition_config=None) -> dict[str, tuple]:
    return {name: (kind, sizes) for name, kind, sizes in plan(model, partition_config)}


def test_llama_projections_and_untouched_layers():
    got = _kinds(tp_models.make_model("llama"))
    layer = "model.layers.0."
    for leaf in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert got[layer + leaf] == ("column", None), leaf
    for leaf in ("self_attn.o_proj", "mlp.down_proj"):
        assert got[layer + leaf] == ("row", None), leaf
    assert "lm_head" not in got and len(got) == 14  # 7 projections x 2 layers; embeddings and head replicated


def test_fused_projections_are_split_per_part():
    gpt2 = _kinds(tp_models.make_model("gpt2"))
    assert gpt2["transformer.h.0.attn.c_attn"] == ("column", [32, 32, 32])  # [q|k|v] of Conv1D [in, 3*hidden]
    assert gpt2["transformer.h.0.attn.c_proj"][0] == "row" and gpt2["transformer.h.0.mlp.c_proj"][0] == "row"
    assert gpt2["transformer.h.0.mlp.c_fc"] == ("column", None)
    phi3 = _kinds(tp_models.make_model("phi3"))
    assert phi3["model.layers.0.self_attn.qkv_proj"] == ("column", [32, 16, 16])  # 4 query, 2 key/value heads of 8
    assert phi3["model.layers.0.mlp.gate_up_proj"] == ("column", [64, 64])
    bloom = _kinds(tp_models.make_model("bloom"))
    # per-head interleaved [heads, 3, head_dim]: a contiguous split keeps whole heads; `dense` beside it is row
    assert bloom["transformer.h.0.self_attention.query_key_value"] == ("column", None)
    assert bloom["transformer.h.0.self_attention.dense"] == ("row", None)
    assert bloom["transformer.h.0.mlp.dense_4h_to_h"] == ("row", None)
    opt = _kinds(tp_models.make_model("opt"))
    assert opt["model.decoder.layers.0.fc1"][0] == "column" and opt["model.decoder.layers.0.fc2"][0] == "row"
    assert opt["model.decoder.layers.0.self_attn.out_proj"][0] == "row"


def test_partition_config_layer_specs():
    spec = {"use_default_specs": False, "layer_specs": [
        {"patterns": [r".*\.mlp\.(gate|up)_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.mlp\.down_proj$"], "partition_type": "row"}]}
    got = _kinds(tp_models.make_model("llama"), spec)
    assert sorted({k.split(".", 3)[3] for k in got}) == ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj"]
    skip = {"layer_specs": [{"patterns": [r"self_attn"], "partition_type": "skip"}]}  # defaults for the rest
    assert all("self_attn" not in k for k in _kinds(tp_models.make_model("llama"), skip))


@pytest.mark.parametrize("spec, words", [
    ({"layer_spec": []}, ["layer_spec", "layer_specs"]),
    ({"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]}, ["partition_type", "diagonal"]),
    ({"layer_specs": [{"partition_type": "row"}]}, ["patterns"]),
])
def test_bad_partition_config_names_the_key(spec, words):
    with pytest.raises(ValueError) as info:
        plan(tp_models.make_model("llama"), spec)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_preset_model_plans():
    """tensor_parallel.preset_model (DeepSpeed's presets, as partition_config rules): LLaMA's preset names the
    layers the built-in detection finds; phi3's leaves its fused projections to the config-aware split; chatglm's
    splits its stacked [Q, K, V] and [gate, up] in equal parts; a given partition_config comes first or, with
    use_default_specs false, alone; an unknown name raises naming the known ones."""
    from deepspeed_c.runtime.tensor_parallel.presets import resolve

    llama = tp_models.make_model("llama")
    assert _kinds(llama, resolve("llama", None)) == _kinds(llama)
    phi3 = tp_models.make_model("phi3")
    assert _kinds(phi3, resolve("Phi3", None)) == _kinds(phi3)

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.query_key_value, self.dense = torch.nn.Linear(8, 24), torch.nn.Linear(8, 8)

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dense_h_to_4h, self.dense_4h_to_h = torch.nn.Linear(8, 32), torch.nn.Linear(16, 8)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attention, self.mlp = Attn(), Mlp()

    glm = torch.nn.Module()
    glm.layers = torch.nn.ModuleList([Layer()])
    got = _kinds(glm, resolve("chatglm", None))
    assert got["layers.0.self_attention.query_key_value"] == ("column", [8, 8, 8])
    assert got["layers.0.mlp.dense_h_to_4h"] == ("column", [16, 16])
    assert got["layers.0.self_attention.dense"] == ("row", None) and got["layers.0.mlp.dense_4h_to_h"] == ("row", None)
    mine = {"layer_specs": [{"patterns": [r".*\.mlp\.down_proj"], "partition_type": "skip"}]}
    merged = _kinds(llama, resolve("llama", mine))
    assert "model.layers.0.mlp.down_proj" not in merged and merged["model.layers.0.self_attn.o_proj"][0] == "row"
    alone = _kinds(llama, resolve("llama", {**mine, "use_default_specs": False}))
    assert alone == {}
    with pytest.raises(ValueError, match=r"preset_model='gpt5' is not a preset; known: \['bloom'"):
        resolve("gpt5", None)


def test_preset_model_reaches_autotp_from_the_config():
    from deepspeed_c.runtime.tensor_parallel.autotp_setup import _requested_size
    from deepspeed_c.runtime.tensor_parallel.presets import PRESETS

    size, partition = _requested_size({"tensor_parallel": {"autotp_size": 2, "preset_model": "qwen2"}})
    assert size == 2 and partition["layer_specs"] == PRESETS["qwen2"]
    with pytest.raises(ValueError, match="preset_model"):
        _requested_size({"tensor_parallel": {"autotp_size": 2, "preset_model": "nope"}})
