"""init_inference on 2 gloo ranks, fp32, against the one-process Hugging Face model (one shared launch):
- kernel injection with tensor parallelism (tp_size 2): GPT-2 and LLaMA (GQA) greedy tokens equal HF eager's,
  prefill logits equal tp_size 1's and HF's to fp32 rounding; each rank's fused blocks hold half the heads and
  half the MLP rows; enable_cuda_graph at tp_size 2 is refused without injection and on gloo (naming why);
- save_mp_checkpoint_path at TP 2 (injected and AutoTP) writes DeepSpeed's JSON and per-rank tp files;
  `checkpoint=` that JSON on a meta-built model gives HF's tokens, each rank holding only its shard; loaded at
  tp_size 1 it is resharded (same tokens), and one saved at tp_size 1 (AutoTP GPT-2 / LLaMA, injected GPT-2) is
  cut into tp_size 2 shards (same tokens); a quantized one loaded at another tp_size names both sizes;
- MoE inference (moe={"enabled": True, "ep_size": 2}) of deepspeed.moe.layer.MoE models, each rank with its own
  tokens: 4 experts (2 a rank, all-to-all), a residual MoE, and expert slicing (1 expert split over both
  ranks): outputs equal the one-process model's on the same tokens; a Hugging Face Mixtral (4 experts, top 2)
  and a Qwen2-MoE (shared expert beside the routed ones) at ep_size 2 generate the one-process model's greedy
  tokens; ep_size not dividing the world raises;
- quant section with injection at TP 2 (int8, group 16): greedy tokens equal tp_size 1's."""
from __future__ import annotations

import copy
import json
import os

import torch

from tests.distributed import inference_models as im
from tests.harness import run_distributed

NEW = 5


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _gen(model, ids):
    return model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)


def _tp_inject(out: dict, folder: str, ids: torch.Tensor) -> None:
    import deepspeed_c

    out["inject"], out["ckpt"], out["logits"] = {}, {}, {}
    for kind in ("gpt2", "llama"):
        model = im.make(kind, seed=3)
        ref = _gen(model, ids)
        path = os.path.join(folder, f"{kind}-inj")
        engine = deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32, tensor_parallel={"tp_size": 2},
                                            replace_with_kernel_inject=True, max_out_tokens=32,
                                            save_mp_checkpoint_path=path)
        block = engine.module.base_model.layers[0]
        out["inject"][kind] = (bool(torch.equal(_gen(engine, ids), ref)), type(block).__name__,
                               block.spec.n_heads, block.w2.shape[1])
        # prefill logits, fp32: TP 2 against TP 1 (both injected) and against HF eager; only the order of the
        # partial sums differs, so both stay at fp32 rounding level
        one = deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32, replace_with_kernel_inject=True,
                                         max_out_tokens=32)
        hf, tp1, tp2 = (m(input_ids=ids).logits for m in (model, one, engine))
        out["logits"][kind] = (_rel(tp2, tp1), _rel(tp2, hf), _rel(tp1, hf))
        if kind == "llama":  # the experimental symmetric-memory reducer: argument check, nothing to route at TP 1
            from deepspeed_c.module_inject import hybrid_tp

            out["errors"]["symm_tokens"] = _error(lambda: hybrid_tp.use_symmetric_allreduce(engine.module, -1))
            out["symm_tp1"] = hybrid_tp.use_symmetric_allreduce(one.module, 1)
        with deepspeed_c.OnDevice(dtype=torch.float32, device="meta"):
            meta = im.make(kind, seed=3)
        loaded = deepspeed_c.init_inference(meta, dtype=torch.float32, tensor_parallel={"tp_size": 2},
                                            replace_with_kernel_inject=True, max_out_tokens=32,
                                            checkpoint=os.path.join(path, "ds_inference_config.json"))
        held = sum(p.numel() for p in loaded.module.parameters())
        out["ckpt"][f"{kind}/inject"] = (bool(torch.equal(_gen(loaded, ids), ref)),
                                         held / sum(p.numel() for p in model.parameters()))
    out["errors"]["autotp_graph"] = _error(lambda: deepspeed_c.init_inference(
        im.make("llama", seed=4), dtype=torch.float32, tensor_parallel={"tp_size": 2}, enable_cuda_graph=True))
    out["errors"]["gloo_graph"] = _error(lambda: deepspeed_c.init_inference(  # graphs capture NCCL only
        im.make("llama", seed=4), dtype=torch.float32, tensor_parallel={"tp_size": 2}, enable_cuda_graph=True,
        replace_with_kernel_inject=True, max_out_tokens=32))
    # AutoTP (no injection): the sharded LinearLayer / LinearAllreduce / vocabulary layers are the tp files
    model = im.make("llama", seed=4)
    ref = _gen(model, ids)
    path = os.path.join(folder, "llama-autotp")
    deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32, tensor_parallel={"tp_size": 2},
                               save_mp_checkpoint_path=path)
    with deepspeed_c.OnDevice(dtype=torch.float32, device="meta"):
        meta = im.make("llama", seed=4)
    desc = json.load(open(os.path.join(path, "ds_inference_config.json")))
    loaded = deepspeed_c.init_inference(meta, dtype=torch.float32, tensor_parallel={"tp_size": 2}, checkpoint=desc)
    out["ckpt"]["llama/autotp"] = (bool(torch.equal(_gen(loaded, ids), ref)), 0.0)
    out["desc"] = {k: desc[k] for k in ("type", "version", "parallelization", "tp_size", "dtype")}
    out["desc"]["files"] = sorted(os.listdir(path))
    with deepspeed_c.OnDevice(dtype=torch.float32, device="meta"):  # saved at TP 2, loaded at TP 1: resharded
        meta = im.make("llama", seed=4)
    out["ckpt"]["llama/autotp->tp1"] = (bool(torch.equal(_gen(deepspeed_c.init_inference(
        meta, dtype=torch.float32, checkpoint=desc), ids), ref)), 0.0)
    for kind in ("gpt2", "llama"):  # injected TP 2 -> TP 1
        with deepspeed_c.OnDevice(dtype=torch.float32, device="meta"):
            meta = im.make(kind, seed=3)
        one = deepspeed_c.init_inference(meta, dtype=torch.float32, replace_with_kernel_inject=True,
                                         max_out_tokens=32,
                                         checkpoint=os.path.join(folder, f"{kind}-inj", "ds_inference_config.json"))
        out["ckpt"][f"{kind}/inject->tp1"] = (bool(torch.equal(_gen(one, ids), _gen(im.make(kind, seed=3), ids))),
                                              0.0)


