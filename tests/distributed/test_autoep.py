"""AutoEP (`expert_parallel`): tiny Hugging Face Mixtral, Qwen3-MoE, Qwen2-MoE (shared expert), DeepSeek-V3
(group-limited routing, a dense first layer), DeepSeek-V2, Qwen3.5-MoE (linear attention, gated shared expert) and
MiniMax-M3 (clamped SwiGLU experts) models trained through deepspeed_c.initialize against plain PyTorch training of
the unsplit model in one process.

Reference: the same Hugging Face model (same seed), no deepspeed_c, each step every rank's micro-batch run
separately and their losses averaged (the ranks route their own tokens), then torch.optim.SGD. The runs use
a client SGD too, created before initialize on the model's parameters (AutoEP narrows the expert parameters
in place, so that optimizer stays valid). Checked: the forward output before training equals Hugging Face's,
every step's loss, and after the steps every weight: the router, the shared expert and every expert (each
rank's slice gathered over the expert-parallel group). fp32 throughout, norm-wise relative per tensor.

One 2-rank gloo launch runs the autoep_size 2 cases (ZeRO 0 and 2), a checkpoint round trip and the errors
that need 2 ranks; the autoep_size 1 case (with a save/load round trip) and the other bad inputs run in this
process (a world of one)."""
from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from tests.harness import run_distributed

STEPS = 2
LR = 0.5
TOL = 1e-5
MICRO, SEQ, VOCAB = 2, 8, 64


def make_model(kind: str, experts: int = 4) -> torch.nn.Module:
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  max_position_embeddings=32, num_experts_per_tok=2, initializer_range=0.1)
    if kind == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=16, num_local_experts=experts, **common)
        cls = tf.MixtralForCausalLM
    elif kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(intermediate_size=32, moe_intermediate_size=16, num_experts=experts, head_dim=16,
                                norm_topk_prob=True, decoder_sparse_step=1, **common)
        cls = tf.Qwen3MoeForCausalLM
    elif kind in ("deepseek_v3", "deepseek_v2"):  # a dense first layer (skipped), then two MoE layers
        deepseek = dict(intermediate_size=32, moe_intermediate_size=16, n_routed_experts=experts, n_shared_experts=1,
                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, **{**common, "num_hidden_layers": 3})
        if kind == "deepseek_v3":  # group-limited routing: 2 groups of 2 experts, the best group's chosen
            cfg, cls = tf.DeepseekV3Config(n_group=2, topk_group=1, **deepseek), tf.DeepseekV3ForCausalLM
        else:
            cfg, cls = tf.DeepseekV2Config(**deepseek), tf.DeepseekV2ForCausalLM
    elif kind == "qwen3_5_moe":  # the text backbone: a linear-attention and a full-attention layer, gated shared expert
        cfg = tf.Qwen3_5MoeTextConfig(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=experts,
                                      head_dim=16, layer_types=["linear_attention", "full_attention"], **common)
        cls = tf.Qwen3_5MoeForCausalLM
    elif kind == "minimax_m3":  # the text model: sigmoid router with a correction bias, clamped SwiGLU experts
        from transformers.models.minimax_m3_vl import configuration_minimax_m3_vl as mc, modeling_minimax_m3_vl as mm

        cfg = mc.MiniMaxM3VLTextConfig(intermediate_size=16, shared_intermediate_size=16, num_local_experts=experts,
                                       head_dim=16, bos_token_id=0, eos_token_id=0, **common)
        cls = mm.MiniMaxM3VLForCausalLM
    else:
        cfg = tf.Qwen2MoeConfig(intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                num_experts=experts, decoder_sparse_step=1, **common)
        cls = tf.Qwen2MoeForCausalLM
    torch.manual_seed(1234)
    return cls(cfg).float()


