"""The comms logger on 2 real ranks: counts and message bytes for a known sequence of collectives,
prof_all / prof_ops / prof / enabled switching, debug names, and log_summary's table (with the
straggler breakdown, which must not hang when ranks logged different point-to-point ops)."""
from __future__ import annotations

import contextlib
import io

from tests.harness import run_distributed


def _counts(raw):
    return {name: {size: rec[0] for size, rec in by_size.items()} for name, by_size in raw.items()}


def _caller_for_debug(dc, t):
    dc.all_reduce(t)
    dc.reduce_scatter_tensor(t[:t.numel() // dc.get_world_size()], t)


def _body(rank: int, w: int) -> dict:
    import torch

    import deepspeed_c.comm as dc

    dc.configure(deepspeed_config={"comms_logger": {"enabled": True, "prof_all": True}})
    f32 = torch.zeros(10, dtype=torch.float32)
    for _ in range(3):
        dc.all_reduce(f32.clone())                                       # 40 B x3
    dc.all_reduce(torch.zeros(10, dtype=torch.float64))                  # 80 B
    for _ in range(2):
        dc.all_gather_into_tensor(torch.zeros(8 * w), torch.zeros(8))    # input 32 B x2
    dc.reduce_scatter_tensor(torch.zeros(16 // w, dtype=torch.bfloat16),
                             torch.zeros(16, dtype=torch.bfloat16))      # input 32 B
    dc.broadcast(torch.zeros(5, dtype=torch.float64), src=0)             # 40 B
    dc.barrier()                                                         # 0 B
    dc.all_reduce(f32.clone(), log_name="my_ar")                         # 40 B under its own name
    if rank == 0:
        dc.send(torch.zeros(3, dtype=torch.int64), 1)                    # 24 B, rank 0 only
    elif rank == 1:
        dc.recv(torch.zeros(3, dtype=torch.int64), 0)                    # 24 B, rank 1 only
    first = _counts(dc.comms_logger.get_raw_data())
    first_total = dc.get_comm_operation_count()

    raw = dc.comms_logger.get_raw_data()
    lat_ok = all(lat > 0 for by_size in raw.values() for rec in by_size.values() for lat in rec[1])
    ar = raw["all_reduce"][40]
    ratio = [busbw / algbw for algbw, busbw in zip(ar[2], ar[3])]

    # only the ops named in prof_ops, plus any call made with prof=True
    dc.reset_log()
    dc.configure(prof_all=False, prof_ops=["all_reduce"])
    dc.all_reduce(f32.clone())
    dc.broadcast(torch.zeros(5, dtype=torch.float64), src=0)
    dc.broadcast(torch.zeros(2, dtype=torch.float64), src=0, prof=True)
    dc.all_gather_into_tensor(torch.zeros(8 * w), torch.zeros(8))
    second = _counts(dc.comms_logger.get_raw_data())

    dc.reset_log()
    dc.configure(prof_all=True, debug=True)
    _caller_for_debug(dc, f32.clone())
    debug_names = dc.get_logged_comm_ops()

    dc.reset_log()
    dc.configure(enabled=False)
    dc.all_reduce(f32.clone())
    disabled_has_data = dc.has_comm_data()

    # summary: same sequence again, then the printed table on rank 0 and the dict on every rank
    dc.configure(enabled=True, prof_all=True, debug=False, prof_ops=[])
    for _ in range(3):
        dc.all_reduce(f32.clone())
    if rank == 0:
        dc.send(torch.zeros(3, dtype=torch.int64), 1)
    elif rank == 1:
        dc.recv(torch.zeros(3, dtype=torch.int64), 0)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        summary = dc.log_summary(show_straggler=True, return_dict=True)
    dc.configure(enabled=False)
    return {"first": first, "first_total": first_total, "lat_ok": lat_ok, "ratio": ratio, "second": second,
            "debug_names": debug_names, "disabled_has_data": disabled_has_data, "printed": buf.getvalue(),
            "summary_counts": {k: {s: v["count"] for s, v in d.items()} for k, d in summary["summary"].items()},
            "straggler": {k: {s: v["total_straggler_ms"] for s, v in d.items()}
                          for k, d in summary["straggler_analysis"].items()}}


def test_comms_logger_counts_bytes_and_summary():
    w = 2
    res = run_distributed(_body, w, timeout=180, backend="gloo")  # CPU tensors: gloo on any machine
    for rank, r in enumerate(res):
        want = {"all_reduce": {40: 3, 80: 1}, "all_gather_into_tensor": {32: 2}, "reduce_scatter_tensor": {32: 1},
                "broadcast": {40: 1}, "barrier": {0: 1}, "my_ar": {40: 1}}
        want.update({"send": {24: 1}} if rank == 0 else {"recv": {24: 1}})
        assert r["first"] == want, (rank, r["first"])
        assert r["first_total"] == sum(c for d in want.values() for c in d.values())
        assert r["lat_ok"]
        # all-reduce: busbw / algbw = (2(n-1)/n) / 2 = (n-1)/n
        assert all(abs(x - (w - 1) / w) < 1e-12 for x in r["ratio"])
        assert r["second"] == {"all_reduce": {40: 1}, "broadcast": {16: 1}}
        assert r["debug_names"] == ["all_reduce | [Caller Func: _caller_for_debug]",
                                    "reduce_scatter_tensor | [Caller Func: _caller_for_debug]"]
        assert r["disabled_has_data"] is False
        p2p = {"send": {24: 1}} if rank == 0 else {"recv": {24: 1}}
        assert r["summary_counts"] == {"all_reduce": {40: 3}, **p2p}
        assert all(v >= 0 for d in r["straggler"].values() for v in d.values())
    printed = res[0]["printed"].splitlines()
    assert printed[0].split() == ["Comm.", "Op", "Message", "Size", "Count", "Total", "Latency(ms)", "Avg",
                                  "Latency(ms)", "tput_avg", "(Gbps)", "busbw_avg", "(Gbps)"]
    assert printed[1] == "all_reduce"
    assert printed[2].split()[:3] == ["40.0", "B", "3"]
    assert "Breakdown with straggler effect" in res[0]["printed"]
    assert res[1]["printed"] == ""  # only rank 0 prints
