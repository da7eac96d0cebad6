"""init_inference with AutoTP against the unsharded Hugging Face model in one process.

One 4-rank gloo run, fp32, tensor_parallel.tp_size 1, 2 and 4 (TP 2: groups {0,1} and {2,3}):
- tiny GPT-2 (Conv1D, tied vocab-parallel head), LLaMA (GQA at TP 2), OPT, BERT (masked-LM logits): the
  engine's logits equal the unsharded model's, and the decoders' greedy generate() tokens are the same;
  also a GPT-2 whose vocabulary (61) is no multiple of 4 at TP 4, and BLOOM, Qwen2, Mistral logits at TP 2;
- T5 (encoder-decoder, relative attention bias) at TP 4 by AutoTP and at TP 2 by DeepSpeed's tutorial
  injection_policy {T5Block: ('SelfAttention.o', 'EncDecAttention.o', 'DenseReluDense.wo')};
- dtype=torch.int8 (weight-only) at TP 2 against the unsharded model with int8-rounded weights in fp16;
- a Hugging Face pipeline("text-generation", model=engine.module, tokenizer=...) returns the same text, and so
  does one whose model is replaced by the engine (`pipe.model = init_inference(pipe.model)`, the tutorial's way);
- injection_policy={GPT2Block: ('attn.c_proj', 'mlp.c_proj')} shards like AutoTP, and
  {Block: ('attn.out_proj', 'mlp.down_proj')} shards a plain-PyTorch model no AutoTP rule knows (TP 4);
- a LLaMA and a GPT-2 saved in 2 files (torch.save and safetensors), described by a DeepSpeed checkpoint JSON, built on the meta device and
  loaded file by file at TP 1, 2 and 4 give the unsharded model's logits;
- kernel injection at tp_size 4 (GPT-2, LLaMA: one head a rank): greedy tokens equal HF eager's;
- MoE inference at ep_size 4 (deepspeed.moe layers, each rank its own tokens): 4 experts one a rank, and 2
  experts each sliced over 2 ranks, equal the one-process layer;
- bad input: tp_size not dividing the world or the heads, unsupported dtype, prompts past max_out_tokens."""
from __future__ import annotations

import copy
import json
import os

import numpy as np
import torch

from tests.distributed import inference_models as im
from tests.harness import run_distributed

NEW = 6  # generated tokens


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _serve(kind: str, model: torch.nn.Module, ids: torch.Tensor, tp: int, **extra) -> tuple[float, list, str]:
    import deepspeed_c

    ref_logits = model(input_ids=ids).logits
    engine = deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32,
                                        tensor_parallel={"tp_size": tp}, **extra)
    rel = _rel(engine(input_ids=ids).logits, ref_logits)
    if kind == "bert":
        return rel, [], type(engine.module.bert.encoder.layer[0].intermediate.dense).__name__
    ref = model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    out = engine.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    layers = sorted({type(m).__name__ for m in engine.module.modules() if "Parallel" in type(m).__name__
                     or type(m).__name__ in ("LinearLayer", "LinearAllreduce")})
    return rel, [bool(torch.equal(out, ref)), int(out.shape[1])], ",".join(layers)


