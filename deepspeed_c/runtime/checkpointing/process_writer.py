"""`checkpoint.writer.decoupled: true`: the staged files are written by a child process, as DeepSpeed's
decoupled writer does, so the training process spends no interpreter time on pickling and writing.

The staging buffers live in shared memory (StagingPool(shared=True)); a job crosses to the child as
torch.multiprocessing handles to those buffers, not as bytes. The child writes each file with the same
crash-safe store.save_file and sends back its manifest entry (or the error's text), then drops its views of
the buffers, so the parent may reuse them once every entry of a save is back. One child serves a writer for
its whole life: started (spawn: no forked CUDA state) at the first decoupled save, stopped at exit; it leaves
on its own when the training process is gone."""
from __future__ import annotations

import os
from typing import Any, Optional

import torch.multiprocessing as mp


def _child(jobs: Any, done: Any, parent: int) -> None:
    from deepspeed_c.checkpoint import store

    while True:
        item = jobs.get()
        if item is None or os.getppid() != parent:
            return
        name, obj, path = item
        try:
            done.put((name, store.save_file(obj, path), None))
        except BaseException as e:  # noqa: BLE001 (sent back: raised in the training process at the commit)
            done.put((name, None, f"{type(e).__name__}: {e}"))
        del obj, item


class ProcessWriter:
    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        self._proc: Optional[Any] = None
        self._jobs: Any = None
        self._done: Any = None

    def _ensure(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        self._jobs, self._done = self._ctx.Queue(), self._ctx.Queue()
        self._proc = self._ctx.Process(target=_child, args=(self._jobs, self._done, os.getpid()),
                                       name="dsc-checkpoint-writer", daemon=True)
        self._proc.start()

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def write(self, jobs: list[tuple[str, Any, str]]) -> dict[str, dict]:
        """Every job's manifest entry, once the child has written it; the first failure raised (OSError
        text and all). Blocks its caller (the writer thread) only."""
        self._ensure()
        for job in jobs:
            self._jobs.put(job)
        entries: dict[str, dict] = {}
        failure: Optional[str] = None
        for _ in jobs:
            while True:
                try:
                    name, entry, error = self._done.get(timeout=5.0)
                    break
                except Exception:  # noqa: BLE001 (queue.Empty: check that the child still lives)
                    if not self._proc.is_alive():
                        raise RuntimeError(f"the decoupled checkpoint writer process died (exit code "
                                           f"{self._proc.exitcode}) before writing every file") from None
            if error is not None and failure is None:
                failure = f"{name}: {error}"
            elif entry is not None:
                entries[name] = entry
        if failure is not None:
            raise RuntimeError(f"decoupled writer process failed on {failure}")
        return entries

    def stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.is_alive():
            self._jobs.put(None)
            self._proc.join(timeout=30)
        self._proc = None
