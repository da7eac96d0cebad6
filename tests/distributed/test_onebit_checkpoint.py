"""1-bit Adam, 0/1 Adam and 1-bit LAMB checkpoints in the compressed phase, on 2 gloo ranks.

The reference is the same training without interruption. A run saved at step k (inside the
compressed phase; for 0/1 Adam also between two synchronisations of its frozen phase, where the
ranks' parameters differ), loaded into fresh engines and continued must give the uninterrupted
run's losses and final parameters bit for bit on every rank: each rank's compression errors (and
0/1 Adam's local steps) come back from its onebit_errors_rank_R_of_W.pt. The files are shown to
matter: they hold non-zero errors, and with them removed the load falls back to DeepSpeed's
reset (no error buffers, 0/1 Adam's accumulated move zero and every rank on rank 0's parameters
and momentum), logs why on rank 0, still trains, and no longer matches the uninterrupted run. A
1-rank load of the 2-rank checkpoint resets too, naming the world sizes. The pipeline engine's
checkpointer (one stage, two replicas) writes and restores the same files."""
from __future__ import annotations

import glob
import os

import numpy as np

from tests.harness import run_distributed

LR = 1e-2
STEPS = 22
# name -> (optimizer, precision, params, save steps). 1-bit Adam / LAMB compress from step 6 on.
# 0/1 Adam's variance phase compresses on steps 5, 7, 9 (var_interval 2, then 4); its frozen phase
# starts at step 12 and synchronises on steps 12, 13, 14, 16 and 20 (local_step_interval 1, 2, 4),
# so at step 17 each rank holds two local steps of its own.
ZO = {"lr": LR, "var_freeze_step": 10, "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 4}
PIPE_STEPS, PIPE_SAVE = 10, 6  # 1-bit Adam in a pipeline engine: compressed from step 4 on
CASES = {
    "OneBitAdam": ("OneBitAdam", "fp32", {"lr": LR, "freeze_step": 5}, (9,)),
    "OneBitLamb": ("OneBitLamb", "fp32", {"lr": LR, "freeze_step": 5}, (9,)),
    "ZeroOneAdam": ("ZeroOneAdam", "fp32", ZO, (7, 17)),
    "ZeroOneAdam-bf16": ("ZeroOneAdam", "bf16", ZO, (17,)),
}


def _engine(opt_type: str, precision: str, params: dict):
    import deepspeed_c
    from tests.distributed.engine_models import make_model

    cfg = {"train_micro_batch_size_per_gpu": 16, "gradient_clipping": 0.0,
           "optimizer": {"type": opt_type, "params": dict(params)}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = deepspeed_c.initialize(model=make_model("mlp", 0), config=cfg)
    return engine


def _train(engine, rank: int, steps: int) -> list:
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(16, 12, generator=g)
    y = x @ torch.randn(12, 3, generator=torch.Generator().manual_seed(7)) + 0.3 * torch.randn(16, 3, generator=g)
    dtype = engine.module.net[0].weight.dtype
    x, y = x.to(dtype), y.to(dtype)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return losses


def _params(engine) -> list:
    return [p.detach().float().numpy().copy() for p in engine.module.parameters()]


def _ranks_differ(engine) -> bool:
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    both = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(both, flat)
    return not all(torch.equal(both[0], t) for t in both[1:])


def _optimizer_view(engine) -> dict:
    """The 1-bit optimizer's carried state after a load: its error plans and per-parameter tensors."""
    opt = engine.optimizer.optimizer if hasattr(engine.optimizer, "fp32_groups") else engine.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    return {"plans": len(opt.compression_plans()),
            "exp_avg": [opt.state[p]["exp_avg"].float().numpy().copy() for p in params],
            "acc": [float(opt.state[p]["momentum_accumulator"].abs().sum()) for p in params
                    if "momentum_accumulator" in opt.state[p]],
            "lrs": [float(opt.state[p]["lrs"]) for p in params if "lrs" in opt.state[p]]}


class _Captured:
    def __enter__(self) -> list:
        import logging

        from deepspeed_c.utils.logging import logger

        self.records: list = []
        self.handler = logging.Handler()
        self.handler.emit = lambda rec: self.records.append(rec.getMessage())  # type: ignore[method-assign]
        logger.addHandler(self.handler)
        return self.records

    def __exit__(self, *exc) -> None:
        from deepspeed_c.utils.logging import logger

        logger.removeHandler(self.handler)


def _body(rank: int, world: int, tmp: str) -> dict:
    import torch
    import torch.distributed as dist

    out = {}
    for case, (opt_type, precision, params, saves) in CASES.items():
        whole = _engine(opt_type, precision, params)
        res = {"whole": (_train(whole, rank, STEPS), _params(whole))}
        for k in saves:
            tag = f"{case}-{k}"
            engine = _engine(opt_type, precision, params)
            _train(engine, rank, k)
            differ = _ranks_differ(engine)
            saved_state = _optimizer_view(engine)
            saved_params = _params(engine)
            engine.save_checkpoint(tmp, tag=tag)
            del engine
            name = os.path.join(tmp, tag, f"onebit_errors_rank_{rank:05d}_of_{world:05d}.pt")
            side = torch.load(name, weights_only=True)
            errors = sum(float(p["worker_error"].abs().sum() + p["server_error"].abs().sum()) for p in side["plans"])
            fresh = _engine(opt_type, precision, params)
            fresh.load_checkpoint(tmp, tag=tag)
            allreduce = bool(fresh.enable_backward_allreduce)
            res[k] = {"resumed": (_train(fresh, rank, STEPS - k), _params(fresh)), "differ": differ,
                      "errors": errors, "allreduce": allreduce, "saved_state": saved_state,
                      "saved_params": saved_params}
        # the last save again without the rank files: DeepSpeed's reset
        k = saves[-1]
        dist.barrier()
        os.remove(os.path.join(tmp, f"{case}-{k}", f"onebit_errors_rank_{rank:05d}_of_{world:05d}.pt"))
        dist.barrier()
        reset = _engine(opt_type, precision, params)
        with _Captured() as logged:
            reset.load_checkpoint(tmp, tag=f"{case}-{k}")
        res["reset"] = {"state": _optimizer_view(reset), "params": _params(reset),
                        "logged": [m for m in logged if "restart at zero" in m]}
        res["reset"]["run"] = (_train(reset, rank, STEPS - k), _params(reset))
        out[case] = res
    out["pipe"] = _pipe_body(rank, tmp)
    return out


def _pipe_engine():
    import deepspeed_c
    from deepspeed_c.pipe import PipelineModule
    from tests.distributed import pipe_models as pm

    model = PipelineModule(pm.specs(False), num_stages=1, loss_fn=pm.loss_fn, seed_layers=True)
    cfg = {"train_micro_batch_size_per_gpu": pm.MBS, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
           "optimizer": {"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": 3}}}
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    return engine


def _pipe_body(rank: int, tmp: str) -> dict:
    """The pipeline engine's checkpointer (one stage, two data-parallel replicas) writes and reads the
    same rank files."""
    from tests.distributed import pipe_models as pm

    batches = pm.batches(PIPE_STEPS, 2, 2)

    def run(engine, lo: int, hi: int) -> list:
        return [float(engine.train_batch(iter(batches[s][rank * 2:(rank + 1) * 2]))) for s in range(lo, hi)]

    whole = _pipe_engine()
    out = {"whole": (run(whole, 0, PIPE_STEPS), _params(whole))}
    engine = _pipe_engine()
    run(engine, 0, PIPE_SAVE)
    engine.save_checkpoint(tmp, tag="pipe")
    fresh = _pipe_engine()
    fresh.load_checkpoint(tmp, tag="pipe")
    out["resumed"] = (run(fresh, PIPE_SAVE, PIPE_STEPS), _params(fresh))
    out["files"] = sorted(n for n in os.listdir(os.path.join(tmp, "pipe")) if n.startswith("onebit_errors_rank_"))
    return out


def _world1_body(rank: int, world: int, tmp: str) -> list:
    opt_type, precision, params, saves = CASES["ZeroOneAdam"]
    engine = _engine(opt_type, precision, params)
    with _Captured() as logged:
        engine.load_checkpoint(tmp, tag=f"ZeroOneAdam-{saves[0]}")  # the reset removed only the last save's
    losses = _train(engine, rank, 2)
    return [m for m in logged if "restart at zero" in m] + [str(np.isfinite(losses).all())]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_onebit_checkpoint_resume_equals_uninterrupted_and_reset_without_rank_files(tmp_path):
    world = 2
    res = run_distributed(_body, world, args=(str(tmp_path),), timeout=300)
    for case, (opt_type, _, _, saves) in CASES.items():
        for r in range(world):
            whole_losses, whole_params = res[r][case]["whole"]
            for k in saves:
                got = res[r][case][k]
                assert got["errors"] > 0, f"{case} k={k} rank {r}: the rank file holds no compression error"
                assert not got["allreduce"] or (opt_type == "ZeroOneAdam" and k < 12), (case, k)
                losses, params = got["resumed"]
                assert losses == whole_losses[k:], f"{case} k={k} rank {r}: {losses} vs {whole_losses[k:]}"
                assert _same(params, whole_params), f"{case} k={k} rank {r}: final parameters differ"
        if opt_type == "ZeroOneAdam":
            assert res[0][case][17]["differ"], f"{case}: ranks' parameters agree at step 17 (not between syncs)"
        # without the rank files: DeepSpeed's reset, logged once (rank 0), still training, not the uninterrupted run
        k = saves[-1]
        assert len(res[0][case]["reset"]["logged"]) == 1 and not res[1][case]["reset"]["logged"], \
            [res[r][case]["reset"]["logged"] for r in range(world)]
        assert "holds no 1-bit optimizer rank files" in res[0][case]["reset"]["logged"][0]
        rank0_saved = res[0][case][k]
        for r in range(world):
            reset = res[r][case]["reset"]
            assert reset["state"]["plans"] == 0, f"{case} rank {r}: error buffers survived the reset"
            assert _same(reset["state"]["exp_avg"], rank0_saved["saved_state"]["exp_avg"]), (case, r)
            assert _same(reset["params"], rank0_saved["saved_params"]), (case, r)
            if opt_type == "ZeroOneAdam":
                assert all(a == 0.0 for a in reset["state"]["acc"]) and all(v == 0.0 for v in reset["state"]["lrs"])
                assert any(a > 0 for a in rank0_saved["saved_state"]["acc"]), case  # the reset dropped something
            losses, params = reset["run"]
            assert np.all(np.isfinite(losses)) and losses[-1] < res[r][case]["whole"][0][0], (case, r, losses)
            assert losses != res[r][case]["whole"][0][k:], f"{case} rank {r}: the reset run equals the uninterrupted"
    for r in range(world):
        pipe = res[r]["pipe"]
        assert pipe["files"] == [f"onebit_errors_rank_{q:05d}_of_{world:05d}.pt" for q in range(world)], pipe["files"]
        assert pipe["resumed"][0] == pipe["whole"][0][PIPE_SAVE:], (r, pipe["resumed"][0], pipe["whole"][0])
        assert _same(pipe["resumed"][1], pipe["whole"][1]), f"pipeline rank {r}: final parameters differ"
    # another world size: the 2-rank files are not this run's; reset, saying why
    logged = run_distributed(_world1_body, 1, args=(str(tmp_path),), timeout=120)[0]
    assert logged[-1] == "True" and len(logged) == 2, logged
    assert "was saved by 2 ranks, this run has 1" in logged[0], logged
    assert glob.glob(os.path.join(str(tmp_path), "ZeroOneAdam-7", "onebit_errors_rank_*_of_00002.pt"))
