"""Comms logger pieces that need no process group: bandwidth formulas, sizes, the config model,
configure() in its several forms, the summary table, the timeout variable, ReduceOp mapping."""
from __future__ import annotations

import io
from datetime import timedelta

import pydantic
import pytest
import torch.distributed as dist

import deepspeed_c.comm as dc
from deepspeed_c.comm.comms_logging import CommsLogger, calc_bw_log, convert_size, trim_mean
from deepspeed_c.comm.config import CommsLoggerConfig, DeepSpeedCommsConfig


@pytest.fixture(autouse=True)
def _restore_logger():
    lg = dc.comms_logger
    saved = (lg.enabled, lg.prof_all, list(lg.prof_ops), lg.verbose, lg.debug)
    yield
    lg.enabled, lg.prof_all, lg.prof_ops, lg.verbose, lg.debug = saved
    lg.reset_data()


# nccl-tests' definitions: algbw = bytes moved by the op's definition / time; busbw = algbw * factor
@pytest.mark.parametrize("op,n,alg_bytes,factor", [
    ("all_reduce", 4, lambda s, n: 2 * s, lambda n: (n - 1) / n),  # DeepSpeed counts all-reduce algbw as 2S/t
    ("inference_all_reduce", 8, lambda s, n: 2 * s, lambda n: (n - 1) / n),
    ("all_gather_into_tensor", 4, lambda s, n: s * n, lambda n: (n - 1) / n),
    ("all_gather", 2, lambda s, n: s * n, lambda n: (n - 1) / n),
    ("reduce_scatter_tensor", 4, lambda s, n: s, lambda n: (n - 1) / n),
    ("all_to_all_single", 8, lambda s, n: s, lambda n: (n - 1) / n),
    ("broadcast", 4, lambda s, n: s, lambda n: 1.0),
    ("send", 2, lambda s, n: s, lambda n: 1.0),
    ("barrier", 4, lambda s, n: s, lambda n: 1.0),
])
def test_bandwidth_formulas(op, n, alg_bytes, factor):
    size, ms = 3_000_000, 1.5
    algbw, busbw = calc_bw_log(op, size, ms, n)
    seconds = ms / 1e3
    want_alg = alg_bytes(size, n) / seconds * 8 / 1e9  # Gbit/s
    assert algbw == pytest.approx(want_alg, rel=1e-12)
    if op.endswith("all_reduce"):
        assert busbw == pytest.approx(size / seconds * 8 / 1e9 * 2 * (n - 1) / n, rel=1e-12)
    else:
        assert busbw == pytest.approx(want_alg * factor(n), rel=1e-12)
    assert calc_bw_log(op, size, 0.0, n) == (0.0, 0.0)


def test_convert_size_and_trim_mean():
    assert convert_size(0) == "0B"
    assert convert_size(40) == "40.0 B"
    assert convert_size(1536) == "1.5 KB"
    assert convert_size(3 * 1024 ** 3) == "3.0 GB"
    assert trim_mean([], 0.1) == 0
    assert trim_mean([1.0, 2.0, 3.0], 0.1) == pytest.approx(2.0)
    data = [100.0] + [1.0] * 8 + [-50.0]  # 10 values: one dropped at each end
    assert trim_mean(data, 0.1) == pytest.approx(1.0)


def test_utils_comms_logging_path():
    # DeepSpeed keeps the logger at deepspeed.utils.comms_logging; scripts import it from there
    from deepspeed_c.utils import comms_logging as ucl

    assert ucl.CommsLogger is CommsLogger and ucl.convert_size is convert_size
    assert ucl.calc_bw_log("all_reduce", 1000.0, 2.0) == calc_bw_log("all_reduce", 1000.0, 2.0, 1)
    lg = ucl.CommsLogger()
    lg.start_profiling_comms()
    assert lg.prof_all is True
    lg.stop_profiling_comms()
    assert lg.prof_all is False


def test_config_defaults_and_validation():
    c = CommsLoggerConfig()
    assert (c.enabled, c.verbose, c.prof_all, c.prof_ops, c.debug) == (False, False, True, [], False)
    c = CommsLoggerConfig(enabled=True, prof_ops="all_reduce")
    assert c.prof_ops == ["all_reduce"]
    with pytest.raises(pydantic.ValidationError, match="prof_alll"):
        CommsLoggerConfig(prof_alll=True)
    with pytest.raises(pydantic.ValidationError, match="enabled"):
        CommsLoggerConfig(enabled="maybe")
    holder = DeepSpeedCommsConfig({"train_batch_size": 8})
    assert holder.comms_logger_enabled is False


