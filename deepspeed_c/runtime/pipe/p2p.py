"""Point-to-point transfer of activations and gradients between neighbouring stages, over
torch.distributed isend/irecv only.

Before the first tensor of a kind crosses a link (and before every one with dynamic_shape), the
sender sends a small int64 header: how many tensors, and each one's dtype, requires_grad and
shape. The receiver allocates from it. Without dynamic_shape a later payload whose shapes or
dtypes differ from the handshake raises, naming the stage and the shapes. Sends are
asynchronous (their handles are kept until `wait_sends`). Over NCCL a wait only orders the CUDA
streams (the host never blocks on a transfer; NCCL's watchdog bounds a hang); over gloo, or with
DSC_PIPE_RECV_TIMEOUT set, receives wait on the host with a timeout derived from the process
group's and, on timeout, say which stage they waited for.
"""
from __future__ import annotations

import datetime
import os
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]
_HEADER = 64  # int64 words: [n, (dtype, requires_grad, ndim, *shape) per tensor]


def recv_timeout() -> datetime.timedelta:
    """The receive timeout: DSC_PIPE_RECV_TIMEOUT seconds if set, else the default process group's
    timeout (torch's 30 minutes unless init_process_group was given another)."""
    env = os.environ.get("DSC_PIPE_RECV_TIMEOUT")
    if env:
        return datetime.timedelta(seconds=float(env))
    try:
        from torch.distributed.distributed_c10d import _get_default_group

        opts = getattr(_get_default_group(), "options", None)
        t = getattr(opts, "_timeout", None)
        if isinstance(t, datetime.timedelta):
            return t
    except Exception:  # noqa: BLE001 - a private API; fall back to torch's documented default
        pass
    return dist.default_pg_timeout


def _as_tuple(x: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x)
    raise TypeError(f"pipeline stages exchange a tensor or a tuple of tensors, got {type(x).__name__}"
                    + (f" of {[type(t).__name__ for t in x]}" if isinstance(x, (tuple, list)) else ""))


def _header(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    words = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"pipeline p2p cannot send dtype {t.dtype}")
        words += [_DTYPES.index(t.dtype), int(t.requires_grad or t.is_floating_point()), t.dim(), *t.shape]
    if len(words) > _HEADER:
        raise ValueError(f"pipeline p2p: {len(tensors)} tensors with shapes {[tuple(t.shape) for t in tensors]} "
                         f"do not fit the {_HEADER}-word handshake")
    return torch.tensor(words + [0] * (_HEADER - len(words)), dtype=torch.int64)


def _parse(h: torch.Tensor) -> list[tuple[torch.dtype, bool, tuple[int, ...]]]:
    w = h.tolist()
    out, i = [], 1
    for _ in range(w[0]):
        dtype, grad, nd = _DTYPES[w[i]], bool(w[i + 1]), w[i + 2]
        out.append((dtype, grad, tuple(w[i + 3:i + 3 + nd])))
        i += 3 + nd
    return out


class PipeLink:
    """One direction of one kind (activations or gradients) between this rank and a peer."""

    def __init__(self, peer: int, peer_stage: int, my_stage: int, kind: str, device: torch.device,
                 dynamic_shape: bool) -> None:
        self.peer, self.peer_stage, self.my_stage, self.kind = peer, peer_stage, my_stage, kind
        self.device = device
        self.dynamic = dynamic_shape
        # activations and gradients may travel between the same two ranks (interleaved schedules
        # wrap around): each kind has its own tag, so their messages never cross
        self.tag = 0 if kind == "activations" else 1
        # agreed (dtype, requires_grad, shape) per tensor, per boundary (a model chunk's output can
        # differ from another's)
        self.metas: dict = {}
        self.meta: Optional[list] = None
        self.pending: list = []  # (work, tensor) of sends in flight
        # NCCL without DSC_PIPE_RECV_TIMEOUT: waits order the streams only (see _wait)
        self.stream_ordered = (device.type == "cuda" and not os.environ.get("DSC_PIPE_RECV_TIMEOUT")
                               and dist.get_backend() == "nccl")

    def _check_static(self, meta: list) -> None:
        if self.meta is not None and meta != self.meta and not self.dynamic:
            raise RuntimeError(
                f"stage {self.my_stage}: the {self.kind} to stage {self.peer_stage} changed from "
                f"{[(str(d), s) for d, _, s in self.meta]} to {[(str(d), s) for d, _, s in meta]} between "
                "micro-batches; build the PipelineModule with dynamic_shape=True for varying shapes")

    def send(self, x: Any, boundary: int = 0) -> None:
        tensors = [t.detach().contiguous() for t in _as_tuple(x)]
        meta = [(t.dtype, bool(t.requires_grad or t.is_floating_point()), tuple(t.shape)) for t in _as_tuple(x)]
        self.meta = self.metas.get(boundary)
        self._check_static(meta)
        if self.meta is None or self.dynamic:
            h = _header(tensors).to(self.device)
            self.pending.append((dist.isend(h, self.peer, tag=self.tag), h))
            self.metas[boundary] = meta
        for t in tensors:
            self.pending.append((dist.isend(t, self.peer, tag=self.tag), t))

    def _wait(self, work: Any, what: str) -> None:
        if self.stream_ordered:
            # NCCL: the current stream waits for the transfer, the host goes on enqueueing. A wait with a
            # timeout would block the host until the data arrived (torch polls for completion), so a stage
            # could not queue its next kernels ahead: ~8% of a 4-stage 1F1B step on H100s. A hang is still
            # bounded: NCCL's watchdog aborts after the process group's timeout.
            work.wait()
            return
        timeout = recv_timeout()
        try:
            ok = work.wait(timeout)
        except RuntimeError as e:
            raise RuntimeError(f"stage {self.my_stage} timed out or failed after {timeout} waiting for the {what} "
                               f"of stage {self.peer_stage} (rank {self.peer}): {e}") from None
        if ok is False:
            raise RuntimeError(f"stage {self.my_stage} timed out after {timeout} waiting for the {what} of "
                               f"stage {self.peer_stage} (rank {self.peer})")

    def recv(self, boundary: int = 0) -> tuple[torch.Tensor, ...]:
        meta = self.metas.get(boundary)
        if meta is None or self.dynamic:
            h = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            self._wait(dist.irecv(h, self.peer, tag=self.tag), f"{self.kind} handshake")
            meta = self.metas[boundary] = _parse(h.cpu())
        out = []
        for dtype, _, shape in meta:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            self._wait(dist.irecv(t, self.peer, tag=self.tag), self.kind)
            out.append(t)
        return tuple(out)

    def reset(self) -> None:
        self.metas.clear()
        self.meta = None

    def wait_sends(self) -> None:
        for work, _ in self.pending:
            self._wait(work, f"acknowledgement of a {self.kind} send to")
        self.pending.clear()
