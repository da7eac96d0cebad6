"""The hybrid engine (hybrid_engine.enabled) on 2 real gloo ranks, fp32, tiny HF causal LMs built from configs.

For each rank: greedy generations through engine.generate (and engine.module.generate) equal Hugging Face's
generate on a plain copy of the model holding the gathered training weights, token for token (left-padded
prompts with an attention mask too), at ZeRO 2 and 3, with and without a DeepSpeed-Chat style LoRA linear;
LLaMA and GPT-2 take the fused-kernel path, OPT the fallback (one warning naming it); inference_tp_size 2
splits every block over both ranks. Training then continues bit for bit as a run of the same engine that
never generated: the same losses and the same final weights. Bad input: inference_tp_size not dividing the
world or on a family without fused blocks, prompts of different shapes in one TP group, generate on an engine
that initialize did not build, a generation past max_out_tokens."""
from __future__ import annotations

import copy
import warnings
from typing import Any, Optional

import pytest
import torch

from tests.harness import rank_device, run_distributed

NEW = 10


def _config(stage: int, **he: Any) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 5e-3}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "hybrid_engine": {"enabled": True, "max_out_tokens": 64, **he}}


def _gathered_copy(engine: Any, ref: torch.nn.Module) -> torch.nn.Module:
    """`ref` (a plain copy of the model as built) loaded with the engine's gathered training weights."""
    from deepspeed_c.runtime.zero.partition_parameters import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    return ref.eval()


def _fuse_lora_check(engine: Any, stage: int) -> Optional[dict[str, Any]]:
    """DeepSpeed's engine.fuse_lora_weight / unfuse_lora_weight (its test calls them inside GatheredParameters)
    against W + s * (right @ left)^T in float64; layer_params: one list per block, LoRA adapters apart."""
    from deepspeed_c.module_inject.hybrid_inference import lora_modules
    from deepspeed_c.runtime.zero.partition_parameters import GatheredParameters

    adapters = {id(p) for p in engine.all_lora_params}
    res: dict[str, Any] = {"blocks": len(engine.layer_params),
                           "adapters_apart": all(id(p) not in adapters for ps in engine.layer_params for p in ps),
                           "nonempty": all(len(ps) > 0 for ps in engine.layer_params)}
    if not lora_modules(engine.module):  # GPT-2's Conv1D layers get no DeepSpeed-Chat LoRA
        return None
    with GatheredParameters(list(engine.module.parameters())):
        mods = lora_modules(engine.module)
        base = [m.weight.detach().double().clone() for m in mods]
        want = [b + m.lora_scaling * (m.lora_right_weight.double() @ m.lora_left_weight.double()).t()
                for b, m in zip(base, mods)]
        engine.fuse_lora_weight()
        fused = max(float((m.weight.double() - w).abs().max()) for m, w in zip(mods, want))
        engine.unfuse_lora_weight()
        back = max(float((m.weight.double() - b).abs().max()) for m, b in zip(mods, base))
    res.update(n=len(mods), fused_err=fused, back_err=back, moved=max(float((w - b).abs().max())
                                                                      for w, b in zip(want, base)))
    return res


def _run(rank: int, kind: str, stage: int, lora: bool, generate: bool, he: dict) -> dict[str, Any]:
    import deepspeed_c
    from tests.distributed.hybrid_models import prompts, tiny_lm

    model = tiny_lm(kind, seed=3, lora=lora)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = deepspeed_c.initialize(model=model, config=_config(stage, **he))
        if stage == 3 and lora and generate and kind == "llama":
            with pytest.raises(RuntimeError, match="GatheredParameters"):  # partitioned base weights
                engine.fuse_lora_weight()
        dev = rank_device()
        data = prompts(8, 12, seed=10 + rank).to(dev)
        losses, out = [], {}
        for step in range(4):
            if step == 2 and generate:
                engine.eval()
                ids = prompts(2, 7, seed=100 + rank).to(dev)
                kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
                got = engine.generate(ids, **kw)
                # a second generation reuses (or rebuilds) the copy; DeepSpeed-Chat's spelling goes through the module
                again = engine.module.generate(ids, **kw)
                with torch.no_grad():
                    want = _gathered_copy(engine, ref).to(dev).generate(ids, **kw)
                out["kept"] = engine.inference_module is not None  # release_inference_cache drops the copy
                # DeepSpeed-Chat's prompts: left-padded, with an attention mask
                mask = torch.ones_like(ids)
                mask[0, :3] = 0
                padded = ids.masked_fill(mask == 0, 0)
                got_pad = engine.generate(padded, attention_mask=mask, **kw)
                with torch.no_grad():
                    want_pad = ref.generate(padded, attention_mask=mask, **kw)
                out.update(got=got.tolist(), again=again.tolist(), want=want.tolist(),
                           fused=engine.uses_fused_inference, got_pad=got_pad.tolist(), want_pad=want_pad.tolist())
                engine.train()
            batch = data[2 * step:2 * step + 2]
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    from deepspeed_c.runtime.zero.partition_parameters import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        out["weights"] = {n: p.detach().cpu().clone().numpy() for n, p in engine.module.named_parameters()}
    out["losses"] = losses
    if lora and generate:
        out["fuse"] = _fuse_lora_check(engine, stage)
    out["warnings"] = [str(w.message) for w in caught if "hybrid engine" in str(w.message)]
    out["engine"] = type(engine).__name__
    out["tp"] = 1 if engine.mp_group is None else torch.distributed.get_world_size(engine.mp_group)
    shell = engine.inference_module
    out["tp_blocks"] = sorted({type(b).__name__ for b in shell.modules()}) if shell is not None else []
    return out


