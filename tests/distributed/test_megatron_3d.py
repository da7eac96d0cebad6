"""3D parallelism (issue 54): a PipelineModule over PipeModelDataParallelTopology whose stages hold the
test's Megatron-style tensor-parallel layers, with the vocab-parallel embedding tied between the first
stage (token embedding) and the last (logits). 4 gloo ranks, PP 2 x TP 2 x DP 1 (stage 0: ranks 0,1;
stage 1: ranks 2,3; tensor pairs {0,1},{2,3}), fp32, gradient clipping that bites at every step,
ZeRO 0 and 1. After 10 steps (2 micro-batches each) every weight, gathered over its tensor pair, must
equal one-process training of the unsplit model on the same global batches (1e-5 norm-wise per
tensor), and the engine's gradient norm the unsplit model's. Also: a topology whose product is not
the world size is refused. Checkpoints: DeepSpeed's names (mp_rank_{XX} by the grid's model-parallel
rank, stage x tensor slice; layer_{LL}-model_{YY} files per tensor slice; zero_pp_rank_{D}_mp_rank_{XX});
a fresh engine resumes from one exactly."""
from __future__ import annotations

import os

import numpy as np
import torch

from tests.distributed import megatron_models as mm
from tests.harness import run_distributed

STEPS, MICRO, GAS, LR, EPS, CLIP = 10, 2, 2, 1e-2, 1e-4, 0.3


def pipe_model(tp: mm.TP, topo: object) -> torch.nn.Module:
    import deepspeed_c

    model = deepspeed_c.pipe.PipelineModule(layers=mm.pipe_layers(deepspeed_c.pipe, tp), topology=topo, loss_fn=mm.pipe_loss,
                           partition_method="uniform")
    full = dict(mm.MegatronGPT(seed=0).named_parameters())
    with torch.no_grad():  # this rank's shards of the unsplit model's initial weights
        for name, p in model.named_parameters():
            w = full[mm.pipe_name(name)]
            if getattr(p, "tensor_model_parallel", False):
                w = w.chunk(tp.size, dim=p.partition_dim)[tp.rank]
            p.copy_(w)
    return model


def _resume(engine: object, tp: mm.TP, cfg: dict, data: list, ckpt: str) -> dict:
    """Save after the 10 steps, 3 more; a fresh engine (other weights) loads and runs the same 3."""
    import deepspeed_c
    from deepspeed_c.pipe import PipeModelDataParallelTopology

    more = mm.batches(3 * GAS, MICRO, seed=9)
    engine.save_checkpoint(ckpt, tag="t")
    it = iter([(t[:, :-1], t[:, 1:]) for t in more])
    straight = [float(engine.train_batch(it)) for _ in range(3)]
    want = mm.full_state(engine.module, tp)
    model = pipe_model(tp, PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    fresh, *_ = deepspeed_c.initialize(model=model, config=cfg, model_parameters=model.parameters())
    path, _ = fresh.load_checkpoint(ckpt, tag="t")
    it = iter([(t[:, :-1], t[:, 1:]) for t in more])
    resumed = [float(fresh.train_batch(it)) for _ in range(3)]
    errs = mm.rel_errors(mm.full_state(fresh.module, tp), want)
    saved = torch.load(path, weights_only=False, map_location="cpu")
    return {"files": sorted(os.listdir(os.path.join(ckpt, "t"))), "path": os.path.basename(path),
            "mp_world_size": saved["mp_world_size"], "engine_mp": fresh.mp_world_size,
            "engine_mp_rank": fresh.checkpoint_mp_rank, "weight_rel": max(errs.values()),
            "loss_err": float(np.max(np.abs(np.array(straight) - resumed)))}


def body(rank: int, world: int, stages: tuple, tmp: str) -> dict:
    import deepspeed_c
    from deepspeed_c.pipe import PipeModelDataParallelTopology

    out: dict = {}
    try:
        PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
        from deepspeed_c.pipe import PipelineModule

        PipelineModule(layers=[torch.nn.Identity()], topology=PipeModelDataParallelTopology(2, 2, 2))
        out["bad_topology"] = "accepted"
    except ValueError as e:
        out["bad_topology"] = str(e)
    mpu = mm.MegatronMPU(tp=2)  # the layers' tensor pairs; the topology's model axis makes the same pairs
    tp = mpu.context()
    data = mm.batches(STEPS * GAS, MICRO, seed=3)
    steps = [torch.cat(data[i * GAS:(i + 1) * GAS]) for i in range(STEPS)]
    ref_losses, ref_state, ref_norms = mm.reference_training(steps, LR, EPS, CLIP)
    for stage in stages:
        model = pipe_model(tp, PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1))
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**9,
               "gradient_clipping": CLIP, "zero_optimization": {"stage": stage},
               "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "eps": EPS}}}
        engine, *_ = deepspeed_c.initialize(model=model, config=cfg, model_parameters=model.parameters())
        it = iter([(t[:, :-1], t[:, 1:]) for t in data])
        losses, norms = [], []
        for _ in range(STEPS):
            losses.append(float(engine.train_batch(it)))
            norms.append(float(engine.get_global_grad_norm()))
        state = {mm.pipe_name(n): v for n, v in mm.full_state(engine.module, tp).items()}
        errs = mm.rel_errors(state, {k: ref_state[k] for k in state})
        out[stage] = {"weight_rel": max(errs.values()), "worst": max(errs, key=errs.get), "held": sorted(state),
                      "loss_err": float(np.max(np.abs(np.array(losses) - ref_losses))),
                      "norm_rel": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
                      "clipped": sum(n > CLIP for n in ref_norms), "stage_id": engine.stage_id}
        out[stage]["resume"] = _resume(engine, tp, cfg, data, os.path.join(tmp, f"z{stage}"))
    return out


def test_pp2_tp2_equals_unsplit_training(tmp_path):
    results = run_distributed(body, 4, args=((0, 1), str(tmp_path)), timeout=500)
    for rank, r in enumerate(results):
        assert "topology" in r["bad_topology"] and "world size is 4" in r["bad_topology"], r["bad_topology"]
        for stage in (0, 1):
            got = r[stage]
            assert got["stage_id"] == rank // 2, got
            assert ("embed.weight" in got["held"]) and (("pos" in got["held"]) == (rank < 2)), got["held"]
            assert got["clipped"] == STEPS, got
            assert got["norm_rel"] < 1e-5 and got["loss_err"] < 1e-5, (stage, got)
            assert got["weight_rel"] < 1e-5, (stage, got)
            res = got["resume"]
            mine = {f"mp_rank_{rank:02d}_model_states.pt", f"layer_0{2 + 2 * (rank // 2)}-model_{rank % 2:02d}-model_states.pt"}
            if stage:
                mine.add(f"zero_pp_rank_0_mp_rank_{rank:02d}_optim_states.pt")
            assert mine <= set(res["files"]) and "mp_rank_04_model_states.pt" not in res["files"], res["files"]
            assert res["path"] == f"mp_rank_{rank:02d}_model_states.pt" and res["mp_world_size"] == 4 == res["engine_mp"], res
            assert res["engine_mp_rank"] == rank, res
            assert res["loss_err"] < 1e-6 and res["weight_rel"] < 1e-6, (stage, res)
