"""SuperOffload at ZeRO-3 on 2 real gloo ranks through deepspeed_c.initialize (a tiny GPT), against plain
ZeRO-3 offload on the same config: the speculative host step commits when the step is taken unclipped, and
is rolled back to its snapshot (then stepped the ordinary way) when gradient clipping scales the gradient or
an fp16 overflow skips the step; after a clipped step the next backward does not speculate (the ordinary
step), until a step is taken unclipped again. Either way the losses and weights equal the non-speculative run
bit for bit, and the speculation counters say which path each step took. Every run of the module shares one
launch (tests/shared_launch.py: the 2-rank cases, then the refused config on 1 rank)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.distributed.zenflow_models import ds_config, flat_weights, resume_run, train
from tests.shared_launch import run_worlds

STEPS = 6


def gathered_weights(engine) -> np.ndarray:
    """The whole model's weights through GatheredParameters (ZeRO-3's gather outside a forward)."""
    import deepspeed_c
    import torch

    params = list(engine.module.parameters())
    with deepspeed_c.zero.GatheredParameters(params):
        return torch.cat([p.detach().float().reshape(-1).cpu() for p in params]).numpy()


def _body(rank: int, world: int, clip: float, fp16: bool, ratio: float = 1.0) -> dict:
    def cfg(super_offload: bool) -> dict:
        off = {"device": "cpu", "super_offload": super_offload}
        if super_offload and ratio < 1.0:
            off["ratio"] = ratio
        c = ds_config(3, offload=off, clip=clip)
        if fp16:  # 2^20 overflows the first steps' fp16 gradients: skipped steps, then a lower scale
            c["fp16"] = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 1000}
        return c

    plain, e0 = train(rank, world, cfg(False), STEPS)
    w0 = gathered_weights(e0)
    switch = [sys.getswitchinterval()]
    spec, e1 = train(rank, world, cfg(True), STEPS)
    assert type(e1.optimizer).__name__ == "SuperOffloadOptimizer_Stage3"
    w1 = gathered_weights(e1)  # read while the last step is still deferred: GatheredParameters takes it first
    stats = e1.optimizer.speculation_stats()
    skipped = e1.skipped_steps
    switch.append(sys.getswitchinterval())
    e1.destroy()
    switch.append(sys.getswitchinterval())
    return {"plain": plain, "spec": spec, "w0": w0, "w1": w1, "stats": stats, "skipped": skipped, "switch": switch}


def _cases(rank: int, world: int, cases: list) -> dict:
    """Each case (id, body, its args) in turn on the same ranks; each builds its own engines."""
    return {cid: fn(rank, world, *args) for cid, fn, args in cases}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run of the module in one launch, by id: per id, the results of its ranks."""
    root = tmp_path_factory.mktemp("so")
    two = [(("spec", clip, fp16), _body, (clip, fp16)) for clip, fp16 in ((0.0, False), (1e-3, False), (1.0, False),
                                                                          (0.0, True))]
    two += [(("ratio", clip), _body, (clip, False, 0.5)) for clip in (0.0, 1e-3)]
    two += [(("zero_grad", clip), _zero_grad_body, (clip,)) for clip in (1.0, 0.0)]
    two += [(("resume", ratio), _resume_body, (str(root / f"ck{ratio}"), ratio)) for ratio in (1.0, 0.5)]
    one = [("below_stage_3", _bad_body, ())]
    out: dict = {}
    for cases, per_rank in zip((two, one), run_worlds([(2, _cases, (two,)), (1, _cases, (one,))], timeout=900)):
        for cid, _, _ in cases:
            out[cid] = [r[cid] for r in per_rank]
    return out


@pytest.mark.parametrize("clip,fp16,expect", [
    (0.0, False, "commits"), (1e-3, False, "rollbacks"), (1.0, False, "mixed"), (0.0, True, "overflow")],
    ids=["no-clip", "always-clipped", "clip-1", "fp16-overflow"])
