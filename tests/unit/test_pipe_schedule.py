"""Pipeline schedules from the C core, checked by an independent simulation in Python over every
(stages, micro_batches) up to (8, 32): sends meet their receives in order (FIFO per channel,
buffered sends, blocking receives: the engine's isend/irecv), no stage waits forever, each
micro-batch goes forward and backward exactly once per stage (per chunk), buffers are never
reused while a micro-batch still holds them, and the 1F1B / inference instruction streams equal
DeepSpeed's: the real DeepSpeed's when DSC_DEEPSPEED_REAL is set (from /tmp/ds_real), otherwise a
re-derivation of the documented order written here (forward of micro-batch b on stage s at step
2b + s, its backward at step 2b + 2S - 1 - s; exchanges before compute)."""
from __future__ import annotations

import os
import sys

import pytest

from deepspeed_c.runtime.pipe import schedule as sch

MAX_S, MAX_M = 8, 32


def names(steps):
    return [[repr(i) for i in step] for step in steps]


# ---- independent re-derivation of DeepSpeed's documented orders ---------------------------------
def ref_train(M, S, s):
    nbuf = max(2, min(S - s, M))
    total = 2 * (M + S - 1)
    fwd_at = {2 * b + s: b for b in range(M)}
    bwd_at = {2 * b + 2 * S - 1 - s: b for b in range(M)}
    out, prev = [], None
    for t in range(total):
        is_fwd = (t + s) % 2 == 0  # a stage alternates, even stages start with a forward
        cur = fwd_at.get(t) if is_fwd else bwd_at.get(t)
        cmds = []
        if is_fwd:
            if prev is not None and s > 0:
                cmds.append(f"SendGrad(buffer_id={prev % nbuf})")
            if cur is not None and s > 0:
                cmds.append(f"RecvActivation(buffer_id={cur % nbuf})")
        else:
            if cur is not None and s < S - 1:
                cmds.append(f"RecvGrad(buffer_id={cur % nbuf})")
            if prev is not None and s < S - 1:
                cmds.append(f"SendActivation(buffer_id={prev % nbuf})")
        if is_fwd and cur is not None and s in (0, S - 1):
            cmds.append(f"LoadMicroBatch(buffer_id={cur % nbuf})")
        if cur is not None:
            cmds.append(f"{'ForwardPass' if is_fwd else 'BackwardPass'}(buffer_id={cur % nbuf})")
        if t == total - 1:
            cmds += ["ReduceTiedGrads()", "ReduceGrads()", "OptimizerStep()"]
        out.append(cmds)
        prev = cur
    return out, nbuf


def ref_inference(M, S, s):
    out = []
    for t in range(M + S - 1):
        b = t - s  # micro-batch b reaches stage s on step b + s
        recv = t % 2 if s % 2 == 0 else (t + 1) % 2
        send = 1 - recv
        cmds = []
        if s in (0, S - 1) and 0 <= b < M:
            cmds.append(f"LoadMicroBatch(buffer_id={recv})")
        sends = [f"SendActivation(buffer_id={send})"] if s < S - 1 and 0 <= b - 1 < M else []
        recvs = [f"RecvActivation(buffer_id={recv})"] if s > 0 and 0 <= b < M else []
        cmds += sends + recvs if s % 2 == 0 else recvs + sends
        if 0 <= b < M:
            cmds.append(f"ForwardPass(buffer_id={recv})")
        out.append(cmds)
    return out


def deepspeed_schedules():
    sys.path[:0] = ["/tmp/ds_real", "/tmp/ds_deps"]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.pipe import schedule as ds

    return ds


# ---- simulation --------------------------------------------------------------------------------
def simulate(scheds, V=1, forward_only=False):
    """Runs all stages' instruction streams together; returns per-stage lists of executed
    (kind, chunk, micro_batch) compute events. Asserts matching and progress."""
    S = len(scheds)
    streams = [[i for step in s.steps() for i in step] for s in scheds]
    pcs = [0] * S
    chans: dict = {}  # (src, 'act'|'grad') -> list of (vs, mb)
    heads: dict = {}
    computed = [[] for _ in range(S)]
    holder = [dict() for _ in range(S)]  # buffer id -> (chunk, mb) holding it
    last_vs = S * V - 1
    while any(pcs[r] < len(streams[r]) for r in range(S)):
        progressed = False
        for r in range(S):
            while pcs[r] < len(streams[r]):
                ins = streams[r][pcs[r]]
                mb, chunk = ins.micro_batch_id, getattr(ins, "chunk", 0)
                vs = chunk * S + r
                n = ins.name
                if n in ("SendActivation", "SendGrad"):
                    key = (r, n)
                    chans.setdefault(key, []).append((vs, mb))
                    if forward_only:  # an inference buffer is free once its output is sent
                        assert holder[r].pop(ins.buffer_id) == (chunk, mb)
                elif n in ("RecvActivation", "RecvGrad"):
                    src = (r - 1) % S if n == "RecvActivation" else (r + 1) % S
                    key = (src, "SendActivation" if n == "RecvActivation" else "SendGrad")
                    q, h = chans.get(key, []), heads.get(key, 0)
                    if h == len(q):
                        break
                    heads[key] = h + 1
                    svs, smb = q[h]
                    assert smb == mb, f"stage {r} got micro-batch {smb}, expected {mb}"
                    assert svs == vs + (-1 if n == "RecvActivation" else 1)
                    if n == "RecvActivation":
                        assert ins.buffer_id not in holder[r], "buffer reused while held"
                        holder[r][ins.buffer_id] = (chunk, mb)
                elif n == "LoadMicroBatch":
                    if vs == 0:
                        assert ins.buffer_id not in holder[r], "buffer reused while held"
                        holder[r][ins.buffer_id] = (chunk, mb)
                    else:
                        assert vs == last_vs
                elif n in ("ForwardPass", "BackwardPass", "BackwardInputPass", "BackwardWeightPass"):
                    assert 0 <= ins.buffer_id < scheds[r].num_pipe_buffers()
                    assert holder[r].get(ins.buffer_id) == (chunk, mb), (r, ins, holder[r])
                    computed[r].append((n, chunk, mb))
                    if n in ("BackwardPass", "BackwardWeightPass") or (forward_only and vs == last_vs):
                        del holder[r][ins.buffer_id]
                pcs[r] += 1
                progressed = True
        assert progressed, f"deadlock at {[(r, pcs[r], len(streams[r])) for r in range(S)]}"
    for key, q in chans.items():
        assert heads.get(key, 0) == len(q), f"unreceived messages on {key}"
    return computed


