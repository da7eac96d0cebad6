"""`train_throughput.py --profile`: where one system's step goes, from torch.profiler on rank 0.

Per phase (forward, backward, step) of --steps profiled steps: the CPU time to enqueue the phase
(until its call returns) against its wall time (until the GPU is done): a phase whose enqueue time
is close to its wall time is host-bound (Python hooks, launches, synchronisations), one whose GPU
busy time is close to the wall is kernel-bound. Then the kernels by device time (NCCL apart), and
the CUDA runtime calls that stall the host (synchronisations, cudaMalloc/cudaFree, event syncs)."""
from __future__ import annotations

import time
from typing import Any

import torch

STALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMalloc", "cudaFree",
          "cudaMemcpy", "cudaHostAlloc", "cudaStreamWaitEvent")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _activities() -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


def _kernels(events: Any) -> list:
    return [e for e in events if getattr(e, "device_time_total", 0) > 0 and e.device_type.name == "CUDA"]


def _compute_and_nccl_ms(kern: list, steps: int) -> tuple[float, float]:
    """Device time per step of the compute kernels and of the NCCL ones (which overlap them)."""
    nccl = sum(e.device_time_total for e in kern if "nccl" in e.key.lower()) / 1e3 / steps
    busy = sum(e.device_time_total for e in kern if "nccl" not in e.key.lower()) / 1e3 / steps
    return busy, nccl


def _top_kernel_lines(kern: list, steps: int, top: int) -> list[str]:
    return [f"  {e.device_time_total / 1e3 / steps:8.2f} {e.count / steps:7.1f}  {e.key[:90]}"
            for e in sorted(kern, key=lambda e: -e.device_time_total)[:top]]


def _stall_lines(events: Any, steps: int, min_ms: float = 0.0, prefix: str = "") -> list[str]:
    """The CUDA runtime calls that may stall the host, by CPU time per step (ms, calls/step)."""
    return [f"  {prefix}{e.cpu_time_total / 1e3 / steps:8.2f} {e.count / steps:7.1f}  {e.key}"
            for e in sorted(events, key=lambda e: -e.cpu_time_total)
            if any(e.key.startswith(s) for s in STALLS) and e.cpu_time_total / 1e3 / steps > min_ms]


def _top_host_lines(events: Any, steps: int, top: int) -> list[str]:
    ops = [e for e in events if e.device_type.name == "CPU" and not e.key.startswith("cuda")]
    return [f"  {e.self_cpu_time_total / 1e3 / steps:8.2f} {e.count / steps:7.1f}  {e.key[:90]}"
            for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:top]]


def profile_system(sysm: Any, batches: list, k: int, steps: int, rank: int, label: str) -> None:
    from torch.profiler import profile

    phases = {n: [0.0, 0.0] for n in ("forward", "backward", "step")}  # enqueue ms, wall ms

    def timed(name: str, fn: Any, *fa: Any) -> Any:
        _sync()
        t0 = time.perf_counter()
        r = fn(*fa)
        t1 = time.perf_counter()
        _sync()
        phases[name][0] += (t1 - t0) * 1e3 / steps
        phases[name][1] += (time.perf_counter() - t0) * 1e3 / steps
        return r

    with profile(activities=_activities()) as prof:
        for i in range(steps):
            loss = timed("forward", sysm.fwd, *batches[(k + i) % len(batches)])
            timed("backward", sysm.bwd, loss)
            timed("step", sysm.opt)
    if rank != 0:
        return
    print(f"\n--- profile {label} (rank 0, {steps} steps; ms per step) ---")
    print("phase      enqueue(CPU)    wall")
    for n, (cpu, wall) in phases.items():
        print(f"{n:10s} {cpu:12.2f} {wall:8.2f}")
    events = prof.key_averages()
    kern = _kernels(events)
    busy, nccl = _compute_and_nccl_ms(kern, steps)
    print(f"GPU kernel time per step: compute {busy:.2f} ms, NCCL {nccl:.2f} ms (overlapping)")
    print("\n".join(["top kernels (ms/step, calls/step):", *_top_kernel_lines(kern, steps, 14),
                     "host-side CUDA runtime calls (ms/step CPU, calls/step):", *_stall_lines(events, steps),
                     "top host ops by self CPU time (ms/step, calls/step):", *_top_host_lines(events, steps, 12)]))


