"""AutoSP's dynamo backend (DeepSpeed's deepspeed.compile.init_sp): registers the sequence-parallel group, runs
the AutoSP passes (passes/sp_compile.py) on each graph dynamo captures, then compiles it with inductor or, for
"eager", AOT autograd without code generation (the same traced forward and backward, run op by op).

The group is the engine's sequence-parallel group (config `sequence_parallel_size`, world = data x sequence);
the engine's ZeRO-0 reduction already sums replicated weights' gradients over it and averages the data-parallel
replicas, which is what the per-rank backward of the aggregated loss needs."""
from __future__ import annotations

from typing import Any, Callable

import torch

from deepspeed_c.compile import sp_ops
from deepspeed_c.compile.backend import _timed
from deepspeed_c.compile.passes import sp_compile

graphs_transformed: list[dict[str, int]] = []  # per graph: SDPAs wrapped, losses aggregated (tests, logs)


def init_autosp(backend: str, compile_kwargs: dict, group: Any, size: int, rank: int) -> Callable[..., Any]:
    if backend not in ("inductor", "eager"):
        raise ValueError(f"AutoSP: backend {backend!r} is not supported; use 'inductor' or 'eager' "
                         "(argument 'backend' of engine.compile)")
    sp_ops.register_group(group, size, rank)
    options = dict(compile_kwargs.get("options") or {})

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        if size > 1:
            graphs_transformed.append(_timed("autosp", sp_compile.apply_autosp, gm, size, rank))
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs, config_patches=options)
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def run(g: torch.fx.GraphModule, _inputs: Any) -> Any:
            return make_boxed_func(g.forward)

        return aot_autograd(fw_compiler=run, bw_compiler=run)(gm, example_inputs)

    return compile_graph
