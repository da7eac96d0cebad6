"""torch.compile support (DeepSpeed's deepspeed.runtime.compiler): the helpers DeepSpeed exports
(is_compile_supported, disable, enable, is_compiling, compile) and what engine.compile does.

engine.compile compiles the module in place. Without DeepCompile every ZeRO stage works through its eager
hooks: the gradient hooks live on the parameters (they fire after the compiled backward accumulates), and
ZeRO-3's gather/release module hooks run outside the graphs (their bodies are not traced: dynamo breaks the
graph at each, the same numbers as eager). With `compile.deepcompile` at ZeRO-3 the gathers, releases and
gradient reduce-scatters become graph operations (deepspeed_c/compile/init_z3.py); at ZeRO-1/2 the compiled
model keeps the bucketed reduction of the eager engine, whose hooks run after the compiled backward."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


def is_compile_supported() -> bool:
    return hasattr(torch, "compile") and hasattr(torch, "compiler")


def is_compiling() -> bool:
    return bool(torch.compiler.is_compiling()) if is_compile_supported() else False


def disable(func: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compiler.disable(func) if is_compile_supported() else func


def enable(min_version: Any = None) -> Any:
    """DeepSpeed's decorator factory: the function as it is (deepspeed_c requires a torch that compiles)."""
    if callable(min_version):
        return min_version
    return lambda func: func


def compile() -> Callable[..., Any]:  # noqa: A001 (DeepSpeed's name)
    return torch.compile


def deepcompile_unsupported_reason() -> Optional[str]:
    """Why this torch cannot run DeepCompile (None when it can)."""
    if not is_compile_supported():
        return f"torch {torch.__version__} has no torch.compile"
    if not hasattr(torch.library, "custom_op") or not hasattr(torch.library, "register_autograd"):
        return f"torch {torch.__version__} lacks torch.library.custom_op / register_autograd (torch >= 2.4 needed)"
    try:
        import torch._inductor.config as inductor_config  # noqa: F401
        from torch._functorch.partitioners import must_recompute  # noqa: F401
        from torch.nn.utils.stateless import _reparametrize_module  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} lacks a compiler feature DeepCompile uses ({e})"
    if not hasattr(inductor_config, "joint_custom_pre_pass"):
        return f"torch {torch.__version__} has no inductor joint-graph pass hook (torch >= 2.6 needed)"
    return None


def kwargs_without_options(kwargs: dict) -> dict:
    """torch.compile's keywords less `options` (a custom backend takes those itself)."""
    return {k: v for k, v in kwargs.items() if k != "options"}


@dataclass
class CompiledModule:
    """What engine.compile left behind: the DeepCompile runner (ZeRO-3) or None (torch.compile in place)."""
    backend: str
    deepcompile_active: bool
    runner: Any = None

    def remove(self) -> None:
        if self.runner is not None:
            self.runner.remove()


def compile_engine_module(module: torch.nn.Module, compile_config: Any, *, backend: Optional[str],
                          compile_kwargs: Optional[dict], schedule: Any, compiled_autograd_enabled: bool,
                          zero_stage: int, optimizer: Any, group: Any, default_backend: str) -> CompiledModule:
    from deepspeed_c.utils.logging import log_dist

    if schedule is not None:
        raise NotImplementedError("deepspeed_c: engine.compile(schedule=...) (a custom DeepCompile pass schedule) is "
                                  "not built; the ZeRO-3 passes run on their own schedule. Pass schedule=None")
    if compiled_autograd_enabled:
        raise NotImplementedError("deepspeed_c: engine.compile(compiled_autograd_enabled=True) is not built; "
                                  "pass compiled_autograd_enabled=False")
    if not is_compile_supported():
        raise RuntimeError("compile is not supported in your version of PyTorch.")
    kwargs = dict(compile_kwargs or {})
    if "backend" in kwargs:
        log_dist("The `backend` in `compile_kwargs` will be overridden. Use the `backend` argument instead.", ranks=[0])
        kwargs.pop("backend")
    backend = backend or default_backend
    log = functools.partial(log_dist, ranks=[0])
    if compile_config.deepcompile and zero_stage == 3:
        from deepspeed_c.compile.init_z3 import init_z3

        runner = init_z3(module, optimizer, group, backend, kwargs, log)
        log(f"Compiling deepcompile=True backend={backend}: ZeRO-3 gathers, releases and reduce-scatters in the graph")
        return CompiledModule(backend, True, runner)
    if compile_config.deepcompile and "autosp" in (compile_config.passes or []):
        from deepspeed_c.compile.init_sp import init_autosp
        from deepspeed_c.utils import groups

        size = groups._get_sequence_parallel_world_size()
        module.compile(backend=init_autosp(backend, kwargs, groups._get_sequence_parallel_group(), size,
                                           groups._get_sequence_parallel_rank()), **kwargs_without_options(kwargs))
        log(f"Compiling deepcompile=True backend={backend}: AutoSP (Ulysses) over a sequence-parallel group of {size}")
        return CompiledModule(backend, True)
    if compile_config.deepcompile:
        log(f"Compiling deepcompile=True backend={backend}: at ZeRO stage {zero_stage} the compiled model keeps "
            "ZeRO's bucketed gradient reduction (hooks after the compiled backward)")
    module.compile(backend=backend, **kwargs)
    return CompiledModule(backend, False)
