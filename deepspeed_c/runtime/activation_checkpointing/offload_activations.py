"""Hidden-state CPU offload for Hugging Face gradient checkpointing (DeepSpeed 0.19.x's
`deepspeed.runtime.activation_checkpointing.offload_activations`).

    with get_checkpoint_hidden_states_offloading_ctx_manager():
        loss = model(**batch).loss      # HF model with gradient checkpointing (non-reentrant)
    loss.backward()

Inside the context, the input hidden states of each HF `GradientCheckpointingLayer` call are marked;
when autograd saves a marked tensor (the checkpoint keeps the layer's input), a `saved_tensors_hooks`
pair moves it to host memory (pinned, copied on a side stream) and brings it back when backward
unpacks it. Everything else autograd saves is untouched. The last `keep_last_count` marked tensors
stay on the device (backward needs them first), tensors under `min_offload_bytes` stay too, and
host tensors are never copied (a CPU run passes everything through, as DeepSpeed's does)."""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Optional

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["CheckpointActivationOffloadStats", "CheckpointHiddenStatesOffload",
           "get_checkpoint_hidden_states_offloading_ctx_manager", "patch_gradient_checkpointing_layer_marker"]


@dataclasses.dataclass
class CheckpointActivationOffloadStats:
    saved_tensors_seen: int = 0
    marked_tensors: int = 0
    offloaded_tensors: int = 0
    restored_tensors: int = 0
    skipped_marked_tensors: int = 0
    kept_last_tensors: int = 0
    offloaded_bytes: int = 0


class _Held:
    """What autograd holds for a marked tensor: the device tensor until it is offloaded (the newest
    keep_last_count stay), then its host copy and the event that says the copy is done."""
    __slots__ = ("tensor", "host", "device", "event")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: Optional[torch.Tensor] = tensor
        self.host: Optional[torch.Tensor] = None
        self.device = tensor.device
        self.event: Any = None

    def offloaded(self, host: torch.Tensor, event: Any) -> None:
        """The device tensor is let go: `host` holds its copy, done once `event` (None: already) completes."""
        self.tensor, self.host, self.event = None, host, event


_ACTIVE = threading.local()


def _stack() -> list["CheckpointHiddenStatesOffload"]:
    if not hasattr(_ACTIVE, "stack"):
        _ACTIVE.stack = []
    return _ACTIVE.stack


# The marker is one wrapper on the class, shared by every open context (any thread): installed by the
# first context to enter, removed when the last one exits, so nesting never wraps it twice and an
# out-of-order exit cannot put back a stale wrapper. An explicit patch_gradient_checkpointing_layer_marker()
# keeps it installed past the contexts, as DeepSpeed's does.
_PATCH_LOCK = threading.Lock()
_patch_users = 0  # open contexts
_installed_by_context = False
_wrapper: Optional[Callable[..., Any]] = None
_owned_call: Optional[Callable[..., Any]] = None  # the class's own __call__ before patching (None: inherited)


def _hf_layer_class() -> Any:
    try:
        from transformers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


def patch_gradient_checkpointing_layer_marker() -> None:
    """Wraps transformers' GradientCheckpointingLayer.__call__ so that, while a context is active, each
    training call marks its positional hidden states for offload (idempotent)."""
    global _wrapper, _owned_call
    with _PATCH_LOCK:
        if _wrapper is not None:
            return
        cls = _hf_layer_class()
        if cls is None:
            raise RuntimeError("patch_gradient_checkpointing_layer_marker needs the `transformers` package "
                               "(>= 4.52, which has GradientCheckpointingLayer): pip install transformers")
        _install(cls)


