"""deepspeed_c.runtime.activation_checkpointing.offload_activations (DeepSpeed 0.19.x): the context
from `get_checkpoint_hidden_states_offloading_ctx_manager()` marks the hidden-states input of each
Hugging Face `GradientCheckpointingLayer` and offloads it to host memory when autograd saves it,
restoring it in backward; host tensors pass through ("cpu-like accelerators ... never offload",
DeepSpeed's docstring). Gradients must equal a run without the context, bit for bit."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.runtime.activation_checkpointing.offload_activations import (
    CheckpointHiddenStatesOffload, get_checkpoint_hidden_states_offloading_ctx_manager)

LAYERS = 3


def _llama(device: str):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _grads(model, ids, ctx=None):
    model.zero_grad(set_to_none=True)
    if ctx is None:
        loss = model(input_ids=ids, labels=ids).loss
    else:
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _check(device: str, min_bytes: int):
    model = _llama(device)
    ids = torch.randint(0, 64, (2, 16), device=device)
    ref = _grads(model, ids)
    ctx = get_checkpoint_hidden_states_offloading_ctx_manager(min_offload_bytes=min_bytes)
    got = _grads(model, ids, ctx)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    return ctx.stats


def test_cpu_marks_every_layer_input_and_passes_through():
    stats = _check("cpu", 0)
    assert stats.marked_tensors == LAYERS
    assert stats.offloaded_tensors == 0 and stats.skipped_marked_tensors == LAYERS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload to host needs a CUDA device")
def test_cuda_offloads_all_but_the_last_and_restores():
    stats = _check("cuda", 0)
    assert stats.marked_tensors == LAYERS and stats.offloaded_tensors == LAYERS - 1
    assert stats.restored_tensors == LAYERS - 1 and stats.kept_last_tensors == 1


def test_bad_arguments_and_reentry():
    with pytest.raises(ValueError, match="keep_last_count"):
        CheckpointHiddenStatesOffload(keep_last_count=-1)
    ctx = CheckpointHiddenStatesOffload()
    with ctx:
        with pytest.raises(RuntimeError, match="re-entrant"):
            ctx.__enter__()
