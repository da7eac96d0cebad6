"""init_inference in one process, fp32 on the host, against Hugging Face eager / float64 references:
weight-only int8 / int4 quantization (the quant section), encoder kernel injection (BERT, RoBERTa, DistilBERT
with padding masks; injection_policy), ZeRO-Inference (cpu and nvme offload, an odd number of layers) and a
sharded checkpoint described in DeepSpeed's own JSON form (quantized, injected)."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import deepspeed_c
from deepspeed_c.ops.transformer.inference import quant as Q
from tests.distributed import inference_models as im

IDS = torch.randint(1, im.VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))


def _gen(model, ids=IDS, new=5):
    return model.generate(input_ids=ids, max_new_tokens=new, do_sample=False, pad_token_id=0)


def _fake_quant(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """[out, in] weight rounded to `bits`-bit levels, one scale per `group` inputs of a row (float64)."""
    qmax = 127 if bits == 8 else 7
    n, k = w.shape
    g = w.double().reshape(n, k // group, group)
    s = g.abs().amax(dim=2, keepdim=True) / qmax
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (torch.round(g / s).clamp(-qmax, qmax) * s).reshape(n, k).to(w.dtype)


@torch.no_grad()
def _dequantized_hf(model: torch.nn.Module, bits: int, group: int, within: str = "") -> torch.nn.Module:
    head = model.get_output_embeddings()
    for name, m in model.named_modules():
        if m is head or within not in name:
            continue
        if isinstance(m, torch.nn.Linear):
            m.weight.copy_(_fake_quant(m.weight, bits, group))
        elif type(m).__name__ == "Conv1D":  # [in, out]
            m.weight.copy_(_fake_quant(m.weight.t(), bits, group).t())
    return model


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_roundtrip_against_float64(bits):
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(bits))
    q, s = Q.quantize(w, bits, 16)
    assert q.dtype == (torch.int8 if bits == 8 else torch.uint8) and q.shape == (24, 64 if bits == 8 else 32)
    got = Q.dequantize_reference(q, s, bits, 16, torch.float64)
    assert torch.allclose(got, _fake_quant(w.double(), bits, 16), rtol=0, atol=1e-6)
    assert float((got - w.double()).abs().max()) <= float(s.max()) / 2 + 1e-6  # within half a level
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    assert torch.allclose(Q.linear(x, q, s, bits, 16), x @ got.float().t(), atol=1e-5)
    with pytest.raises(ValueError, match="input width 64.*group \\(24\\)"):
        Q.quantize(w, bits, 24)


@pytest.mark.parametrize("kind,bits", [("gpt2", 8), ("llama", 4)])
@torch.no_grad()
def test_injected_quantized_tokens_equal_hf_with_rounded_weights(kind, bits):
    model = im.make(kind, seed=2)
    ref = _dequantized_hf(copy.deepcopy(model), bits, 16)
    engine = deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32, replace_with_kernel_inject=True,
                                        max_out_tokens=32, quant={"weight": {"num_bits": bits, "group_size": 16}})
    assert engine.injected
    stored = [b for n, b in engine.module.named_buffers() if n.endswith("qweight")]
    assert len(stored) == 8 and all(b.dtype == (torch.int8 if bits == 8 else torch.uint8) for b in stored)
    assert torch.equal(_gen(engine), _gen(ref))
    rel = (engine(input_ids=IDS).logits - ref(input_ids=IDS).logits).abs().max() / ref(input_ids=IDS).logits.abs().max()
    assert float(rel) < 1e-5
    if kind == "gpt2":
        return
    # decode steps (one row: the GEMV path on a GPU) continue the prefix's cache to the full prefill's logits
    full = ref(input_ids=IDS).logits
    out = engine(input_ids=IDS[:, :3], use_cache=True)
    past = out.past_key_values
    for t in range(3, IDS.shape[1]):
        step = engine(input_ids=IDS[:, t:t + 1], past_key_values=past, use_cache=True)
        past = step.past_key_values
        assert float((step.logits[:, -1] - full[:, t]).abs().max() / full.abs().max()) < 1e-5
    # the same section without injection quantizes each Linear alike
    plain = deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32, max_out_tokens=32,
                                       quant={"weight": {"num_bits": bits, "group_size": 16}})
    assert torch.equal(_gen(plain), _gen(ref))
    with pytest.raises(ValueError, match="input width 32.*group \\(24\\)"):
        deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32, replace_with_kernel_inject=True,
                                   max_out_tokens=32, quant={"weight": {"num_bits": bits, "group_size": 24}})
    with pytest.raises(ValueError, match="input width 32, which q_groups=3 does not divide"):  # DeepSpeed's key
        deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32, max_out_tokens=32,
                                   quant={"weight": {"num_bits": bits, "q_groups": 3}})
    with pytest.raises(ValueError, match="quant.weight.num_bits=3"):
        deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32, quant={"weight": {"num_bits": 3}})
    with pytest.raises(NotImplementedError, match="q_type='asymmetric'"):
        deepspeed_c.init_inference(copy.deepcopy(model), quant={"weight": {"q_type": "asymmetric"}})


def _encoder(kind: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    small = dict(vocab_size=im.VOCAB, attn_implementation="eager")
    if kind == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                intermediate_size=64, max_position_embeddings=32, **small)).eval()
    if kind == "roberta":
        return tf.RobertaForMaskedLM(tf.RobertaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                      intermediate_size=64, max_position_embeddings=40, pad_token_id=1,
                                                      hidden_act="gelu_new", **small)).eval()
    return tf.DistilBertForMaskedLM(tf.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                                        max_position_embeddings=32, **small)).eval()


@torch.no_grad()
def test_encoder_injection_masked_lm_logits_equal_hf():
    from transformers.models.bert.modeling_bert import BertLayer, BertSelfOutput

    ids = torch.randint(3, im.VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # padding in the second row
    for kind in ("bert", "roberta", "distilbert"):
        model = _encoder(kind)
        ref = model(input_ids=ids, attention_mask=mask).logits
        engine = deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32, replace_with_kernel_inject=True)
        fused = [m for m in engine.module.modules() if type(m).__name__ == "FusedEncoderLayer"]
        assert engine.injected and len(fused) == 2, kind
        got = engine(input_ids=ids, attention_mask=mask).logits
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5, kind
    # DeepSpeed's injection_policy dict: its keys pick the layer classes to replace
    model = _encoder("bert")
    engine = deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32, replace_with_kernel_inject=True,
                                        injection_policy={BertLayer: ("output.dense",)})
    assert sum(type(m).__name__ == "FusedEncoderLayer" for m in engine.module.modules()) == 2
    with pytest.raises(ValueError, match="BertSelfOutput"):
        deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32, replace_with_kernel_inject=True,
                                   injection_policy={BertSelfOutput: ("dense",)})
    # int8 encoder blocks against HF with the same rounded weights
    ref = _dequantized_hf(copy.deepcopy(model), 8, 32, "encoder.layer")(input_ids=ids, attention_mask=mask).logits
    engine = deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32, replace_with_kernel_inject=True,
                                        quant={"weight": {"num_bits": 8, "q_groups": 1}})
    got = engine(input_ids=ids, attention_mask=mask).logits
    # float32 vs float64 scales may round a weight at a level's midpoint the other way: far below int8's own
    # error on these logits (~7e-3 relative)
    assert float((got - ref).abs().max() / ref.abs().max()) < 5e-4


def _three_layer_llama() -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(6)
    cfg = tf.LlamaConfig(vocab_size=im.VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attn_implementation="eager")
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn_like(p) * 0.15)
    return model


@torch.no_grad()
def test_zero_inference_streams_layers_and_matches_hf(tmp_path):
    model = _three_layer_llama()  # 3 layers: the two device buffers alternate across steps
    ref = _gen(model, new=6)
    for device, inject in (("cpu", False), ("nvme", True)):
        zero = {"stage": 3, "offload_param": {"device": device, "nvme_path": str(tmp_path)}}
        engine = deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32, zero=zero,
                                            replace_with_kernel_inject=inject, max_out_tokens=32)
        streamer = engine.streamer
        streamed = sum(len(entries) for entries in streamer.params)  # every matrix of every layer...
        assert len(streamer.layers) == 3 and streamed >= 12
        assert sum(p.numel() == 0 for p in streamer.layers.parameters()) == streamed  # ...holds nothing between calls
        assert torch.equal(_gen(engine, new=6), ref), (device, inject)
        if device == "nvme":
            assert streamer.host_bytes() == 0 and len(os.listdir(os.path.dirname(streamer.files[0]))) == 3
    for zero, needle in (({"stage": 2}, "zero.stage=2"), ({"stage": "3"}, "zero.stage='3'"),
                         ({"stage": 3}, "offload_param.device='none'"),
                         ({"stage": 3, "offload_param": {"device": "nvme"}}, "nvme_path")):
        with pytest.raises(ValueError, match=needle):
            deepspeed_c.init_inference(im.make("gpt2"), dtype=torch.float32, zero=zero)


@torch.no_grad()
def test_sharded_checkpoint_in_deepspeeds_json_form_quantized(tmp_path):
    model = im.make("llama", seed=8)
    q = {"weight": {"num_bits": 4, "group_size": 16}}
    engine = deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32, replace_with_kernel_inject=True,
                                        max_out_tokens=32, quant=q, save_mp_checkpoint_path=str(tmp_path))
    want = _gen(engine)
    desc = json.load(open(tmp_path / "ds_inference_config.json"))
    assert desc["checkpoints"]["non_tp"] == ["non-tp.pt"] and len(desc["checkpoints"]["tp"]) == 8
    del desc["deepspeed_c"]  # DeepSpeed's own form: no record of how the weights were prepared
    with deepspeed_c.OnDevice(dtype=torch.float32, device="meta"):
        meta = im.make("llama", seed=8)
    loaded = deepspeed_c.init_inference(meta, dtype=torch.float32, replace_with_kernel_inject=True, max_out_tokens=32,
                                        quant=q, checkpoint=desc, set_empty_params=True)
    assert torch.equal(_gen(loaded), want)
    assert any(b.dtype == torch.uint8 for b in loaded.module.buffers())
