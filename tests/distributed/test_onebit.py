"""1-bit Adam, 0/1 Adam and 1-bit LAMB trained by the engine on 2 and 4 gloo ranks.

Each optimizer's run is replayed by a float64 simulation of its algorithm with every rank's
compression errors (tests/distributed/onebit_reference.py): the parameters after every one of the
steps (warm-up and compressed) must match within fp32 tolerance. The gradients the optimizer saw
must be identical on every rank exactly when the engine was to all-reduce them (warm-up, and 0/1
Adam's variance steps) and differ otherwise (the engine skipped its all-reduce).

In one 2-rank run also: the bytes the comms logger counts in the compressed phase (per step: the
padded size / 8 of signs all-to-all'd plus a chunk / 8 all-gathered, each with the 4-byte scales;
the signs are 1/32 of an fp32 all-reduce's ring traffic, plus padding); DeepSpeed's
compressed_allreduce API against the simulation (result and both error buffers); momentum masks;
bf16 and fp16 training; the loss at the end of a stated run (CONVERGENCE: 200 full-batch steps on
2 x 1024 samples) no more than 2% above the uncompressed optimizer's (Adam for 1-bit and 0/1 Adam,
LAMB for 1-bit LAMB). Bad input: tests/unit/test_onebit_codec.py. Checkpoints in the compressed
phase (a resumed run equals the uninterrupted one): test_onebit_checkpoint.py."""
from __future__ import annotations

import numpy as np
import pytest

from tests.distributed import onebit_reference as ref
from tests.harness import rank_device, run_distributed

STEPS = 50
LR = 1e-2
ONEBIT_OPS = ("onebit_all_to_all", "onebit_all_gather")

CASES = {
    "OneBitAdam": {"lr": LR, "freeze_step": 10},
    "ZeroOneAdam": {"lr": LR, "var_freeze_step": 24, "var_update_scaler": 3, "local_step_scaler": 4,
                    "local_step_clipper": 4},
    "OneBitLamb": {"lr": LR, "freeze_step": 10},
}
# the convergence run: each 1-bit optimizer against its uncompressed counterpart (Adam, LAMB), warm-ups long
# enough for LAMB's frozen coefficient (1 / (1 - coeff_beta) = 10 steps) and 0/1 Adam's variance
CONVERGENCE = {
    "Adam": {"lr": LR}, "OneBitAdam": {"lr": LR, "freeze_step": 30},
    "ZeroOneAdam": {"lr": LR, "var_freeze_step": 60, "var_update_scaler": 3, "local_step_scaler": 4,
                    "local_step_clipper": 4},
    "Lamb": {"lr": 5e-2}, "OneBitLamb": {"lr": 5e-2, "freeze_step": 50},
}
BASELINE = {"OneBitAdam": "Adam", "ZeroOneAdam": "Adam", "OneBitLamb": "Lamb"}


def _data(rank: int, n: int = 32):
    """Each rank's own regression data: a fixed linear teacher plus noise."""
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, 12, generator=g)
    teacher = torch.randn(12, 3, generator=torch.Generator().manual_seed(7)) * 0.5
    return x, x @ teacher + 0.3 * torch.randn(n, 3, generator=g)


