"""Run a test body on N real processes: gloo on CPU, or NCCL with one process per GPU.

The backend of a run that names none comes from DSC_TEST_BACKEND: "gloo" (the default) runs CPU
ranks, with any GPUs hidden from them, so the same suite means the same thing on every machine;
"nccl" runs rank r on cuda:r (torch.cuda.set_device, LOCAL_RANK as the launcher sets it, TF32 off,
deterministic kernels where torch has them, math attention) and skips, naming the shortfall, when
fewer GPUs than ranks are visible. Test bodies put their model and data on `rank_device()` (cpu, or
cuda:LOCAL_RANK) and return numpy on the host. scripts/gpu_parity.sh runs the parity suites so.

Each rank is a new process (forked from a server that preloaded torch, see _context) with
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set and
the default process group initialised before the body runs. A hang fails in bounded time: on
timeout every rank's whole process tree is killed, and no child outlives the call.

Ports: the rendezvous store of a gloo/NCCL run is a TCPStore the calling process opens on a port the
OS picks (port 0) before any rank starts, and the ranks join it as clients, so no other process can
take the port between its choice and its use (with a port picked by closing a probe socket and bound
later by rank 0, suites starting process groups side by side lost it now and then: EADDRINUSE).
Runs with backend "none" (the body initialises its group itself, rank 0 binding MASTER_PORT) keep a
picked free port; there, and as a safety net everywhere, a rank whose failure is EADDRINUSE is
reported as such and the whole run is retried on a fresh port, PORT_ATTEMPTS times at most; any other
failure fails the call at once.

    def body(rank: int, world_size: int, scale: float) -> float:
        t = torch.ones(1) * rank * scale
        dist.all_reduce(t)
        return t.item()

    results = run_distributed(body, world_size=2, args=(3.0,))
"""
from __future__ import annotations

import datetime
import errno
import multiprocessing as mp
import os
import queue
import signal
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import psutil


class DistributedTestError(AssertionError):
    """A rank raised, died, or the run timed out."""


class _PortInUse(Exception):
    """A rank could not listen on the run's port (EADDRINUSE): the run is retried on another."""


PORT_ATTEMPTS = 3  # runs of one call whose port was taken before the call fails
_HOST = "127.0.0.1"
# what a rank reports: its value, a failure, or a failure to listen on the run's port
_OK, _FAILED, _PORT_TAKEN = "ok", "failed", "port-in-use"


BACKEND_ENV = "DSC_TEST_BACKEND"
_DEVICE_ENV = "DSC_TEST_DEVICE"  # set in each rank: the device its body works on
# NVLink multicast stays off on shared GPU hosts (a program using it can take the host's GPUs down)
_NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def backend_choice() -> str:
    """The backend DSC_TEST_BACKEND asks for: "gloo" (default) or "nccl"."""
    name = os.environ.get(BACKEND_ENV, "").strip().lower() or "gloo"
    if name not in ("gloo", "nccl"):
        raise ValueError(f"{BACKEND_ENV} must be 'gloo' or 'nccl', got {name!r}")
    return name


def rank_device() -> "torch.device":
    """The torch.device a test body puts its model and data on: cuda:LOCAL_RANK in an NCCL rank,
    cpu in a gloo rank and outside ranks (references computed by the test process itself)."""
    import torch

    return torch.device(os.environ.get(_DEVICE_ENV, "cpu"))


def on_gpu() -> bool:
    """True in an NCCL rank (for the few checks whose meaning differs on a GPU)."""
    return os.environ.get(_DEVICE_ENV, "cpu").startswith("cuda")


