"""The dynamo backend of DeepCompile (DeepSpeed's deepspeed.compile.backend): the ZeRO-3 passes
(passes/zero3_compile.py) around inductor or AOT autograd's eager compiler. Pass times are kept for
engine.get_compile_time()."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from deepspeed_c.compile.passes import zero3_compile

opt_pass_times: dict[str, float] = {}
graphs_compiled: list[dict[str, int]] = []  # per graph dynamo handed over: gathers (for tests and the log)


def _timed(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    t = time.perf_counter()
    try:
        return fn(*args)
    finally:
        opt_pass_times[name] = opt_pass_times.get(name, 0.0) + time.perf_counter() - t


def _graph_pass(fn: Callable[[torch.fx.Graph], Any], name: str) -> Any:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Pass(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            _timed(name, fn, graph)

        def uuid(self) -> Any:  # the FX graph cache keys on this: bump with the pass's behaviour
            return f"deepspeed_c.compile.{name}.v3.{int(zero3_compile.ACROSS_BOUNDARY)}"

    return _Pass()


def _partition(joint: Any, joint_inputs: Any, **kwargs: Any) -> Any:
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    _timed("mark_gathers_recomputed", zero3_compile.mark_gathers_recomputed, joint.graph)
    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def _eager_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    _timed("schedule_prefetch", zero3_compile.schedule_prefetch, gm.graph)
    gm.recompile()
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(gm.forward)


def make_backend(backend: str, compile_kwargs: dict) -> Callable[..., Any]:
    """A dynamo backend: the gathers sink to their first use, then inductor (recomputing gathers in the
    backward, prefetching one unit ahead) or, for "eager", AOT autograd with the same partition and
    schedule and no code generation."""
    if backend not in ("inductor", "eager"):
        raise ValueError(f"DeepCompile: backend {backend!r} is not supported; use 'inductor' or 'eager' "
                         "(argument 'backend' of engine.compile)")
    options = dict(compile_kwargs.get("options") or {})

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        _timed("sink_gathers", zero3_compile.sink_gathers, gm)
        graphs_compiled.append({"gathers": len(zero3_compile.gather_nodes(gm.graph))})
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            patches = dict(options)
            patches["joint_custom_pre_pass"] = _graph_pass(zero3_compile.mark_gathers_recomputed,
                                                           "mark_gathers_recomputed")
            patches["post_grad_custom_post_pass"] = _graph_pass(zero3_compile.schedule_prefetch, "schedule_prefetch")
            return compile_fx(gm, example_inputs, config_patches=patches)
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=_eager_compiler, bw_compiler=_eager_compiler,
                            partition_fn=_partition)(gm, example_inputs)

    return compile_graph
