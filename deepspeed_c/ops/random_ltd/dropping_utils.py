"""random-LTD's token sampling and the gather/scatter of the kept tokens.

Sampling: each (layer, sample) keeps `reserved_length` of `seq_length` token positions, drawn uniformly
without replacement (torch.multinomial's draw over ones, as DeepSpeed draws them, so a seeded run draws the
same positions; made here without multinomial's host syncs) and sorted ascending so the kept tokens stay in
sequence order. Indices are [layers, batch, reserved_length] int32.

Gather / scatter move whole hidden vectors: batch_first hidden states are [batch, seq, hidden], otherwise
[seq, batch, hidden]. They run in C (token_ops: a CUDA kernel on GPU tensors, the plain-loop C reference on
host tensors; torch.gather/scatter where neither is built), one pass each. Their gradients are exact on their own: gather's
input gradient is the incoming one plus the kept tokens' gradients added at their positions; scatter's
gradient to the full activations is zero at the overwritten positions. (DeepSpeed's pair is only right in
combination: its gather overwrites the kept positions' gradient, its scatter passes it through.)

The C moves are not differentiable and torch.func cannot see inside them: under a torch.func transform
both Functions step aside for torch.gather / torch.scatter, and a create_graph backward (grad mode on
inside backward) forms its gradients with those differentiable torch ops instead of the C ones."""
from __future__ import annotations

from typing import Optional

import torch

from deepspeed_c.ops.random_ltd import token_ops
from deepspeed_c.runtime.autograd_paths import transforms_active


def _check(hidden: torch.Tensor, indices: torch.Tensor, batch_first: bool, what: str) -> None:
    if hidden.dim() != 3:
        raise ValueError(f"{what}: hidden states must be 3-d ([batch, seq, hidden] or [seq, batch, hidden]), "
                         f"got shape {tuple(hidden.shape)}")
    batch = hidden.shape[0] if batch_first else hidden.shape[1]
    if indices.dim() != 2 or indices.shape[0] != batch:
        raise ValueError(f"{what}: indices must be [batch={batch}, reserved_length], got shape {tuple(indices.shape)}")


