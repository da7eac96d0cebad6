"""MoE with expert parallelism on gloo: a small transformer with two MoE layers of different ep_size,
trained 20 steps through deepspeed_c.initialize at ZeRO stage 0, 1 and 2, against the same model
trained in one process with every expert local (each step: every rank's micro-batch run separately,
as the ranks gate their own tokens, and their losses averaged). Losses and every weight (each rank's
experts against their global counterparts) within fp32 tolerance. The same runs check the expert
groups and that after the first backward each expert's gradient is the one-process gradient (summed
over its expert-data-parallel group only, divided by the data-parallel world size, as DeepSpeed).
The cases also cover PR-MoE, drop_tokens=False, gradient accumulation, clipping (DeepSpeed's norms),
offload_optimizer, and bf16/fp16 (there: losses near fp32, replicas bit-identical).

At 4 ranks the same spawn also checks MoE checkpoints in DeepSpeed's layout: saved at ep_size 2 (dp
2 x ep 2), loaded into a differently initialised model at ep_size 4, training continues with the
losses of the run that never stopped (Adam's moments followed each expert to its new rank); the
files are DeepSpeed's (mp_rank_00 without experts, layer_{L}_expert_{E}, expp_rank_{R} optimizer
files) and zero_to_fp32 consolidates every expert into the one-process model's state dict; bf16 and
ZeRO-2 checkpoints resume bit-equal at the same layout, and ZeRO-2 ones are refused at another ep_size.

One spawn per world size runs every case. Under DSC_TEST_BACKEND=nccl they run one GPU a rank (tokens on
rank_device()) against the same one-process reference on the CPU, with the same tolerances; the bit-equal
checks (replicas, resumes at the same layout) hold there too: same kernels, deterministic ones (harness).

Routing is discontinuous: a token whose k-th and (k+1)-th gate logits are within rounding of each other can
go to another expert in a run that merely sums in another order (the ranks, a GPU), and then no rounding
bound holds. So no routing decision here sits near a tie, by construction: the one-process reference
draws each rank's micro-batch at the weights of its step and redraws it while any token in either MoE
layer has a gate margin (moe_models.gate_margins: the smallest gap among its k + 1 largest logits,
relative to ||x|| * max ||w_e||) below MARGIN; the ranks train on the micro-batches it kept, and each
case asserts the smallest margin of the reference's own training forwards. Drops go by token order
(use_rts=False) or not at all, so given the chosen experts they are exact."""
from __future__ import annotations

import atexit
import io
import math
import os
import shutil
import tempfile
from typing import Any

import numpy as np
import pytest
import torch

from tests.distributed.moe_models import (EXPERTS, T, V, MarginRecorder, local_name, make_batches, make_full,
                                          make_sharded)
from tests.harness import backend_choice, rank_device
from tests.shared_launch import run_worlds

STEPS = 20
MICRO = 2
LR = 2e-3
TOL = 2e-5
# Over NCCL the ranks compute on GPUs (TF32 off, harness) and the reference on the CPU: other kernels, other
# summation orders, other exp/erf/rsqrt roundings. With no routing decision within MARGIN of a flip (see
# above) the bound stays a rounding bound. Measured on these cases (20 steps): gloo ranks against the
# reference <= 8e-7 relative in the worst weight, losses <= 2e-7; the fp32 reference against the same run in
# float64 (the distance of the whole run from exact arithmetic) <= 1.3e-5 in the worst weight (an expert
# seeing few tokens), ~2e-6 typically. A GPU run is another fp32 rounding of the same arithmetic, so it may
# sit up to ~2.6e-5 from the CPU one (estimate). Measured over NCCL in the worst weight of z2-offload-clip (an
# expert seeing few tokens; the CPU Adam steps on the offloaded partition, clipping divides by a GPU-summed
# norm): 1.01e-4 on 4 H100s, 4.1e-4 on 2 (another weight); the other cases within 1e-4. 1e-3 leaves 2.4x and
# is still far below what a wrong gradient or a lost micro-batch gives (O(1e-1)); a routing flip cannot hide
# behind it, since each rank's own smallest gate margin is asserted (>= MARGIN / 2) (gloo keeps 2e-5).
if backend_choice() == "nccl":
    TOL = 1e-3
