"""AutoTP checkpoints saved at tensor-parallel degree 2 and loaded at degree 4.

A tiny LLaMA (4 heads, 4 key/value heads: 1 head a rank at TP 4) from a transformers config trains 5 steps
at TP 2 and is saved with save_checkpoint; the saved engine's whole fp32 masters and Adam moments (every
parameter, gathered over data and tensor parallel) and its next 3 losses (the uninterrupted run) are the
reference. A fresh engine with other initial weights loads the checkpoint:

- 4 ranks, TP 2 x DP 2 saved, loaded at TP 4 x DP 1 (the data-parallel size changes too) and, as a control,
  at TP 2 x DP 2 again; at fp32 ZeRO 1, bf16 ZeRO 2 and bf16 stage 0 (masters kept by the stage-0 optimizer);
- TP 2 x DP 1 saved by a 2-rank run, loaded at TP 4 x DP 1 by a 4-rank run (the world size changes), fp32
  ZeRO 2.

Loaded masters and moments must equal the saved ones exactly (bit for bit, resharded, not reset). The next
losses: bitwise at the same degree; at TP 4 the row-parallel layers sum 4 partial products instead of 2 and
one data-parallel rank sees the whole batch instead of two averaging halves, so the rounding differs:
relative 1e-6 at fp32 (~8 float32 epsilons; observed 0.8e-7-1.5e-7, a last-bit difference from the first
loss after loading on), 2**-8 at bf16 (bfloat16's unit roundoff: weights and activations are bf16; observed 1.9e-4).
The bf16 cases' losses are taken in fp32 (the loss cast before it is averaged), not rounded to bf16.
"""
from __future__ import annotations

import numpy as np
import torch

from tests.distributed import tp_models
from tests.harness import rank_device, run_distributed

ROWS, SAVE_AT, NEXT, LR, EPS = 4, 5, 3, 1e-2, 1e-4
# relative, on the next losses at TP 4: ~8 fp32 epsilons (2**-23) and bf16's unit roundoff (2**-8)
FP32_TOL, BF16_TOL = 1e-6, 2.0**-8
CASES = {"fp32_z1": (False, 1), "bf16_z2": (True, 2), "bf16_s0": (True, 0)}


def _engine(tp: int, stage: int, bf16: bool, seed: int):
    import deepspeed_c

    world = torch.distributed.get_world_size()
    cfg = {"train_micro_batch_size_per_gpu": ROWS * tp // world, "gradient_accumulation_steps": 1,
           "steps_per_print": 10**9, "gradient_clipping": 0.0,
           "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "eps": EPS}},
           "zero_optimization": {"stage": stage}, "tensor_parallel": {"autotp_size": tp}, "bf16": {"enabled": bf16}}
    model = tp_models.make_model("llama", seed=seed, kv_heads=4)
    return deepspeed_c.initialize(model=model, config=cfg)[0]


def _run(engine, data: list, steps: range) -> list[float]:
    """The global batch's mean loss each step (fp32, averaged over the data-parallel ranks)."""
    from deepspeed_c.utils import groups

    dp, dp_rank, out = engine.dp_world_size, groups.get_data_parallel_rank(), []
    micro = ROWS // dp
    for i in steps:
        loss = tp_models.loss_of(engine, data[i][dp_rank * micro:(dp_rank + 1) * micro].to(rank_device()))
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().clone()
        torch.distributed.all_reduce(t, group=groups.get_data_parallel_group())
        out.append(t.item() / dp)
    return out


def _whole_state(engine, moments: bool = True) -> dict[str, np.ndarray]:
    """Every parameter's fp32 master and Adam moments, whole (ZeRO's partitions gathered over data parallel,
    the shards over tensor parallel). A collective: every rank calls it and gets the same."""
    from deepspeed_c.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    zero = engine.zero_optimization_stage() > 0
    masters = {} if zero else engine.stepper.master_params()
    out = {}
    for name, p in engine.module.named_parameters():
        for what in ("master", "exp_avg", "exp_avg_sq") if moments else ("master",):
            if zero:
                v = safe_get_full_fp32_param(p) if what == "master" else safe_get_full_optimizer_state(p, what)
            else:
                m = masters[id(p)]
                v = m.data if what == "master" else engine.basic_optimizer.state[m][what]
            assert v.dtype == torch.float32, (name, what, v.dtype)
            v = v.reshape(p.shape)
            if getattr(p, "ds_is_tensor_model_parallel", False):
                v = engine.module.get_submodule(name.rsplit(".", 1)[0])._gather(v, p.partition_dim)
            out[f"{name}:{what}"] = v.cpu().numpy().copy()
    return out


def _save(engine, data: list, ckpt: str, tag: str) -> dict:
    _run(engine, data, range(SAVE_AT))
    engine.save_checkpoint(ckpt, tag=tag)
    state = _whole_state(engine)
    return {"state": state, "uninterrupted": _run(engine, data, range(SAVE_AT, SAVE_AT + NEXT)),
            "tp": engine.mpu.get_model_parallel_world_size(), "dp": engine.dp_world_size}