def batches(world: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [[torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(world)] for _ in range(STEPS)]


def reference(kind: str, world: int) -> dict[str, Any]:
    """Plain PyTorch, one process, the unsplit model."""
    model = make_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = batches(world)
    with torch.no_grad():
        logits0 = model(input_ids=data[0][0]).logits.clone()
    losses = []
    for step in data:
        opt.zero_grad()
        per = [model(input_ids=b, labels=b).loss for b in step]
        sum(per).div(world).backward()
        opt.step()
        losses.append([float(x.detach()) for x in per])
    return {"logits0": logits0, "losses": losses,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _config(ep: int, stage: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage}, "expert_parallel": {"enabled": True, "autoep_size": ep}}


def train(kind: str, ep: int, stage: int, rank: int, world: int) -> dict[str, Any]:
    import deepspeed_c

    model = make_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = deepspeed_c.initialize(model=model, optimizer=opt, config=_config(ep, stage))
    data = batches(world)
    with torch.no_grad():
        logits0 = engine(input_ids=data[0][0]).logits.clone()
    losses = []
    for step in data:
        loss = engine(input_ids=step[rank], labels=step[rank]).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    weights = gathered_weights(engine.module, ep)
    experts = [m for m in engine.module.modules() if type(m).__name__ == "AutoEPExperts"]
    ckpt = _checkpoint(engine, kind, ep, stage) if (kind, stage) == ("mixtral", 0) else None
    # numpy: tensors would cross the harness's result queue as shared memory the exiting rank takes along
    return {"logits0": logits0.numpy(), "losses": losses, "weights": {n: w.numpy() for n, w in weights.items()},
            "local_experts": [m.num_local_experts for m in experts], "ckpt": ckpt}


def gathered_weights(module: torch.nn.Module, ep: int) -> dict[str, torch.Tensor]:
    """Every weight of the module, each AutoEP expert tensor gathered over the expert-parallel group (rank order is
    expert order): the unsplit model's. Collective when ep > 1."""
    import torch.distributed as dist

    out = {}
    for n, p in module.named_parameters():
        w = p.detach().clone()
        if getattr(p, "allreduce", True) is False and ep > 1:
            parts = [torch.empty_like(w) for _ in range(ep)]
            dist.all_gather(parts, w.contiguous())
            w = torch.cat(parts)
        out[n] = w
    return out


def _checkpoint(engine: Any, kind: str, ep: int, stage: int) -> str:
    """A save/load round trip into a fresh engine restores every weight this rank holds (returns "", else what
    differs); test_autoep_checkpoint.py checks the files, the optimizer state and loads at another autoep_size."""
    import shutil
    import tempfile

    import deepspeed_c

    import torch.distributed as dist

    path = [tempfile.mkdtemp(prefix="autoep_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)  # one directory for every rank
    path = path[0]
    try:
        engine.save_checkpoint(path, tag="t")
        fresh = make_model(kind)
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            other, _, _, _ = deepspeed_c.initialize(model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=LR),
                                                    config=_config(ep, stage))
        other.load_checkpoint(path, tag="t")
        want = dict(engine.module.named_parameters())
        bad = [n for n, p in other.module.named_parameters() if not torch.equal(p, want[n])]
        return f"weights differ after load: {bad}" if bad else ""
    finally:
        dist.barrier()  # every rank has loaded
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


def _rel(a: Any, b: torch.Tensor) -> float:
    a = torch.as_tensor(a)
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def check_against_reference(res: dict[str, Any], ref: dict[str, Any], what: str, rank: int, world: int) -> None:
    assert _rel(res["logits0"], ref["logits0"]) < TOL, f"{what}: forward before training differs from Hugging Face's"
    for s, (loss, ref_losses) in enumerate(zip(res["losses"], ref["losses"])):
        assert abs(loss - ref_losses[rank]) <= TOL * abs(ref_losses[rank]), f"{what} step {s}: loss {loss} vs " \
                                                                             f"{ref_losses[rank]}"
    assert set(res["weights"]) == set(ref["weights"])
    for n, w in ref["weights"].items():
        assert res["weights"][n].shape == w.shape, f"{what} {n}: {tuple(res['weights'][n].shape)}"
        moved = _rel(ref["weights"][n], make_model_weights(what)[n])
        # the steps did something (Qwen3.5-MoE's linear-attention dt_bias moves least: 7e-4), well above TOL
        assert moved > 2e-4, f"{what} {n}: the reference barely moved it ({moved:.3g})"
        assert _rel(res["weights"][n], w) < TOL, f"{what} {n}: relative difference {_rel(res['weights'][n], w):.3g}"


_INIT: dict[str, dict[str, torch.Tensor]] = {}


def make_model_weights(what: str) -> dict[str, torch.Tensor]:
    kind = what.split("-")[0]
    if kind not in _INIT:
        _INIT[kind] = {n: p.detach().clone() for n, p in make_model(kind).named_parameters()}
    return _INIT[kind]


# every preset family, ZeRO 0 and 2
DIST_CASES = [("mixtral", 0), ("qwen3_moe", 2), ("qwen2_moe", 0), ("deepseek_v3", 2), ("deepseek_v2", 0),
              ("qwen3_5_moe", 0), ("minimax_m3", 2)]


def _expect_error(fn: Any, exc: type, *words: str) -> str:
    try:
        fn()
    except exc as e:
        missing = [w for w in words if w not in str(e)]
        return f"message lacks {missing}: {e}" if missing else ""
    except Exception as e:  # noqa: BLE001 (reported to the test)
        return f"raised {type(e).__name__}: {e}"
    return "no error"


def _rank_body(rank: int, world: int) -> dict[str, Any]:
    import deepspeed_c

    out: dict[str, Any] = {}
    for kind, stage in DIST_CASES:
        out[f"{kind}-z{stage}"] = train(kind, 2, stage, rank, world)

    def bad(model: torch.nn.Module, **section: Any) -> Any:
        cfg = _config(2, 0)
        cfg["expert_parallel"].update(section)
        return lambda: deepspeed_c.initialize(model=model, config={**cfg, "optimizer": {"type": "SGD",
                                                                                       "params": {"lr": 0.1}}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["errors"] = {
            "experts": _expect_error(bad(make_model("mixtral", experts=3)), ValueError, "expert_parallel.autoep_size",
                                     "3"),
            "autotp": _expect_error(lambda: deepspeed_c.initialize(
                model=make_model("mixtral"), config={**_config(2, 0), "tensor_parallel": {"autotp_size": 2}}),
                ValueError, "expert_parallel", "tensor_parallel.autotp_size"),
        }
    return out


def test_autoep_two_ranks_match_one_process_training() -> None:
    results = run_distributed(_rank_body, 2, timeout=240)
    for kind, stage in DIST_CASES:
        what = f"{kind}-z{stage}"
        ref = reference(kind, 2)
        for rank, res in enumerate(results):
            assert res[what]["local_experts"] == [2, 2], what  # 4 experts over 2 ranks, in both MoE layers
            assert res[what]["ckpt"] in (None, ""), res[what]["ckpt"]  # a save/load round trip restores the weights
            check_against_reference(res[what], ref, f"{what} rank {rank}", rank, 2)
    for rank, res in enumerate(results):
        assert res["errors"] == {"experts": "", "autotp": ""}, res["errors"]


@pytest.fixture
def world_of_one_autoep(world_of_one):
    yield
    from deepspeed_c.utils import groups

    groups._reset_expert_groups()  # the ep_size_1 groups belong to this module's process group


def test_autoep_size_one_in_one_process_and_bad_input(world_of_one_autoep) -> None:
    import deepspeed_c

    res = train("mixtral", 1, 0, 0, 1)
    check_against_reference(res, reference("mixtral", 1), "mixtral-ep1", 0, 1)
    assert res["local_experts"] == [4, 4]
    assert res["ckpt"] == "", res["ckpt"]  # save and load at autoep_size 1 restore every weight

    def init(model: torch.nn.Module, **section: Any) -> Any:
        cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
               "expert_parallel": {"enabled": True, **section}}
        return lambda: deepspeed_c.initialize(model=model, config=cfg)

    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _expect_error(init(plain, preset_model="mixtral"), ValueError, "no MoE block matched", "mixtral",
                             "moe_layer_pattern") == ""
        assert _expect_error(init(plain), ValueError, "expert_parallel", "preset_model") == ""
        assert _expect_error(init(make_model("mixtral"), preset_model="qwen3_moe"), ValueError,
                             "expert_parallel.preset_model") == ""
        assert _expect_error(init(make_model("mixtral"), preset_model="deepseek_v3"), ValueError,
                             "expert_parallel.preset_model", "mixtral") == ""
        assert _expect_error(init(make_model("mixtral"), preset_model="llama4"), NotImplementedError,
                             "expert_parallel.preset_model") == ""
        assert _expect_error(init(make_model("mixtral"), preset_model="mixtrall"), ValueError,
                             "expert_parallel.preset_model") == ""
        assert _expect_error(init(make_model("mixtral"), autoep_size=2), ValueError,
                             "expert_parallel.autoep_size") == ""
        assert _expect_error(init(make_model("mixtral"), expert_w1="w1"), ValueError, "expert_parallel.expert_w1") == ""
        assert _expect_error(init(make_model("mixtral"), moe_layer_pattern="model.layers.(mlp"), ValueError,
                             "expert_parallel.moe_layer_pattern") == ""
        assert _expect_error(init(make_model("mixtral"), router_pattern="router"), ValueError,
                             "expert_parallel.router_pattern") == ""
        zero3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                 "expert_parallel": {"enabled": True}}
        assert _expect_error(lambda: deepspeed_c.initialize(model=make_model("mixtral"), config=zero3), ValueError,
                             "expert_parallel", "zero_optimization.stage") == ""
