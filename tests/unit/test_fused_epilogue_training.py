"""The fused optimizer epilogue on the training path (runtime/fused_epilogue.py).

CPU (CI): which optimizers take it (Adam, AdamW, FusedAdam; not amsgrad, maximize or others), that
CPU engines never do, and how ZeRO's bucket-by-bucket step drives the kernel (a stand-in for it).
CUDA (the GPU machine): engines at ZeRO stages 0, 1 and 2 in bf16, fp16 and fp32 with Adam, AdamW
and FusedAdam, gradient clipping that bites and accumulation 2, trained 6 steps with the epilogue
and with it turned off (DSC_FUSED_EPILOGUE=0: separate unscale/clip/step/cast passes) from the same
weights and batches. Reference for both: plain PyTorch in float64 on fp32 copies of the same
gradients would only re-test the kernel (tests/unit/test_cuda_multi_tensor.py does that); here the
question is whether the engine drives it correctly, so the separate-pass engine is the reference:
masters after 6 steps within 1e-5 norm-wise relative (the two paths differ only in where the
clip coefficient and the unscale are multiplied in), global grad norms within 1e-5, the same
optimizer step counts, and the state dict loads into torch.optim.AdamW."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from deepspeed_c.runtime.fused_epilogue import AdamEpilogue, adam_w_mode_of

pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks


def test_which_optimizers_take_the_epilogue() -> None:
    from deepspeed_c.ops.adam.fused_adam import FusedAdam

    p = [torch.nn.Parameter(torch.zeros(3))]
    assert adam_w_mode_of(torch.optim.AdamW(p)) is True
    assert adam_w_mode_of(torch.optim.Adam(p)) is False
    assert adam_w_mode_of(FusedAdam(p)) is True
    assert adam_w_mode_of(FusedAdam(p, adam_w_mode=False)) is False
    assert adam_w_mode_of(torch.optim.Adam(p, amsgrad=True)) is None
    assert adam_w_mode_of(torch.optim.AdamW(p, maximize=True)) is None
    assert adam_w_mode_of(torch.optim.SGD(p, lr=0.1)) is None
    assert AdamEpilogue.for_optimizer(torch.optim.AdamW(p), torch.device("cpu")) is None


def test_engine_takes_the_epilogue_on_cuda_only() -> None:
    import deepspeed_c
    from tests.distributed.engine_models import MLP

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "bf16": {"enabled": True}}
    engine, *_ = deepspeed_c.initialize(model=MLP().bfloat16(), config=cfg)
    assert (engine.optimizer.epilogue is not None) == (engine.device.type == "cuda")
    engine.destroy()


def test_ranges_read_the_pre_step_count_and_advance_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """step_ranges (ZeRO's bucket-by-bucket step) on CPU with a stand-in kernel that does what the CUDA one
    does to its counter (+1 per call): every range sees the count before the step, the group's counter
    advances once, the ranges tile the partition in order with the group's hyperparameters, and after(k)
    follows range k's launch."""
    import inspect

    import deepspeed_c.ops.cuda_multi_tensor as cmt

    real = inspect.signature(cmt.fused_adam_epilogue_)
    seen: list[tuple] = []

    def kernel(*args: Any, **kwargs: Any) -> None:
        a = real.bind(*args, **kwargs).arguments  # the call must fit the real kernel's signature
        seen.append(("range", a["params"][0].numel(), float(a["step"]), a["lr"], a["weight_decay"],
                     a["loss_scale"]))
        a["step"] += 1.0

    monkeypatch.setattr(cmt, "fused_adam_epilogue_", kernel)
    p = torch.nn.Parameter(torch.zeros(10))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.02)
    epi = AdamEpilogue(opt, True)
    ranges = [(0, 4), (4, 7), (7, 10)]
    for _ in range(2):
        epi.step_ranges(0, torch.ones(10), ranges, [None] * 3, torch.ones(1), 2.0, 1.0,
                        lambda k: seen.append(("after", k)))
    want = []
    for i, count in zip(range(0, 12, 2), (0.0, 0.0, 0.0, 1.0, 1.0, 1.0)):
        k = (i // 2) % 3
        want += [("range", ranges[k][1] - ranges[k][0], count, 0.1, 0.02, 2.0), ("after", k)]
    assert seen == want
    assert float(epi._counters[0].device) == 2.0 and float(opt.state[p]["step"]) == 2.0


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused epilogue runs on CUDA")

STEPS, GAS, MICRO = 6, 2, 4
# DeepSpeed's config names: "Adam"/"AdamW" build FusedAdam; torch_adam picks torch's own
OPTIMIZERS = {"fused-adamw": ("AdamW", {}), "fused-adam-l2": ("Adam", {"adam_w_mode": False}),
              "torch-adamw": ("AdamW", {"torch_adam": True}),
              "torch-adam-l2": ("Adam", {"torch_adam": True, "adam_w_mode": False})}
CASES = [(stage, dtype, opt) for stage in (0, 1, 2) for dtype in ("bf16", "fp16", "fp32") for opt in OPTIMIZERS]


def _train(stage: int, dtype: str, opt: str, fused: bool, zero_extra: dict | None = None) -> dict[str, Any]:
    import deepspeed_c
    from tests.distributed.engine_models import MLP

    os.environ["DSC_FUSED_EPILOGUE"] = "1" if fused else "0"
    torch.manual_seed(0)
    model = MLP()
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
                           "gradient_clipping": 0.05, "steps_per_print": 10**9,
                           "optimizer": {"type": OPTIMIZERS[opt][0],
                                         "params": {"lr": 1e-2, "weight_decay": 0.1, **OPTIMIZERS[opt][1]}},
                           "zero_optimization": {"stage": stage, **(zero_extra or {})}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(3)
    norms = []
    dtype_ = next(model.parameters()).dtype
    for k in range(STEPS * GAS):
        x = torch.randn(MICRO, 12, generator=g).to(engine.device, dtype_)
        y = torch.randn(MICRO, 3, generator=g).to(engine.device)
        engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y))
        engine.step()
        if (k + 1) % GAS == 0:
            norms.append(engine.get_global_grad_norm())
    opt_ = engine.optimizer
    masters = ([m.detach().double().cpu() for m in opt_.fp32_partitions] if stage else
               [m.detach().double().cpu().reshape(-1) for g in opt_.fp32_groups for m in g]
               if hasattr(opt_, "fp32_groups") else [p.detach().double().cpu().reshape(-1) for p in model.parameters()])
    inner = opt_.optimizer if hasattr(opt_, "optimizer") else opt_
    steps = sorted({float(s["step"]) for s in inner.state.values()})
    state = inner.state_dict()
    engine.destroy()
    return {"masters": masters, "norms": norms, "steps": steps, "state": state,
            "epilogue": getattr(opt_, "epilogue", None) is not None}