def deterministic() -> None:
    """torch.use_deterministic_algorithms(True) for a rank: strict on the CPU; on a GPU it warns
    (instead of raising) where an op has no deterministic CUDA kernel."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=on_gpu())


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nccl_shortfall(world_size: int) -> str | None:
    """Why an NCCL run of world_size ranks cannot run here (None when it can)."""
    have = visible_gpus()
    if have >= world_size:
        return None
    return f"NCCL at world size {world_size} needs {world_size} CUDA GPU(s), one process per GPU; {have} visible"


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port for a job that binds it later (a launcher's --master_port). Picked below the OS's ephemeral
    range: port-0 binds (the harness's own stores, other jobs' stores) and outgoing connections take
    ephemeral ports, so one of those can no longer grab the port between this choice and the job's bind
    (a launched job whose port a harness store had taken joined that foreign store and aborted)."""
    import random

    lo, _ = _ephemeral_range()
    low = max(10000, lo - 20000)
    pick = random.Random(os.getpid() * 1_000_003 + time.monotonic_ns())
    for _ in range(200):
        port = pick.randrange(low, lo)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # nothing free below the range
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pick_port() -> int:
    """MASTER_PORT of a backend "none" run (whose rank 0 binds it); tests replace it to provoke EADDRINUSE."""
    return free_port()


class _TransientRendezvous(RuntimeError):
    """gloo's full-mesh connect between the ranks failed on a loaded host before the body ran: the run is
    retried like a taken port (the body never started, so nothing it tests is hidden)."""


# what gloo's TCP pairs report when a peer's socket went away during connectFullMesh (seen once in ~3000 CI
# runs on 2 loaded cores); an unknown interface or a timeout is not among them and fails at once
_TRANSIENT_MESH = ("Connection closed by peer", "Connection reset by peer", "Connection refused")


def is_transient_rendezvous(exc: BaseException) -> bool:
    """True when exc is gloo's connectFullMesh failing on a peer socket that closed, reset or refused."""
    text = str(exc)
    return "connectFullMesh failed" in text and any(m in text for m in _TRANSIENT_MESH)


def is_port_in_use(exc: BaseException) -> bool:
    """True when exc, or an exception it was raised from, is a failure to listen on a port already in
    use: an OSError with errno EADDRINUSE, or c10d's DistNetworkError naming EADDRINUSE."""
    import torch.distributed as dist

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
            return True
        if isinstance(e, dist.DistNetworkError) and "EADDRINUSE" in str(e):
            return True
        if isinstance(e, _TransientRendezvous):
            return True
        e = e.__cause__ or e.__context__
    return False


def _parent_store(world_size: int, timeout: float) -> Any:
    """The run's rendezvous store, served by the calling process on a port the OS picks."""
    import torch.distributed as dist

    return dist.TCPStore(_HOST, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str,
               args: Sequence[Any], env: dict[str, str], results: "mp.Queue[Any]") -> None:
    os.environ.update(env)
    _register_stack_dump()
    # The rank starts its own children (DataLoader workers, ...) the platform's default way, as a launched rank
    # would: it inherits the fork-server method it was started with, and a fork server of its own is a fresh
    # interpreter importing torch again (a DataLoader's first batch took ~18 s on 4 ranks of 2 cores).
    mp.set_start_method(None, force=True)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if backend == "nccl":
            torch.cuda.set_device(rank)
            # fp32 matmuls and convolutions in fp32 (TF32 would loosen every fp32 tolerance)
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            # the suites compare runs bit for bit (resume == uninterrupted, replicas equal): deterministic
            # kernels where torch has them, and the math attention (the fused ones' backward may use
            # atomics); the models are tiny, speed is not measured here
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cuda.enable_flash_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
                torch.backends.cuda.enable_cudnn_sdp(False)
        if backend != "none":
            # a client of the store the calling process serves on `port` (see the module's "Ports")
            store = dist.TCPStore(_HOST, port, world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=float(env.get("_DSC_STORE_TIMEOUT", "300"))))
            try:
                dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
            except RuntimeError as e:
                if is_transient_rendezvous(e):
                    raise _TransientRendezvous(str(e)) from e
                raise
        try:
            value = fn(rank, world_size, *args)
        finally:
            if backend != "none" and dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, _OK, value))
    except BaseException as e:  # report everything, including SystemExit from the body
        results.put((rank, _PORT_TAKEN if is_port_in_use(e) else _FAILED, traceback.format_exc()))


def _stack_file(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"dsc-test-rank-{pid}.stacks")


