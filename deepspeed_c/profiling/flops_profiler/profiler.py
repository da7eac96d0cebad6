"""FlopsProfiler and get_model_profile (deepspeed.profiling.flops_profiler's API).

A profile attaches to every module, as DeepSpeed does, the attributes `__flops__`, `__macs__`,
`__params__`, `__expert_params__`, `__model_expert_params__`, `__start_time__` and
`__duration__`, which user code and the printed tree read. Forward pre/post hooks open and
close a counting frame (patches.frames) and time the module with a device synchronisation on
each side; the counted ops are the patched torch functions (patches.py, formulas in counts.py).
A module's totals are the sums over its subtree; its latency is its own forward time, or the sum
of its children's for containers that are never called (ModuleList)."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional, TextIO

import torch
from torch import nn

from deepspeed_c.profiling.flops_profiler import patches
from deepspeed_c.profiling.flops_profiler.rnn import MODULE_HOOKS
from deepspeed_c.profiling.flops_profiler.units import (DEFAULT_PRECISION, bytes_to_string, duration_to_string,
                                                        flops_to_string, macs_to_string, number_to_string,
                                                        params_to_string)
from deepspeed_c.utils.logging import logger

__all__ = ["FlopsProfiler", "get_model_profile", "get_module_flops", "get_module_macs", "get_module_duration",
           "number_to_string", "macs_to_string", "flops_to_string", "params_to_string", "duration_to_string",
           "bytes_to_string", "DEFAULT_PRECISION"]

_PROFILE_ATTRS = ("__flops__", "__macs__", "__params__", "__expert_params__", "__model_expert_params__",
                  "__start_time__", "__duration__")
_EXPERT_PREFIX = "ep_size_"


def _synchronize() -> None:
    from deepspeed_c.accelerator import get_accelerator

    get_accelerator().synchronize()


def _param_numel(p: torch.Tensor) -> int:
    # a ZeRO-3 partitioned parameter is empty outside its gather; ds_numel is its full size
    numel = getattr(p, "ds_numel", None)
    return int(numel) if numel is not None else p.numel()


def _expert_parallelism(p: torch.Tensor) -> int:
    """ep size of an MoE expert parameter (group_name 'ep_size_N'), 0 for any other parameter."""
    name = getattr(p, "group_name", "")
    if isinstance(name, str) and name.startswith(_EXPERT_PREFIX):
        try:
            return int(name[len(_EXPERT_PREFIX):])
        except ValueError:
            return 0
    return 0


def get_module_flops(module: nn.Module) -> int:
    return sum(getattr(m, "__flops__", 0) for m in module.modules())


def get_module_macs(module: nn.Module) -> int:
    return sum(getattr(m, "__macs__", 0) for m in module.modules())


def get_module_duration(module: nn.Module) -> float:
    duration = getattr(module, "__duration__", 0)
    if duration == 0:
        duration = sum(get_module_duration(child) for child in module.children())
    return duration


class FlopsProfiler:
    """Measures the latency, estimated flops/MACs and parameters of each module of a model's forward.

    Use start_profile() before a forward, read get_total_*() or print_model_profile() after it,
    and end_profile() to remove every hook, attribute and patched torch function."""

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self.func_patched = False
        self._handles: list[Any] = []
        self.flops = self.macs = self.params = 0

    # -- lifecycle -------------------------------------------------------------------------------
    def start_profile(self, ignore_list: Optional[Iterable[type]] = None) -> None:
        """Reset the counters, patch the profiled torch functions and hook every module (except
        those whose type is in ignore_list: their ops count toward their parent)."""
        logger.info("Flops profiler started")
        self.reset_profile()
        patches.install()
        ignored = tuple(ignore_list or ())
        for handle in self._handles:  # a second start_profile must not hook the modules twice
            handle.remove()
        self._handles.clear()
        for module in self.model.modules():
            if ignored and type(module) in ignored:
                continue
            direct = MODULE_HOOKS.get(type(module))
            if direct is not None:  # counted from its weights, not timed (as DeepSpeed's)
                self._handles.append(module.register_forward_hook(direct))
                continue
            self._handles.append(module.register_forward_pre_hook(_open_frame))
            self._handles.append(module.register_forward_hook(_close_frame, always_call=True))
        self.started = True
        self.func_patched = True

    def stop_profile(self) -> None:
        """Restore the torch functions and remove the hooks; the counts stay readable."""
        if self.started and self.func_patched:
            patches.restore()
            self.func_patched = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset_profile(self) -> None:
        """Zero (or add) the per-module counters and count each module's parameters."""
        for module in self.model.modules():
            module.__flops__ = 0
            module.__macs__ = 0
            dense = expert = model_expert = 0
            for p in module.parameters():
                n, ep = _param_numel(p), _expert_parallelism(p)
                if ep:
                    expert += n
                    model_expert += n * ep
                else:
                    dense += n
            module.__params__ = dense
            module.__expert_params__ = expert
            module.__model_expert_params__ = model_expert
            module.__start_time__ = 0
            module.__duration__ = 0

    def end_profile(self) -> None:
        """Stop profiling and delete every attribute the profile added."""
        if not self.started:
            return
        self.stop_profile()
        self.started = False
        for module in self.model.modules():
            for attr in _PROFILE_ATTRS:
                if attr in module.__dict__:
                    delattr(module, attr)
        logger.info("Flops profiler finished")

    # -- totals ----------------------------------------------------------------------------------
    def get_total_flops(self, as_string: bool = False) -> Any:
        total = get_module_flops(self.model)
        return number_to_string(total) if as_string else total

    def get_total_macs(self, as_string: bool = False) -> Any:
        total = get_module_macs(self.model)
        return macs_to_string(total) if as_string else total

    def get_total_duration(self, as_string: bool = False) -> Any:
        total = get_module_duration(self.model)
        return duration_to_string(total) if as_string else total

    def get_total_params(self, as_string: bool = False) -> Any:
        """Parameters stored per rank (expert parameters of this rank included)."""
        total = self.model.__params__ + self.model.__expert_params__
        return params_to_string(total) if as_string else total

    def is_expert_tensor_parallelism_enabled(self) -> bool:
        for module in self.model.modules():
            if hasattr(module, "enable_expert_tensor_parallelism") and type(module).__name__ == "MoE":
                return bool(module.enable_expert_tensor_parallelism)
        return False

    # -- printing --------------------------------------------------------------------------------
    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: Optional[str] = None) -> None:
        """Print the summary, the aggregated profile and (detailed) the module tree annotated with
        each module's profile, to stdout or to output_file (its directory is created)."""
        if not self.started:
            return
        from deepspeed_c.profiling.flops_profiler import report

        report.emit(output_file, lambda out: report.write_model_profile(
            self, out, profile_step=profile_step, module_depth=module_depth, top_modules=top_modules,
            detailed=detailed))

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1,
                                       out: Optional[TextIO] = None) -> None:
        """Print, per depth, the top_modules module classes by params, MACs and forward latency."""
        from deepspeed_c.profiling.flops_profiler import report

        report.write_aggregated_profile(self.model, out, module_depth=module_depth, top_modules=top_modules)


