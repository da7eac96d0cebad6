"""DeepCompile for ZeRO-3 (DeepSpeed's deepspeed.compile.init_z3): the model's forward, compiled as one graph
in which the gathers of our store's units and the reduce-scatters of their gradients are operations.

The runner replaces the module's ZeRO-3 gather hooks. Each call it hands the compiled function one leaf
tensor per unit: this rank's chunk of the unit (an alias of the store's shard, so the optimizer's updates
are seen), requiring grad when its group trains. Inside the graph every unit is gathered from its leaf
(`dsc::z3_gather`), the parameters are views of the gathered unit, and the module runs with them
(torch.nn.utils.stateless reparametrization). The gather's gradient is the reduce-scatter of the unit's
gradient, started asynchronously in the backward graph; when autograd hands the leaf its gradient (after
the compiled backward) the runner waits for that collective and adds the chunk, averaged, into the ZeRO
optimizer's gradient partition (ZeroGradPartitioner.add_reduced) where it would add its own reduced
buckets. The passes (passes/zero3_compile.py) place each gather before its first use, re-gather in the
backward instead of saving units, and prefetch one unit ahead.

A graph break inside the model (data-dependent control flow) splits the model's frame: the units are then
gathered before the break by the part dynamo captured, and the rest of the model runs on them, compiled
region by region; the numbers are the same, the memory is that of gathered parameters for that forward.
This is said once in the log."""
from __future__ import annotations

from typing import Any, Optional

import torch

from deepspeed_c.compile import backend as dc_backend
from deepspeed_c.compile.custom_ops import Z3GraphContext, register_context, unregister_context


class Z3GraphRunner:
    """The compiled ZeRO-3 forward of one engine's module."""

    def __init__(self, module: torch.nn.Module, optimizer: Any, group: Any, backend: str,
                 compile_kwargs: dict, log: Any) -> None:
        store = optimizer.store
        self.module = module
        self.store = store
        self.reducer = optimizer.reducer
        self._log = log
        names: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        self.units: list[tuple[int, int, int]] = []  # unit -> (group, chunk start, chunk end)
        self.members: list[list[tuple[str, int, int, tuple[int, ...]]]] = []
        for u, params in enumerate(store.unit_params):
            g = store.unit_of[u][0]
            start, end = store.chunk_range(u)
            self.units.append((g, start, end))
            self.members.append([(name, off, int(p.ds_numel), tuple(p.ds_shape))
                                 for p, off in params for name in names.get(id(p), [])])
        self.trainable = [any(p.requires_grad for p in params) and g < len(self.reducer.groups)
                          for g, params in enumerate(store.groups)]
        self.context = Z3GraphContext(group=group, world_size=store.world_size, shards=store.shards,
                                      unit_of=self.units)
        self.handle = register_context(self.context)
        kwargs = {k: v for k, v in compile_kwargs.items() if k not in ("backend", "options", "mode")}
        self._compiled = torch.compile(self._run, backend=dc_backend.make_backend(backend, compile_kwargs), **kwargs)
        self.calls = 0
        self.graphs_first_call = 0

    # -- what the compiled function runs -----------------------------------------------------------
    def _run(self, leaves: list[torch.Tensor], args: tuple, kwargs: dict) -> Any:
        from torch.nn.utils.stateless import _reparametrize_module

        params: dict[str, torch.Tensor] = {}
        for u, (g, start, end) in enumerate(self.units):
            if not self.members[u]:
                continue
            full = torch.ops.dsc.z3_gather(leaves[u], self.handle, u, -1)
            for name, off, numel, shape in self.members[u]:
                params[name] = full.narrow(0, off, numel).view(shape)
        with _reparametrize_module(self.module, params):
            return self.module._call_impl(*args, **kwargs)

    def _leaves(self) -> list[torch.Tensor]:
        """One leaf per unit: this rank's chunk of it, an alias of the store's shard (a leaf per unit, not per
        group, so each unit's reduced gradient reaches autograd as the graph produced it, without assembly)."""
        grad = torch.is_grad_enabled()
        leaves = []
        shards = self.store.shards
        for u, (g, start, end) in enumerate(self.units):
            leaf = shards[g][start:end].detach()
            if grad and self.trainable[g] and self.members[u]:
                leaf.requires_grad_(True)
                leaf.register_hook(self._grad_arrived(u))
                leaf.register_post_accumulate_grad_hook(self._drop_grad)
            leaves.append(leaf)
        return leaves

    def _grad_arrived(self, u: int) -> Any:
        """A tensor hook, before autograd accumulates: the collective still holds the tensor until it is waited
        for (autograd would copy it, unfinished, into .grad), so wait first, then add it into the partition."""
        g, start, _ = self.units[u]
        scale = 1.0 / self.store.world_size

        def hook(grad: torch.Tensor) -> torch.Tensor:
            self.context.finish_reduce(u)
            self.reducer.add_reduced(g, grad, start=start, scale=scale)
            return grad

        return hook

    @staticmethod
    def _drop_grad(leaf: torch.Tensor) -> None:
        leaf.grad = None  # the partition has it

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        before = len(dc_backend.graphs_compiled)
        leaves = self._leaves()
        self.context.begin_forward(expect_backward=any(leaf.requires_grad for leaf in leaves))
        try:
            return self._compiled(leaves, args, kwargs)
        finally:
            self.context.end_forward()
            if self.calls == 0:
                self._report_first_call(len(dc_backend.graphs_compiled) - before)
            self.calls += 1

    def _report_first_call(self, graphs: int) -> None:
        self.graphs_first_call = graphs
        fresh = dc_backend.graphs_compiled[-graphs:] if graphs else []
        gathers = sum(g["gathers"] for g in fresh)
        if graphs > 1:
            self._log(f"DeepCompile: the model's forward did not compile as one graph ({graphs} graphs: dynamo "
                      "broke it, e.g. at data-dependent control flow); its units are gathered before the break "
                      "and the regions after it run compiled on them, with the same numbers but without "
                      "per-unit release in those regions. Remove the break (torch._dynamo.explain names it) "
                      "for the full schedule.")
        else:
            self._log(f"DeepCompile: ZeRO-3 forward compiled as one graph with {gathers} unit gathers "
                      "(recomputed in the backward, one unit prefetched ahead, reduce-scatter in the graph)")

    def remove(self) -> None:
        unregister_context(self.handle)
        if self.module.__dict__.get("_compiled_call_impl") is self:
            self.module._compiled_call_impl = None


def init_z3(module: torch.nn.Module, optimizer: Any, group: Any, backend: str, compile_kwargs: dict,
            log: Any) -> Z3GraphRunner:
    """Takes the module's ZeRO-3 gathers into compiled graphs: the gather hooks go (the store stays the
    parameters' home), and the module's calls go through the runner."""
    if getattr(optimizer, "store", None) is None or getattr(optimizer, "reducer", None) is None:
        raise ValueError("config key 'compile.deepcompile' at ZeRO stage 3 needs the engine's ZeRO-3 optimizer "
                         f"(got {type(optimizer).__name__}): pass an optimizer (config 'optimizer' or "
                         "initialize(optimizer=...)), or call engine.compile without compile.deepcompile")
    coordinator: Optional[Any] = getattr(optimizer, "coordinator", None)
    if coordinator is not None:
        coordinator.remove()
    optimizer.store.release_all(keep_persistent=False)
    runner = Z3GraphRunner(module, optimizer, group, backend, compile_kwargs, log)
    # what nn.Module.compile sets: the module's calls (the engine's, and a user's own) run the runner
    module._compiled_call_impl = runner
    return runner