def _register_stack_dump() -> None:
    """SIGUSR1 makes this rank write every thread's Python stack to its stack file: a hung rank then says
    where it waits (the parent asks before killing it, see _stacks_of)."""
    import faulthandler

    dump = open(_stack_file(os.getpid()), "w")  # noqa: SIM115 (open for the process's life)
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)


def _stacks_of(procs: Sequence[mp.process.BaseProcess], ranks: Sequence[int]) -> str:
    """The Python stacks of the still-running ranks among `ranks` (asked with SIGUSR1), as text."""
    alive = [(r, procs[r]) for r in ranks if procs[r].is_alive() and procs[r].pid is not None]
    for _, p in alive:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(1.0)
    parts = []
    for r, p in alive:
        try:
            with open(_stack_file(p.pid)) as f:
                parts.append(f"--- rank {r} (pid {p.pid}) stacks ---\n{f.read()[-6000:]}")
        except OSError:
            parts.append(f"--- rank {r} (pid {p.pid}): no stacks ---")
    return "\n".join(parts)


# deepspeed_c modules the rank server imports (tests/harness_preload.py) before forking ranks (see _context).
# runtime.engine is a lazy package: the engine itself, initialize and what a first initialize / save / load pulls in
# are named too (without them each rank imported ~180 modules itself: ~0.2 CPU-s a rank, ~1 s of a 2-rank
# launch's wall time on 2 loaded cores).
PRELOADED_DSC = ("deepspeed_c.runtime.engine", "deepspeed_c.runtime.zero.stage_1_and_2", "deepspeed_c.runtime.zero.stage3",
                 "deepspeed_c.runtime.engine.engine", "deepspeed_c.runtime.initialize",
                 "deepspeed_c.runtime.engine.zero_setup", "deepspeed_c.runtime.engine.profile_setup",
                 "deepspeed_c.runtime.pipe.engine", "deepspeed_c.runtime.checkpointing.engine", "deepspeed_c.comm",
                 "deepspeed_c.utils.groups", "deepspeed_c.ops.adam.fused_adam", "deepspeed_c.ops.adam.cpu_adam",
                 "deepspeed_c.ops.op_builder.all_ops", "deepspeed_c.monitor", "deepspeed_c.autotuning.config",
                 "deepspeed_c.compression.engine_hooks", "deepspeed_c.utils.zero_to_fp32")