def _load(tp: int, stage: int, bf16: bool, data: list, ckpt: str, tag: str) -> dict:
    from deepspeed_c.utils import groups

    engine = _engine(tp, stage, bf16, seed=7)  # other initial weights: the load must replace them
    before = _whole_state(engine, moments=False)["model.layers.0.self_attn.q_proj.weight:master"]
    engine.load_checkpoint(ckpt, tag=tag)
    out = {"state": _whole_state(engine), "before": before, "tp": engine.mpu.get_model_parallel_world_size(),
           "dp": engine.dp_world_size, "sharded": sum(type(m).__name__ in ("LinearLayer", "LinearAllreduce")
                                                      for m in engine.module.modules())}
    out["losses"] = _run(engine, data, range(SAVE_AT, SAVE_AT + NEXT))
    groups._reset_tp_groups()
    return out


def body_dp2(rank: int, world: int, save_dir: str) -> dict:
    """TP 2 x DP 2 saved; loaded at TP 4 x DP 1 and TP 2 x DP 2, for each case."""
    from deepspeed_c.utils import groups

    data, out = tp_models.batches(SAVE_AT + NEXT, ROWS, seed=3), {}
    for case, (bf16, stage) in CASES.items():
        ckpt = f"{save_dir}/{case}"
        out[case] = {"saved": _save(_engine(2, stage, bf16, seed=0), data, ckpt, "t")}
        groups._reset_tp_groups()
        out[case]["tp4"] = _load(4, stage, bf16, data, ckpt, "t")
        out[case]["tp2"] = _load(2, stage, bf16, data, ckpt, "t")
    return out


def body_save_world2(rank: int, world: int, ckpt: str) -> dict:
    from deepspeed_c.utils import groups

    out = _save(_engine(2, 2, False, seed=0), tp_models.batches(SAVE_AT + NEXT, ROWS, seed=3), ckpt, "w2")
    groups._reset_tp_groups()
    return out


def body_load_world4(rank: int, world: int, ckpt: str) -> dict:
    return _load(4, 2, False, tp_models.batches(SAVE_AT + NEXT, ROWS, seed=3), ckpt, "w2")


def _rel(a: list[float], b: list[float]) -> float:
    return float(np.max(np.abs(np.array(a) - np.array(b)) / np.abs(np.array(b))))


def _check_resume(saved: dict, loaded: dict, tp: int, dp: int, tol: float, what: str) -> None:
    assert loaded["tp"] == tp and loaded["dp"] == dp and loaded["sharded"] >= 14, (what, loaded["tp"], loaded["dp"])
    state = saved["state"]
    assert sorted(loaded["state"]) == sorted(state) and len(state) == 3 * 21, (what, len(state))
    # the checkpoint is not trivially the fresh engine's state: moments are non-zero, the weights differ
    assert min(float(np.abs(v).max()) for k, v in state.items() if ":exp_avg" in k) > 0, what
    assert not np.array_equal(loaded["before"], state["model.layers.0.self_attn.q_proj.weight:master"]), what
    for key, value in state.items():  # bit for bit, every master and moment, resharded
        got = loaded["state"][key]
        assert np.array_equal(got, value), (what, key, float(np.abs(got - value).max()))
    if tol == 0.0:
        assert loaded["losses"] == saved["uninterrupted"], (what, loaded["losses"], saved["uninterrupted"])
    else:
        assert _rel(loaded["losses"], saved["uninterrupted"]) < tol, (what, loaded["losses"], saved["uninterrupted"])


def test_tp2_dp2_checkpoint_loads_at_tp4(tmp_path):
    results = run_distributed(body_dp2, 4, args=(str(tmp_path),), timeout=240)
    for rank, r in enumerate(results):  # each rank's gathered view: the same on all of them
        assert set(r) == set(CASES)
        for case, (bf16, _) in CASES.items():
            saved = r[case]["saved"]
            assert saved["tp"] == 2 and saved["dp"] == 2, (case, saved["tp"], saved["dp"])
            _check_resume(saved, r[case]["tp2"], 2, 2, 0.0, f"rank {rank} {case} TP2xDP2->TP2xDP2")
            _check_resume(saved, r[case]["tp4"], 4, 1, BF16_TOL if bf16 else FP32_TOL,
                          f"rank {rank} {case} TP2xDP2->TP4xDP1")


def test_tp2_world2_checkpoint_loads_at_tp4_world4(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(body_save_world2, 2, args=(ckpt,), timeout=120)[0]
    assert saved["tp"] == 2 and saved["dp"] == 1, (saved["tp"], saved["dp"])
    for rank, loaded in enumerate(run_distributed(body_load_world4, 4, args=(ckpt,), timeout=120)):
        _check_resume(saved, loaded, 4, 1, FP32_TOL, f"rank {rank}: fp32 ZeRO 2 TP2xDP1 (2 ranks) -> TP4xDP1 (4 ranks)")