def _install(cls: Any) -> None:
    global _wrapper, _owned_call
    _owned_call = cls.__dict__.get("__call__")
    original: Callable[..., Any] = cls.__call__

    def call(layer: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = _stack()[-1] if _stack() else None
        hidden = args[0] if args else None  # a keyword hidden_states is never saved by the checkpoint
        marked = None
        if (ctx is not None and isinstance(hidden, torch.Tensor) and layer.training and torch.is_grad_enabled()
                and getattr(layer, "gradient_checkpointing", False)):
            ctx.mark(hidden)
            marked = hidden
        try:
            return original(layer, *args, **kwargs)
        finally:
            if marked is not None:  # not saved after all: a stale id() could match another tensor later
                ctx.take_mark(marked)

    cls.__call__ = call
    _wrapper = call


def _unpatch_gradient_checkpointing_layer_marker() -> None:
    global _wrapper, _owned_call
    wrapper, owned = _wrapper, _owned_call
    _wrapper = _owned_call = None
    cls = _hf_layer_class()
    if wrapper is None or cls is None or cls.__dict__.get("__call__") is not wrapper:
        return  # someone patched over us: leave theirs in place
    if owned is None:
        delattr(cls, "__call__")
    else:
        cls.__call__ = owned


def _context_entered() -> None:
    global _patch_users, _installed_by_context
    with _PATCH_LOCK:
        _patch_users += 1
        if _wrapper is None:
            cls = _hf_layer_class()
            if cls is not None:  # without transformers only explicit mark() calls select tensors
                _install(cls)
                _installed_by_context = True


def _context_exited() -> None:
    global _patch_users, _installed_by_context
    with _PATCH_LOCK:
        _patch_users = max(0, _patch_users - 1)
        if _patch_users == 0 and _installed_by_context:
            _unpatch_gradient_checkpointing_layer_marker()
            _installed_by_context = False


class CheckpointHiddenStatesOffload(saved_tensors_hooks):
    """Offloads only marked tensors (see the module docstring); not re-entrant."""

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64, keep_last_count: int = 1) -> None:
        for name, value in (("min_offload_bytes", min_offload_bytes), ("max_fwd_stash_count", max_fwd_stash_count),
                            ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count),
                            ("keep_last_count", keep_last_count)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.use_pin_memory = use_pin_memory
        self.use_streams = use_streams
        self.min_offload_bytes = min_offload_bytes
        self.keep_last_count = keep_last_count
        self.stats = CheckpointActivationOffloadStats()
        self._marks: dict[int, int] = {}
        self._pending: list[_Held] = []  # marked and still on the device, oldest first
        self._stream: Optional[torch.cuda.Stream] = None
        super().__init__(self._pack, self._unpack)

    def mark(self, tensor: torch.Tensor) -> None:
        self._marks[id(tensor)] = self._marks.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def take_mark(self, tensor: torch.Tensor) -> bool:
        """Consumes one mark of `tensor` (the saved-tensor hook, or the marker dropping a mark the checkpoint
        did not use); False when it had none."""
        count = self._marks.get(id(tensor), 0)
        if count == 0:
            return False
        if count == 1:
            del self._marks[id(tensor)]
        else:
            self._marks[id(tensor)] = count - 1
        return True

    def _pack(self, tensor: torch.Tensor) -> Any:
        self.stats.saved_tensors_seen += 1
        if not self.take_mark(tensor):
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cuda" or nbytes < self.min_offload_bytes:
            self.stats.skipped_marked_tensors += 1
            return tensor
        held = _Held(tensor)
        self._pending.append(held)
        while len(self._pending) > self.keep_last_count:
            self._offload(self._pending.pop(0))
        return held

    def _offload(self, held: _Held) -> None:
        tensor = held.tensor
        assert tensor is not None
        nbytes = tensor.numel() * tensor.element_size()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.use_pin_memory)
        if self.use_streams:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=tensor.device)
            self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self._stream):
                host.copy_(tensor, non_blocking=self.use_pin_memory)
                event = torch.cuda.Event()
                event.record(self._stream)
            tensor.record_stream(self._stream)  # the allocator must not reuse it before the copy ran
        else:
            host.copy_(tensor)
            event = None
        held.offloaded(host, event)
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += nbytes

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Held):
            return packed
        if packed.tensor is not None:  # one of the newest: never left the device
            self.stats.kept_last_tensors += 1
            return packed.tensor
        if packed.event is not None:
            packed.event.synchronize()
        self.stats.restored_tensors += 1
        return packed.host.to(packed.device, non_blocking=self.use_pin_memory)

    def reset(self) -> None:
        self.stats = CheckpointActivationOffloadStats()
        self._marks.clear()
        self._pending.clear()

    def __enter__(self) -> "CheckpointHiddenStatesOffload":
        if self in _stack():
            raise RuntimeError("CheckpointHiddenStatesOffload is not re-entrant; use a separate instance for a "
                               "nested context")
        self.reset()
        _stack().append(self)
        _context_entered()
        try:
            super().__enter__()
        except BaseException:
            _stack().remove(self)
            _context_exited()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _stack().remove(self)
            _context_exited()
            self._marks.clear()
            self._pending.clear()


def get_checkpoint_hidden_states_offloading_ctx_manager(
        use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64,
        keep_last_count: int = 1) -> CheckpointHiddenStatesOffload:
    return CheckpointHiddenStatesOffload(use_pin_memory=use_pin_memory, use_streams=use_streams,
                                         min_offload_bytes=min_offload_bytes,
                                         max_fwd_stash_count=max_fwd_stash_count,
                                         max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
                                         keep_last_count=keep_last_count)
