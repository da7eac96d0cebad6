"""init_inference's config and single-process engine: DeepSpeed's keys and aliases, merging a config with
kwargs, errors naming the key or value, the kernel-injection fallback warning, checkpoint descriptions."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

import deepspeed_c
from deepspeed_c.inference.checkpoint_loader import checkpoint_files
from deepspeed_c.inference.config import DeepSpeedInferenceConfig, build_config
from tests.distributed import inference_models as im


def test_aliases_and_legacy_keys(tmp_path):
    cfg = build_config({"kernel_inject": True, "tp": {"tp_size": 2}, "max_tokens": 64, "min_tokens": 8,
                        "dtype": "bf16"}, {})
    assert cfg.replace_with_kernel_inject and cfg.tensor_parallel.tp_size == 2
    assert (cfg.max_out_tokens, cfg.min_out_tokens, cfg.dtype) == (64, 8, torch.bfloat16)
    assert build_config(None, {"mp_size": 4}).tensor_parallel.tp_size == 4  # deprecated spelling moves over
    path = tmp_path / "inf.json"
    path.write_text(json.dumps({"dtype": "fp32", "replace_method": "auto"}))
    cfg = build_config(str(path), {"return_tuple": False})
    assert cfg.dtype == torch.float32 and cfg.return_tuple is False
    assert isinstance(cfg, DeepSpeedInferenceConfig)


@pytest.mark.parametrize("config,kwargs,needle,exc", [
    ({"dtype": "fp16"}, {"dtype": "fp32"}, "Conflicting argument 'dtype'", ValueError),
    ({"tensor_parallel": {"tp_szie": 2}}, {}, "Did you mean 'tp_size'", ValueError),
    ({"max_out_tokens": 0}, {}, "max_out_tokens=0", ValueError),
    ({"max_out_tokens": 8, "min_out_tokens": 9}, {}, "min_out_tokens=9", ValueError),
    ({"dtype": "fp64"}, {}, "dtype='fp64'", ValueError),
    ({"mp_size": 2, "tensor_parallel": {"tp_size": 4}}, {}, "mp_size=2", ValueError),
    ({"use_triton": True}, {}, "'use_triton'", NotImplementedError),
])
def test_bad_config_names_the_key(config, kwargs, needle, exc):
    with pytest.raises(exc, match=None) as info:
        build_config(config, kwargs)
    assert needle in str(info.value), str(info.value)


def test_single_process_engine_and_kernel_inject_fallback():
    model = im.make("opt")
    ids = torch.randint(1, im.VOCAB, (1, 5))
    ref = model(input_ids=ids).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = deepspeed_c.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True)
    # kinject's hook returns None for OPT: the warning names the architecture and the model runs as is
    assert any("OPTForCausalLM" in str(w.message) and "model_type='opt'" in str(w.message) for w in caught)
    assert torch.equal(engine(input_ids=ids).logits, ref) and engine.module is model
    assert engine.config is model.config  # DeepSpeed's engine.config is the model's config
    half = deepspeed_c.init_inference(im.make("gpt2"), dtype="bf16")
    assert all(p.dtype == torch.bfloat16 for p in half.module.parameters())


def test_injection_policy_errors():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    with pytest.raises(ValueError, match="'attn.o_proj'"):
        deepspeed_c.init_inference(im.make("gpt2"), dtype="fp32", injection_policy={GPT2Block: ("attn.o_proj",)})
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    with pytest.raises(ValueError, match="GPT2MLP is not a transformer block"):  # kernel injection replaces blocks
        deepspeed_c.init_inference(im.make("gpt2"), dtype="fp32", replace_with_kernel_inject=True, max_out_tokens=32,
                                   injection_policy={GPT2MLP: ("c_proj",)})
    engine = deepspeed_c.init_inference(im.make("gpt2"), dtype="fp32", replace_with_kernel_inject=True,
                                        max_out_tokens=32, injection_policy={GPT2Block: ("attn.c_proj",)})
    assert engine.injected


def test_checkpoint_descriptions(tmp_path):
    assert checkpoint_files({"type": "ds_model", "checkpoints": ["a.pt", "b.pt"], "version": 1.0}, str(tmp_path)) \
        == [str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]
    assert checkpoint_files({"type": "BLOOM", "checkpoints": ["a.pt"], "version": 1, "base_dir": "/d"}) == ["/d/a.pt"]
    with pytest.raises(NotImplementedError, match="'Megatron'"):
        checkpoint_files({"type": "Megatron", "checkpoints": ["a.pt"], "version": 1.0})
    with pytest.raises(ValueError, match="'version'"):
        checkpoint_files({"type": "ds_model", "checkpoints": ["a.pt"]})
    with pytest.raises(FileNotFoundError, match="missing.json"):
        checkpoint_files(str(tmp_path / "missing.json"))
    # a file holding a tensor of the wrong shape, and one naming a parameter the model lacks
    model = im.make("gpt2")
    state = model.state_dict()
    torch.save({"transformer.wte.weight": state["transformer.wte.weight"][:10]}, tmp_path / "bad.pt")
    torch.save({"transformer.nope.weight": torch.zeros(2)}, tmp_path / "extra.pt")
    for name, needle in (("bad.pt", "transformer.wte.weight"), ("extra.pt", "transformer.nope.weight")):
        desc = {"type": "ds_model", "checkpoints": [name], "version": 1.0}
        with pytest.raises(ValueError, match=needle):
            deepspeed_c.init_inference(im.make("gpt2"), dtype="fp32", checkpoint=desc, base_dir=str(tmp_path))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@torch.no_grad()
def test_int8_weight_only(kind):
    model = im.make(kind)
    ids = torch.randint(1, im.VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    ref_model = im.dequantized_reference(im.make(kind))
    plain = im.make(kind).half()(input_ids=ids).logits.float()
    ref = ref_model(input_ids=ids).logits.float()
    engine = deepspeed_c.init_inference(model, dtype=torch.int8)
    got = engine(input_ids=ids).logits.float()
    assert float((got - ref).abs().max() / ref.abs().max()) < 2e-3  # fp16 activations both sides
    assert float((plain - ref).abs().max() / ref.abs().max()) > 5e-3  # rounding to int8 levels is visible
    stored = [p for n, p in engine.module.named_parameters() if n.endswith("original")]
    assert stored and all(p.dtype == torch.int8 for p in stored)
    assert engine.module.get_output_embeddings().weight.dtype == torch.float16
    tokens = engine.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, ref_model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0))


def test_meta_model_without_checkpoint_raises():
    with deepspeed_c.OnDevice(dtype=torch.float32, device="meta"):
        model = im.make("llama")
    with pytest.raises(ValueError, match="meta device"):
        deepspeed_c.init_inference(model, dtype="fp32")


def test_kernel_inject_with_int8_quantizes_the_fused_blocks():
    engine = deepspeed_c.init_inference(im.make("gpt2"), dtype=torch.int8, replace_with_kernel_inject=True,
                                        max_out_tokens=32)
    assert engine.injected
    assert any(b.dtype == torch.int8 for b in engine.module.buffers())
    assert all(p.dtype == torch.float16 for p in engine.module.parameters())


def test_kv_cache_overflow_past_max_out_tokens_raises():
    """Kernel-injected blocks hold max_out_tokens positions: the engine refuses a generate() that would pass
    them (prompt + max_new_tokens), naming both; within the limit the tokens are HF eager's."""
    model = im.make("gpt2")
    ids = torch.randint(1, im.VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    ref = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    engine = deepspeed_c.init_inference(model, dtype="fp32", replace_with_kernel_inject=True, max_out_tokens=12)
    assert engine.injected
    assert torch.equal(engine.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0), ref)
    with pytest.raises(RuntimeError, match="max_out_tokens=12") as info:
        engine.generate(input_ids=ids, max_new_tokens=7, do_sample=False, pad_token_id=0)
    assert "13" in str(info.value)