def _moe(out: dict, rank: int) -> None:
    import deepspeed_c

    out["moe"] = {}
    tokens = torch.randint(0, 23, (3, 5), generator=torch.Generator().manual_seed(20 + rank))  # each rank its own
    for name, experts, residual in (("ep2", 4, False), ("residual", 4, True), ("sliced", 1, False)):
        net = im.MoENet(experts, residual)
        ref = net(tokens)
        engine = deepspeed_c.init_inference(copy.deepcopy(net), dtype=torch.float32,
                                            moe={"enabled": True, "ep_size": 2, "moe_experts": [experts],
                                                 "type": "residual" if residual else "standard"})
        got = engine(tokens)
        local = sum(p.numel() for n, p in engine.module.named_parameters() if "expert" in n)
        full = sum(p.numel() for n, p in net.named_parameters() if "expert" in n)
        out["moe"][name] = (float((got - ref).abs().max() / ref.abs().max()), local / full)
    import transformers as tf  # a Hugging Face MoE (Mixtral: 4 experts, top 2), each rank its own prompt

    torch.manual_seed(2)
    mix = tf.MixtralForCausalLM(tf.MixtralConfig(vocab_size=im.VOCAB, hidden_size=32, intermediate_size=40,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 num_local_experts=4, num_experts_per_tok=2,
                                                 max_position_embeddings=32)).eval()
    with torch.no_grad():
        for p in mix.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(1, im.VOCAB, (1, 5), generator=torch.Generator().manual_seed(30 + rank))
    ref = _gen(mix, ids)
    engine = deepspeed_c.init_inference(copy.deepcopy(mix), dtype=torch.float32, moe={"ep_size": 2})
    kinds = {type(m).__name__ for m in engine.module.modules()}
    out["moe_hf"] = (bool(torch.equal(_gen(engine, ids), ref)), "HFExpertParallel" in kinds)
    # Qwen2-MoE: fused experts beside a shared expert with its own gate (the shared one stays whole on each rank)
    qwen = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        vocab_size=im.VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, max_position_embeddings=32)).eval()
    with torch.no_grad():
        for p in qwen.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    engine = deepspeed_c.init_inference(copy.deepcopy(qwen), dtype=torch.float32, moe={"ep_size": 2})
    experts = [m for m in engine.module.modules() if type(m).__name__ == "HFExpertParallel"]
    out["moe_qwen"] = (bool(torch.equal(_gen(engine, ids), _gen(qwen, ids))), len(experts),
                       _rel(engine(input_ids=ids).logits, qwen(input_ids=ids).logits))
    out["errors"]["ep3"] = _error(lambda: deepspeed_c.init_inference(im.MoENet(4), dtype=torch.float32,
                                                                     moe={"ep_size": 3}))


def _quant_tp(out: dict, ids: torch.Tensor, folder: str) -> None:
    import deepspeed_c

    model = im.make("llama", seed=3)
    q = {"weight": {"num_bits": 8, "group_size": 16}}
    one = deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32, replace_with_kernel_inject=True,
                                     max_out_tokens=32, quant=q)
    path = os.path.join(folder, "llama-q8")
    two = deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32, replace_with_kernel_inject=True,
                                     max_out_tokens=32, quant=q, tensor_parallel={"tp_size": 2},
                                     save_mp_checkpoint_path=path)
    out["quant_tp2"] = bool(torch.equal(_gen(one, ids), _gen(two, ids)))
    with deepspeed_c.OnDevice(dtype=torch.float32, device="meta"):
        meta = im.make("llama", seed=3)
    out["errors"]["tp_mismatch"] = _error(lambda: deepspeed_c.init_inference(  # quantized: not reshardable
        meta, dtype=torch.float32, replace_with_kernel_inject=True, max_out_tokens=32, quant=q,
        checkpoint=os.path.join(path, "ds_inference_config.json")))


