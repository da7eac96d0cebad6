"""The comms logger: per-op call counts, message bytes, latency and bandwidth, and the summary
table `deepspeed_c.comm.log_summary()` prints.

Records are keyed by log name, then by message size in bytes, as DeepSpeed's are, so a summary
row is one (op, size) pair. Latencies are in milliseconds; bandwidths in Gbps.
"""
from __future__ import annotations

import math
import sys
from datetime import datetime
from typing import Any, Callable

from deepspeed_c.comm.constants import (COMMS_LOGGER_DEBUG_DEFAULT, COMMS_LOGGER_ENABLED_DEFAULT,
                                        COMMS_LOGGER_PROF_ALL_DEFAULT, COMMS_LOGGER_VERBOSE_DEFAULT)

_SIZE_UNITS = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")

# ops whose logged size is one rank's input, which every rank contributes
_GATHER_OPS = frozenset({"all_gather", "all_gather_into_tensor", "allgather_fn"})
# ops whose logged size is already the whole exchanged buffer
_SCATTER_OPS = frozenset({"reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_fn",
                          "all_to_all_single", "all_to_all"})
_ALLREDUCE_OPS = frozenset({"all_reduce", "all_reduce_coalesced", "inference_all_reduce"})
_P2P_LIKE_OPS = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv", "broadcast",
                           "broadcast_object_list", "reduce", "gather", "scatter", "barrier",
                           "monitored_barrier", "all_gather_object"})


def convert_size(size_bytes: float) -> str:
    """Human-readable byte count in powers of 1024, two decimals: 1536 -> '1.5 KB'."""
    if size_bytes <= 0:
        return "0B"
    i = min(int(math.floor(math.log(size_bytes, 1024))), len(_SIZE_UNITS) - 1)
    return f"{round(size_bytes / math.pow(1024, i), 2)} {_SIZE_UNITS[i]}"


def trim_mean(data: list[float], trim_percent: float) -> float:
    """Mean after dropping round(n * trim_percent) values from each end (0 for no data)."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_percent must be in [0, 1], got {trim_percent}")
    n = len(data)
    if n == 0:
        return 0.0
    ordered = sorted(data)
    k = int(round(n * trim_percent))
    kept = ordered[k:n - k] or ordered  # trimming everything would leave nothing to average
    return sum(kept) / len(kept)


def calc_bw_log(comm_op: str, size: float, duration_ms: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in Gbps for one op of `size` logged bytes taking `duration_ms`.

    The bus-bandwidth factors are the ones nccl-tests uses: (n-1)/n for gathers, scatters and
    all-to-all, 2(n-1)/n for all-reduce, 1 for rooted and point-to-point ops.
    """
    n = max(int(world_size), 1)
    if duration_ms <= 0:
        return 0.0, 0.0
    if comm_op in _GATHER_OPS:
        size *= n
        algbw = size / duration_ms
        busbw = algbw * (n - 1) / n
    elif comm_op in _SCATTER_OPS:
        algbw = size / duration_ms
        busbw = algbw * (n - 1) / n
    elif comm_op in _ALLREDUCE_OPS:
        algbw = size * 2 / duration_ms
        busbw = (size / duration_ms) * (2 * (n - 1) / n)
    else:  # rooted, point-to-point and anything unknown: the bytes moved once
        algbw = size / duration_ms
        busbw = algbw
    # bytes per millisecond -> gigabits per second
    return algbw * 8 / 1e6, busbw * 8 / 1e6