def _checkpoint(kind: str, tp: int, folder: str, ids: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    import deepspeed_c

    with deepspeed_c.OnDevice(dtype=torch.float32, device="meta"):
        model = im.make(kind, seed=5, kv_heads=4)
    engine = deepspeed_c.init_inference(model, dtype=torch.float32, tensor_parallel={"tp_size": tp},
                                        checkpoint=os.path.join(folder, f"{kind}.json"), base_dir=folder)
    held = sum(p.numel() for p in engine.module.parameters())  # what this rank holds after loading
    whole = sum(p.numel() for p in im.make(kind, seed=5, kv_heads=4).parameters())
    return _rel(engine(input_ids=ids).logits, ref), held / whole


def _save_two_files(kind: str, folder: str, rank: int) -> torch.nn.Module:
    model = im.make(kind, seed=5, kv_heads=4)
    if rank == 0:
        state = model.state_dict()
        keys = list(state)
        half = len(keys) // 2
        from safetensors.torch import save_file

        torch.save({k: state[k] for k in keys[:half]}, os.path.join(folder, f"{kind}-0.pt"))
        save_file({k: state[k].clone() for k in keys[half:]}, os.path.join(folder, f"{kind}-1.safetensors"))
        with open(os.path.join(folder, f"{kind}.json"), "w") as f:
            json.dump({"type": "ds_model", "checkpoints": [f"{kind}-0.pt", f"{kind}-1.safetensors"],
                       "version": 1.0}, f)
    torch.distributed.barrier()
    return model


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def body(rank: int, world: int, folder: str) -> dict:
    import deepspeed_c
    from transformers import pipeline
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, im.VOCAB, (2, 7), generator=g)
    out: dict = {"models": {}}
    with torch.no_grad():
        for kind in ("gpt2", "llama", "opt", "bert"):
            model = im.make(kind)
            for tp in (1, 2, 4):
                mine = im.make("llama", kv_heads=4) if kind == "llama" and tp == 4 else model
                out["models"][f"{kind}/tp{tp}"] = _serve(kind, mine, ids, tp)
        out["models"]["gpt2-vocab61/tp4"] = _serve("gpt2", im.make("gpt2", vocab=61), ids % 61, 4)
        out["logits"] = {}  # other decoders, forward only: BLOOM (ALiBi), Qwen2 and Mistral (GQA)
        for kind in ("bloom", "qwen2", "mistral"):
            model = im.make(kind)
            ref = model(input_ids=ids).logits
            engine = deepspeed_c.init_inference(model, dtype=torch.float32, tensor_parallel={"tp_size": 2})
            out["logits"][kind] = _rel(engine(input_ids=ids).logits, ref)
        torch.manual_seed(0)  # a model no AutoTP rule knows, sharded by DeepSpeed's injection_policy
        custom, x = torch.nn.Sequential(im.Block(), im.Block()), torch.randn(2, 5, 16, generator=g)
        engine = deepspeed_c.init_inference(copy.deepcopy(custom), dtype="fp32", tensor_parallel={"tp_size": 4},
                                            injection_policy={im.Block: ("attn.out_proj", "mlp.down_proj")})
        out["custom"] = (_rel(engine(x), custom(x)), type(engine.module[1].mlp.down_proj).__name__)
        out["t5"] = {}  # encoder-decoder: AutoTP, and the tutorial's injection_policy, against the whole model
        from transformers.models.t5.modeling_t5 import T5Block

        t5, dec = im.make("t5"), ids[:, :5]
        ref, ref_gen = t5(input_ids=ids, decoder_input_ids=dec).logits, t5.generate(input_ids=ids, max_new_tokens=NEW)
        for name, tp, extra in (("auto/tp4", 4, {}), ("policy/tp2", 2, {"injection_policy": {
                T5Block: ("SelfAttention.o", "EncDecAttention.o", "DenseReluDense.wo")}})):
            engine = deepspeed_c.init_inference(copy.deepcopy(t5), dtype="fp32", tensor_parallel={"tp_size": tp},
                                                **extra)
            out["t5"][name] = (_rel(engine(input_ids=ids, decoder_input_ids=dec).logits, ref),
                               bool(torch.equal(engine.generate(input_ids=ids, max_new_tokens=NEW), ref_gen)),
                               sum(type(m).__name__ == "Embedding" for m in engine.module.modules()))
        out["int8"] = {}  # weight-only int8 at TP 2: row-parallel scales come from whole rows
        for kind in ("gpt2", "llama"):
            ref = im.dequantized_reference(im.make(kind))(input_ids=ids).logits.float()
            engine = deepspeed_c.init_inference(im.make(kind), dtype=torch.int8, tensor_parallel={"tp_size": 2})
            out["int8"][kind] = _rel(engine(input_ids=ids).logits.float(), ref)
        model = im.make("gpt2")
        out["policy"] = _serve("gpt2", model, ids, 2,
                               injection_policy={GPT2Block: ("attn.c_proj", "mlp.c_proj")})
        tok = im.tokenizer()
        ref_text = pipeline("text-generation", model=model, tokenizer=tok)("w3 w9 w27", max_new_tokens=NEW,
                                                                            do_sample=False)
        engine = deepspeed_c.init_inference(copy.deepcopy(model), dtype="fp32", tensor_parallel={"tp_size": 4})
        text = pipeline("text-generation", model=engine.module, tokenizer=tok)("w3 w9 w27", max_new_tokens=NEW,
                                                                               do_sample=False)
        tutorial = pipeline("text-generation", model=im.make("gpt2"), tokenizer=tok)
        tutorial.model = engine  # DeepSpeed's tutorial: pipe.model = deepspeed.init_inference(pipe.model, ...)
        again = tutorial("w3 w9 w27", max_new_tokens=NEW, do_sample=False)
        out["pipeline"] = [ref_text[0]["generated_text"], text[0]["generated_text"], again[0]["generated_text"]]
        out["checkpoint"] = {}
        for kind in ("llama", "gpt2"):
            ref = _save_two_files(kind, folder, rank)(input_ids=ids).logits
            for tp in (1, 2, 4):
                out["checkpoint"][f"{kind}/tp{tp}"] = _checkpoint(kind, tp, folder, ids, ref)
    out["inject_tp4"] = {}  # kernel injection at tp_size 4: one head (and kv head) a rank
    for kind in ("gpt2", "llama"):
        model = im.make(kind, kv_heads=4)
        engine = deepspeed_c.init_inference(copy.deepcopy(model), dtype="fp32", tensor_parallel={"tp_size": 4},
                                            replace_with_kernel_inject=True, max_out_tokens=32)
        ref = model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        got = engine.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        out["inject_tp4"][kind] = (bool(torch.equal(got, ref)), engine.module.base_model.layers[0].spec.n_heads)
    out["moe_ep4"] = {}  # MoE inference at ep_size 4: one expert a rank (all-to-all), 2 experts sliced over 2 ranks
    tokens = torch.randint(0, 23, (2, 5), generator=torch.Generator().manual_seed(40 + rank))
    for experts in (4, 2):
        net = im.MoENet(experts)
        with torch.no_grad():
            engine = deepspeed_c.init_inference(copy.deepcopy(net), dtype="fp32", moe={"ep_size": 4})
            out["moe_ep4"][experts] = _rel(engine(tokens), net(tokens))
    gpt2 = im.make("gpt2")
    out["errors"] = {
        "world": _error(lambda: deepspeed_c.init_inference(gpt2, dtype="fp32", tensor_parallel={"tp_size": 3})),
        "heads": _error(lambda: deepspeed_c.init_inference(im.make("gpt2", heads=2), dtype="fp32",
                                                           tensor_parallel={"tp_size": 4})),
        "kv_heads": _error(lambda: deepspeed_c.init_inference(im.make("llama", kv_heads=2), dtype="fp32",
                                                              mp_size=4)),
        "dtype": _error(lambda: deepspeed_c.init_inference(gpt2, dtype=torch.float64)),
        "max_out": _error(lambda: deepspeed_c.init_inference(gpt2, dtype="fp32", max_out_tokens=5).generate(
            input_ids=ids, max_new_tokens=2)),
    }
    return out