def _open_frame(module: nn.Module, inputs: Any) -> None:
    patches.frames.append([])
    _synchronize()
    module.__start_time__ = time.time()


def _close_frame(module: nn.Module, inputs: Any, output: Any) -> None:
    _synchronize()
    if hasattr(module, "__duration__"):
        module.__duration__ += time.time() - module.__start_time__
    if patches.frames:
        counted = patches.frames.pop()
        if hasattr(module, "__flops__"):
            module.__flops__ += int(sum(f for f, _ in counted))
            module.__macs__ += int(sum(m for _, m in counted))


def _run(model: nn.Module, mode: str, args: list, kwargs: dict) -> None:
    call: Callable[..., Any] = model if mode == "forward" else model.generate
    call(*args, **kwargs)


def get_model_profile(model: nn.Module, input_shape: Optional[tuple] = None, args: list = [], kwargs: dict = {},
                      print_profile: bool = True, detailed: bool = True, module_depth: int = -1,
                      top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: Optional[str] = None, ignore_modules: Optional[list] = None,
                      mode: str = "forward") -> tuple[Any, Any, Any]:
    """Profile one forward (or generate) of `model` after `warm_up` unprofiled ones and return
    (flops, macs, params), as strings when as_string. The input is either a tensor of
    `input_shape` (the model's dtype and device; its values are uninitialised) or args/kwargs."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")
    if input_shape is not None:
        if type(input_shape) is not tuple or len(input_shape) < 1:
            raise TypeError(f"get_model_profile: input_shape must be a non-empty tuple, got {input_shape!r}")
        first = next(model.parameters(), None)
        like = first if first is not None else torch.empty(())
        args = [torch.empty(input_shape, dtype=like.dtype, device=like.device)]
    if len(args) == 0 and len(kwargs) == 0:
        raise ValueError("get_model_profile: give input_shape, or args and/or kwargs, for the model's input")
    prof = FlopsProfiler(model)
    model.eval()
    for _ in range(warm_up):
        _run(model, mode, list(args), dict(kwargs))
    prof.start_profile(ignore_list=ignore_modules)
    try:
        _run(model, mode, list(args), dict(kwargs))
        flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
        if print_profile:
            prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                     detailed=detailed, output_file=output_file)
    finally:
        prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