def _tp1_to_tp2(out: dict, folder: str, ids: torch.Tensor) -> None:
    """Saved at tp_size 1 (the non-tp file holds every tensor whole), loaded at tp_size 2: each rank cuts its
    shards out of the whole tensors (GPT-2's Conv1D weights transposed as AutoTP does)."""
    import deepspeed_c

    out["tp1_to_tp2"] = {}
    for kind, inject in (("gpt2", False), ("llama", False), ("gpt2", True)):
        model = im.make(kind, seed=5)
        path = os.path.join(folder, f"{kind}-{inject}-tp1")
        deepspeed_c.init_inference(copy.deepcopy(model), dtype=torch.float32, replace_with_kernel_inject=inject,
                                   max_out_tokens=32, save_mp_checkpoint_path=path)
        with deepspeed_c.OnDevice(dtype=torch.float32, device="meta"):
            meta = im.make(kind, seed=5)
        loaded = deepspeed_c.init_inference(meta, dtype=torch.float32, tensor_parallel={"tp_size": 2},
                                            replace_with_kernel_inject=inject, max_out_tokens=32,
                                            checkpoint=os.path.join(path, "ds_inference_config.json"))
        held = sum(p.numel() for p in loaded.module.parameters()) / sum(p.numel() for p in model.parameters())
        out["tp1_to_tp2"][f"{kind}/{'inject' if inject else 'autotp'}"] = (
            bool(torch.equal(_gen(loaded, ids), _gen(model, ids))), _rel(loaded(input_ids=ids).logits,
                                                                         model(input_ids=ids).logits), held)


def body(rank: int, world: int, folder: str) -> dict:
    ids = torch.randint(1, im.VOCAB, (2, 6), generator=torch.Generator().manual_seed(7))
    out: dict = {"errors": {}}
    with torch.no_grad():
        _tp_inject(out, folder, ids)
        _moe(out, rank)
        _quant_tp(out, ids, folder)
        _tp1_to_tp2(out, folder, ids)
    return out


def test_inference_rest_two_ranks(tmp_path):
    results = run_distributed(body, world_size=2, args=(str(tmp_path),), timeout=300)
    for rank, res in enumerate(results):
        for kind, (same, cls, heads, ffn_cols) in res["inject"].items():
            assert same and cls == "TPFusedDecoderBlock", (rank, kind, res["inject"])
            assert heads == 2, (kind, heads)  # 4 query heads over 2 ranks
        for name, (same, frac) in res["ckpt"].items():
            assert same, (rank, name)
            if name.endswith("inject"):
                assert frac < 0.85, (name, frac)  # blocks halved; embeddings, norms whole
        desc = res["desc"]
        assert (desc["type"], desc["version"], desc["parallelization"], desc["tp_size"], desc["dtype"]) == \
            ("ds_model", 1.0, "tp", 2, "float32"), desc
        assert "non-tp.pt" in desc["files"] and "tp_01_07.pt" in desc["files"], desc["files"]
        err = res["errors"]["autotp_graph"]
        assert "enable_cuda_graph=True with tensor_parallel.tp_size=2 needs replace_with_kernel_inject=True" in err, err
        err = res["errors"]["gloo_graph"]
        assert "needs the nccl backend" in err and "'gloo'" in err, err
        assert "tokens must be >= 0, got -1" in res["errors"]["symm_tokens"], res["errors"]["symm_tokens"]
        assert res["symm_tp1"] == 0
        for kind, (tp2_tp1, tp2_hf, tp1_hf) in res["logits"].items():
            assert tp2_tp1 < 1e-5 and tp2_hf < 1e-5 and tp1_hf < 1e-5, (rank, kind, res["logits"][kind])
        err = res["errors"]["tp_mismatch"]
        assert "tp_size=2" in err and "tp_size=1" in err, err
        for name, (rel, frac) in res["moe"].items():
            assert rel < 1e-5, (rank, name, rel)
            assert 0.45 < frac < 0.55, (name, frac)  # half the experts (or half of each, biases whole) a rank
        assert "ep_size=3" in res["errors"]["ep3"] and "world size 2" in res["errors"]["ep3"], res["errors"]
        assert res["quant_tp2"]
        assert len(res["tp1_to_tp2"]) == 3, res["tp1_to_tp2"]
        for name, (same, rel, held) in res["tp1_to_tp2"].items():
            assert same and rel < 1e-5 and held < 0.85, (rank, name, same, rel, held)  # resharded, a rank's shards
        assert res["moe_hf"] == (True, True), res["moe_hf"]
        same, blocks, rel = res["moe_qwen"]
        assert same and blocks == 2 and rel < 1e-5, res["moe_qwen"]