def _body(rank: int, world: int, kind: str, stage: int, lora: bool, he: dict) -> dict[str, Any]:
    return {"gen": _run(rank, kind, stage, lora, True, he), "plain": _run(rank, kind, stage, lora, False, he)}


def _check(results: list[dict], fused: bool, kept: bool = True) -> None:
    for r in results:
        gen, plain = r["gen"], r["plain"]
        assert gen["kept"] is (fused and kept)
        assert gen["engine"] == "DeepSpeedHybridEngine"
        assert gen["fused"] is fused
        assert len(gen["got"][0]) == 7 + NEW
        assert gen["got"] == gen["want"]
        assert gen["again"] == gen["want"]
        assert gen["got_pad"] == gen["want_pad"]
        assert gen["losses"] == plain["losses"]  # bit for bit: generation left the training state alone
        assert gen["weights"].keys() == plain["weights"].keys()
        for n in gen["weights"]:
            assert (gen["weights"][n] == plain["weights"][n]).all(), n
    assert results[0]["gen"]["got"] != results[1]["gen"]["got"]  # each rank generated its own prompts
    for r in results:
        f = r["gen"].get("fuse")
        if f is not None:
            assert f["blocks"] == 2 and f["adapters_apart"] and f["nonempty"] and f["n"] > 0, f
            assert f["moved"] > 1e-3 and f["fused_err"] < 1e-6 and f["back_err"] < 1e-6, f


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("lora", [False, True])
def test_fused_generation_equals_hf_and_training_is_untouched(stage: int, lora: bool) -> None:
    results = run_distributed(_body, 2, args=("llama", stage, lora, {}), timeout=300)
    _check(results, fused=True)
    assert all(not r["gen"]["warnings"] for r in results)


def test_zero3_per_layer_groups_and_released_cache_gpt2_lora() -> None:
    he = {"pin_parameters": False, "tp_gather_partition_size": 1, "release_inference_cache": True}
    _check(run_distributed(_body, 2, args=("gpt2", 3, True, he), timeout=300), fused=True, kept=False)


@pytest.mark.parametrize("stage", [2, 3])
def test_inference_tensor_parallel_over_both_ranks(stage: int) -> None:
    """inference_tp_size 2: the two ranks generate both ranks' prompts with half of every block each."""
    results = run_distributed(_body, 2, args=("llama", stage, True, {"inference_tp_size": 2}), timeout=300)
    _check(results, fused=True)
    assert all(r["gen"]["tp"] == 2 and "TPFusedDecoderBlock" in r["gen"]["tp_blocks"] for r in results)


@pytest.mark.parametrize("stage", [2, 3])
def test_unsupported_family_falls_back_to_hf_generate_with_one_warning(stage: int) -> None:
    results = run_distributed(_body, 2, args=("opt", stage, True, {}), timeout=300)
    _check(results, fused=False)
    for r in results:
        assert len(r["gen"]["warnings"]) == 1
        assert "opt (OPTForCausalLM)" in r["gen"]["warnings"][0]


def _bad_body(rank: int, world: int) -> dict[str, str]:
    import deepspeed_c
    from tests.distributed.hybrid_models import prompts, tiny_lm

    seen = {}
    for kind, tp in (("llama", 3), ("opt", 2)):
        try:
            deepspeed_c.initialize(model=tiny_lm(kind), config=_config(2, inference_tp_size=tp))
        except (ValueError, NotImplementedError) as e:
            seen[f"tp{tp}"] = f"{type(e).__name__}: {e}"
    engine, *_ = deepspeed_c.initialize(model=tiny_lm("llama"), config=_config(3, max_out_tokens=16))
    try:
        engine.generate(prompts(1, 10, 0), max_new_tokens=8)
    except ValueError as e:
        seen["long"] = str(e)
    engine, *_ = deepspeed_c.initialize(model=tiny_lm("llama"), config=_config(2, inference_tp_size=2))
    try:  # the ranks of an inference TP group generate together: their prompts must have one shape
        engine.generate(prompts(1 + rank, 5, 0), max_new_tokens=4)
    except ValueError as e:
        seen["shapes"] = str(e)
    return seen


def test_bad_input() -> None:
    for seen in run_distributed(_bad_body, 2, timeout=200):
        assert seen["tp3"].startswith("DeepSpeedConfigError") and "'hybrid_engine.inference_tp_size'" in seen["tp3"] \
            and "world size (2)" in seen["tp3"]
        assert seen["tp2"].startswith("NotImplementedError") and "hybrid_engine.inference_tp_size" in seen["tp2"] \
            and "OPTForCausalLM" in seen["tp2"]
        assert "prompts of one shape" in seen["shapes"] and "[[1, 5], [2, 5]]" in seen["shapes"]
        assert "hybrid_engine.max_out_tokens=16" in seen["long"] and "18" in seen["long"]


def test_generate_before_initialize() -> None:
    from deepspeed_c.runtime.hybrid_engine import DeepSpeedHybridEngine

    engine = DeepSpeedHybridEngine.__new__(DeepSpeedHybridEngine)
    with pytest.raises(RuntimeError, match="before the engine was built"):
        engine.generate(torch.ones(1, 3, dtype=torch.long))