# the smallest relative gate margin (moe_models.gate_margins) of any token in any step of the reference:
# a 1e-3 relative change of a weight or an activation moves a gap by ~4e-3 of the scale at most, so the
# 2e-5 (1e-3 on GPUs) relative agreement of the runs leaves it 12x short of a flip even in that
# worst alignment (on GPUs the ranks' margins are asserted instead); ~20% of micro-batches are redrawn at this margin
MARGIN = 1e-3
MAX_DRAWS = 50  # draws of one micro-batch before the reference gives up (~1.25 are needed on average)

CASES: dict[str, dict[str, Any]] = {
    # name: ep sizes of the two MoE layers, ZeRO stage, PR-MoE, gradient clipping
    "ep4-ep2-z0-clip": dict(ep=(4, 2), stage=0, residual=False, clip=0.05),
    "dp2xep2-z0-prmoe": dict(ep=(2, 2), stage=0, residual=True, clip=0.0),
    "ep1-ep4-z0-nodrop": dict(ep=(1, 4), stage=0, residual=False, clip=0.0, drop=False),
    "ep2-ep1-z0-prmoe-clip": dict(ep=(2, 1), stage=0, residual=True, clip=0.3),
    "dp2xep2-z1-clip-gas2": dict(ep=(2, 2), stage=1, residual=False, clip=0.05, gas=2),
    "ep4-ep2-z2-prmoe": dict(ep=(4, 2), stage=2, residual=True, clip=0.0),
    "ep2-ep1-z2-clip": dict(ep=(2, 1), stage=2, residual=False, clip=0.05),
    # bf16 at stage 0: the clipping norm is averaged over the ranks, so replicas stay identical
    "ep2-ep1-z0-bf16-clip": dict(ep=(2, 1), stage=0, residual=False, clip=0.05, bf16=True),
    "ep2-ep1-z2-fp16-clip": dict(ep=(2, 1), stage=2, residual=False, clip=0.05, fp16=True),
    "ep2-ep1-z2-offload-clip": dict(ep=(2, 1), stage=2, residual=True, clip=0.05, offload=True),
}
WORLD_CASES = {4: ["ep4-ep2-z0-clip", "dp2xep2-z0-prmoe", "ep1-ep4-z0-nodrop", "dp2xep2-z1-clip-gas2",
                   "ep4-ep2-z2-prmoe"],
               2: ["ep2-ep1-z0-prmoe-clip", "ep2-ep1-z2-clip", "ep2-ep1-z0-bf16-clip", "ep2-ep1-z2-fp16-clip",
                   "ep2-ep1-z2-offload-clip"]}


def _config(stage: int, clip: float, bf16: bool = False, fp16: bool = False, gas: int = 1) -> dict[str, Any]:
    return {"bf16": {"enabled": bf16}, "fp16": {"enabled": fp16, "loss_scale": 0, "initial_scale_power": 8},
            "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
            "optimizer": {"type": "Adam", "params": {"lr": LR}}, "zero_optimization": {"stage": stage},
            "steps_per_print": 10**9}


