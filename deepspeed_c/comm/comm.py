"""deepspeed_c.comm: DeepSpeed's `deepspeed.comm` functions over torch.distributed.

Every collective goes through the backend object `cdb` (a TorchBackend). When the comms logger
is on, the wrapper times the op (synchronising the device first so the time is the op's, not its
launch's) and records its message size; when it is off the wrapper costs one attribute test.

A process group created by someone else (torch.distributed.init_process_group, a test harness,
accelerate) is adopted on first use, so these functions work whichever way the group came up.
"""
from __future__ import annotations

import functools
import inspect
import time
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional, TypeVar

import torch
import torch.distributed as dist

from deepspeed_c.comm.backend import CompletedWork, Noop, TorchBackend  # noqa: F401  (public names)
from deepspeed_c.comm.comms_logging import CommsLogger
from deepspeed_c.comm.config import CommsLoggerConfig, DeepSpeedCommsConfig
from deepspeed_c.comm.constants import COMMS_LOGGER, default_pg_timeout
from deepspeed_c.comm.direct import MISS
from deepspeed_c.comm.reduce_op import ReduceOp
from deepspeed_c.comm.utils import get_caller_func, get_local_rank_from_launcher

# the backend object, named as DeepSpeed names it ("comm dist backend")
cdb: Optional[TorchBackend] = None
comms_logger = CommsLogger()

_NOT_INIT = "DeepSpeed backend not set, please initialize it using init_process_group()"

F = TypeVar("F", bound=Callable[..., Any])


def _backend() -> TorchBackend:
    """The backend; adopts a torch.distributed group that was initialised elsewhere."""
    global cdb
    if cdb is not None and cdb.is_initialized():
        return cdb
    if dist.is_available() and dist.is_initialized():
        cdb = TorchBackend(None, default_pg_timeout, None)
        return cdb
    raise AssertionError(_NOT_INIT)


def _world_size_for_bw() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


comms_logger.world_size_fn = _world_size_for_bw


# ---- configuration ------------------------------------------------------------------------

def _comms_config_of(deepspeed_config: Any) -> Any:
    """Whatever the caller holds -> an object with comms_logger_enabled / comms_logger."""
    if isinstance(deepspeed_config, CommsLoggerConfig):
        holder = DeepSpeedCommsConfig({})
        holder.comms_logger_enabled, holder.comms_logger = True, deepspeed_config
        return holder
    if isinstance(deepspeed_config, DeepSpeedCommsConfig):
        return deepspeed_config
    if isinstance(deepspeed_config, Mapping):
        # a whole ds_config dict, or just its comms_logger section
        if COMMS_LOGGER in deepspeed_config:
            return DeepSpeedCommsConfig(deepspeed_config)
        if set(deepspeed_config) <= set(CommsLoggerConfig.model_fields):
            return DeepSpeedCommsConfig({COMMS_LOGGER: dict(deepspeed_config)})
        return DeepSpeedCommsConfig({})
    for attr in ("comms_config", "comms_logger"):  # an engine config object
        inner = getattr(deepspeed_config, attr, None)
        if inner is not None:
            return _comms_config_of(inner)
    if hasattr(deepspeed_config, "comms_logger_enabled"):
        return deepspeed_config
    raise TypeError("configure(deepspeed_config=...) takes a CommsLoggerConfig, a DeepSpeedCommsConfig, a config "
                    f"dict or a config object with .comms_config; got {type(deepspeed_config).__name__}")


def configure(deepspeed_config: Any = None, enabled: Optional[bool] = None, prof_all: Optional[bool] = None,
              prof_ops: Optional[list[str]] = None, verbose: Optional[bool] = None,
              debug: Optional[bool] = None) -> None:
    """Set up the comms logger from a config (typed or dict) and/or plain values; plain values win."""
    if deepspeed_config is not None:
        comms_logger.configure(_comms_config_of(deepspeed_config))
    if enabled is not None:
        comms_logger.enabled = bool(enabled)
    if prof_all is not None:
        comms_logger.prof_all = bool(prof_all)
    if prof_ops is not None:
        comms_logger.prof_ops = [prof_ops] if isinstance(prof_ops, str) else list(prof_ops)
    if verbose is not None:
        comms_logger.verbose = bool(verbose)
    if debug is not None:
        comms_logger.debug = bool(debug)


# ---- the logging wrapper ------------------------------------------------------------------

def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.element_size() * obj.nelement()
    if isinstance(obj, (list, tuple)):
        return sum(t.element_size() * t.nelement() for t in obj if isinstance(t, torch.Tensor))
    return 0


