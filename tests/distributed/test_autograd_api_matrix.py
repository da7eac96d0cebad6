"""Every way users call autograd gives plain PyTorch's gradients through the engine: ZeRO stages 0-3, with
and without contiguous_gradients, on 2 gloo ranks (fp32), against one process of float64 PyTorch on the
same global batch (tests/distributed/autograd_flows.py holds the flows and the reference).

What could go wrong, and what the rule is (../shared/ARCHITECTURE.md): the engine's fast paths change how
a gradient reaches `.grad` (ZeRO-1/2 Linear weight gradients written in place into the reduction bucket,
the accumulation-scaling hooks of a direct `loss.backward()`, the engine's backward prologue on the model's
outputs, ZeRO-3's gather/release marks and memory-efficient Linear). Each must act only in a backward that
accumulates into that parameter's `.grad` with grad mode off, and step aside for plain autograd under
`autograd.grad`, `backward(inputs=)`, `create_graph` and `torch.func`. Before that rule the FGSM,
`inputs=` and penalty flows trained on the wrong gradients (0.3 off at stages 1-2) or raised, and the
per-sample flow raised at every ZeRO stage above 0.

Each flow trains 2 optimizer steps of SGD; the final trainable weights and everything the user read back
(input gradients, captured weight gradients, per-sample gradients, forces) are compared norm-wise relative
per tensor below TOL."""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

from tests.distributed import autograd_flows as af
from tests.harness import rank_device, run_distributed

STEPS = 2
WORLD = 2
TOL = 1e-5
CONFIGS = {
    "stage0": dict(stage=0),
    "stage1": dict(stage=1),
    "stage1-nocontig": dict(stage=1, contiguous_gradients=False),
    "stage2": dict(stage=2),
    "stage2-nocontig": dict(stage=2, contiguous_gradients=False),
    "stage3": dict(stage=3, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=200,
                   stage3_max_live_parameters=2000),
}


def ds_config(zero: dict[str, Any], gas: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": af.MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": af.LR}},
        "zero_optimization": dict(zero, reduce_bucket_size=150, allgather_bucket_size=150),
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 6,
    }


def _engine_run(rank: int, world: int, zero: dict[str, Any], flows: list[str],
                precision: Any = None) -> dict[str, Any]:
    import deepspeed_c

    results: dict[str, Any] = {}
    for name in flows:
        flow, kind, gas = af.FLOWS[name]
        try:
            model = af.make_model(kind).to(rank_device())
            params = [p for p in model.parameters() if p.requires_grad]
            config = ds_config(zero, gas)
            if precision is not None:
                config.update(precision)
            engine, *_ = deepspeed_c.initialize(model=model, model_parameters=params, config=config)
            tr = af.EngineTrainer(engine)
            x, y = af.data(world, gas, STEPS)
            dtype = next(engine.module.parameters()).dtype
            x, y = x.to(dtype), y.to(dtype)
            obs = []
            for s in range(STEPS):
                for m in range(gas):
                    got = flow(tr, x[s, m, rank].to(rank_device()), y[s, m, rank].to(rank_device()))
                    obs += [o.detach().double().cpu().numpy() for o in got]
                    tr.step()
            with deepspeed_c.zero.GatheredParameters(list(engine.module.parameters())):
                weights = {n: t.numpy() for n, t in af.trainable_state(engine.module).items()}
            results[name] = ("ok", weights, obs)
        except Exception as exc:  # noqa: BLE001 - reported per flow, the test fails on it
            results[name] = ("raised", f"{type(exc).__name__}: {exc}", None)
    return results


@functools.lru_cache(maxsize=None)
def _reference(name: str) -> tuple[dict[str, np.ndarray], list[list[np.ndarray]]]:
    weights, obs = af.reference_run(name, WORLD, STEPS)
    return {n: t.numpy() for n, t in weights.items()}, [[o.numpy() for o in per] for per in obs]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def compare(name: str, ranks: list[dict[str, Any]], tol: float) -> list[str]:
    """Mismatches of one flow (empty when it matched)."""
    ref_w, ref_obs = _reference(name)
    problems = []
    for rank, res in enumerate(ranks):
        status, weights, obs = res[name]
        if status != "ok":
            return [f"{name}: rank {rank} raised {weights}"]
        for n, w in ref_w.items():
            err = _rel(weights[n], w)
            if not err < tol:
                problems.append(f"{name}: rank {rank} weight {n} off by {err:.3g}")
        if len(obs) != len(ref_obs[rank]):
            problems.append(f"{name}: rank {rank} observed {len(obs)} tensors, the reference {len(ref_obs[rank])}")
            continue
        for i, (o, r) in enumerate(zip(obs, ref_obs[rank])):
            err = _rel(o, r)
            if not err < tol:
                problems.append(f"{name}: rank {rank} observation {i} off by {err:.3g}")
    return problems


@pytest.mark.parametrize("config", list(CONFIGS))
def test_autograd_api_matrix(config: str) -> None:
    flows = list(af.FLOWS)
    ranks = run_distributed(_engine_run, world_size=WORLD, args=(CONFIGS[config], flows), timeout=600)
    problems = [p for name in flows for p in compare(name, ranks, TOL)]
    assert not problems, f"{config}: " + "; ".join(problems)


def test_reference_flows_differ() -> None:
    """The flows are not interchangeable: FGSM's adversarial step, the penalties and the second loss each
    move the weights away from plain training (a flow that silently did nothing would not pass)."""
    base, _ = _reference("two_losses")
    for name in ("fgsm", "input_penalty", "gradnorm_penalty"):
        other, _ = _reference(name)
        assert max(_rel(other[n], base[n]) for n in base) > 1e-3, name


FP16 = {"fp16": {"enabled": True, "initial_scale_power": 8}}
FP16_FLOWS = ["fgsm", "inputs_first", "input_penalty"]


@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_loss_scaling_leaves_user_autograd_alone(stage: int) -> None:
    """Under fp16 dynamic loss scaling the engine refuses an unscaled direct `loss.backward()` (as DeepSpeed
    does); a user's `autograd.grad(loss, x)` or `backward(inputs=[x])` is no training backward and must not
    be refused (it was: "Loss scaling is required ... backward() was called directly"). fp16 weights and
    activations: within 2e-2 of the float64 reference."""
    ranks = run_distributed(_engine_run, world_size=WORLD, args=({"stage": stage}, FP16_FLOWS, FP16), timeout=600)
    problems = [p for name in FP16_FLOWS for p in compare(name, ranks, 2e-2)]
    assert not problems, "; ".join(problems)


BF16 = {"bf16": {"enabled": True}}
BF16_TOL = 3e-2  # measured: at most 1.4e-2 (gradients read back in bf16), 2 ranks on CPU


@pytest.mark.parametrize("config", list(CONFIGS))
def test_autograd_api_matrix_bf16(config: str) -> None:
    """The same matrix with bf16 weights and activations (fp32 master weights in the optimizer): within
    BF16_TOL of the float64 reference (bf16 keeps 8 bits of mantissa; a wrong path is off by 0.3 or raises)."""
    flows = list(af.FLOWS)
    ranks = run_distributed(_engine_run, world_size=WORLD, args=(CONFIGS[config], flows, BF16), timeout=600)
    problems = [p for name in flows for p in compare(name, ranks, BF16_TOL)]
    assert not problems, f"{config} bf16: " + "; ".join(problems)