def test_speculation_equals_plain_offload(runs, clip, fp16, expect):
    out = runs[("spec", clip, fp16)]
    for r in out:
        np.testing.assert_array_equal(r["spec"], r["plain"])
        np.testing.assert_array_equal(r["w1"], r["w0"])
    for r in out:  # the worker's GIL waits bounded while the engine lives; the process's interval back at destroy
        before, during, after = r["switch"]
        assert during == min(before, 5e-4) and after == before, r["switch"]
    st = out[0]["stats"]
    assert st["deferred_steps"] == STEPS - out[0]["skipped"], st  # every step taken returned before the host was done
    if expect == "commits":
        assert (st["commits"], st["rollbacks"]) == (STEPS, 0), st
    elif expect == "rollbacks":  # the first clipped step stops the speculation: the others step the ordinary way
        assert (st["commits"], st["rollbacks"], st["plain_steps"]) == (0, 1, STEPS - 1), st
    elif expect == "overflow":
        assert out[0]["skipped"] > 0 and st["rollbacks"] >= out[0]["skipped"], (st, out[0]["skipped"])
    else:
        assert st["commits"] + st["rollbacks"] + st["plain_steps"] >= STEPS, st


@pytest.mark.parametrize("clip", [0.0, 1e-3], ids=["commits", "rollbacks"])
def test_ratio_steps_a_share_on_the_device(runs, clip):
    """offload_optimizer.ratio 0.5: the groups' first buckets (about half the state) stepped on the device, the
    rest speculatively on the host: still plain ZeRO-3 offload's run bit for bit (on a CPU run the device share
    takes the same C kernel)."""
    out = runs[("ratio", clip)]
    assert out[0]["stats"]["device_elements"] > 0, out[0]["stats"]
    for r in out:
        np.testing.assert_array_equal(r["spec"], r["plain"])
        np.testing.assert_array_equal(r["w1"], r["w0"])


def _bad_body(rank: int, world: int) -> str:
    import deepspeed_c

    from tests.distributed.zenflow_models import make_gpt

    try:
        deepspeed_c.initialize(model=make_gpt(), config=ds_config(2, offload={"device": "cpu", "super_offload": True}))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "accepted"


def test_super_offload_below_stage_3_is_refused(runs):
    msg = runs["below_stage_3"][0]
    assert "zero_optimization.offload_optimizer.super_offload' needs ZeRO stage 3" in msg, msg


def _zero_grad_body(rank: int, world: int, clip: float) -> dict:
    """A backward whose step never comes (zero_grad instead): the speculative update is undone, so the next
    steps equal a run that never had that backward (with a snapshot bit for bit; without one, when nothing
    could have rolled the step back, by inverting the update: within fp32 rounding)."""
    from tests.distributed.zenflow_models import batch

    cfg = ds_config(3, offload={"device": "cpu", "super_offload": True}, clip=clip)
    ref, e0 = train(rank, world, cfg, 3)
    w0 = flat_weights(e0).numpy()
    e0.destroy()
    _, e1 = train(rank, world, cfg, 0)
    x, y = batch(99, rank, world)
    e1.backward(e1(x, y))
    e1.optimizer.zero_grad()
    got, e1 = train(rank, world, cfg, 3, engine=e1)
    w1 = flat_weights(e1).numpy()
    e1.destroy()
    return {"ref": ref, "got": got, "w0": w0, "w1": w1}


@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["snapshot", "inverse"])
def test_zero_grad_without_step_undoes_the_speculation(runs, clip):
    out = runs[("zero_grad", clip)]
    for r in out:
        if clip:
            np.testing.assert_array_equal(r["got"], r["ref"])
            np.testing.assert_array_equal(r["w1"], r["w0"])
        else:
            np.testing.assert_allclose(r["got"], r["ref"], rtol=1e-5)
            np.testing.assert_allclose(r["w1"], r["w0"], rtol=1e-4, atol=1e-5)


def _resume_body(rank: int, world: int, ckpt: str, ratio: float) -> dict:
    """Masters and moments whose storage the commits swapped save and load like any: a resumed run equals the
    uninterrupted one."""
    cfg = ds_config(3, offload={"device": "cpu", "super_offload": True, "ratio": ratio}, clip=1.0)
    return resume_run(rank, world, cfg, 8, 4, ckpt, "so")


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_checkpoint_resumes(runs, ratio):
    out = runs[("resume", ratio)]
    for r in out:
        np.testing.assert_array_equal(r["resumed"], r["full"])
        np.testing.assert_array_equal(r["w_res"], r["w_full"])