def check_once_each(computed, M, V, kinds):
    for r, events in enumerate(computed):
        for k in kinds:
            got = sorted((c, mb) for (n, c, mb) in events if n == k)
            assert got == sorted((c, b) for c in range(V) for b in range(M)), (r, k)
        # backward of a micro-batch after its forward on the stage
        seen = set()
        for n, c, mb in events:
            if n == "ForwardPass":
                seen.add((c, mb))
            else:
                assert (c, mb) in seen


def test_train_and_inference_match_reference_and_simulate():
    ds = deepspeed_schedules() if os.environ.get("DSC_DEEPSPEED_REAL") else None
    for S in range(1, MAX_S + 1):
        for M in range(1, MAX_M + 1):
            train = [sch.TrainSchedule(M, S, s) for s in range(S)]
            for s in range(S):
                want, nbuf = ref_train(M, S, s)
                assert names(train[s].steps()) == want, (M, S, s)
                assert train[s].num_pipe_buffers() == nbuf
                assert names(sch.InferenceSchedule(M, S, s).steps()) == ref_inference(M, S, s)
                if ds is not None:
                    assert names(train[s].steps()) == names(ds.TrainSchedule(M, S, s).steps())
                    assert train[s].num_pipe_buffers() == ds.TrainSchedule(M, S, s).num_pipe_buffers()
                    assert names(sch.InferenceSchedule(M, S, s).steps()) == names(
                        ds.InferenceSchedule(M, S, s).steps())
            check_once_each(simulate(train), M, 1, ("ForwardPass", "BackwardPass"))
            check_once_each(simulate([sch.InferenceSchedule(M, S, s) for s in range(S)], forward_only=True), M, 1, ("ForwardPass",))


def test_iteration_protocol_and_data_parallel():
    s = sch.TrainSchedule(4, 2, 1)
    assert [names([x])[0] for x in s] == names(s.steps())  # iterating = steps()
    assert s.is_last_stage and not s.is_first_stage and s.num_stages == 2 and s.num_micro_batches == 4
    dp = sch.DataParallelSchedule(3, 1, 0)
    assert dp.num_pipe_buffers() == 1
    assert names(dp.steps())[-1] == ["LoadMicroBatch(buffer_id=0)", "ForwardPass(buffer_id=0)",
                                     "BackwardPass(buffer_id=0)", "ReduceGrads()", "OptimizerStep()"]


def test_interleaved_and_zero_bubble_simulate_and_beat_1f1b():
    for S in range(1, MAX_S + 1):
        for M in range(1, MAX_M + 1):
            zb = [sch.ZeroBubbleH1Schedule(M, S, s) for s in range(S)]
            check_once_each(simulate(zb), M, 1, ("ForwardPass", "BackwardInputPass", "BackwardWeightPass"))
            base = sch.TrainSchedule(M, S, 0).bubble_fraction()
            if S > 1:
                assert zb[0].bubble_fraction() < base, (M, S)
            for s in range(S):  # activation memory about 1F1B's: at most one more buffer
                assert zb[s].num_pipe_buffers() <= min(S - s, M) + 1
            for V in (2, 3):
                if M % S:
                    with pytest.raises(ValueError, match="multiple"):
                        sch.InterleavedSchedule(M, S, 0, V)
                    continue
                il = [sch.InterleavedSchedule(M, S, s, V) for s in range(S)]
                check_once_each(simulate(il, V), M, V, ("ForwardPass", "BackwardPass"))
                if S > 1:
                    assert il[0].bubble_fraction() < base, (M, S, V)


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="stage_id"):
        sch.TrainSchedule(4, 2, 2)
    with pytest.raises(ValueError, match="micro_batches"):
        sch.TrainSchedule(0, 2, 0)
    with pytest.raises(TypeError, match="micro_batches"):
        sch.TrainSchedule(4.0, 2, 0)
    with pytest.raises(ValueError, match="schedule"):
        sch.schedule_for("gpipe", 4, 2, 0)
