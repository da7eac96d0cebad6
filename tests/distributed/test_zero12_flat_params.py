"""ZeRO-1/2 model parameters live in one flat buffer per parameter group (runtime/zero/flat_model_params.py),
laid out as the group's partition plan, and the step's all-gathers write straight into it.
The engine's model checkpoints its activations (deepspeed_c.checkpointing) and has two outputs and a frozen bias.

Across real ranks (gloo, 2 and 4; NCCL under DSC_TEST_BACKEND=nccl): after initialize every trainable
parameter is a view of its group's buffer at the plan's offset (frozen ones are left alone); training with
a frozen bias, two outputs and gradient accumulation matches plain float64 AdamW on the global batch; when
something re-points the parameters' storage mid-training (`p.data = ...`, offload_states/reload_states) the
next step notices and the run goes on exactly as the undisturbed one (a stale buffer would leave the
re-pointed parameters un-updated); a checkpoint's module file holds each weight in its own bytes (no flat
buffer in the file) with the model's values."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.harness import rank_device, run_distributed

STEPS, DISTURB_AT, GAS, MICRO, LR, CLIP = 6, 3, 2, 2, 1e-2, 0.05


class TwoHeads(torch.nn.Module):

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.body = torch.nn.Linear(12, 24)
        self.mid = torch.nn.Linear(24, 24)
        self.head_a = torch.nn.Linear(24, 3)
        self.head_b = torch.nn.Linear(24, 5)
        self.body.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        # activation checkpointing (DeepSpeed's API; its input requires grad, as a transformer block's
        # hidden states do) on the engine's side only
        if self.checkpointed:
            import deepspeed_c

            h = deepspeed_c.checkpointing.checkpoint(lambda t: torch.tanh(self.mid(t)), h)
        else:
            h = torch.tanh(self.mid(h))
        return self.head_a(h), self.head_b(h)


def _loss(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    a, b = out
    return a.pow(2).mean() + 0.5 * b.sin().sum() / b.shape[0]


def _batch(rank: int, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(MICRO, 12, generator=g)


def _reference(world: int) -> dict[str, torch.Tensor]:
    """float64 single process: the gradient is the mean over ranks and micro-steps of each micro-loss's,
    clipped by its global norm."""
    torch.manual_seed(0)
    model = TwoHeads().double()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(world):
            for m in range(GAS):
                (_loss(model(_batch(rank, step, m).double())) / (world * GAS)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # DeepSpeed's rule: max / (norm + 1e-6)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _body(rank: int, world: int, stage: int, disturb: str, save_dir: str, dtype: str = "fp32") -> dict[str, Any]:
    import deepspeed_c
    from deepspeed_c.utils import safe_get_full_fp32_param

    torch.manual_seed(0)
    model = TwoHeads(checkpointed=True)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, "gradient_clipping": CLIP,
           "bf16": {"enabled": dtype == "bf16"},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 200}}
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    opt = engine.optimizer
    res: dict[str, Any] = {"views": [], "frozen_alone": True}
    for params, plan in zip(getattr(opt, "bit16_groups", []), getattr(opt, "partition_plans", [])):
        base = params[0].untyped_storage().data_ptr()
        res["views"] += [p.untyped_storage().data_ptr() == base and
                         p.data_ptr() == base + off * p.element_size() for p, off in zip(params, plan.param_offset)]
    bias = model.body.bias
    res["frozen_alone"] = bias.untyped_storage().nbytes() == bias.numel() * bias.element_size()
    dev = rank_device()
    losses = []
    for step in range(STEPS):
        if step == DISTURB_AT and disturb == "repoint":
            for p in model.parameters():
                p.data = p.data.clone()
        if step == DISTURB_AT and disturb == "offload":
            engine.offload_states()
            engine.reload_states()
        for m in range(GAS):
            x = _batch(rank, step, m).to(dev)
            loss = engine(x.bfloat16() if dtype == "bf16" else x)
            loss = _loss(loss)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    res["losses"] = losses
    # every rank's model weights are exactly its masters (all ranks' partitions) in the model dtype
    # a list, not a short-circuiting all(): each safe_get_full_fp32_param is a collective every rank must call
    masters_equal = [torch.equal(p.detach(), safe_get_full_fp32_param(p).to(p.dtype))
                     for p in model.parameters() if p.requires_grad]
    res["model_is_masters"] = all(masters_equal)
    # plain lists: tensors would travel back through shared memory the exiting rank takes with it
    res["weights"] = {n: p.detach().double().cpu().tolist() for n, p in model.named_parameters()}
    if save_dir:
        engine.save_checkpoint(save_dir, tag="t")
        if rank == 0:
            sd = torch.load(os.path.join(save_dir, "t", "mp_rank_00_model_states.pt"), weights_only=False)["module"]
            res["saved_own_bytes"] = all(t.untyped_storage().nbytes() == t.numel() * t.element_size()
                                         for t in sd.values())
            res["saved_equal"] = all(torch.equal(sd[n].cpu(), p.detach().cpu()) for n, p in model.named_parameters())
    return res


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_flat_params_train_like_float64_adamw(world: int, stage: int, dtype: str, tmp_path: Any) -> None:
    ref = _reference(world)
    runs = run_distributed(_body, world, args=(stage, "none", str(tmp_path), dtype), timeout=180)
    for r in runs:
        assert r["views"] and all(r["views"]), r["views"]
        assert r["frozen_alone"] and r["model_is_masters"]
        for n, w in ref.items():
            got = torch.tensor(r["weights"][n], dtype=torch.float64)
            # bf16: forward and gradients in 16 bits (the masters and the update stay fp32)
            assert _rel(got, w) < (1e-5 if dtype == "fp32" else 3e-2), (n, _rel(got, w))
    assert runs[0]["saved_own_bytes"] and runs[0]["saved_equal"]


@pytest.mark.parametrize("disturb", ["repoint", "offload"])
@pytest.mark.parametrize("stage", [1, 2])
def test_repointed_params_are_flattened_again(stage: int, disturb: str) -> None:
    calm = run_distributed(_body, 2, args=(stage, "none", ""), timeout=180)
    moved = run_distributed(_body, 2, args=(stage, disturb, ""), timeout=180)
    for c, m in zip(calm, moved):
        assert m["losses"] == c["losses"], (m["losses"], c["losses"])
        assert m["weights"] == c["weights"]


def test_flat_buffer_views_refresh_and_fallback() -> None:
    """One process, the class alone: views at the plan's offsets keep the values; a re-pointed parameter
    is taken back in with its new values; a group of mixed dtypes (or a tensor subclass) stays as it is."""
    from deepspeed_c.ops.partition import DEEPSPEED_ALIGNMENT, PartitionPlan
    from deepspeed_c.runtime.zero.flat_model_params import FlatModelParams

    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 300, 7)]
    values = [p.detach().clone() for p in params]
    plan = PartitionPlan.build([p.numel() for p in params], 4, 128, DEEPSPEED_ALIGNMENT, [2, 1, 0])
    flat = FlatModelParams([plan], [params])
    flat.ensure()
    buf = flat.buffers[0]
    assert buf is not None and buf.numel() == plan.runtime_total
    for p, v, off in zip(params, values, plan.param_offset):
        assert p.data_ptr() == buf.data_ptr() + off * 4 and torch.equal(p.detach(), v)
    slot = flat.own_slot(0, 0, 3, 4)
    assert slot is not None and slot.numel() == plan.bucket_size[0] // 4
    params[1].data = torch.full((300,), 7.0)
    flat.ensure()
    assert flat.buffers[0] is not buf and torch.equal(params[1].detach(), torch.full((300,), 7.0))
    assert params[1].data_ptr() == flat.buffers[0].data_ptr() + plan.param_offset[1] * 4
    mixed = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4, dtype=torch.float64))]
    ptrs = [p.data_ptr() for p in mixed]
    other = FlatModelParams([PartitionPlan.build([4, 4], 2, 64, DEEPSPEED_ALIGNMENT, [1, 0])], [mixed])
    other.ensure()
    assert other.bucket(0, 0) is None and [p.data_ptr() for p in mixed] == ptrs
