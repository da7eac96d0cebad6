"""ALST for Hugging Face models: a tiny LLaMA (transformers config, float64, GQA with 2 kv heads) trained by
the engine with Ulysses attention registered in transformers, UlyssesSPDataLoaderAdapter slicing each
rank's batches (variable lengths 16 / 8, prompt tokens labelled -100), against one process training the
same model with eager attention on the whole sequences (alst_models.reference).

One 4-rank run: SP 4 (fewer kv heads than ranks: kv heads replicated) at ZeRO 0 with full logits; DP 2 x
SP 2 with the mpu register_with_transformers returns at ZeRO 1; DP 2 x SP 2 from
initialize(mesh_param=(2, 2)) at ZeRO 2 with TiledMLP and TiledFusedLogitsLoss (the logits never whole);
DP 2 x SP 2 at ZeRO 3 (parameters partitioned over the 4 data x sequence ranks).

The per-rank loss is sum(token losses of the slice) / (good tokens of the whole sequence): the engine
sums gradients over a sequence-parallel group and averages over data-parallel replicas (DeepSpeed's
reduction), so one SGD step equals the reference's; SGD makes any gradient scale error show in the
weights. Gradients are all-reduced in fp32, hence the 1e-6 tolerances. Under DSC_TEST_BACKEND=nccl the
engine's model and the slices are on each rank's GPU; the reference stays on the host."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.distributed import alst_models as am
from tests.harness import run_distributed

STEPS, LR = 4, 1.0


def _ce_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                             ignore_index=-100, reduction="sum")


def _phase(rank: int, world: int, sp: int, stage: int, tiled: bool, use_mesh: bool) -> dict:
    import deepspeed_c
    from deepspeed_c.runtime.sequence_parallel.ulysses_sp import (TiledFusedLogitsLoss, UlyssesSPAttentionHF,
                                                                  UlyssesSPDataLoaderAdapter)
    from deepspeed_c.utils import groups

    dp = world // sp
    ref_losses, ref_weights = am.reference(STEPS, dp, sp, LR)
    model = am.llama("sdpa")
    if tiled:
        am.tile_mlps(model, shards=2)
    # a model object here, its config at the mesh phase (DeepSpeed takes a model or a name/path; a config
    # is deepspeed_c's addition)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model.config if use_mesh else model, "sdpa", sp, am.BATCH)
    cfg = {"train_micro_batch_size_per_gpu": am.BATCH, "zero_optimization": {"stage": stage},
           "steps_per_print": 10**9, "sequence_parallel_size": sp, "gradient_clipping": 0.0,
           "zero_allow_untested_optimizer": True}
    opt = lambda ps: torch.optim.SGD(ps, lr=LR)  # noqa: E731
    if use_mesh:
        engine, *_ = deepspeed_c.initialize(model=model, config=cfg, optimizer=opt, mesh_param=(dp, sp))
    else:
        engine, *_ = deepspeed_c.initialize(model=model, config=cfg, optimizer=opt, mpu=mpu)
    sp_group, sp_rank = groups._get_sequence_parallel_group(), groups._get_sequence_parallel_rank()
    assert groups._get_sequence_parallel_world_size() == sp and engine.train_batch_size() == am.BATCH * dp
    # DeepSpeed's engine attributes: the SP group, no model parallelism, ZeRO over the data x sequence ranks
    ranks = torch.distributed.get_process_group_ranks
    assert ranks(engine.seq_parallel_group) == ranks(sp_group) == ranks(engine.get_sequence_parallel_group())
    assert engine.mp_world_size == 1 and engine.checkpoint_mp_rank == 0 and engine.seq_dp_world_size == world == \
        torch.distributed.get_world_size(engine.seq_data_parallel_group)
    mine = [am.batch(rank, j) for j in range(-(-STEPS // sp))]
    loader = UlyssesSPDataLoaderAdapter(torch.utils.data.DataLoader(mine, batch_size=None), sp_rank=sp_rank,
                                        sp_group=sp_group, sp_world_size=sp, device=engine.device)
    replica = rank // sp
    start = _weights(engine, stage)
    losses, slice_err = [], 0.0
    for t in range(STEPS):
        b = next(loader)
        full = am.replica_batch(t, replica, sp)  # what the adapter must have cut this rank's slice from
        chunk = full["input_ids"].shape[1] // sp
        want_shift = torch.nn.functional.pad(full["labels"], (0, 1), value=-100)[:, 1:]
        for key, want in (("input_ids", full["input_ids"]), ("position_ids", full["position_ids"]),
                          ("shift_labels", want_shift)):
            slice_err += float((b[key] != want[:, sp_rank * chunk:(sp_rank + 1) * chunk]).sum())
        dev = engine.device  # the adapter hands out host tensors, as DeepSpeed's does
        ids, pos, target = b["input_ids"].to(dev), b["position_ids"].to(dev), b["shift_labels"].to(dev)
        if tiled:  # the logits exist one tile at a time
            hidden = engine.module.model(input_ids=ids, position_ids=pos).last_hidden_state
            head = engine.module.lm_head
            loss_sum = TiledFusedLogitsLoss.apply(lambda self, x, y: _ce_sum(self(x), y), head, hidden, target, None,
                                                  2, [head.weight], "sum")
        else:
            loss_sum = _ce_sum(engine(input_ids=ids, position_ids=pos).logits, target)
        good = (target != -100).sum().to(torch.float64)
        torch.distributed.all_reduce(good, group=sp_group)
        loss = loss_sum / good
        engine.backward(loss)
        engine.step()
        shown = loss.detach().clone()
        torch.distributed.all_reduce(shown)
        losses.append(shown.item() / dp)
    params = _weights(engine, stage)
    return {"loss_err": float(np.max(np.abs(np.array(losses) - np.array(ref_losses)))),
            "weight_err": max((p - r).abs().max().item() for p, r in zip(params, ref_weights)),
            "moved": max((p - s).abs().max().item() for p, s in zip(params, start)),
            "slice_err": slice_err}


def _weights(engine, stage: int) -> list[torch.Tensor]:
    """The whole parameters (gathered from their ZeRO-3 partitions at stage 3)."""
    import deepspeed_c

    params = list(engine.module.parameters())
    if stage < 3:
        return [p.detach().cpu().clone() for p in params]
    with deepspeed_c.zero.GatheredParameters(params):
        return [p.detach().cpu().clone() for p in params]


def _tiled_compute_check() -> float:
    """sequence_tiled_compute (3 uneven tiles of 7 positions, mean) against the untiled computation."""
    from deepspeed_c.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 5, generator=g, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(5, 5, generator=g))
    fn = lambda x, scale: torch.tanh(x @ w) * scale  # noqa: E731
    out = sequence_tiled_compute(fn, 7, 3, {"x": x}, {"scale": 2.0}, "x", [w])
    out.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad, w.grad = None, None
    ref = fn(x, 2.0).mean()
    ref.backward()
    return max((out - ref).abs().item(), (gx - x.grad).abs().max().item(), (gw - w.grad).abs().max().item())


def _errors(rank: int, world: int) -> list[str]:
    """Bad input raises ValueError on every rank (never a hang)."""
    from deepspeed_c.runtime.sequence_parallel import parallel_state_sp as mpu
    from deepspeed_c.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    caught = []
    odd = {"input_ids": torch.zeros(1, 6, dtype=torch.long), "position_ids": torch.arange(6)[None],
           "labels": torch.zeros(1, 6, dtype=torch.long)}  # 6 tokens: not a multiple of 4 at SP 4
    loader = UlyssesSPDataLoaderAdapter([odd] if world == 4 else [dict(odd, input_ids=odd["input_ids"][:, :5],
                                                                       position_ids=torch.arange(5)[None],
                                                                       labels=odd["labels"][:, :5])],
                                        mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_group(),
                                        world, "cpu")
    for what, call in (("seqlen", lambda: next(loader)),
                       ("eager", lambda: UlyssesSPAttentionHF.register_with_transformers(
                           am.llama("eager"), "eager", world, 1)),
                       ("heads", lambda: UlyssesSPAttentionHF(None, 1, world + 1, 4, world, 1,
                                                              mpu.get_sequence_parallel_group(), True))):
        with pytest.raises(ValueError) as info:
            call()
        caught.append(f"{what}: {info.value}")
    return caught


def body(rank: int, world: int) -> dict:
    from deepspeed_c.runtime.sequence_parallel import parallel_state_sp

    torch.set_default_dtype(torch.float64)
    out = {"sp4": _phase(rank, world, 4, stage=0, tiled=False, use_mesh=False)}
    out["errors"] = _errors(rank, world)
    parallel_state_sp._release_sequence_parallel_groups()  # the next phases lay out (dp 2, sp 2)
    out["dp2_sp2_zero1"] = _phase(rank, world, 2, stage=1, tiled=False, use_mesh=False)
    out["dp2_sp2_mesh_zero2_tiled"] = _phase(rank, world, 2, stage=2, tiled=True, use_mesh=True)
    out["dp2_sp2_zero3"] = _phase(rank, world, 2, stage=3, tiled=False, use_mesh=False)
    out["tiled_compute_err"] = _tiled_compute_check()
    return out


def test_alst_sp4_and_dp2_sp2_match_whole_sequence():
    # one 4-rank run for every check: each run pays for importing transformers on every rank
    results = run_distributed(body, 4, timeout=300)
    for r in results:
        for name, phase in r.items():
            if isinstance(phase, dict):
                assert phase["slice_err"] == 0, (name, phase)
                assert phase["moved"] > 1e-2, (name, phase)  # the weights trained
                assert phase["loss_err"] < 1e-6 and phase["weight_err"] < 1e-6, (name, phase)
        assert r["tiled_compute_err"] < 1e-12, r
        assert len(r["errors"]) == 3 and "divisible" in r["errors"][0], r["errors"]