class CommsLogger:
    """Collects one record per logged collective. Switched by configure(); cheap when off (the
    comm wrappers test `enabled` before doing anything else)."""

    def __init__(self) -> None:
        self.comms_dict: dict[str, dict[int, list[Any]]] = {}
        self.verbose: bool = COMMS_LOGGER_VERBOSE_DEFAULT
        self.debug: bool = COMMS_LOGGER_DEBUG_DEFAULT
        self.prof_ops: list[str] = []
        self.prof_all: bool = COMMS_LOGGER_PROF_ALL_DEFAULT
        self.enabled: bool = COMMS_LOGGER_ENABLED_DEFAULT
        # world size used for busbw; set by the comm module so this file needs no torch
        self.world_size_fn: Callable[[], int] = lambda: 1

    def configure(self, comms_config: Any) -> None:
        """Take a DeepSpeedCommsConfig-like object (comms_logger_enabled, comms_logger)."""
        section = getattr(comms_config, "comms_logger", None)
        present = bool(getattr(comms_config, "comms_logger_enabled", section is not None))
        self.enabled = present and bool(getattr(section, "enabled", True))
        if self.enabled and section is not None:
            self.verbose = bool(section.verbose)
            self.debug = bool(section.debug)
            self.prof_ops = list(section.prof_ops)
            self.prof_all = bool(section.prof_all)

    def should_profile(self, prof: bool, log_name: str) -> bool:
        return bool(prof) or self.prof_all or log_name in self.prof_ops

    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = list(dict.fromkeys(list(self.prof_ops) + list(op_name_list)))

    def stop_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def append(self, raw_name: str, record_name: str, latency_ms: float, msg_size: int) -> None:
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency_ms, self.world_size_fn())
        by_size = self.comms_dict.setdefault(record_name, {})
        rec = by_size.get(msg_size)
        if rec is None:
            by_size[msg_size] = [1, [latency_ms], [algbw], [busbw]]
        else:
            rec[0] += 1
            rec[1].append(latency_ms)
            rec[2].append(algbw)
            rec[3].append(busbw)
        if self.verbose:
            from deepspeed_c.utils.logging import log_dist

            log_dist(f"comm op: {record_name} | time (ms): {latency_ms:.2f} | msg size: {convert_size(msg_size)} | "
                     f"algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}", [0])

    # ---- queries -------------------------------------------------------------------------
    def get_raw_data(self) -> dict[str, dict[int, list[Any]]]:
        return {name: {size: [r[0], list(r[1]), list(r[2]), list(r[3])] for size, r in by_size.items()}
                for name, by_size in self.comms_dict.items()}

    def has_data(self) -> bool:
        return len(self.comms_dict) > 0

    def reset_data(self) -> None:
        self.comms_dict.clear()

    def get_operation_names(self) -> list[str]:
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        return sum(rec[0] for by_size in self.comms_dict.values() for rec in by_size.values())

    @staticmethod
    def _row(msg_size: int, rec: list[Any]) -> dict[str, Any]:
        return {
            "count": rec[0],
            "total_latency_ms": sum(rec[1]),
            "avg_latency_ms": trim_mean(rec[1], 0.1),
            "tput_avg_gbps": trim_mean(rec[2], 0.1),
            "busbw_avg_gbps": trim_mean(rec[3], 0.1),
            "msg_size_bytes": msg_size,
            "msg_size_str": convert_size(msg_size),
        }

    def get_operation_summary(self, operation_name: str) -> dict[int, dict[str, Any]] | None:
        by_size = self.comms_dict.get(operation_name)
        if by_size is None:
            return None
        return {size: self._row(size, rec) for size, rec in sorted(by_size.items())}

    # ---- the summary table ---------------------------------------------------------------
    def log_all(self, print_log: bool = True, show_straggler: bool = False, return_dict: bool = False,
                gather_all: Callable[[Any], list[Any]] | None = None,
                rank: int = 0, world_size: int = 1, file: Any = None) -> dict[str, Any] | None:
        """Print (and/or return) the summary. With show_straggler, `gather_all` (an all_gather_object
        over the ranks) collects every rank's latencies; every rank must then call log_all."""
        out = file if file is not None else sys.stdout
        snapshot = {name: dict(by_size) for name, by_size in self.comms_dict.items()}
        result: dict[str, Any] | None = None
        if return_dict:
            result = {"summary": {}, "straggler_analysis": None,
                      "metadata": {"world_size": world_size, "rank": rank,
                                   "timestamp": datetime.now().isoformat()}}
        w = 20
        if print_log:
            print(f"{'Comm. Op':<{w}}{'Message Size':<{w}}{'Count':<{w}}{'Total Latency(ms)':<{w}}"
                  f"{'Avg Latency(ms)':<{w}}{'tput_avg (Gbps)':<{w}}{'busbw_avg (Gbps)':<{w}}", file=out)
        for name, by_size in snapshot.items():
            if print_log:
                print(name, file=out)
            if result is not None:
                result["summary"][name] = {}
            for size, rec in sorted(by_size.items()):
                row = self._row(size, rec)
                if result is not None:
                    result["summary"][name][size] = row
                if print_log:
                    print(f"{' ':<{w}}{row['msg_size_str']:<{w}}{row['count']:<{w}}{row['total_latency_ms']:<{w}.2f}"
                          f"{row['avg_latency_ms']:<{w}.2f}{row['tput_avg_gbps']:<{w}.2f}"
                          f"{row['busbw_avg_gbps']:<{w}.2f}", file=out)
        if show_straggler:
            self._log_stragglers(snapshot, print_log, result, gather_all, out, w)
        return result

    def _log_stragglers(self, snapshot: dict[str, dict[int, list[Any]]], print_log: bool,
                        result: dict[str, Any] | None, gather_all: Callable[[Any], list[Any]] | None,
                        out: Any, w: int) -> None:
        # Straggler time of one op on this rank: its latency minus the fastest rank's latency for
        # the same call. One object gather of everything (rather than a collective per record)
        # cannot hang when ranks logged different ops, e.g. send on one rank and recv on another.
        mine = {(name, size): list(rec[1]) for name, by_size in snapshot.items() for size, rec in by_size.items()}
        everyone = gather_all(mine) if gather_all is not None else [mine]
        if result is not None:
            result["straggler_analysis"] = {}
        if print_log:
            print("_______________________________", file=out)
            print("Breakdown with straggler effect", file=out)
            print("-------------------------------", file=out)
            print(f"{'Comm. Op':<{w}}{'Message Size':<{w}}{'Count':<{w}}{'Total comm lat(ms)':<{w}}"
                  f"{'Total straggler(ms)':<{w}}{'Avg comm lat(ms)':<{w}}{'Avg straggler(ms)':<{w}}", file=out)
        for name, by_size in snapshot.items():
            if print_log:
                print(name, file=out)
            if result is not None:
                result["straggler_analysis"][name] = {}
            for size, rec in sorted(by_size.items()):
                lats = list(rec[1])
                mins = list(lats)
                for other in everyone:
                    theirs = other.get((name, size))
                    if theirs is not None and len(theirs) == len(lats):
                        mins = [min(a, b) for a, b in zip(mins, theirs)]
                strag = [a - b for a, b in zip(lats, mins)]
                row = {"count": rec[0], "total_comm_lat_ms": sum(mins), "total_straggler_ms": sum(strag),
                       "avg_comm_lat_ms": trim_mean(mins, 0.1), "avg_straggler_ms": trim_mean(strag, 0.1),
                       "msg_size_bytes": size, "msg_size_str": convert_size(size)}
                if result is not None:
                    result["straggler_analysis"][name][size] = row
                if print_log:
                    print(f"{' ':<{w}}{row['msg_size_str']:<{w}}{row['count']:<{w}}"
                          f"{row['total_comm_lat_ms']:<{w}.2f}{row['total_straggler_ms']:<{w}.2f}"
                          f"{row['avg_comm_lat_ms']:<{w}.2f}{row['avg_straggler_ms']:<{w}.2f}", file=out)