def test_init_inference_autotp_matches_unsharded(tmp_path):
    results = run_distributed(body, world_size=4, args=(str(tmp_path),), timeout=300)
    for rank, res in enumerate(results):
        for name, (rel, gen, layers) in list(res["models"].items()) + [("policy", res["policy"])]:
            assert rel < 1e-5, (rank, name, rel)
            tp = int(name.rsplit("tp", 1)[1]) if "/tp" in name else 2
            if not name.startswith("bert"):
                assert gen == [True, 7 + NEW], (rank, name, gen)
            if tp > 1 and not name.startswith("bert"):  # sharded: both kinds of linear and the vocab layers
                assert "LinearAllreduce" in layers and "VocabParallelLMHead" in layers, (name, layers)
            if name.startswith("bert"):
                assert layers == ("LinearLayer" if tp > 1 else "Linear"), (name, layers)
        assert res["custom"][0] < 1e-5 and res["custom"][1] == "LinearAllreduce", res["custom"]
        assert len(res["t5"]) == 2 and all(r[0] < 1e-5 and r[1] and r[2] == 0 for r in res["t5"].values()), res["t5"]
        assert len(res["int8"]) == 2 and max(res["int8"].values()) < 2e-3, res["int8"]  # fp16 activations
        assert len(res["logits"]) == 3 and max(res["logits"].values()) < 1e-5, res["logits"]
        assert res["pipeline"][0] == res["pipeline"][1] == res["pipeline"][2] and res["pipeline"][0].startswith("w3 w9 w27"), res["pipeline"]
        ckpt = res["checkpoint"]
        assert len(ckpt) == 6 and max(rel for rel, _ in ckpt.values()) < 1e-5, ckpt
        for kind in ("llama", "gpt2"):  # a rank holds its shards, not the whole model (norms stay replicated)
            assert ckpt[f"{kind}/tp1"][1] == 1.0 and ckpt[f"{kind}/tp4"][1] < 0.5, ckpt
        assert res["inject_tp4"] == {"gpt2": (True, 1), "llama": (True, 1)}, res["inject_tp4"]
        assert len(res["moe_ep4"]) == 2 and max(res["moe_ep4"].values()) < 1e-5, res["moe_ep4"]
        errs = res["errors"]
        assert "tp_size=3" in errs["world"] and "world size 4" in errs["world"], errs["world"]
        assert "tp_size=4" in errs["heads"] and "=2" in errs["heads"], errs["heads"]
        assert "num_key_value_heads=2" in errs["kv_heads"], errs["kv_heads"]
        assert "float64" in errs["dtype"] and "dtype" in errs["dtype"], errs["dtype"]
        assert "max_out_tokens=5" in errs["max_out"] and "size 7" in errs["max_out"], errs["max_out"]
    # every rank of a group served the same tokens as the one-process model (checked above per rank)
    assert np.isfinite([r["checkpoint"]["llama/tp4"][0] for r in results]).all()
