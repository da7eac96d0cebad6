"""The pre-hooks of modules inside ZeRO-3 unit roots, taken off while their root's forward runs.

A module inside a unit root (a block's Linear under automatic units) has a pre-hook for calls outside the root's
forward (ParamCoordinator._outside_call: the call becomes a step of the root). Inside the root's forward, where
nearly all its calls are, the hook does nothing, but its presence alone sends every call through torch's hooked
module-call path (a closure, the hook-dict walk, the compile check, the hook itself: six Python calls a module
call, a thousand a step for a 48-block model of Linears). So the root's pre-hook detaches its members' hooks and
its post-hook puts them back. Only a hook that is its module's sole pre-hook is taken off (putting it back then
keeps the order of hooks); one left off by a forward that raised is put back when the iteration ends. Under
torch.compile the hooks stay on (compile_hooks.py calls attach_all and stops the toggling before any trace)."""
from __future__ import annotations

from typing import Any


class OutsideCallHooks:

    def __init__(self) -> None:
        self.by_root: dict[int, list[tuple[dict, int, Any]]] = {}  # root key -> (hook dict, hook id, hook)
        self._detached: dict[int, list[tuple[dict, int, Any]]] = {}
        self.enabled = True

    def add(self, root_key: int, handle: Any) -> None:
        hooks = handle.hooks_dict_ref()
        self.by_root.setdefault(root_key, []).append((hooks, handle.id, hooks[handle.id]))

    def detach(self, root_key: int) -> None:
        if not self.enabled or root_key in self._detached:
            return  # a recursive call of the root: its first call took them off
        off = [e for e in self.by_root[root_key] if len(e[0]) == 1 and e[1] in e[0]]
        for hooks, hid, _ in off:
            del hooks[hid]
        self._detached[root_key] = off

    def attach(self, root_key: int) -> None:
        off = self._detached.pop(root_key, None)
        if off:
            for hooks, hid, hook in off:
                hooks[hid] = hook

    def attach_all(self) -> None:
        for key in list(self._detached):
            self.attach(key)

    def stop(self) -> None:
        """Hooks on for good (a compile, the coordinator's removal)."""
        self.attach_all()
        self.enabled = False