def _train(rank: int, world: int, name: str, batches: list) -> dict[str, Any]:
    import deepspeed_c
    import torch.distributed as dist
    from deepspeed_c.utils import groups

    case = CASES[name]
    drop = case.get("drop", True)  # drop_tokens=False: capacity maximised over each expert-parallel group
    model = make_sharded(make_full(7, case["residual"], drop), rank, case["ep"], case["residual"], drop)
    gas = case.get("gas", 1)
    config = _config(case["stage"], case["clip"], case.get("bf16", False), case.get("fp16", False), gas)
    if case.get("offload"):
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, _, _, _ = deepspeed_c.initialize(model=model, config=config)
    losses, first_grads, margins = [], {}, []
    dev = rank_device()
    rec = MarginRecorder(engine.module).__enter__()  # the rank's own gate margins, in its own arithmetic
    for step in range(STEPS):
        total = torch.zeros((), device=dev)
        for m in range(gas):
            tokens, targets = batches[step * gas + m]
            rec.clear()
            loss = engine(tokens[rank].to(dev), targets[rank].to(dev))
            margins.append(rec.smallest())
            engine.backward(loss)
            if step == 0 and m == gas - 1:
                first_grads = {n: p.grad.detach().float().cpu().numpy().copy()
                               for n, p in engine.module.named_parameters() if p.grad is not None}
            engine.step()
            total += loss.detach().float() / gas
        dist.all_reduce(total)
        losses.append(float(total) / world)
    rec.__exit__()
    names = {f"ep_size_{n}" for n in case["ep"]}
    out = {"losses": losses, "first_grads": first_grads, "margin": min(margins),
           "weights": {n: p.detach().float().cpu().numpy().copy() for n, p in engine.module.named_parameters()},
           "ep_ranks": {n: list(groups._get_expert_parallel_group_ranks(n)) for n in names},
           "edp_ranks": {n: list(groups._get_expert_data_parallel_group_ranks(n)) for n in names}}
    engine.destroy()
    return out


CKPT_CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
          "optimizer": {"type": "Adam", "params": {"lr": 2e-3}}, "steps_per_print": 10**9}


