"""ZeRO-Inference by DeepSpeed's other documented route (DeepSpeedExamples' inference/huggingface/zero_inference):
`deepspeed.initialize(model=..., config=...)` with `zero_optimization.stage` 3 + `offload_param` (cpu or nvme) and
no optimizer, the model built under `zero.Init` (as transformers' from_pretrained does under HfDeepSpeedConfig) or
whole, then `engine.module.generate(...)`. Greedy tokens in fp32 on the host equal Hugging Face eager's on the
same weights (issue 39's bar for ZeRO-Inference through initialize; the init_inference route is
test_inference_rest.py::test_zero_inference_streams_layers_and_matches_hf)."""
from __future__ import annotations

import copy
import os

import pytest
import torch

import deepspeed_c

pytestmark = pytest.mark.usefixtures("world_of_one")

VOCAB = 48


def _llama_config():
    import transformers as tf

    return tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                          attn_implementation="eager")


def _llama() -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(6)
    model = tf.LlamaForCausalLM(_llama_config()).eval()
    with torch.no_grad():
        for p in model.parameters():  # weights large enough that the greedy tokens depend on every layer
            if p.dim() >= 2:
                p.add_(torch.randn_like(p) * 0.15)
    return model


def _config(device: str, path: str) -> dict:
    offload = {"device": device, "pin_memory": True}
    if device == "nvme":
        offload["nvme_path"] = path
    return {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
            "zero_optimization": {"stage": 3, "offload_param": offload, "stage3_param_persistence_threshold": 0}}


def _gen(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("built", ["whole", "zero.Init"])
@torch.no_grad()
def test_initialize_route_generates_hf_tokens(tmp_path, device: str, built: str) -> None:
    ref_model = _llama()
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    ref = _gen(ref_model, ids)
    cfg = _config(device, str(tmp_path))
    if built == "zero.Init":
        import transformers as tf

        with deepspeed_c.zero.Init(config_dict_or_path=cfg):
            model = tf.LlamaForCausalLM(_llama_config()).eval()
        for p, q in zip(model.parameters(), ref_model.parameters()):  # the reference's weights, shard by shard
            with deepspeed_c.zero.GatheredParameters([p], modifier_rank=0):
                p.copy_(q)
    else:
        model = copy.deepcopy(ref_model)
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    engine.module.eval()
    partitioned = [p for p in engine.module.parameters() if hasattr(p, "ds_numel")]
    assert partitioned and all(p.numel() == 0 for p in partitioned if p.ds_numel > 0), "not ZeRO-3 partitioned"
    if device == "nvme":  # the partitions live in swap files under nvme_path
        assert any(files for _, _, files in os.walk(tmp_path)), "nothing swapped to nvme_path"
    got = _gen(engine.module, ids)
    assert torch.equal(got, ref), (got, ref)
