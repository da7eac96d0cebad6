"""ZeRO-Offload's pipelined host step, driven directly (no engine) on 1, 2 and 4 ranks (gloo on CPU;
under DSC_TEST_BACKEND=nccl one GPU a rank with the model on it: then the gradients really cross to the host
on the side stream and the weights come back through pinned buffers).

The optimizer collaborator wraps a plain torch model; the host step runs in tiny sub-chunks (7
elements, so every bucket takes several C-kernel calls and the Adam state is sliced) with the
gradients staged into a separate host buffer bucket by bucket, as on a GPU. References:
- fp32, stage 1 and 2, gradient accumulation 2 and clipping: single-process torch.optim.Adam on the
  global batch with clip_grad_norm_ (1e-5 norm-wise relative, every step's weights);
- bf16 model (CPU, gloo): the same run without offload (the device-side path: fp32 up-cast, torch-side cast
  back), which must agree bit for bit, since the C kernel reads the 16-bit gradients and writes the
  16-bit weights with the same roundings;
- a torch optimizer with offload (DeepSpeed's zero_force_ds_cpu_optimizer=false case) against the
  same torch optimizer on one process."""
from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np
import pytest
import torch

from tests.distributed.engine_models import loss_fn, make_batches, make_model
from tests.harness import rank_device, run_distributed

MICRO = 2
STEPS = 4
GAS = 2
CAP = 200  # elements a bucket: several buckets for the MLP


def _zero(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, stage: int, clip: float,
          offload: bool, boundary: list[bool]) -> Any:
    from deepspeed_c.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedZeroOptimizer(
        opt, stage=stage, rank=rank, world_size=world, should_reduce=lambda: stage == 2 or boundary[0],
        is_boundary=lambda: boundary[0], reduce_bucket_size=CAP, allgather_bucket_size=CAP, clip_grad=clip,
        offload_device="cpu" if offload else None, offload_sub_chunk=7, offload_stage_on_host=True)


def _train_zero(rank: int, world: int, model: torch.nn.Module, zopt: Any, boundary: list[bool],
                dtype: torch.dtype) -> list[np.ndarray]:
    batches = make_batches("mlp", STEPS * GAS, MICRO * world, seed=11)
    dev = next(model.parameters()).device
    snaps = []
    for step in range(STEPS):
        for k in range(GAS):
            x, y = batches[step * GAS + k]
            boundary[0] = k == GAS - 1
            lo, hi = rank * MICRO, (rank + 1) * MICRO
            loss = loss_fn(model(x[lo:hi].to(dev, dtype)).float(), y[lo:hi].to(dev)) / GAS
            loss.backward()
        zopt.step()
        zopt.zero_grad()
        snaps.append(torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).cpu().numpy().copy())
    return snaps


def fp32_body(rank: int, world: int, stage: int, clip: float) -> dict[str, Any]:
    from deepspeed_c.ops.adam import DeepSpeedCPUAdam

    model = make_model("mlp", seed=5).to(rank_device())
    boundary = [False]
    zopt = _zero(model, DeepSpeedCPUAdam(model.parameters(), lr=1e-2, adamw_mode=False, weight_decay=0.01),
                 rank, world, stage, clip, True, boundary)
    snaps = _train_zero(rank, world, model, zopt, boundary, torch.float32)
    stats = zopt.offload_stats()
    zopt.destroy()
    return {"snaps": snaps, "stats": stats, "cuda": next(model.parameters()).is_cuda}


def reference_fp32(world: int, clip: float) -> list[np.ndarray]:
    model = make_model("mlp", seed=5).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)
    batches = make_batches("mlp", STEPS * GAS, MICRO * world, seed=11)
    snaps = []
    for step in range(STEPS):
        for k in range(GAS):
            x, y = batches[step * GAS + k]
            (loss_fn(model(x.double()), y.double()) / GAS).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        snaps.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy())
    return snaps


@functools.lru_cache(maxsize=None)
def _fp32(world: int, stage: int, clip: float) -> list[dict[str, Any]]:
    return run_distributed(fp32_body, world, args=(stage, clip), timeout=240)


FP32_CASES = [(1, 2, 0.0), (2, 2, 0.05), (2, 1, 0.05), (4, 2, 0.05)]


@pytest.mark.parametrize("world,stage,clip", FP32_CASES, ids=[f"w{w}-stage{s}-clip{c}" for w, s, c in FP32_CASES])
def test_offload_matches_torch_adam(world: int, stage: int, clip: float) -> None:
    ref = reference_fp32(world, clip)
    for res in _fp32(world, stage, clip):
        for got, want in zip(res["snaps"], ref):
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
        stats = res["stats"]
        assert stats["steps"] == STEPS
        n = sum(p.numel() for p in make_model("mlp", seed=5).parameters())
        # every step staged this rank's whole partition (1/W of the gradients, plus padding) once
        assert n * 4 * STEPS / world <= stats["d2h_bytes"] < (n / world + 64) * 4 * STEPS
        if res["cuda"]:  # the copies ran on the side stream, timed by CUDA events
            assert stats["d2h_copy_ms"] > 0 and stats["h2d_copy_ms"] > 0
            assert stats["h2d_bytes"] == stats["d2h_bytes"]  # fp32 model: the same partition each way


def bf16_body(rank: int, world: int) -> dict[str, Any]:
    from deepspeed_c.ops.adam import DeepSpeedCPUAdam

    out = {}
    for offload in (False, True):
        model = make_model("mlp", seed=5).to(torch.bfloat16)
        boundary = [False]
        zopt = _zero(model, DeepSpeedCPUAdam(model.parameters(), lr=1e-2), rank, world, 2, 0.0, offload, boundary)
        out[offload] = _train_zero(rank, world, model, zopt, boundary, torch.bfloat16)
        zopt.destroy()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_offload_bf16_fused_write_back_equals_device_path(world: int) -> None:
    # the device path steps with the same C optimizer only when the model is in host memory: gloo,
    # also under DSC_TEST_BACKEND=nccl (a host-memory check; the GPU path is the fp32 cases')
    for res in run_distributed(bf16_body, world, timeout=240, backend="gloo"):
        for a, b in zip(res[True], res[False]):
            np.testing.assert_array_equal(a, b)
        assert not np.array_equal(res[True][0], res[True][-1])  # it trained


def torch_opt_body(rank: int, world: int) -> list[np.ndarray]:
    model = make_model("mlp", seed=5).to(rank_device())
    boundary = [False]
    zopt = _zero(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank, world, 2, 0.0, True, boundary)
    snaps = _train_zero(rank, world, model, zopt, boundary, torch.float32)
    zopt.destroy()
    return snaps


def test_offload_with_a_torch_optimizer() -> None:
    model = make_model("mlp", seed=5)
    ref_model = copy.deepcopy(model).double()
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    batches = make_batches("mlp", STEPS * GAS, MICRO * 2, seed=11)
    ref = []
    for step in range(STEPS):
        for k in range(GAS):
            x, y = batches[step * GAS + k]
            (loss_fn(ref_model(x.double()), y.double()) / GAS).backward()
        opt.step()
        opt.zero_grad()
        ref.append(torch.cat([p.detach().reshape(-1) for p in ref_model.parameters()]).numpy())
    for snaps in run_distributed(torch_opt_body, 2, timeout=240):
        for got, want in zip(snaps, ref):
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