def _context() -> Any:
    """Rank processes fork from a server that has already imported torch (a fresh interpreter
    importing torch costs seconds, on every rank of every distributed test). The server is a clean
    single-threaded interpreter that imports nothing that touches CUDA (not even deepspeed_c, whose
    accelerator probe may), so each forked rank can still initialise CUDA; it is started with the
    test process's environment at first use. torch._dynamo (imported by a rank's first optimizer
    step, ~1.5 CPU-s) and transformers.modeling_utils (~3 CPU-s, the Hugging Face tests) are preloaded
    too: neither touches torch.cuda on import; a missing one is skipped by the server. Last,
    tests.harness_freeze moves all of it out of the cyclic garbage collector's reach (gc.freeze).
    deepspeed_c's engine and ZeRO modules are preloaded as well (~0.7 CPU-s a rank, hundreds of ranks a suite):
    importing them touches no CUDA (the accelerator is chosen at first get_accelerator(), in the rank, under
    the rank's environment; tests/unit/test_harness.py holds that), and what they read from the environment
    at import (DSC_CORE_DIR) is the test process's, as it is for a rank."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "transformers.modeling_utils",
                                "tests.harness", "tests.harness_preload", "tests.harness_freeze"])
    return ctx


def rank_server_context() -> Any:
    """The multiprocessing context whose processes fork from the rank server (see _context), for tests that
    start and kill their own processes (the crash tests) instead of calling run_distributed."""
    return _context()


def _kill_tree(proc: mp.process.BaseProcess) -> None:
    try:
        parent = psutil.Process(proc.pid)
        victims = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=5)


def run_distributed(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                    timeout: float = 120.0, backend: str | None = None,
                    env: dict[str, str] | None = None, start_method: str = "forkserver") -> list[Any]:
    """Run fn(rank, world_size, *args) on world_size processes; return the per-rank results.

    backend: None takes DSC_TEST_BACKEND (gloo by default: CPU ranks, GPUs hidden; nccl: rank r on
    cuda:r); "gloo" or "nccl" named by the caller are used as they are (GPUs stay visible); "none"
    skips init_process_group (for bodies that initialise the group themselves). An NCCL run with
    fewer visible GPUs than world_size is skipped (pytest.skip), naming the shortfall. start_method "spawn"
    gives each rank a fresh interpreter (memory tests: a forked rank's first writes to the
    server's preloaded pages count as its own resident growth).
    """
    env = dict(env or {})
    chosen = backend if backend is not None else backend_choice()
    if chosen == "nccl":
        reason = nccl_shortfall(world_size)
        if reason is not None:
            import pytest

            pytest.skip(f"{BACKEND_ENV}=nccl: {reason}" if backend is None else reason)
        for k, v in _NCCL_SAFE_ENV.items():
            env.setdefault(k, os.environ.get(k, v))
        # deterministic cuBLAS for bodies that ask torch.use_deterministic_algorithms(True)
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    elif backend is None:
        env.setdefault("CUDA_VISIBLE_DEVICES", "")  # gloo from the default: CPU ranks even on a GPU host
    ctx = _context() if start_method == "forkserver" else mp.get_context(start_method)
    env["_DSC_STORE_TIMEOUT"] = str(max(timeout, 30.0))
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return _run_once(ctx, fn, world_size, tuple(args), timeout, chosen, env)
        except _PortInUse as e:
            if attempt == PORT_ATTEMPTS:
                raise DistributedTestError(f"the run's port was in use (or gloo's rendezvous failed transiently) on all {PORT_ATTEMPTS} attempts; last:\n{e}")
    raise AssertionError("unreachable")


def _run_once(ctx: Any, fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, backend: str,
              env: dict[str, str]) -> list[Any]:
    """One run on a fresh port; _PortInUse when a rank could not listen on it."""
    store = _parent_store(world_size, timeout) if backend != "none" else None
    port = store.port if store is not None else _pick_port()
    results: "mp.Queue[Any]" = ctx.Queue()
    procs = [ctx.Process(target=_rank_main,
                         args=(fn, r, world_size, port, backend, args,
                               {**env, _DEVICE_ENV: f"cuda:{r}" if backend == "nccl" else "cpu"}, results),
                         daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    failures: list[str] = []
    port_taken = False
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                hung = [r for r in range(world_size) if r not in out]
                raise DistributedTestError(
                    f"distributed test timed out after {timeout:.0f}s; ranks finished: {sorted(out)}\n"
                    + _stacks_of(procs, hung))
            try:
                rank, kind, value = results.get(timeout=min(remaining, 0.1))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs)
                        if p.exitcode is not None and i not in out and p.exitcode != 0]
                if dead:
                    # give a dying rank's report a moment to arrive before declaring it lost: a rank that exited
                    # (code > 0) may have sent one on its way out; ranks killed by a signal (code < 0, the
                    # crash tests' SIGKILL) send nothing more, only what already sits in the pipe
                    grace = 2.0 if any(procs[i].exitcode > 0 for i in dead) else 0.05
                    try:
                        rank, kind, value = results.get(timeout=grace)
                    except queue.Empty:
                        raise DistributedTestError(
                            f"rank(s) {dead} died with exit code(s) "
                            f"{[procs[i].exitcode for i in dead]} without reporting")
                else:
                    continue
            if kind == _OK:
                out[rank] = value
            else:
                port_taken = kind == _PORT_TAKEN
                failures.append(f"--- rank {rank} (port {port}) ---\n{value}")
                break  # one failing rank is enough; the others may be waiting on it
        if port_taken:
            raise _PortInUse("\n".join(failures))
        if failures:
            raise DistributedTestError("a rank failed:\n" + "\n".join(failures))
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                _kill_tree(p)
            p.join(timeout=5)
            if p.pid is not None:
                try:
                    os.unlink(_stack_file(p.pid))
                except OSError:
                    pass
        results.close()
        del store