def _synchronize(obj: Any) -> None:
    first = obj[0] if isinstance(obj, (list, tuple)) and obj else obj
    if isinstance(first, torch.Tensor) and first.device.type != "cpu":
        try:
            from deepspeed_c.accelerator import get_accelerator

            get_accelerator().synchronize()
            return
        except (ImportError, AttributeError):
            pass
        if first.device.type == "cuda":
            torch.cuda.synchronize(first.device)


def timed_op(size_arg: Optional[str], name: Optional[str] = None, depth: int = 2) -> Callable[[F], F]:
    """Log a comm function when the logger is on and the op is profiled (prof=True, prof_all, or
    its log_name in prof_ops). `size_arg` names the parameter whose bytes are the message size;
    `name` is the op's name in the log (the function's own by default); `depth` how far up the
    stack the debug caller is from the wrapper (one more where a public function calls it)."""

    def decorate(func: F) -> F:
        params = list(inspect.signature(func).parameters.values())
        names = [p.name for p in params]
        size_pos = names.index(size_arg) if size_arg in names else -1
        log_pos = names.index("log_name") if "log_name" in names else -1
        prof_pos = names.index("prof") if "prof" in names else -1
        debug_pos = names.index("debug") if "debug" in names else -1
        raw_name = name or func.__name__
        default_log = params[log_pos].default if log_pos >= 0 else raw_name

        def arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, name: str, default: Any) -> Any:
            if 0 <= pos < len(args):
                return args[pos]
            return kwargs.get(name, default)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not comms_logger.enabled:
                return func(*args, **kwargs)
            log_name = arg(args, kwargs, log_pos, "log_name", default_log)
            if not comms_logger.should_profile(arg(args, kwargs, prof_pos, "prof", False), log_name):
                return func(*args, **kwargs)
            payload = arg(args, kwargs, size_pos, size_arg or "", None)
            record_name = log_name
            if comms_logger.debug:
                caller = arg(args, kwargs, debug_pos, "debug", None) or get_caller_func(depth)
                record_name = f"{log_name} | [Caller Func: {caller}]"
            _synchronize(payload)
            start = time.perf_counter()
            result = func(*args, **kwargs)
            _synchronize(payload)
            if cdb is not None and cdb.using_mpi:
                cdb.barrier()
            comms_logger.append(raw_name, record_name, (time.perf_counter() - start) * 1e3, _nbytes(payload))
            return result

        return wrapper  # type: ignore[return-value]

    return decorate


# ---- state --------------------------------------------------------------------------------

def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def destroy_process_group(group: Any = None) -> None:
    global cdb
    if not is_initialized():
        return
    _backend().destroy_process_group(group)
    if group is None or not dist.is_initialized():
        cdb = None


def new_group(ranks: Any, **kwargs: Any) -> Any:
    return _backend().new_group(ranks, **kwargs)


def get_world_group() -> Any:
    return _backend().get_world_group()


def get_world_size(group: Any = None) -> int:
    return _backend().get_world_size(group)


def get_rank(group: Any = None) -> int:
    return _backend().get_rank(group)


def get_local_rank() -> int:
    """This process's rank on its node (= its device index), from the launcher's environment."""
    _backend()
    return get_local_rank_from_launcher()


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return _backend().get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    _backend()
    return list(dist.get_process_group_ranks(group if group is not None else dist.GroupMember.WORLD))


def get_backend(group: Any = None) -> str:
    return _backend().get_backend(group)


