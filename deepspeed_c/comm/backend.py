"""TorchBackend: the one transport of deepspeed_c.comm, a thin layer over torch.distributed.

It adds what a backend may lack: when the backend refuses `reduce_scatter_tensor`,
`reduce_scatter`, `all_gather_into_tensor`, the list `all_to_all` or `ReduceOp.AVG` (gloo on
older torch, MPI, third-party backends), the op is rebuilt from collectives every backend has
(all_reduce, all_gather, all_to_all_single, SUM). A refusal is a local argument check that every
rank meets the same way, so all ranks switch to the fallback together; it is remembered per
backend so later calls go straight to the fallback.

`DSC_COMM_FALLBACK` (comma-separated op names, or "all") forces fallbacks, for tests and for
backends that misbehave rather than refuse.
"""
from __future__ import annotations

import inspect
import os
import re
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from deepspeed_c.comm import direct, exit_hook
from deepspeed_c.comm.direct import MISS, PG_ALL_GATHER_COALESCED, TORCH_ALL_GATHER, TORCH_REDUCE_SCATTER
from deepspeed_c.comm.reduce_op import is_avg, to_torch_op

_has_torch_function = torch._C._has_torch_function_unary
_any_torch_function = torch._C._has_torch_function  # over a sequence of tensors
# unbound tensor methods, mapped over a coalesced call's tensors in C
_DIM, _NUMEL, _CONTIGUOUS = torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_contiguous
_COMPLEX = torch.Tensor.is_complex
_FLAT = {1}  # the dims of a coalesced call's tensors where its direct call may serve it

FALLBACK_ENV = "DSC_COMM_FALLBACK"
FALLBACK_OPS = ("reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor", "all_to_all", "avg")

_UNSUPPORTED = re.compile(r"not supported|unsupported|not implemented|does not support|cannot use|"
                          r"no support|is not available", re.IGNORECASE)