@pytest.mark.parametrize("form", ["whole", "section", "typed", "holder", "engine"])
def test_configure_forms(form):
    section = {"enabled": True, "verbose": False, "prof_all": False, "prof_ops": ["all_gather"], "debug": True}
    cfg = {
        "whole": {"train_batch_size": 4, "comms_logger": section},
        "section": section,
        "typed": CommsLoggerConfig(**section),
        "holder": DeepSpeedCommsConfig({"comms_logger": section}),
        "engine": type("Cfg", (), {"comms_config": DeepSpeedCommsConfig({"comms_logger": section})})(),
    }[form]
    dc.configure(deepspeed_config=cfg)
    lg = dc.comms_logger
    assert (lg.enabled, lg.prof_all, lg.prof_ops, lg.debug) == (True, False, ["all_gather"], True)
    dc.configure(prof_all=True, prof_ops=["x"], verbose=True, debug=False, enabled=False)
    assert (lg.enabled, lg.prof_all, lg.prof_ops, lg.verbose, lg.debug) == (False, True, ["x"], True, False)


def test_configure_section_disabled_stays_off():
    dc.configure(deepspeed_config={"comms_logger": {"enabled": False, "prof_all": False}})
    assert dc.comms_logger.enabled is False
    with pytest.raises(TypeError, match="CommsLoggerConfig"):
        dc.configure(deepspeed_config=42)


def test_summary_table_and_dict():
    lg = CommsLogger()
    lg.world_size_fn = lambda: 4
    for ms in (1.0, 2.0, 3.0):
        lg.append("all_reduce", "all_reduce", ms, 4000)
    lg.append("all_reduce", "all_reduce", 5.0, 8)
    lg.append("broadcast", "broadcast", 0.5, 1024)
    assert lg.get_total_operations() == 5
    assert lg.get_operation_names() == ["all_reduce", "broadcast"]
    buf = io.StringIO()
    out = lg.log_all(print_log=True, return_dict=True, file=buf, world_size=4)
    text = buf.getvalue().splitlines()
    for col in ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
                "busbw_avg (Gbps)"):
        assert col in text[0]
    assert text[1] == "all_reduce"
    # rows sorted by size within an op: 8 B first, then 3.91 KB
    assert text[2].split()[:4] == ["8.0", "B", "1", "5.00"]
    assert text[3].split()[:5] == ["3.91", "KB", "3", "6.00", "2.00"]
    row = out["summary"]["all_reduce"][4000]
    assert row["count"] == 3 and row["total_latency_ms"] == pytest.approx(6.0)
    want_alg = [2 * 4000 / (ms / 1e3) * 8 / 1e9 for ms in (1.0, 2.0, 3.0)]
    assert row["tput_avg_gbps"] == pytest.approx(sum(want_alg) / 3)
    assert row["busbw_avg_gbps"] == pytest.approx(sum(want_alg) / 3 * 3 / 4)
    assert out["summary"]["broadcast"][1024]["msg_size_str"] == "1.0 KB"
    assert out["straggler_analysis"] is None and out["metadata"]["world_size"] == 4
    strag = lg.log_all(print_log=False, show_straggler=True, return_dict=True,
                       gather_all=lambda mine: [mine, {("all_reduce", 4000): [0.5, 2.0, 1.0]}])
    s = strag["straggler_analysis"]["all_reduce"][4000]
    assert s["total_comm_lat_ms"] == pytest.approx(0.5 + 2.0 + 1.0)
    assert s["total_straggler_ms"] == pytest.approx(0.5 + 0.0 + 2.0)
    lg.reset_data()
    assert not lg.has_data()


def test_timeout_env(monkeypatch):
    from deepspeed_c.comm.constants import timeout_from_env

    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
    assert timeout_from_env() == timedelta(minutes=30)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "25")
    assert timeout_from_env() == timedelta(minutes=25)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DEEPSPEED_TIMEOUT"):
        timeout_from_env()


def test_reduce_op_mapping():
    from deepspeed_c.comm.reduce_op import is_avg, to_torch_op

    for name in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"):
        assert to_torch_op(getattr(dc.ReduceOp, name)) == getattr(dist.ReduceOp, name)
    assert to_torch_op(dist.ReduceOp.MAX) == dist.ReduceOp.MAX
    assert is_avg(dc.ReduceOp.AVG) and is_avg(dist.ReduceOp.AVG) and not is_avg(dc.ReduceOp.SUM)
    with pytest.raises(ValueError, match="UNUSED"):
        to_torch_op(dc.ReduceOp.UNUSED)


def test_uninitialised_calls_assert():
    # tests never build a process group in the pytest process itself; they spawn ranks
    assert dc.is_initialized() is False and dc.is_available() is True
    with pytest.raises(AssertionError, match="init"):
        dc.get_rank()