def collective_device(group: Any = None) -> torch.device:
    """Where a tensor handed to this group's collectives must live: NCCL only takes CUDA tensors
    (host-side state such as offloaded masters is staged through the current device), gloo takes
    host tensors."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def has_all_gather_into_tensor() -> bool:
    return _backend().has_all_gather_into_tensor()


def has_reduce_scatter_tensor() -> bool:
    return _backend().has_reduce_scatter_tensor()


def has_all_reduce_coalesced() -> bool:
    return _backend().has_all_reduce_coalesced


def has_coalescing_manager() -> bool:
    return _backend().has_coalescing_manager


# ---- collectives --------------------------------------------------------------------------

@timed_op("tensor")
def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, prof: bool = False,
              log_name: str = "broadcast", debug: Optional[str] = None) -> Any:
    return _backend().broadcast(tensor, src, group, async_op)


@timed_op(None)
def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None) -> Any:
    return _backend().broadcast_object_list(object_list, src, group, device)


@timed_op("tensor")
def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_gather", debug: Optional[str] = None) -> Any:
    return _backend().all_gather(tensor_list, tensor, group, async_op)


@timed_op(None)
def all_gather_object(object_list: list[Any], obj: Any, group: Any = None, prof: bool = False,
                      log_name: str = "all_gather_object", debug: Optional[str] = None) -> Any:
    return _backend().all_gather_object(object_list, obj, group)


@timed_op("tensor", name="all_gather_into_tensor", depth=3)
def _all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                            async_op: bool = False, prof: bool = False, log_name: str = "all_gather_into_tensor",
                            debug: Optional[str] = None) -> Any:
    return _backend().all_gather_into_tensor(output_tensor, tensor, group, async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False, prof: bool = False, log_name: str = "all_gather_into_tensor",
                           debug: Optional[str] = None) -> Any:
    # ZeRO-3's per-fetch call: as reduce_scatter_tensor below
    backend = cdb
    if backend is not None and not comms_logger.enabled:
        work = backend.all_gather_direct(output_tensor, tensor, group, async_op)
        if work is not MISS:
            return work
    return _all_gather_into_tensor(output_tensor, tensor, group, async_op, prof, log_name, debug)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                 async_op: bool = False, debug: Optional[str] = None) -> Any:
    """all_gather_into_tensor where torch has it, else all_gather into views of the output."""
    if has_all_gather_into_tensor():
        return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op, debug=debug)
    parts = list(torch.chunk(output_tensor, get_world_size(group)))
    return all_gather(parts, input_tensor, group=group, async_op=async_op, debug=debug)


@timed_op("tensor", name="reduce_scatter_tensor", depth=3)
def _reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                           group: Any = None, async_op: bool = False, prof: bool = False,
                           log_name: str = "reduce_scatter_tensor", debug: Optional[str] = None) -> Any:
    return _backend().reduce_scatter_tensor(output_tensor, tensor, op, group, async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False, prof: bool = False,
                          log_name: str = "reduce_scatter_tensor", debug: Optional[str] = None) -> Any:
    # ZeRO's per-bucket call: with the logger off, one test, then the backend's prebuilt call (comm/direct.py)
    backend = cdb
    if backend is not None and not comms_logger.enabled:
        work = backend.reduce_scatter_direct(output_tensor, tensor, op, group, async_op)
        if work is not MISS:
            return work
    return _reduce_scatter_tensor(output_tensor, tensor, op, group, async_op, prof, log_name, debug)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
                      async_op: bool = False, prof: bool = False, debug: Optional[str] = None) -> Any:
    """reduce_scatter_tensor where torch has it, else reduce_scatter over chunks of the input."""
    if has_reduce_scatter_tensor():
        return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op, prof=prof,
                                     debug=debug)
    chunks = list(torch.chunk(tensor, get_world_size(group)))
    return reduce_scatter(output_tensor, chunks, op=op, group=group, async_op=async_op, prof=prof, debug=debug)


@timed_op("input_list")
def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False, prof: bool = False, log_name: str = "reduce_scatter",
                   debug: Optional[str] = None) -> Any:
    return _backend().reduce_scatter(output, input_list, op, group, async_op)


@timed_op("tensor")
def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: Optional[list[int]] = None,
                      input_split_sizes: Optional[list[int]] = None, group: Any = None, async_op: bool = False,
                      prof: bool = False, log_name: str = "all_to_all_single", debug: Optional[str] = None) -> Any:
    return _backend().all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group, async_op)


@timed_op("input_tensor_list")
def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group: Any = None,
               async_op: bool = False, prof: bool = False, log_name: str = "all_to_all",
               debug: Optional[str] = None) -> Any:
    return _backend().all_to_all(output_tensor_list, input_tensor_list, group, async_op)


@timed_op("tensor")
def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False,
         log_name: str = "send", debug: Optional[str] = None) -> Any:
    return _backend().send(tensor, dst, group, tag)


@timed_op("tensor")
def recv(tensor: torch.Tensor, src: Optional[int] = None, group: Any = None, tag: int = 0, prof: bool = False,
         log_name: str = "recv", debug: Optional[str] = None) -> Any:
    return _backend().recv(tensor, src, group, tag)


@timed_op("tensor")
def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False,
          log_name: str = "isend", debug: Optional[str] = None) -> Any:
    return _backend().isend(tensor, dst, group, tag)


@timed_op("tensor")
def irecv(tensor: torch.Tensor, src: Optional[int] = None, group: Any = None, tag: int = 0, prof: bool = False,
          log_name: str = "irecv", debug: Optional[str] = None) -> Any:
    return _backend().irecv(tensor, src, group, tag)


@timed_op("tensor")
def gather(tensor: torch.Tensor, gather_list: Optional[list[torch.Tensor]] = None, dst: int = 0, group: Any = None,
           async_op: bool = False, prof: bool = False, log_name: str = "gather", debug: Optional[str] = None) -> Any:
    return _backend().gather(tensor, gather_list, dst, group, async_op)


@timed_op("tensor")
def scatter(tensor: torch.Tensor, scatter_list: Optional[list[torch.Tensor]] = None, src: int = 0, group: Any = None,
            async_op: bool = False, prof: bool = False, log_name: str = "scatter", debug: Optional[str] = None) -> Any:
    return _backend().scatter(tensor, scatter_list, src, group, async_op)


@timed_op(None)
def barrier(group: Any = None, async_op: bool = False, device_ids: Optional[list[int]] = None, prof: bool = False,
            log_name: str = "barrier", debug: Optional[str] = None) -> Any:
    return _backend().barrier(group, async_op, device_ids)


@timed_op(None)
def monitored_barrier(group: Any = None, timeout: Optional[timedelta] = None, wait_all_ranks: bool = False,
                      prof: bool = False, log_name: str = "monitored_barrier", debug: Optional[str] = None) -> Any:
    return _backend().monitored_barrier(group, timeout, wait_all_ranks)


@timed_op("tensor")
def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
           prof: bool = False, log_name: str = "reduce", debug: Optional[str] = None) -> Any:
    return _backend().reduce(tensor, dst, op, group, async_op)


@timed_op("tensor")
def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_reduce", debug: Optional[str] = None) -> Any:
    return _backend().all_reduce(tensor, op, group, async_op)


@timed_op("tensor")
def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
                         prof: bool = False, log_name: str = "all_reduce", debug: Optional[str] = None) -> Any:
    return _backend().inference_all_reduce(tensor, op, group)


@timed_op("tensors")
def all_reduce_coalesced(tensors: list[torch.Tensor], op: Any = ReduceOp.SUM, group: Any = None,
                         async_op: bool = False, prof: bool = False, log_name: str = "all_reduce",
                         debug: Optional[str] = None) -> Any:
    return _backend().all_reduce_coalesced(tensors, op, group, async_op)


def all_gather_coalesced(output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], group: Any = None,
                         async_op: bool = False) -> Any:
    """all_gather_into_tensor of each pair, as one collective where the backend can (not logged, as DeepSpeed's)."""
    backend = cdb
    if backend is not None and len(output_tensors) == len(input_tensors):
        work = backend.all_gather_coalesced_direct(output_tensors, input_tensors, group, async_op)
        if work is not MISS:
            return work
    return _backend().all_gather_coalesced(output_tensors, input_tensors, group, async_op)


# ---- the comms log ------------------------------------------------------------------------

def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Optional[dict[str, Any]]:
    """Print the comms summary table on rank 0 (every rank may return the dict). A collective:
    every rank must call it. The two synchronising barriers are not themselves logged."""
    backend = _backend()
    rank, world = backend.get_rank(), backend.get_world_size()
    backend.barrier()

    def gather_all(obj: Any) -> list[Any]:
        everyone: list[Any] = [None] * world
        backend.all_gather_object(everyone, obj)
        return everyone

    result = comms_logger.log_all(print_log=rank == 0, show_straggler=show_straggler, return_dict=return_dict,
                                  gather_all=gather_all, rank=rank, world_size=world)
    backend.barrier()
    return result


def reset_log() -> None:
    comms_logger.reset_data()


def has_comm_data() -> bool:
    return comms_logger.has_data()


def get_comm_operation_count() -> int:
    return comms_logger.get_total_operations()


def get_logged_comm_ops() -> list[str]:
    return comms_logger.get_operation_names()


def start_profiling_comms() -> None:
    comms_logger.start_profiling_comms()


def stop_profiling_comms() -> None:
    comms_logger.stop_profiling_comms()


def start_profiling_op(op_name_list: list[str]) -> None:
    comms_logger.start_profiling_op(op_name_list)


def stop_profiling_op(op_name_list: list[str]) -> None:
    comms_logger.stop_profiling_op(op_name_list)


__all__ = [name for name in dir() if not name.startswith("_") and name not in {
    "annotations", "functools", "inspect", "os", "time", "timedelta", "Any", "Callable", "Mapping", "Optional",
    "TypeVar", "F", "torch", "dist", "cdb", "MISS"}]