class CompletedWork:
    """What an async_op call returns when the op already ran synchronously (a fallback)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def get_future(self) -> "torch.futures.Future[Any]":
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_result(None)
        return fut


Noop = CompletedWork  # DeepSpeed's name for a work handle that needs no waiting


def _forced_from_env() -> set[str]:
    raw = os.environ.get(FALLBACK_ENV, "")
    names = {n.strip() for n in raw.split(",") if n.strip()}
    if "all" in names:
        return set(FALLBACK_OPS)
    unknown = names - set(FALLBACK_OPS)
    if unknown:
        raise ValueError(f"{FALLBACK_ENV} names unknown op(s) {sorted(unknown)}; valid: {list(FALLBACK_OPS)} or 'all'")
    return names


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous for this collective, got strides {tuple(t.stride())}")
    return t.view(-1)


def _divide_(t: torch.Tensor, n: int) -> None:
    if not (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"ReduceOp.AVG needs a floating-point tensor on this backend, got {t.dtype}")
    t.div_(n)


class TorchBackend:
    """deepspeed_c.comm's backend object (DeepSpeed calls it `cdb`)."""

    def __init__(self, backend: str | None, timeout: timedelta, init_method: str | None,
                 rank: int = -1, world_size: int = -1, name: str = "torch") -> None:
        self.name = name
        self.initialized = True
        self.single_gpu_mode = True
        self.has_all_reduce_coalesced = hasattr(dist, "all_reduce_coalesced")
        self.has_coalescing_manager = hasattr(dist.distributed_c10d, "_coalescing_manager")
        self.all_gather_function = getattr(dist, "all_gather_into_tensor", None)
        self.reduce_scatter_function = getattr(dist, "reduce_scatter_tensor", None)
        self._forced = _forced_from_env()
        self._refused: set[tuple[str, str]] = set()  # (backend name, op) pairs the backend refused
        self.init_process_group(backend, timeout, init_method, rank, world_size)

    # ---- setup ---------------------------------------------------------------------------
    def init_process_group(self, backend: str | None, timeout: timedelta, init_method: str | None,
                           rank: int, world_size: int) -> None:
        if not dist.is_initialized():
            kwargs: dict[str, Any] = dict(timeout=timeout, init_method=init_method, rank=rank, world_size=world_size)
            wants_nccl = backend is not None and "nccl" in backend
            if (wants_nccl and torch.cuda.is_available()
                    and "device_id" in inspect.signature(dist.init_process_group).parameters):
                local_rank = int(os.environ.get("LOCAL_RANK", "0"))
                if local_rank < torch.cuda.device_count():
                    # binds the communicator to this rank's GPU, so NCCL never guesses device 0
                    torch.cuda.set_device(local_rank)
                    kwargs["device_id"] = torch.device("cuda", local_rank)
            dist.init_process_group(backend, **kwargs)
        # also when the caller made the group (the Hugging Face Trainer's and accelerate's launches do)
        exit_hook.register(str(dist.get_backend()))
        self.using_mpi = dist.get_backend() == "mpi"

    def is_initialized(self) -> bool:
        return dist.is_initialized()

    def has_all_gather_into_tensor(self) -> bool:
        return self.all_gather_function is not None

    def has_reduce_scatter_tensor(self) -> bool:
        return self.reduce_scatter_function is not None

    # ---- fallback bookkeeping ------------------------------------------------------------
    def _use_fallback(self, op: str, group: Any) -> bool:
        if op in self._forced:
            return True
        return (self.get_backend(group), op) in self._refused

    def _native_or_fallback(self, op: str, group: Any, native: Callable[[], Any], fallback: Callable[[], Any]) -> Any:
        if self._use_fallback(op, group):
            return fallback()
        try:
            return native()
        except (RuntimeError, NotImplementedError, ValueError) as err:
            if not _UNSUPPORTED.search(str(err)):
                raise
            self._refused.add((self.get_backend(group), op))
            return fallback()

    def _with_op(self, op: Any, group: Any, async_op: bool, run: Callable[[Any, bool], Any],
                 results: Sequence[torch.Tensor]) -> Any:
        """Run `run(torch_op, async_op)`; where the backend lacks AVG, run SUM and divide `results`."""
        torch_op = to_torch_op(op)
        if not is_avg(torch_op):
            return run(torch_op, async_op)

        def sum_then_divide() -> Any:
            run(dist.ReduceOp.SUM, False)
            n = self.get_world_size(group)
            for t in results:
                _divide_(t, n)
            return CompletedWork() if async_op else None

        return self._native_or_fallback("avg", group, lambda: run(torch_op, async_op), sum_then_divide)

    # ---- reductions ----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> Any:
        return self._with_op(op, group, async_op,
                             lambda o, a: dist.all_reduce(tensor, op=o, group=group, async_op=a), [tensor])

    def inference_all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None) -> Any:
        if self.get_world_size(group) <= 1:
            return tensor
        return self.all_reduce(tensor, op, group, False)

    def all_reduce_coalesced(self, tensors: list[torch.Tensor], op: Any = dist.ReduceOp.SUM, group: Any = None,
                             async_op: bool = False) -> Any:
        # one flat buffer and one collective per (dtype, device): what coalescing is for, and every
        # backend can do it; grouping keeps each tensor reduced in its own dtype
        buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            buckets.setdefault((t.dtype, t.device), []).append(t)
        for members in buckets.values():
            flat = torch.cat([t.reshape(-1) for t in members])
            self.all_reduce(flat, op, group, False)
            offset = 0
            for t in members:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        return CompletedWork() if async_op else None

    def reduce(self, tensor: torch.Tensor, dst: int, op: Any = dist.ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Any:
        # only dst holds the reduced value, so only dst divides
        is_dst = self.get_rank() == dst
        return self._with_op(op, group, async_op,
                             lambda o, a: dist.reduce(tensor, dst=dst, op=o, group=group, async_op=a),
                             [tensor] if is_dst else [])

    def reduce_scatter_direct(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, op: Any,
                              group: Any, async_op: bool) -> Any:
        """reduce_scatter_tensor's common path (comm/direct.py): the prebuilt call for (group, op, async_op),
        the same collective with the same options as the general path's native call; MISS where the
        general path must serve it (the first call, a fallback due, a replaced function, a coalescing
        block, a tensor subclass or torch-function mode, tensors other than flat and contiguous, a
        size mismatch, a refusal: the general path raises, records or falls back as always)."""
        entry = direct.last_reduce_scatter
        if (entry is None or entry.group is not group or entry.op is not op or entry.async_op is not async_op
                or entry.world is not direct._WORLD._default_pg):
            entry = direct.find_reduce_scatter(group, op, async_op)
            if entry is None:
                return MISS
        if self.reduce_scatter_function is not TORCH_REDUCE_SCATTER:
            return MISS
        forced, refused = self._forced, self._refused
        if (forced or refused) and entry.fallback_due(forced, refused):
            return MISS
        if direct._WORLD._pg_coalesce_state:
            return MISS
        try:
            if (output_tensor.ndim != 1 or input_tensor.ndim != 1
                    or input_tensor.shape[0] != output_tensor.shape[0] * entry.world_size
                    or _has_torch_function(input_tensor) or not output_tensor.is_contiguous()
                    or not input_tensor.is_contiguous()):
                return MISS
        except AttributeError:  # not tensors: the general path says so
            return MISS
        try:
            work = entry.pg._reduce_scatter_base(output_tensor, input_tensor, entry.options)
        except (RuntimeError, NotImplementedError, ValueError) as err:
            if not _UNSUPPORTED.search(str(err)):
                raise
            return MISS  # a refusal enqueues nothing: the general path meets it again and records it
        if async_op:
            return work
        if work is not None:
            work.wait()
        return None

    def reduce_scatter_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                              group: Any = None, async_op: bool = False) -> Any:
        work = self.reduce_scatter_direct(output_tensor, input_tensor, op, group, async_op)
        if work is not MISS:
            return work
        ws = self.get_world_size(group)
        if input_tensor.numel() != output_tensor.numel() * ws:
            raise ValueError(f"reduce_scatter_tensor: input has {input_tensor.numel()} elements, expected "
                             f"output.numel() * world_size = {output_tensor.numel()} * {ws}")

        def native(o: Any, a: bool) -> Any:
            if self.reduce_scatter_function is None:
                raise NotImplementedError("reduce_scatter_tensor is not available in this torch")
            out_flat = _flat(output_tensor, "output_tensor")
            in_flat = input_tensor.contiguous().view(-1)  # both input layouts, as for all-gather
            return self._native_or_fallback(
                "reduce_scatter_tensor", group,
                lambda: self.reduce_scatter_function(out_flat, in_flat, op=o, group=group, async_op=a),
                lambda: self._reduce_scatter_via_all_reduce(output_tensor, [input_tensor], o, group, a))

        return self._with_op(op, group, async_op, native, [output_tensor])

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op: Any = dist.ReduceOp.SUM,
                       group: Any = None, async_op: bool = False) -> Any:
        ws = self.get_world_size(group)
        if len(input_list) != ws:
            raise ValueError(f"reduce_scatter: input_list has {len(input_list)} tensors, expected world size {ws}")

        def native(o: Any, a: bool) -> Any:
            return self._native_or_fallback(
                "reduce_scatter", group,
                lambda: dist.reduce_scatter(output, input_list, op=o, group=group, async_op=a),
                lambda: self._reduce_scatter_via_all_reduce(output, input_list, o, group, a))

        return self._with_op(op, group, async_op, native, [output])

    def _reduce_scatter_via_all_reduce(self, output: torch.Tensor, inputs: list[torch.Tensor], op: Any,
                                       group: Any, async_op: bool) -> Any:
        """Reduce the whole input everywhere, keep this rank's slice: twice the traffic of a real
        reduce-scatter, but every backend has all_reduce. Inputs are left untouched."""
        flat = torch.cat([t.reshape(-1) for t in inputs]) if len(inputs) > 1 else inputs[0].reshape(-1).clone()
        self.all_reduce(flat, op, group, False)
        rank = self.get_rank(group)
        if len(inputs) > 1:
            start = sum(t.numel() for t in inputs[:rank])
        else:
            start = rank * output.numel()
        output.copy_(flat[start:start + output.numel()].view_as(output))
        return CompletedWork() if async_op else None

    # ---- gathers and exchanges -----------------------------------------------------------
    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
                   async_op: bool = False) -> Any:
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)

    def _all_gather_entry(self, group: Any, async_op: bool) -> Any:
        """The prebuilt all-gather for (group, async_op) where it may serve a call now, else None."""
        try:
            entry = direct.ALL_GATHERS[(group, async_op)]
        except (KeyError, TypeError):
            entry = None
        if entry is None or entry.world is not direct._WORLD._default_pg:
            entry = direct.prebuild_all_gather(group, async_op)
            if entry is None:
                return None
        if self.all_gather_function is not TORCH_ALL_GATHER or direct._WORLD._pg_coalesce_state:
            return None
        forced, refused = self._forced, self._refused
        if (forced or refused) and entry.fallback_due(forced, refused):
            return None
        return entry

    def all_gather_direct(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                          async_op: bool) -> Any:
        """all_gather_into_tensor's common path, as reduce_scatter_direct (MISS: the general path serves it)."""
        entry = self._all_gather_entry(group, async_op)
        if entry is None:
            return MISS
        try:
            if (output_tensor.ndim != 1 or input_tensor.ndim != 1 or input_tensor.dtype.is_complex
                    or output_tensor.shape[0] != input_tensor.shape[0] * entry.world_size
                    or _has_torch_function(input_tensor) or not output_tensor.is_contiguous()
                    or not input_tensor.is_contiguous()):
                return MISS
        except AttributeError:  # not tensors: the general path says so
            return MISS
        try:
            work = entry.pg._allgather_base(output_tensor, input_tensor, entry.options)
        except (RuntimeError, NotImplementedError, ValueError) as err:
            if not _UNSUPPORTED.search(str(err)):
                raise
            return MISS
        if async_op:
            return work
        if work is not None:
            work.wait()
        return None

    def all_gather_coalesced_direct(self, output_tensors: Sequence[torch.Tensor], input_tensors: Sequence[torch.Tensor],
                                    group: Any, async_op: bool) -> Any:
        """Several all_gather_into_tensor as one collective (what torch's coalescing manager issues for a
        block of them); the checks run over the tensors in C. MISS: the general path serves each pair."""
        if not output_tensors or PG_ALL_GATHER_COALESCED is None:
            return MISS
        entry = self._all_gather_entry(group, async_op)
        if entry is None:
            return MISS
        try:
            ws = entry.world_size
            if (set(map(_DIM, output_tensors)) != _FLAT or set(map(_DIM, input_tensors)) != _FLAT
                    or any(map(_COMPLEX, input_tensors))
                    or list(map(_NUMEL, output_tensors)) != [n * ws for n in map(_NUMEL, input_tensors)]):
                return MISS
            if (_any_torch_function(input_tensors) or not all(map(_CONTIGUOUS, output_tensors))
                    or not all(map(_CONTIGUOUS, input_tensors))):
                return MISS
        except (TypeError, ValueError):  # not tensors (or no inputs): the general path says so
            return MISS
        try:
            work = entry.pg.allgather_into_tensor_coalesced(list(output_tensors), list(input_tensors), entry.options)
        except (RuntimeError, NotImplementedError, ValueError) as err:
            if not _UNSUPPORTED.search(str(err)):
                raise
            return MISS
        if async_op:
            return work
        if work is not None:
            work.wait()
        return None

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                               async_op: bool = False) -> Any:
        work = self.all_gather_direct(output_tensor, input_tensor, group, async_op)
        if work is not MISS:
            return work
        ws = self.get_world_size(group)
        if output_tensor.numel() != input_tensor.numel() * ws:
            raise ValueError(f"all_gather_into_tensor: output has {output_tensor.numel()} elements, expected "
                             f"input.numel() * world_size = {input_tensor.numel()} * {ws}")

        def fallback() -> Any:
            # views into the output, one per rank: all_gather writes straight into place
            parts = list(_flat(output_tensor, "output_tensor").view(ws, -1).unbind(0))
            parts = [p.view(input_tensor.shape) for p in parts]
            dist.all_gather(parts, input_tensor.contiguous(), group=group)
            return CompletedWork() if async_op else None

        if self.all_gather_function is None:
            return fallback()
        # flat views take both output layouts, (W*n, ...) and (W, n, ...), on every backend
        # (gloo accepts only the first)
        out_flat = _flat(output_tensor, "output_tensor")
        in_flat = input_tensor.contiguous().view(-1)
        return self._native_or_fallback(
            "all_gather_into_tensor", group,
            lambda: self.all_gather_function(out_flat, in_flat, group=group, async_op=async_op), fallback)

    # DeepSpeed's older name
    def all_gather_base(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                        async_op: bool = False) -> Any:
        return self.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)

    def all_gather_coalesced(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                             group: Any = None, async_op: bool = False) -> Any:
        if len(output_tensors) != len(input_tensors):
            raise ValueError(f"all_gather_coalesced: {len(output_tensors)} outputs for {len(input_tensors)} inputs")
        work = self.all_gather_coalesced_direct(output_tensors, input_tensors, group, async_op)
        if work is not MISS:
            return work
        for out, inp in zip(output_tensors, input_tensors):
            self.all_gather_into_tensor(out, inp, group, False)
        return CompletedWork() if async_op else None

    def all_gather_object(self, object_list: list[Any], obj: Any, group: Any = None) -> Any:
        return dist.all_gather_object(object_list, obj, group=group)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
        return dist.broadcast(tensor, src=src, group=group, async_op=async_op)

    def broadcast_object_list(self, object_list: list[Any], src: int, group: Any = None, device: Any = None) -> Any:
        return dist.broadcast_object_list(object_list, src=src, group=group, device=device)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                          input_split_sizes: list[int] | None = None, group: Any = None, async_op: bool = False) -> Any:
        return dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                      input_split_sizes=input_split_sizes, group=group, async_op=async_op)

    def all_to_all(self, output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
                   group: Any = None, async_op: bool = False) -> Any:
        def fallback() -> Any:
            # one all_to_all_single over flat buffers, split by each tensor's element count
            send = torch.cat([t.reshape(-1) for t in input_tensor_list])
            recv = torch.empty(sum(t.numel() for t in output_tensor_list), dtype=send.dtype, device=send.device)
            dist.all_to_all_single(recv, send, output_split_sizes=[t.numel() for t in output_tensor_list],
                                   input_split_sizes=[t.numel() for t in input_tensor_list], group=group)
            offset = 0
            for t in output_tensor_list:
                t.copy_(recv[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
            return CompletedWork() if async_op else None

        return self._native_or_fallback(
            "all_to_all", group,
            lambda: dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op), fallback)

    def gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
               group: Any = None, async_op: bool = False) -> Any:
        return dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)

    def scatter(self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
                group: Any = None, async_op: bool = False) -> Any:
        return dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)

    # ---- point to point ------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
        return dist.send(tensor, dst=dst, group=group, tag=tag)

    def recv(self, tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Any:
        return dist.recv(tensor, src=src, group=group, tag=tag)

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
        return dist.isend(tensor, dst=dst, group=group, tag=tag)

    def irecv(self, tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Any:
        return dist.irecv(tensor, src=src, group=group, tag=tag)

    # ---- synchronisation -----------------------------------------------------------------
    def barrier(self, group: Any = None, async_op: bool = False, device_ids: list[int] | None = None) -> Any:
        return dist.barrier(group=group if group is not None else dist.GroupMember.WORLD, async_op=async_op,
                            device_ids=device_ids)

    def monitored_barrier(self, group: Any = None, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> Any:
        return dist.monitored_barrier(group=group if group is not None else dist.GroupMember.WORLD, timeout=timeout,
                                      wait_all_ranks=wait_all_ranks)

    # ---- groups and ranks ----------------------------------------------------------------
    def get_rank(self, group: Any = None) -> int:
        return dist.get_rank(group=group)

    def get_world_size(self, group: Any = None) -> int:
        return dist.get_world_size(group=group)

    def get_backend(self, group: Any = None) -> str:
        return str(dist.get_backend(group))

    def new_group(self, ranks: Sequence[int] | None = None, **kwargs: Any) -> Any:
        return dist.new_group(ranks, **kwargs)

    def get_global_rank(self, group: Any, group_rank: int) -> int:
        return dist.get_global_rank(group if group is not None else dist.GroupMember.WORLD, group_rank)

    def get_world_group(self) -> Any:
        return dist.group.WORLD

    def destroy_process_group(self, group: Any = None) -> None:
        direct.clear()  # its entries hold process groups
        return dist.destroy_process_group(group)