def gpu_idle_report(events: Any, steps: int, wall_ms: float, top: int = 6) -> list[str]:
    """Where a device waited: the union of its kernels' intervals (NCCL apart and all together) against
    the wall, and the longest gaps with the kernels on either side. For a loop profiled without
    synchronisations between phases (a step as users run it), so the host's lead, or its lag, shows."""
    kern = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                  if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    if not kern:
        return ["(no device kernels recorded)"]

    def union(spans: list) -> tuple[float, list]:
        busy, merged = 0.0, []
        for a, b, name in spans:
            if merged and a <= merged[-1][1]:
                if b > merged[-1][1]:
                    merged[-1][1], merged[-1][3] = b, name
            else:
                merged.append([a, b, name, name])  # start, end, first kernel, last kernel
        for a, b, _, _ in merged:
            busy += b - a
        return busy, merged

    busy_all, merged = union(kern)
    busy_compute, _ = union([k for k in kern if "nccl" not in k[2].lower()])
    span = (merged[-1][1] - merged[0][0]) / 1e3
    gaps = sorted(((merged[i + 1][0] - merged[i][1], merged[i][3], merged[i + 1][2]) for i in range(len(merged) - 1)),
                  reverse=True)[:top]
    lines = [f"device, per step: wall {wall_ms:.1f} ms; busy (any kernel) {busy_all / 1e3 / steps:.1f}, compute "
             f"kernels alone {busy_compute / 1e3 / steps:.1f}, idle {(span * 1e3 - busy_all) / 1e3 / steps:.1f} "
             f"(over the {span:.1f} ms from the first kernel to the last)", "longest idle gaps (us: after -> before):"]
    lines += [f"  {g:9.0f}  {a[:50]} -> {b[:50]}" for g, a, b in gaps]
    return lines


def profile_unphased(step: Any, first: int, steps: int, rank: int, label: str) -> None:
    """train_throughput.py --profile_unphased: `steps` whole steps as a user runs them (no synchronisation
    between forward, backward and step) under torch.profiler; rank 0 prints the device's busy and idle time
    per step and the longest idle gaps (gpu_idle_report), the host's time per step and its stalls."""
    from torch.profiler import profile

    step(first)  # the queue starts as in steady state: one step ahead of the profiled ones
    _sync()
    with profile(activities=_activities()) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            step(first + 1 + i)
        t1 = time.perf_counter()
        _sync()
        t2 = time.perf_counter()
    if rank != 0:
        return
    wall = (t2 - t0) * 1e3 / steps
    print(f"\n--- unphased profile {label} (rank 0, {steps} steps; ms per step) ---\n"
          f"host returns after {(t1 - t0) * 1e3 / steps:.1f} ms a step; device done after {wall:.1f}")
    events = prof.key_averages()
    print("\n".join([*gpu_idle_report(prof.events(), steps, wall),
                     *_stall_lines(events, steps, 0.3, prefix="host stall "),
                     "  top host ops by self CPU time (ms/step, calls/step):", *_top_host_lines(events, steps, 12)]))


def profile_steps(step: Any, first: int, steps: int, rank: int, label: str, printing: bool) -> None:
    """parallel_throughput.py --profile: `steps` whole steps of one system under torch.profiler on every
    rank; a printing rank reports the step's enqueue and wall time, its GPU compute and NCCL kernel
    time (a pipeline stage's idle time is the wall minus its compute), the top kernels, the CUDA runtime
    calls that stall the host and the top host ops. The ranks print in turn (a barrier between)."""
    import torch.distributed as dist
    from torch.profiler import profile

    enqueue = wall = 0.0
    with profile(activities=_activities()) as prof:
        for i in range(steps):
            _sync()
            dist.barrier()
            t0 = time.perf_counter()
            step(first + i)
            t1 = time.perf_counter()
            _sync()
            enqueue += (t1 - t0) * 1e3 / steps
            wall += (time.perf_counter() - t0) * 1e3 / steps
    events = prof.key_averages()
    for r in range(dist.get_world_size()):
        dist.barrier()
        if r != rank or not printing:
            continue
        kern = _kernels(events)
        busy, nccl = _compute_and_nccl_ms(kern, steps)
        print(f"\n--- profile {label}, rank {rank} ({steps} steps; ms per step) ---\n"
              f"enqueue {enqueue:.1f}, wall {wall:.1f}; GPU compute kernels {busy:.1f} (idle {wall - busy:.1f}), "
              f"NCCL kernels {nccl:.1f}")
        print("\n".join([*_top_kernel_lines(kern, steps, 10),
                         "  host-side CUDA runtime calls (ms/step CPU, calls/step):", *_stall_lines(events, steps, 0.3),
                         "  top host ops by self CPU time (ms/step, calls/step):", *_top_host_lines(events, steps, 8)]),
              flush=True)
