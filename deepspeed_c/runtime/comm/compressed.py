"""The compressed all-reduce of the 1-bit optimizers (DeepSpeed's `compressed_allreduce`), its two
collectives through deepspeed_c.comm (gloo on CPU ranks, NCCL on GPUs; logged as onebit_all_to_all and
onebit_all_gather), with the sign codec in C/CUDA.

Per tensor, as DeepSpeed: the tensor is zero-padded to a multiple of W * lcm(W, 8) elements (W
ranks) and cut into W chunks, one per rank. Phase 1 (worker): add the worker error, scale =
norm / sqrt(padded numel), signs packed, worker error = compensated - scale * sign; one
all-to-all gives each rank every rank's signs of its own chunk and their scales (DeepSpeed sends
the scales in a second collective; here they ride in each row of the message). Phase 2 (server,
each rank for its chunk): average of the ranks' scale * sign, add the server error, recompress with
its own scale (server error updated the same way); one all-gather of the chunks' signs and scales
gives every rank the whole result.

`SignAllreduce` does this for a list of tensors at once with per-tensor scales (numerically one
DeepSpeed call per tensor), with two collectives per call whatever the number of tensors: the
work buffer is chunk-major, [W rows][tensor 0's chunk | tensor 1's chunk | ...], so row r's bits
are exactly what rank r receives."""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from deepspeed_c.runtime.comm import sign_codec

COMM_BACKEND_NAMES = ("nccl", "mpi", "compressed", "hccl")


