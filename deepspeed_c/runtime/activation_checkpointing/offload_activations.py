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

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Optional

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["CheckpointActivationOffloadStats", "CheckpointHiddenStatesOffload",
           "get_checkpoint_hidden_states_offloading_ctx_manager"]


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


_ACTIVE = threading.local()


def _stack() -> list["CheckpointHiddenStatesOffload"]:
    if not hasattr(_ACTIVE, "stack"):
        _ACTIVE.stack = []
    return _ACTIVE.stack


@contextlib.contextmanager
def _marking_hf_layers() -> Any:
    """While active, HF's GradientCheckpointingLayer marks its hidden-states input for offload."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # no transformers: only explicit mark() calls select tensors
        yield
        return
    original: Callable[..., Any] = GradientCheckpointingLayer.__call__

    def call(layer: Any, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if _stack() and isinstance(hidden, torch.Tensor) and layer.training and \
                getattr(layer, "gradient_checkpointing", False):
            _stack()[-1].mark(hidden)
        return original(layer, *args, **kwargs)

    GradientCheckpointingLayer.__call__ = call
    try:
        yield
    finally:
        GradientCheckpointingLayer.__call__ = original


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
        self._marking: Any = None
        super().__init__(self._pack, self._unpack)

    def mark(self, tensor: torch.Tensor) -> None:
        self._marks[id(tensor)] = self._marks.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def _take_mark(self, tensor: torch.Tensor) -> bool:
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
        if not self._take_mark(tensor):
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
        held.tensor, held.host, held.event = None, host, event
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
        self._marking = _marking_hf_layers()
        self._marking.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._marking.__exit__(*exc)
            _stack().remove(self)
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
