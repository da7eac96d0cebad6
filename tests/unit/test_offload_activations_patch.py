"""How CheckpointHiddenStatesOffload installs its marker on transformers' GradientCheckpointingLayer
(issue 49 item 6; the scenarios of DeepSpeed's tests/unit/runtime/activation_checkpointing/
test_offload_activations.py): the class's __call__ is wrapped once however many contexts are open,
the wrapper marks each layer call's positional hidden states once (for the innermost context), and
the class is restored exactly (no class-owned __call__ left behind) when the outermost context exits,
also on an exception; an explicit patch_gradient_checkpointing_layer_marker() stays installed."""
from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from deepspeed_c.runtime.activation_checkpointing import offload_activations as oa
from deepspeed_c.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

transformers = pytest.importorskip("transformers")
GradientCheckpointingLayer = transformers.GradientCheckpointingLayer


class _Tiny(GradientCheckpointingLayer):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = hidden_states.sin()
        return h * h


def _layer() -> _Tiny:
    layer = _Tiny()
    layer.gradient_checkpointing = True
    layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
    layer.train()
    return layer


def _ctx() -> CheckpointHiddenStatesOffload:
    return CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0)


def _clean() -> bool:
    return "__call__" not in GradientCheckpointingLayer.__dict__


def test_patch_restored_after_exit_and_marks_only_inside():
    orig = GradientCheckpointingLayer.__call__
    layer, x = _layer(), torch.randn(4, 8, requires_grad=True)
    ctx = _ctx()
    with ctx:
        assert GradientCheckpointingLayer.__call__ is not orig
        layer(x)
    assert GradientCheckpointingLayer.__call__ is orig and _clean()
    assert ctx.stats.marked_tensors == 1
    layer(x)
    assert ctx.stats.marked_tensors == 1


def test_patch_restored_on_exception():
    orig = GradientCheckpointingLayer.__call__
    with pytest.raises(ValueError, match="boom"):
        with _ctx():
            raise ValueError("boom")
    assert GradientCheckpointingLayer.__call__ is orig and _clean()


def test_nested_contexts_share_one_patch_and_mark_once():
    orig = GradientCheckpointingLayer.__call__
    layer, x = _layer(), torch.randn(4, 8, requires_grad=True)
    outer, inner = _ctx(), _ctx()
    with outer:
        patched = GradientCheckpointingLayer.__call__
        assert patched is not orig
        with inner:
            assert GradientCheckpointingLayer.__call__ is patched  # not wrapped a second time
            layer(x).sum().backward()
        assert GradientCheckpointingLayer.__call__ is patched
        assert inner.stats.marked_tensors == 1 and inner.stats.saved_tensors_seen >= 1
        assert inner._marks == {}  # the one mark was consumed by the checkpoint's save
        layer(x)
    assert outer.stats.marked_tensors == 1 and outer._marks == {}
    assert GradientCheckpointingLayer.__call__ is orig and _clean()


def test_contexts_closed_out_of_order_still_restore():
    orig = GradientCheckpointingLayer.__call__
    a, b = _ctx(), _ctx()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert GradientCheckpointingLayer.__call__ is not orig  # b is still open
    b.__exit__(None, None, None)
    assert GradientCheckpointingLayer.__call__ is orig and _clean()


def test_unconsumed_marks_are_dropped():
    """A call whose hidden states autograd never saves (no grad, keyword argument) leaves no mark
    behind: a stale id() could match an unrelated tensor later."""
    layer = _layer()
    ctx = _ctx()
    with ctx:
        with torch.no_grad():
            layer(torch.randn(4, 8))
        layer(hidden_states=torch.randn(4, 8, requires_grad=True))
        assert ctx._marks == {}
        assert ctx.stats.marked_tensors == 0


def test_same_context_is_not_reentrant():
    ctx = _ctx()
    with ctx:
        with pytest.raises(RuntimeError, match="not re-entrant"):
            ctx.__enter__()
    assert _clean()


def test_explicit_patch_stays_installed_across_contexts():
    orig = GradientCheckpointingLayer.__call__
    oa.patch_gradient_checkpointing_layer_marker()
    try:
        patched = GradientCheckpointingLayer.__call__
        assert patched is not orig
        with _ctx():
            assert GradientCheckpointingLayer.__call__ is patched
        assert GradientCheckpointingLayer.__call__ is patched
    finally:
        oa._unpatch_gradient_checkpointing_layer_marker()
    assert GradientCheckpointingLayer.__call__ is orig and _clean()


def test_gradients_unchanged_with_nested_contexts():
    layer = _layer()
    x = torch.randn(4, 8, requires_grad=True)
    layer(x).sum().backward()
    want = x.grad.clone()
    x.grad = None
    with _ctx(), _ctx():
        layer(x).sum().backward()
    assert torch.equal(x.grad, want)


def test_marker_marks_the_checkpoint_input_and_host_tensors_stay():
    """DeepSpeed's test_marker_offloads_checkpoint_input on a host run: the layer's input is marked
    once, seen by the pack hook and left in place (host tensors are never offloaded)."""
    layer, x = _layer(), torch.randn(4, 8, requires_grad=True)
    ctx = _ctx()
    with ctx:
        layer(x).sum().backward()
    assert x.grad is not None
    assert ctx.stats.marked_tensors == 1 and ctx.stats.skipped_marked_tensors == 1
    assert ctx.stats.saved_tensors_seen >= ctx.stats.marked_tensors
    assert ctx.stats.offloaded_tensors == 0


def test_unmarked_saved_tensors_pass_through():
    x = torch.randn(4, 8, requires_grad=True)
    ctx = _ctx()
    with ctx:
        torch.nn.Linear(8, 8)(x).square().sum().backward()
    assert x.grad is not None and ctx.stats.saved_tensors_seen > 0
    assert ctx.stats.marked_tensors == 0 and ctx.stats.offloaded_tensors == 0


def test_hidden_states_is_the_first_positional_parameter():
    """The marker reads args[0]: transformers' decoder layers take hidden_states first."""
    import inspect

    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    params = list(inspect.signature(llama.LlamaDecoderLayer.forward).parameters.values())[1:]
    assert params[0].name == "hidden_states"
    assert params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