@needs_cuda
@pytest.mark.parametrize("stage,dtype,opt", CASES, ids=[f"z{s}-{d}-{o}" for s, d, o in CASES])
def test_epilogue_matches_separate_passes(stage: int, dtype: str, opt: str) -> None:
    _compare(stage, dtype, opt, None)


# many buckets of uneven sizes, under an all-gather cap smaller than two buckets: the fused step's write-back
# goes out bucket by bucket exactly as the separate passes' does
BUCKETED = [(stage, dtype) for stage in (1, 2) for dtype in ("bf16", "fp16")]


@needs_cuda
@pytest.mark.parametrize("stage,dtype", BUCKETED, ids=[f"z{s}-{d}" for s, d in BUCKETED])
def test_epilogue_with_many_buckets_matches_separate_passes(stage: int, dtype: str) -> None:
    _compare(stage, dtype, "fused-adamw", {"reduce_bucket_size": 50, "allgather_bucket_size": 70})


def _compare(stage: int, dtype: str, opt: str, zero_extra: dict | None) -> None:
    try:
        fused = _train(stage, dtype, opt, fused=True, zero_extra=zero_extra)
        plain = _train(stage, dtype, opt, fused=False, zero_extra=zero_extra)
    finally:
        os.environ.pop("DSC_FUSED_EPILOGUE", None)
    # fp32 at stage 0 has no mixed-precision wrapper: the torch optimizer steps the model directly
    assert fused["epilogue"] == (stage > 0 or dtype != "fp32")
    assert not plain["epilogue"]
    for a, b in zip(fused["masters"], plain["masters"]):
        rel = float((a - b).norm() / b.norm())
        assert rel < 1e-5, rel
    for a, b in zip(fused["norms"], plain["norms"]):
        assert a is not None and b is not None
        assert abs(a - b) <= 1e-5 * abs(b), (a, b)
    assert fused["steps"] == plain["steps"]
    params = [torch.nn.Parameter(m.float()) for m in fused["masters"]] if stage else None
    if params is not None:  # torch's own AdamW reads the state the fused path left
        torch.optim.AdamW(params).load_state_dict(fused["state"])