def token_gather(hidden: torch.Tensor, indices: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """The kept tokens: out[b, j] = hidden[b, indices[b, j]] (seq-first: out[j, b] = hidden[indices[b, j], b])."""
    _check(hidden, indices, batch_first, "token_gather")
    return token_ops.gather(hidden, indices, batch_first)


def token_scatter(hidden: torch.Tensor, part: torch.Tensor, indices: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """A copy of `hidden` with the kept positions replaced by `part` (the layer's output on them)."""
    _check(hidden, indices, batch_first, "token_scatter")
    return token_ops.scatter(hidden, part, indices, batch_first)


def _rows(indices: torch.Tensor, batch_first: bool, like: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(sequence dim, index expanded over the hidden dim) for torch.gather / torch.scatter on `like`."""
    i = indices.to(device=like.device, dtype=torch.int64)
    return (1 if batch_first else 0), (i if batch_first else i.t()).unsqueeze(-1).expand(-1, -1, like.shape[-1])


def _torch_gather(hidden: torch.Tensor, indices: torch.Tensor, batch_first: bool) -> torch.Tensor:
    dim, index = _rows(indices, batch_first, hidden)
    return torch.gather(hidden, dim, index)


def _torch_scatter(hidden: torch.Tensor, part: torch.Tensor, indices: torch.Tensor, batch_first: bool) -> torch.Tensor:
    dim, index = _rows(indices, batch_first, hidden)
    return torch.scatter(hidden, dim, index, part.to(hidden.dtype))


class _GatherTokensNode(torch.autograd.Function):
    """GatherTokens's autograd node (see GatherTokens)."""

    @staticmethod
    def forward(ctx, activations: torch.Tensor, sorted_indices: torch.Tensor, batch_first: bool):
        ctx.save_for_backward(sorted_indices)
        ctx.batch_first = batch_first
        ctx.shape, ctx.dtype = activations.shape, activations.dtype
        return activations.view_as(activations), token_gather(activations, sorted_indices, batch_first)

    @staticmethod
    def backward(ctx, a_grad: Optional[torch.Tensor], g_grad: Optional[torch.Tensor]):
        (indices, ) = ctx.saved_tensors
        if g_grad is None:
            return a_grad, None, None
        if torch.is_grad_enabled():  # create_graph: the same sum through differentiable torch ops
            base = g_grad.new_zeros(ctx.shape, dtype=ctx.dtype) if a_grad is None else a_grad
            dim, index = _rows(indices, ctx.batch_first, base)
            return torch.scatter_add(base, dim, index, g_grad.to(base.dtype)), None, None
        like = g_grad.new_empty(ctx.shape, dtype=ctx.dtype) if a_grad is None else None  # shape only
        # the incoming gradient plus the kept tokens' gradients at their positions
        return token_ops.scatter(a_grad, g_grad, indices, ctx.batch_first, accumulate=True, like=like), None, None


class GatherTokens(torch.autograd.Function):
    """apply(activations, indices, batch_first) -> (activations, kept tokens), DeepSpeed's signature."""

    # the work is a separate Function, called by name: torch.compile traces that apply as torch's own (it
    # cannot resolve super().apply from an override)
    @classmethod
    def apply(cls, activations: torch.Tensor, sorted_indices: torch.Tensor,  # type: ignore[override]
              batch_first: bool):
        if not torch.compiler.is_compiling() and transforms_active():
            _check(activations, sorted_indices, batch_first, "GatherTokens")
            return activations.view_as(activations), _torch_gather(activations, sorted_indices, batch_first)
        return _GatherTokensNode.apply(activations, sorted_indices, batch_first)


class _ScatterTokensNode(torch.autograd.Function):
    """ScatterTokens's autograd node (see ScatterTokens)."""

    @staticmethod
    def forward(ctx, all_activations: torch.Tensor, layer_activations: torch.Tensor, sorted_indices: torch.Tensor,
                batch_first: bool):
        ctx.save_for_backward(sorted_indices)
        ctx.batch_first = batch_first
        ctx.layer_dtype = layer_activations.dtype
        return token_scatter(all_activations, layer_activations, sorted_indices, batch_first)

    @staticmethod
    def backward(ctx, out_grad: torch.Tensor):
        (indices, ) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: differentiable torch ops
            layer_grad = _torch_gather(out_grad, indices, ctx.batch_first).to(ctx.layer_dtype)
            all_grad = _torch_scatter(out_grad, torch.zeros_like(layer_grad), indices, ctx.batch_first)
            return all_grad, layer_grad, None, None
        layer_grad = token_ops.gather(out_grad, indices, ctx.batch_first).to(ctx.layer_dtype)
        all_grad = token_ops.scatter(out_grad, None, indices, ctx.batch_first)  # kept positions were overwritten
        return all_grad, layer_grad, None, None


class ScatterTokens(torch.autograd.Function):
    """apply(all_activations, layer_activations, indices, batch_first) -> all_activations with the kept
    positions replaced, DeepSpeed's signature."""

    # the work is a separate Function, called by name: torch.compile traces that apply as torch's own (it
    # cannot resolve super().apply from an override)
    @classmethod
    def apply(cls, all_activations: torch.Tensor, layer_activations: torch.Tensor,  # type: ignore[override]
              sorted_indices: torch.Tensor, batch_first: bool):
        if not torch.compiler.is_compiling() and transforms_active():
            _check(all_activations, sorted_indices, batch_first, "ScatterTokens")
            return _torch_scatter(all_activations, layer_activations, sorted_indices, batch_first)
        return _ScatterTokensNode.apply(all_activations, layer_activations, sorted_indices, batch_first)


def _sample(reserved_length: int, seq_length: int, batch_size: int, layers: int, device: torch.device) -> torch.Tensor:
    if not 0 < reserved_length <= seq_length:
        raise ValueError(f"random-LTD: reserved_length must be in 1..seq_length={seq_length}, got {reserved_length}")
    prob = torch.ones((layers * batch_size, seq_length), device=device)
    # torch.multinomial(prob, k) without replacement is top-k of prob / Exp(1) noise, but it first reads the
    # probabilities back to the host twice (a validity and a zero-sum check: two device syncs per forward). The
    # same draw without the checks (prob is all ones) takes the same generator values and gives the same indices.
    noise = torch.empty_like(prob).exponential_(1)
    keys = prob / noise
    drawn = (keys.topk(reserved_length, dim=-1).indices if reserved_length > 1 else keys.argmax(-1, keepdim=True))
    return drawn.sort(dim=-1).values.reshape(layers, batch_size, reserved_length).to(torch.int32)


def gpt_sample_tokens(reserved_length: int, seq_length: int, batch_size: int, layers: int = 1,
                      device: torch.device | str = "cpu", attn_mask: Optional[torch.Tensor] = None):
    """Decoder (causal) models: (indices [layers, batch, reserved], the causal mask cut to
    [..., reserved, reserved] or None). The kept tokens are in order, so the leading corner of a causal
    mask is their causal mask."""
    indices = _sample(reserved_length, seq_length, batch_size, layers, torch.device(device))
    new_mask = attn_mask[:, :, :reserved_length, :reserved_length] if attn_mask is not None else None
    return indices, new_mask


def bert_sample_tokens(reserved_length: int, seq_length: int, batch_size: int, layers: int = 1,
                       device: torch.device | str = "cpu", attn_mask: Optional[torch.Tensor] = None):
    """Encoder models: (indices, per layer the mask [batch, heads-or-1, reserved, reserved] of the kept rows
    and columns of each sample's mask)."""
    if attn_mask is None:
        raise ValueError("random-LTD with model_type 'encoder' needs the attention mask (model_mask_name)")
    indices = _sample(reserved_length, seq_length, batch_size, layers, torch.device(device))
    return indices, [token_ops.mask_gather(attn_mask, indices[layer]) for layer in range(layers)]
