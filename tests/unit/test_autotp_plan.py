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
