"""Child processes that cannot outlive the launcher.

Every rank starts in its own session (so its process group holds the rank and whatever it
spawns) with a parent-death signal (Linux `PR_SET_PDEATHSIG`), so that even a SIGKILLed
launcher leaves no rank behind. Stopping a set of ranks sends a signal to each rank's process
group and to descendants that left it, waits a short grace period, then SIGKILLs what is left.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import IO, Callable, Iterable, Mapping, Sequence

import psutil

from deepspeed_c.launcher.constants import POLL_INTERVAL_S, TERMINATE_GRACE_S

_PR_SET_PDEATHSIG = 1
# Loaded before any fork: preexec functions must not import or allocate much.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def exit_code_of(returncode: int) -> int:
    """A child's status as a shell reports it: its exit code, or 128 + N when killed by signal N."""
    return returncode if returncode >= 0 else 128 - returncode


def _child_setup(parent_pid: int, death_signal: int, cpu_affinity: Sequence[int] | None) -> Callable[[], None]:
    def setup() -> None:
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
            if os.getppid() != parent_pid:  # the parent died before prctl took effect
                os.kill(os.getpid(), death_signal)
        if cpu_affinity:
            os.sched_setaffinity(0, cpu_affinity)
    return setup


def spawn(cmd: Sequence[str], env: Mapping[str, str], *, new_session: bool, death_signal: int,
          stdout: IO | None = None, stderr: IO | None = None,
          cpu_affinity: Sequence[int] | None = None) -> subprocess.Popen:
    """Popen that dies with this process (death_signal) and optionally leads its own session."""
    return subprocess.Popen(list(cmd), env=dict(env), stdout=stdout, stderr=stderr,
                            start_new_session=new_session,
                            preexec_fn=_child_setup(os.getpid(), death_signal, cpu_affinity))


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _signal_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False when it has no member left."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _signal_procs(procs: Iterable[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def group_alive(pgid: int) -> bool:
    return _signal_group(pgid, 0)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_ranks(procs: Sequence[subprocess.Popen], first_signal: int = signal.SIGTERM,
               grace: float = TERMINATE_GRACE_S) -> None:
    """Stop rank processes (each the leader of its own process group) and everything under them.

    `first_signal` goes to every group and to descendants that left their group; after `grace`
    seconds SIGKILL finishes whatever remains. Every rank is reaped before this returns.
    """
    escaped: list[psutil.Process] = []
    for proc in procs:
        for child in _descendants(proc.pid):
            try:
                if os.getpgid(child.pid) != proc.pid:
                    escaped.append(child)
            except OSError:
                pass
    for proc in procs:
        _signal_group(proc.pid, first_signal)
    _signal_procs(escaped, first_signal)

    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        leaders_done = all(p.poll() is not None for p in procs)
        if leaders_done and not any(group_alive(p.pid) for p in procs) and not any(
                _running(e) for e in escaped):
            break
        time.sleep(POLL_INTERVAL_S / 2)

    late: list[psutil.Process] = list(escaped)
    for proc in procs:
        if proc.poll() is None:
            late += _descendants(proc.pid)
        _signal_group(proc.pid, signal.SIGKILL)
    _signal_procs(late, signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:  # unkillable (D state): report rather than hang forever
            print(f"[launcher] process {proc.pid} did not exit after SIGKILL", file=sys.stderr)
    psutil.wait_procs([p for p in late if _running(p)], timeout=1)


class SignalLatch:
    """Remembers the first SIGINT/SIGTERM; the handler only records, the main loop acts."""

    def __init__(self, signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM)) -> None:
        self.received: int | None = None
        self.count = 0
        self._previous = {}
        for sig in signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay with whoever handles them there
                break

    def _handle(self, signum: int, frame: object) -> None:
        self.count += 1
        if self.received is None:
            self.received = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