def _steps(engine: Any, rank: int, world: int, batches: list) -> list[float]:
    import torch.distributed as dist

    losses = []
    for tokens, targets in batches:
        loss = engine(tokens[rank].to(rank_device()), targets[rank].to(rank_device()))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def _checkpoint_run(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    import torch.distributed as dist

    import deepspeed_c
    from deepspeed_c.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    batches = make_batches(6, MICRO, world, seed=11)  # 3 steps, save, 3 more
    engine, _, _, _ = deepspeed_c.initialize(model=make_sharded(make_full(7), rank, (2, 2)), config=CKPT_CONFIG)
    _steps(engine, rank, world, batches[:3])
    engine.save_checkpoint(ckpt, tag="ep2")
    saved = {n: p.detach().cpu().numpy().copy() for n, p in engine.module.named_parameters()}
    straight = _steps(engine, rank, world, batches[3:])
    engine.destroy()
    dist.barrier()
    out: dict[str, Any] = {"straight": straight, "saved": saved}
    if rank == 0:
        out["files"] = sorted(os.listdir(os.path.join(ckpt, "ep2")))
        out["model_keys"] = sorted(torch.load(os.path.join(ckpt, "ep2", "mp_rank_00_model_states.pt"),
                                              weights_only=False, map_location="cpu")["module"])
        out["fp32"] = {k: v.numpy().copy() for k, v in get_fp32_state_dict_from_zero_checkpoint(ckpt, "ep2").items()}
    # resume at ep_size 4 into a model initialised differently
    engine, _, _, _ = deepspeed_c.initialize(model=make_sharded(make_full(99), rank, (4, 4)), config=CKPT_CONFIG)
    engine.load_checkpoint(ckpt, tag="ep2")
    out["global_steps"] = engine.global_steps
    out["resumed"] = _steps(engine, rank, world, batches[3:])
    engine.destroy()
    # bf16 (fp32 masters and the loss scaler in the expp_rank files), resumed at the same layout: bit-equal
    bf16 = dict(CKPT_CONFIG, bf16={"enabled": True})
    engine, _, _, _ = deepspeed_c.initialize(model=make_sharded(make_full(7), rank, (2, 2)), config=bf16)
    _steps(engine, rank, world, batches[:3])
    engine.save_checkpoint(ckpt, tag="bf16")
    out["straight_bf16"] = _steps(engine, rank, world, batches[3:])
    engine.destroy()
    engine, _, _, _ = deepspeed_c.initialize(model=make_sharded(make_full(99), rank, (2, 2)), config=bf16)
    engine.load_checkpoint(ckpt, tag="bf16")
    out["resumed_bf16"] = _steps(engine, rank, world, batches[3:])
    engine.destroy()
    # ZeRO stage 2: one ZeRO file per rank (expert groups partitioned over their expert-data-parallel group),
    # resumed at the same layout bit-equal; at another ep_size refused, as DeepSpeed
    z2 = dict(CKPT_CONFIG, zero_optimization={"stage": 2})
    engine, _, _, _ = deepspeed_c.initialize(model=make_sharded(make_full(7), rank, (2, 2)), config=z2)
    _steps(engine, rank, world, batches[:3])
    engine.save_checkpoint(ckpt, tag="z2")
    out["saved_z2"] = {n: p.detach().cpu().numpy().copy() for n, p in engine.module.named_parameters()}
    dist.barrier()
    if rank == 0:
        out["fp32_z2"] = {k: v.numpy().copy() for k, v in get_fp32_state_dict_from_zero_checkpoint(ckpt, "z2").items()}
    out["straight_z2"] = _steps(engine, rank, world, batches[3:])
    engine.destroy()
    engine, _, _, _ = deepspeed_c.initialize(model=make_sharded(make_full(99), rank, (2, 2)), config=z2)
    engine.load_checkpoint(ckpt, tag="z2")
    out["resumed_z2"] = _steps(engine, rank, world, batches[3:])
    engine.destroy()
    engine, _, _, _ = deepspeed_c.initialize(model=make_sharded(make_full(99), rank, (4, 4)), config=z2)
    try:
        engine.load_checkpoint(ckpt, tag="z2")
        out["z2_ep4"] = "loaded"
    except NotImplementedError as e:
        out["z2_ep4"] = str(e)
    engine.destroy()
    return out


def body(rank: int, world: int, names: list[str], batches: dict[str, list],
         ckpt: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    runs = [(name, lambda name=name: _train(rank, world, name, batches[name])) for name in names]
    if ckpt is not None:
        runs.append(("checkpoint", lambda: _checkpoint_run(rank, world, ckpt)))
    for name, run in runs:
        try:
            out[name] = run()
        except Exception as e:  # one broken case must not hide the others
            import traceback

            out[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    return out


def _clip_as_deepspeed_moe(model: torch.nn.Module, clip: float, world: int, ep_sizes: tuple[int, int]) -> None:
    """DeepSpeed's clipping with MoE layers: each rank's gradient norm over the parameters it holds
    (its own experts), averaged over the ranks; every gradient scaled by min(1, clip / (avg + 1e-6))."""
    norms = []
    for r in range(world):
        sq = sum(float(p.grad.double().norm() ** 2) for n, p in model.named_parameters()
                 if local_name(n, r, ep_sizes) is not None)
        norms.append(math.sqrt(sq))
    coef = min(1.0, clip / (sum(norms) / world + 1e-6))
    for p in model.parameters():
        p.grad.mul_(coef)


def _margined_loss(model: torch.nn.Module, rec: MarginRecorder, g: torch.Generator,
                   where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """One rank's micro-batch (tokens, targets), drawn until every token's gate margin in both MoE layers
    is at least MARGIN at the model's current weights, with its loss (the training forward) and margin."""
    for _ in range(MAX_DRAWS):
        tokens = torch.randint(0, V, (MICRO, T), generator=g)
        targets = torch.randint(0, V, (MICRO, T), generator=g)
        rec.clear()
        loss = model(tokens, targets)
        if rec.smallest() >= MARGIN:
            return tokens, targets, loss, rec.smallest()
    raise AssertionError(f"{where}: no micro-batch with every gate margin >= {MARGIN} in {MAX_DRAWS} draws")


def reference(name: str, world: int) -> dict[str, Any]:
    """The one-process run, which also chooses the data (see the module's docstring): its losses, first
    gradients, final weights, the micro-batches it trained on ([world, MICRO, T] tokens and targets per
    micro step) and the smallest gate margin of its training forwards."""
    case = CASES[name]
    model = make_full(7, case["residual"], case.get("drop", True))
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, first_grads, batches, margins = [], {}, [], []
    gas = case.get("gas", 1)
    g = torch.Generator().manual_seed(5)
    for step in range(STEPS):
        parts = []
        with MarginRecorder(model) as rec:
            for m in range(gas):
                drawn = [_margined_loss(model, rec, g, f"{name} step {step} micro {m} rank {r}") for r in range(world)]
                batches.append((torch.stack([d[0] for d in drawn]), torch.stack([d[1] for d in drawn])))
                parts += [d[2] for d in drawn]
                margins += [d[3] for d in drawn]
        total = sum(parts) / (world * gas)
        total.backward()
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if case["clip"] > 0 and case["stage"] == 0:
            _clip_as_deepspeed_moe(model, case["clip"], world, case["ep"])
        elif case["clip"] > 0:  # ZeRO's norm: every rank's partitions summed, so each expert counts once
            torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total.detach()))
    return {"losses": losses, "first_grads": first_grads,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "batches": batches, "margin": min(margins)}


_RESULTS: dict[int, list[dict[str, Any]]] = {}
_REFERENCES: dict[tuple[str, int], dict[str, Any]] = {}


def _reference(name: str, world: int) -> dict[str, Any]:
    if (name, world) not in _REFERENCES:
        _REFERENCES[(name, world)] = reference(name, world)
    return _REFERENCES[(name, world)]


def _pack(obj: Any) -> bytes:
    """The batches as bytes: handed to the ranks as tensors, both worlds' would pass more file descriptors
    than the forkserver takes in one launch (`too many fds`)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _packed_body(rank: int, world: int, names: list[str], packed: bytes, ckpt: str | None) -> dict[str, Any]:
    return body(rank, world, names, torch.load(io.BytesIO(packed), weights_only=False), ckpt)


def _results(world: int) -> list[dict[str, Any]]:
    """Both world sizes run in ONE launch (run_worlds: a 4-rank phase, then a fresh 2-rank group on ranks 0-1,
    the expert groups of the first forgotten before the second): a launch's start-up paid once."""
    if not _RESULTS:
        ckpt = tempfile.mkdtemp(prefix="dsc_moe_ckpt_")
        atexit.register(shutil.rmtree, ckpt, True)
        phases = []
        for w, names in WORLD_CASES.items():
            batches = {name: _reference(name, w)["batches"] for name in names}  # the ranks' data
            phases.append((w, _packed_body, (names, _pack(batches), ckpt if w == 4 else None)))
        for (w, _, _), per_rank in zip(phases, run_worlds(phases, timeout=600)):
            _RESULTS[w] = per_rank
    return _RESULTS[world]


def _close(a: np.ndarray, b: torch.Tensor, what: str) -> None:
    a64, b64 = torch.from_numpy(a).double(), b.double()
    rel = float((a64 - b64).norm() / b64.norm().clamp_min(1e-12))
    assert rel < TOL, f"{what}: relative difference {rel:.3g}"


@pytest.mark.parametrize("world,name", [(w, n) for w, names in WORLD_CASES.items() for n in names])
def test_expert_parallel_training_matches_one_process(world: int, name: str) -> None:
    results = _results(world)
    for r in results:
        assert "error" not in r[name], r[name].get("error")
    ref = _reference(name, world)
    # no routing decision of the reference is within MARGIN of a flip (so none within the runs' rounding)
    assert ref["margin"] >= MARGIN, f"smallest gate margin {ref['margin']:.3g} < {MARGIN}"
    assert len(ref["batches"]) == STEPS * CASES[name].get("gas", 1)
    if not (CASES[name].get("bf16") or CASES[name].get("fp16")):
        # ... and the ranks, deciding in their own arithmetic (a GPU's on NCCL), stayed as far from a flip
        for rank, res in enumerate(results):
            assert res[name]["margin"] >= MARGIN / 2, f"rank {rank}: smallest gate margin {res[name]['margin']:.3g}"
    ep_sizes = CASES[name]["ep"]
    if CASES[name].get("bf16") or CASES[name].get("fp16"):
        _check_bf16_replicas(results, name, ref, world, ep_sizes)
        return
    for rank, res in enumerate(results):
        np.testing.assert_allclose(res[name]["losses"], ref["losses"], rtol=TOL, atol=0)
        seen = 0
        for full_name, ref_w in ref["weights"].items():
            mine = local_name(full_name, rank, ep_sizes)
            if mine is None:
                continue
            seen += 1
            if CASES[name]["stage"] == 0:  # ZeRO keeps reduced gradients in partitions, not in .grad
                _close(res[name]["first_grads"][mine], ref["first_grads"][full_name], f"rank {rank} grad {mine}")
            _close(res[name]["weights"][mine], ref_w, f"rank {rank} weight {mine} (full {full_name})")
        assert seen == len(res[name]["weights"])
        # DeepSpeed's E + D layout: expert-parallel groups are consecutive ranks, expert-data-parallel strided
        for n in sorted({f"ep_size_{e}" for e in ep_sizes}):
            ep = int(n.split("_")[2])
            assert res[name]["ep_ranks"][n] == [rank // ep * ep + i for i in range(ep)]
            assert res[name]["edp_ranks"][n] == list(range(rank % ep, world, ep))


def _check_bf16_replicas(results: list, name: str, ref: dict, world: int, ep_sizes: tuple[int, int]) -> None:
    """bf16/fp16: losses near the fp32 one-process run; every replica of a parameter (all ranks for ordinary
    ones, the expert-data-parallel group for experts) bit-identical after 20 clipped steps."""
    for res in results:
        np.testing.assert_allclose(res[name]["losses"], ref["losses"], rtol=3e-2, atol=0)
    for full_name in ref["weights"]:
        holders = [(r, local_name(full_name, r, ep_sizes)) for r in range(world)]
        values = [results[r][name]["weights"][mine] for r, mine in holders if mine is not None]
        for v in values[1:]:
            np.testing.assert_array_equal(v, values[0], err_msg=f"{full_name}: replicas differ")


def _checkpoint_results() -> list[dict[str, Any]]:
    results = [r["checkpoint"] for r in _results(4)]
    for r in results:
        assert "error" not in r, r.get("error")
    return results


def test_moe_checkpoint_resumes_at_another_ep_size_with_the_same_losses() -> None:
    for r in _checkpoint_results():
        assert r["global_steps"] == 3
        np.testing.assert_allclose(r["resumed"], r["straight"], rtol=1e-5, atol=0)
        assert r["resumed_bf16"] == r["straight_bf16"]
        assert r["resumed_z2"] == r["straight_z2"]
        assert "same world size and ep_size" in r["z2_ep4"], r["z2_ep4"]


def test_moe_checkpoint_files_are_deepspeeds_layout_and_zero_to_fp32_consolidates_them() -> None:
    results = _checkpoint_results()
    files = results[0]["files"]
    experts = [f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(EXPERTS)]
    assert set(experts) <= set(files)
    assert {"expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_1_mp_rank_00_optim_states.pt",
            "mp_rank_00_model_states.pt"} <= set(files)
    assert not any("deepspeed_experts" in k for k in results[0]["model_keys"])
    full_names = set(make_full(7).state_dict())
    for saved, fp32 in (("saved", results[0]["fp32"]), ("saved_z2", results[0]["fp32_z2"])):  # stage 0, ZeRO-2
        assert set(fp32) == full_names
        for rank, r in enumerate(results):
            for full_name in full_names:
                mine = local_name(full_name, rank, (2, 2))
                if mine is not None:
                    np.testing.assert_array_equal(r[saved][mine], fp32[full_name],
                                                  err_msg=f"{saved} rank {rank} {mine}")


def test_moe_checkpoint_refused_where_not_built() -> None:
    from deepspeed_c.runtime.checkpointing.moe import check_stage

    with pytest.raises(NotImplementedError, match="zero_optimization.stage 3"):
        check_stage(3)
    check_stage(2)  # ZeRO 1/2 (same world size and ep_size, as DeepSpeed): built
    check_stage(0)  # fp16/bf16 at stage 0: built