def _engine(opt_type: str, params: dict, precision: str = "fp32", logger: bool = False):
    import deepspeed_c
    from tests.distributed.engine_models import make_model

    cfg = {"train_micro_batch_size_per_gpu": 32, "gradient_clipping": 0.0,
           "optimizer": {"type": opt_type, "params": dict(params)}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if logger:
        cfg["comms_logger"] = {"enabled": True, "prof_all": True}
    engine, *_ = deepspeed_c.initialize(model=make_model("mlp", 0), config=cfg)
    return engine


def _train(engine, rank: int, steps: int, record: bool = True, n: int = 32) -> dict:
    import torch

    x, y = _data(rank, n)
    dtype = engine.module.net[0].weight.dtype
    x, y = x.to(engine.device, dtype), y.to(engine.device, dtype)
    out = {"loss": [], "grads": [], "params": [], "allreduce": []}
    for _ in range(steps):
        out["allreduce"].append(bool(engine.enable_backward_allreduce))
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        if record:
            out["grads"].append([p.grad.detach().double().cpu().numpy().copy() for p in engine.module.parameters()])
        engine.step()
        out["loss"].append(float(loss.detach()))
        if record:
            out["params"].append([p.detach().double().cpu().numpy().copy() for p in engine.module.parameters()])
    return out


def _eval_loss(engine, world: int, n: int) -> float:
    import torch

    with torch.no_grad():
        losses = [float(torch.nn.functional.mse_loss(engine.module(_data(r, n)[0].to(engine.device)),
                                                     _data(r, n)[1].to(engine.device))) for r in range(world)]
    return float(np.mean(losses))


def _replay_body(rank: int, world: int, cases: list) -> dict:
    """Each optimizer for STEPS steps, recorded for the simulation."""
    from tests.distributed.engine_models import make_model

    out = {"p0": [p.detach().double().numpy() for p in make_model("mlp", 0).parameters()]}
    for name in cases:
        engine = _engine(name, CASES[name])
        out[name] = _train(engine, rank, STEPS)
    return out


def _logged(kind: str) -> dict:
    import deepspeed_c.comm as dc

    raw = dc.comms_logger.get_raw_data()
    return {name: sum(size * rec[0] for size, rec in raw.get(name, {}).items()) for name in kind}


def _features_body(rank: int, world: int) -> dict:
    """The replay, then bytes, bf16/fp16, convergence against Adam (one process group for all: a
    run's start-up costs more than its steps)."""
    import deepspeed_c.comm as dc

    out = _replay_body(rank, world, list(CASES))
    # bytes: 3 warm-up steps (one set-up), then 4 compressed steps
    engine = _engine("OneBitAdam", {"lr": LR, "freeze_step": 3}, logger=True)
    _train(engine, rank, 3, record=False)
    dc.comms_logger.reset_data()
    _train(engine, rank, 4, record=False)
    out["bytes"] = _logged(ONEBIT_OPS + ("all_reduce",))
    out["numels"] = [p.numel() for p in engine.module.parameters()]
    dc.configure(enabled=False)

    # DeepSpeed's backend API: compressed_allreduce(buffer, worker_error, server_error, local_rank), twice
    import torch

    from deepspeed_c.runtime.comm.nccl import NcclBackend

    unit = world * (world * 8 // np.gcd(world, 8))
    padded = -(-37 // unit) * unit
    dev = rank_device()
    werr, serr = torch.zeros(padded, device=dev), torch.zeros(padded // world, device=dev)
    x = torch.randn(37, generator=torch.Generator().manual_seed(rank)).to(dev)
    backend = NcclBackend()
    results = [backend.compressed_allreduce(x.clone().view(37, 1), werr, serr, rank).view(-1).cpu().numpy()
               for _ in range(2)]
    out["ds_api"] = (x.double().cpu().numpy(), results, werr.double().cpu().numpy(), serr.double().cpu().numpy())

    # momentum masks: once compressed, the masked rows' momentum is exactly zero, so they stop moving
    import torch

    import deepspeed_c
    from tests.distributed.engine_models import make_model

    model = make_model("mlp", 0)
    w = model.net[0].weight
    mask = torch.ones_like(w)
    mask[:4] = 0.0
    mask = mask.flatten()  # as DeepSpeed's tests and BERT example give it
    groups = [{"params": [w], "exp_avg_mask": mask}, {"params": [p for p in model.parameters() if p is not w]}]
    cfg = {"train_micro_batch_size_per_gpu": 32, "gradient_clipping": 0.0,
           "optimizer": {"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": 3}}}
    engine, *_ = deepspeed_c.initialize(model=model, model_parameters=groups, config=cfg)
    _train(engine, rank, 3, record=False)
    before = w.detach().clone()
    _train(engine, rank, 5, record=False)
    out["mask"] = (bool(torch.equal(w[:4], before[:4])), bool(engine.optimizer.state[w]["exp_avg"][:4].eq(0).all()),
                   not torch.equal(w[4:], before[4:]))

    # 16-bit training: finite, decreasing, and replicas agree (1-bit Adam's momentum is shared)
    for precision in ("bf16", "fp16"):
        engine = _engine("OneBitAdam", {"lr": LR, "freeze_step": 5}, precision=precision)
        run = _train(engine, rank, 20, record=False)
        out[precision] = (run["loss"], [p.detach().float().cpu().numpy() for p in engine.module.parameters()])

    # the stated run (CONVERGENCE): 200 full-batch steps on each rank's 1024 samples, the loss over every rank's data
    final = {}
    for name, params in CONVERGENCE.items():
        engine = _engine(name, params)
        _train(engine, rank, 200, record=False, n=1024)
        final[name] = _eval_loss(engine, world, 1024)
    out["final"] = final
    return out


def _check_replay(res: list, world: int) -> None:
    p0 = res[0]["p0"]
    for name, params in CASES.items():
        grads = [[res[r][name]["grads"][t] for r in range(world)] for t in range(STEPS)]
        if name == "OneBitAdam":
            sim = ref.onebit_adam(p0, grads, LR, params["freeze_step"])
            allreduced = [t + 1 <= params["freeze_step"] for t in range(STEPS)]
        elif name == "ZeroOneAdam":
            sim, allreduced = ref.zero_one_adam(p0, grads, LR, params["var_freeze_step"], params["var_update_scaler"],
                                                params["local_step_scaler"], params["local_step_clipper"])
        else:
            sim = ref.onebit_lamb(p0, grads, LR, params["freeze_step"])
            allreduced = [t + 1 <= params["freeze_step"] for t in range(STEPS)]
        assert [res[0][name]["allreduce"][t] for t in range(STEPS)] == allreduced, name
        for t in range(STEPS):
            same = all(np.array_equal(grads[t][0][i], grads[t][r][i]) for r in range(world) for i in range(len(p0)))
            assert same == allreduced[t], f"{name} step {t + 1}: gradients equal on every rank: {same}"
            for r in range(world):
                for i, (got, want) in enumerate(zip(res[r][name]["params"][t], sim[t][r])):
                    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-3)
                    assert err < 2e-5, f"{name} rank {r} step {t + 1} param {i}: rel error {err:.2e}"
        assert any(not a for a in allreduced), name  # the run reached the compressed phase


def test_onebit_optimizers_4_ranks_match_float64_simulation():
    world = 4
    res = run_distributed(_replay_body, world, args=(list(CASES),), timeout=300)
    _check_replay(res, world)


def test_onebit_2_ranks_simulation_bytes_precision_convergence():
    world = 2
    res = run_distributed(_features_body, world, timeout=300)
    _check_replay(res, world)
    r0 = res[0]
    # bytes per compressed step: each tensor padded to W * lcm(W, 8); the all-to-all takes every rank's
    # padded/8 sign bytes plus a row of the fp32 scales (one per tensor) for each of the W ranks, the
    # all-gather one chunk's (padded/W)/8 sign bytes plus its scales
    unit = world * (world * 8 // np.gcd(world, 8))
    padded = [-(-n // unit) * unit for n in r0["numels"]]
    steps, T, signs = 4, len(padded), sum(padded) // 8
    b = r0["bytes"]
    assert b["onebit_all_to_all"] == steps * (signs + world * 4 * T)
    assert b["onebit_all_gather"] == steps * (signs // world + 4 * T)
    assert b["all_reduce"] == 0  # the engine no longer all-reduces gradients
    # ring traffic per rank and step: an all-to-all sends (W-1)/W of its input, an all-gather W-1 copies
    fp32_ring = 2 * (world - 1) / world * 4 * sum(r0["numels"])  # the fp32 all-reduce it replaces
    signs_ring = (world - 1) / world * signs + (world - 1) * signs / world
    assert 1 / 32 <= signs_ring / fp32_ring <= 1 / 32 * 1.05, signs_ring / fp32_ring  # + padding to whole bytes
    scales_ring = (world - 1) / world * world * 4 * T + (world - 1) * 4 * T
    assert (b["onebit_all_to_all"] * (world - 1) / world + b["onebit_all_gather"] * (world - 1)) / steps == \
        signs_ring + scales_ring
    comp = ref.Compressor(37, world)
    for k in range(2):
        want = comp([res[r]["ds_api"][0] for r in range(world)])[:37]
        for r in range(world):
            assert np.allclose(res[r]["ds_api"][1][k], want, rtol=1e-5, atol=1e-6), (k, r)
    for r in range(world):
        assert np.allclose(res[r]["ds_api"][2], comp.werr[r], atol=1e-5)
        assert np.allclose(res[r]["ds_api"][3], comp.serr[r], atol=1e-5)
    assert all(res[r]["mask"] == (True, True, True) for r in range(world)), [res[r]["mask"] for r in range(world)]
    for precision in ("bf16", "fp16"):
        losses, params = r0[precision]
        assert np.all(np.isfinite(losses)) and np.mean(losses[-5:]) < np.mean(losses[:5]), (precision, losses)
        assert all(np.array_equal(a, b) for a, b in zip(params, res[1][precision][1])), precision
    final = r0["final"]  # no worse than 2% above the uncompressed optimizer's loss at the end of the same run
    for name, base in BASELINE.items():
        assert final[name] <= 1.02 * final[base], (name, final)