def padding_unit(world: int) -> int:
    """Tensors are padded to a multiple of W * lcm(W, 8): each rank's chunk is whole bytes of bits."""
    return world * (world * 8 // math.gcd(world, 8))


def _comm() -> Any:
    import deepspeed_c.comm as dist

    return dist


class SignAllreduce:
    """The compressed all-reduce of a fixed list of tensor sizes, holding their error buffers.

    persistent_pad: the padded tail of the work buffer keeps the previous result instead of being
    zeroed (1-bit LAMB's dummy momentum, which DeepSpeed compresses with the rest)."""

    def __init__(self, numels: Sequence[int], group: Any = None, device: Optional[torch.device] = None,
                 persistent_pad: bool = False) -> None:
        dist = _comm()
        self.group = group
        self.world = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        self.device = torch.device(device or "cpu")
        if self.device.type == "cuda" and self.device.index is None:  # tensors report cuda:N
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.numels = [int(n) for n in numels]
        self.persistent_pad = persistent_pad
        W, unit = self.world, padding_unit(self.world)
        self.padded = [-(-n // unit) * unit for n in self.numels]
        self.chunks = [p // W for p in self.padded]
        self.offsets = [sum(self.chunks[:i]) for i in range(len(self.chunks))]
        S = self.row = sum(self.chunks)
        T = len(self.numels)
        self.max_len = max(self.chunks, default=0)
        self.work = torch.zeros(W * S, dtype=torch.float32, device=self.device)
        self.worker_error = torch.zeros(W * S, dtype=torch.float32, device=self.device)
        self.server_error = torch.zeros(S, dtype=torch.float32, device=self.device)
        self._server = torch.zeros(S, dtype=torch.float32, device=self.device)
        rows = [[r * S + off, c, i] for r in range(W) for i, (off, c) in enumerate(zip(self.offsets, self.chunks))
                if c > 0]
        self._segs_worker = self._table(rows)
        # rank j's row of the gathered bits, with rank j's scales (index j * T + i)
        self._segs_gathered = self._table([[r * S + off, c, r * T + i] for r in range(W)
                                           for i, (off, c) in enumerate(zip(self.offsets, self.chunks)) if c > 0])
        self._segs_server = self._table([[off, c, i] for i, (off, c) in enumerate(zip(self.offsets, self.chunks))
                                         if c > 0])
        self._padded_f = torch.tensor([max(p, 1) for p in self.padded], dtype=torch.float64, device=self.device)
        self._chunk_f = torch.tensor([max(c, 1) for c in self.chunks], dtype=torch.float64, device=self.device)

    def _table(self, rows: list[list[int]]) -> torch.Tensor:
        t = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)
        # the CUDA launchers cannot check the table on the host: check it here, once
        if t.numel():
            assert bool((t[:, 0] % 8 == 0).all()) and bool((t[:, 1] >= 0).all())
        return t.to(self.device)

    def reset_errors(self) -> None:
        self.worker_error.zero_()
        self.server_error.zero_()

    def use_errors(self, worker_error: torch.Tensor, server_error: torch.Tensor) -> None:
        """The error-feedback buffers the next calls read and update in place: the caller's (DeepSpeed's
        compressed_allreduce hands them over on every call) instead of the plan's own."""
        self.worker_error, self.server_error = worker_error, server_error

    def rank_state(self) -> dict[str, Any]:
        """This rank's carried state, on the host: both error buffers and, with persistent_pad, the work
        buffer (its padded tail carries the previous result into the next call). On a CPU run these are
        the live buffers, not copies: save them before the next call."""
        out: dict[str, Any] = {"numels": list(self.numels), "world": self.world, "rank": self.rank,
                               "persistent_pad": self.persistent_pad,
                               "worker_error": self.worker_error.detach().cpu(),
                               "server_error": self.server_error.detach().cpu()}
        if self.persistent_pad:
            out["work"] = self.work.detach().cpu()
        return out

    def mismatch(self, state: dict[str, Any]) -> Optional[str]:
        """Why `state` (a rank_state) cannot be loaded into this plan, or None."""
        for key, mine in (("numels", self.numels), ("world", self.world), ("rank", self.rank),
                          ("persistent_pad", self.persistent_pad)):
            if state.get(key) != mine:
                return f"{key} {state.get(key)!r}, this plan has {mine!r}"
        for key in ("worker_error", "server_error") + (("work",) if self.persistent_pad else ()):
            t, mine = state.get(key), getattr(self, key)
            if not isinstance(t, torch.Tensor) or t.shape != mine.shape or t.dtype != mine.dtype:
                found = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                return f"{key} is {found}, this plan needs {mine.dtype} {tuple(mine.shape)}"
        return None

    @torch.no_grad()
    def load_rank_state(self, state: dict[str, Any]) -> None:
        """Restores what rank_state returned (ValueError naming the field when it does not fit)."""
        why = self.mismatch(state)
        if why is not None:
            raise ValueError(f"compressed all-reduce state does not fit: {why}")
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])
        if self.persistent_pad:
            self.work.copy_(state["work"])

    def bytes_per_call(self) -> dict[str, int]:
        """Bytes handed to each collective per call (what the comms logger counts): every rank's sign
        chunks with its scales to the all-to-all, the server chunk's signs and scales to the all-gather."""
        W, S, T = self.world, self.row, len(self.numels)
        return {"onebit_all_to_all": W * (S // 8 + 4 * T), "onebit_all_gather": S // 8 + 4 * T}

    # -- moving tensors in and out of the chunk-major work buffer ----------------------------------
    def _gather(self, tensors: Sequence[torch.Tensor]) -> None:
        grid = self.work.view(self.world, self.row)
        for t, n, off, c in zip(tensors, self.numels, self.offsets, self.chunks):
            if c == 0:
                continue
            flat = t.detach().reshape(-1)
            block = grid[:, off:off + c]
            full, rem = divmod(n, c)
            if full:
                block[:full].copy_(flat[:full * c].view(full, c))
            if rem:
                block[full, :rem].copy_(flat[full * c:])
            if not self.persistent_pad:
                if rem:
                    block[full, rem:].zero_()
                block[full + (1 if rem else 0):].zero_()

    def _scatter(self, tensors: Sequence[torch.Tensor]) -> None:
        grid = self.work.view(self.world, self.row)
        for t, n, off, c in zip(tensors, self.numels, self.offsets, self.chunks):
            if c == 0:
                continue
            flat = t.detach().view(-1)
            block = grid[:, off:off + c]
            full, rem = divmod(n, c)
            if full:
                flat[:full * c].view(full, c).copy_(block[:full])
            if rem:
                flat[full * c:].copy_(block[full, :rem])

    # -- the algorithm -------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replaces each tensor (contiguous, float32, on this plan's device) by the compressed
        average over the ranks, in place."""
        if len(tensors) != len(self.numels):
            raise ValueError(f"this compressed all-reduce was planned for {len(self.numels)} tensors, "
                             f"got {len(tensors)}")
        for i, (t, n) in enumerate(zip(tensors, self.numels)):
            if t.numel() != n or t.dtype != torch.float32 or not t.is_contiguous() or t.device != self.device:
                raise ValueError(f"tensor {i}: expected a contiguous float32 tensor of {n} elements on {self.device}, "
                                 f"got {t.dtype} {tuple(t.shape)} on {t.device}")
        if self.row == 0:
            return
        dist = _comm()
        W, S, T, L = self.world, self.row, len(self.numels), self.max_len
        B = S // 8  # sign bytes of one rank's chunk row; each message row carries them and the T scales
        self._gather(tensors)
        # phase 1: every rank compresses its whole buffer and sends rank r its chunk r, with its scales
        sumsq = torch.zeros(T, dtype=torch.float64, device=self.device)
        sign_codec.compensate(self.work, self.worker_error, self._segs_worker, sumsq, L)
        worker_scale = (sumsq / self._padded_f).sqrt().to(torch.float32)
        bits = torch.empty(W * B, dtype=torch.uint8, device=self.device)
        sign_codec.pack(self.work, self.worker_error, bits, self._segs_worker, worker_scale, L)
        send = torch.empty(W, B + 4 * T, dtype=torch.uint8, device=self.device)
        send[:, :B] = bits.view(W, B)
        send[:, B:] = worker_scale.view(torch.uint8)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group, log_name="onebit_all_to_all")
        scales = recv[:, B:].contiguous().view(torch.float32).reshape(-1)  # rank j's scales at j * T
        # phase 2: this rank averages its chunk over the ranks and recompresses it
        scales.mul_(1.0 / W)
        server = self._server
        for j in range(W):
            sign_codec.unpack(recv[j, :B], server, self._segs_server, scales[j * T:(j + 1) * T], j > 0, L)
        sumsq.zero_()
        sign_codec.compensate(server, self.server_error, self._segs_server, sumsq, L)
        server_scale = (sumsq / self._chunk_f).sqrt().to(torch.float32)
        mine = torch.empty(B + 4 * T, dtype=torch.uint8, device=self.device)
        sign_codec.pack(server, self.server_error, mine[:B], self._segs_server, server_scale, L)
        mine[B:] = server_scale.view(torch.uint8)
        gathered = torch.empty(W, B + 4 * T, dtype=torch.uint8, device=self.device)
        dist.all_gather_into_tensor(gathered, mine, group=self.group, log_name="onebit_all_gather")
        bits.view(W, B).copy_(gathered[:, :B])
        server_scales = gathered[:, B:].contiguous().view(torch.float32).reshape(-1)
        sign_codec.unpack(bits, self.work, self._segs_gathered, server_scales, False, L)
        self._scatter(tensors)


class CompressedBackend:
    """DeepSpeed's backend object: `compressed_allreduce(buffer_m, worker_error, server_error,
    local_rank)` returns the compressed average of buffer_m, updating the caller's error buffers
    (worker_error: the padded size, server_error: one rank's chunk). All collectives go through
    deepspeed_c.comm (torch.distributed), whatever the backend's name."""

    def __init__(self, mpu: Any = None) -> None:
        dist = _comm()
        self.mpu = mpu
        self.world_group = mpu.get_data_parallel_group() if mpu is not None else None
        self.size = dist.get_world_size(group=self.world_group)
        self.rank = dist.get_rank(group=self.world_group)
        self._plans: dict[tuple[int, str], SignAllreduce] = {}

    def plan(self, numels: Sequence[int], device: torch.device, persistent_pad: bool = False) -> SignAllreduce:
        return SignAllreduce(numels, group=self.world_group, device=device, persistent_pad=persistent_pad)

    def compressed_allreduce(self, buffer_m: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                             local_rank: int = 0) -> torch.Tensor:
        shape, n = buffer_m.shape, buffer_m.numel()
        if n == 0:
            worker_error.zero_()
            server_error.zero_()
            return buffer_m
        key = (n, str(buffer_m.device))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self.plan([n], buffer_m.device)
        if worker_error.numel() != plan.padded[0] or server_error.numel() != plan.chunks[0]:
            raise ValueError(f"compressed_allreduce: a buffer of {n} elements over {self.size} ranks needs a "
                             f"worker_error of {plan.padded[0]} and a server_error of {plan.chunks[0]} elements, got "
                             f"{worker_error.numel()} and {server_error.numel()}")
        # one tensor: the chunk-major layout is the natural order, so the caller's buffers are used in place
        plan.use_errors(worker_error.view(-1), server_error.view(-1))
        out = buffer_m.detach().reshape(-1).to(torch.float32).clone()
        plan([out])
        return out.view(shape).to(buffer_m.dtype)


def comm_backend(name: str, mpu: Any = None, cuda_aware: bool = False) -> CompressedBackend:
    """The backend `comm_backend_name` selects. "nccl" and "compressed" are the same torch.distributed
    implementation here (NCCL on GPUs, gloo on CPU ranks); "mpi" needs mpi4py, as DeepSpeed's, but its
    collectives also go through torch.distributed; "hccl" (Ascend NPUs) is not built."""
    from deepspeed_c.runtime.config.utils import DeepSpeedConfigError, closest

    if name in ("nccl", "compressed"):
        return CompressedBackend(mpu)
    if name == "mpi":
        from deepspeed_c.runtime.comm.mpi import MpiBackend

        return MpiBackend(cuda_aware, mpu)
    if name == "hccl":
        raise NotImplementedError("deepspeed_c: optimizer.params.comm_backend_name 'hccl' (Ascend NPUs) is not built; "
                                  "use 'nccl' or 'compressed'")
    near = closest(str(name), list(COMM_BACKEND_NAMES))
    hint = f" Did you mean '{near}'?" if near else ""
    raise DeepSpeedConfigError(f"Invalid value {name!r} for config key 'optimizer.params.comm_backend_name'.{hint} "
                               f"Allowed: {', '.join(COMM_BACKEND_NAMES[:3])}")
