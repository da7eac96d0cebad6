"""ZeRO-3's gather/release module hooks: plain functions while nothing is compiled, torch.compiler.disable'd
ones from the first dynamo compile of the process on.

Under torch.compile each hook must be a clean graph break with its body run outside dynamo (traced, dynamo would
follow it into the gathers and break at the first collective, or compile the bookkeeping frame by frame).
torch.compiler.disable's wrapper gives that, but in eager execution it costs three Python calls and four
eval-frame switches per call, and ZeRO-3 calls these hooks twice per module per forward (9% of the profiled calls
of a step of benchmarks/zero3_host_overhead.py). So the hooks are registered plain and swapped, in place in the module's hook dict
(same id and order), for disabled wrappers when dynamo starts compiling anything: the swap runs in dynamo's
compile-start callback, before the frame is traced, so dynamo never sees a plain hook. A hook already disabled
(the root module's pair, see ParamCoordinator) is the gate: torch._dynamo.reset() drops the start callbacks,
and the root's pre-hook, which runs before any hook inside the model can be traced, registers it again and
swaps (a reset means dynamo is in use). Other eager-only fast paths switch at the same moment (on_compile: the
memory-efficient Linear's direct Function apply, linear.py; the outside-call hooks taken off while their unit
root runs, outside_hooks.py)."""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch


class CompileAwareHooks:
    """The hooks of one ZeRO-3 coordinator that may be swapped for disabled ones."""

    def __init__(self) -> None:
        self._handles: list[Any] = []  # torch's RemovableHandle: a weak reference to the hook dict, the key
        self._on_compile: list[Callable[[], None]] = []
        self.compiled = False
        _LIVE.add(self)
        watch()

    def register(self, module: torch.nn.Module, hook: Callable[..., Any], *, pre: bool, **kwargs: Any) -> Any:
        if self.compiled:
            hook = torch.compiler.disable(hook)
        handle = (module.register_forward_pre_hook if pre else module.register_forward_hook)(hook, **kwargs)
        self._handles.append(handle)
        return handle

    def hooks(self) -> list[Callable[..., Any]]:
        """The registered hooks as they are now (removed ones left out)."""
        return [d[h.id] for h in self._handles if (d := h.hooks_dict_ref()) is not None and h.id in d]

    def on_compile(self, switch: Callable[[], None]) -> None:
        """`switch` runs when the hooks are swapped (now, if they have been): other eager-only fast paths."""
        self._on_compile.append(switch)
        if self.compiled:
            switch()

    def wrap(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        """A hook registered for one call (not swappable): disabled once compiling has been seen."""
        return torch.compiler.disable(hook) if self.compiled else hook

    def use_compiled(self) -> None:
        if self.compiled:
            return
        self.compiled = True
        for switch in self._on_compile:  # first: one puts hooks taken off back on, to be swapped below
            switch()
        for h in self._handles:
            d = h.hooks_dict_ref()
            if d is not None and h.id in d:
                d[h.id] = torch.compiler.disable(d[h.id])

    def check(self) -> None:
        """Once per forward, from a disabled hook: the compile-start callback is still registered."""
        if not self.compiled and not watching():
            watch()
            for hooks in list(_LIVE):
                hooks.use_compiled()


_LIVE: "weakref.WeakSet[CompileAwareHooks]" = weakref.WeakSet()


def _on_compile_start(*_: Any) -> None:  # torch 2.6 passes nothing, later torch the compile's CallbackArgs
    for hooks in list(_LIVE):
        hooks.use_compiled()


def watching() -> bool:
    return _on_compile_start in torch._dynamo.callback_handler.start_callbacks


def watch() -> None:
    import torch._dynamo  # noqa: F401 (watching() reads torch._dynamo)

    if not watching():
        torch._dynamo.callback_handler.register_start_callback(_on_compile_start)
