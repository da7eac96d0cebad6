"""DeepSpeedTransformerLayer's math in differentiable torch ops: what the layer runs where its one autograd node
cannot serve.

The node (transformer_function.py) has a hand-written, first-order backward over CUDA kernels. Two ways users
call autograd need more, and get this composition instead (same weights, same masks, same rounding points as
the host path's `fused_reference` pieces):
- torch.func transforms (grad, vmap per-sample gradients, jacrev, jvp): the layer's forward runs this in the
  node's place, drawing its dropout masks with torch's RNG (under vmap, `randomness=` decides as for any op);
- a differentiable backward (`create_graph=True`: gradient penalties, double backward): the node's backward
  recomputes the forward from its saved input with this, replaying the forward's dropout masks, and returns
  torch's differentiable gradients."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from deepspeed_c.ops.transformer import fused_reference as ref
from deepspeed_c.runtime.autograd_paths import tensor_hooks_paused


def draw_keep(shape: tuple[int, ...], p: float, device: torch.device) -> Optional[torch.Tensor]:
    """A dropout keep mask drawn with torch's RNG (True with probability 1 - p), None when p is 0."""
    return None if p <= 0.0 else torch.rand(shape, device=device) >= p


def layer_forward(spec, x: torch.Tensor, mask: Optional[torch.Tensor], weights: Sequence[torch.Tensor],
                  keep_attn: Optional[torch.Tensor], keep1: Optional[torch.Tensor],
                  keep2: Optional[torch.Tensor]) -> torch.Tensor:
    """The layer on x [B, S, H] with an additive mask [B, 1 | S, S] (or None) and the given keep masks
    (keep_attn [B, heads, S, S]; keep1, keep2 [B * S, H]; None: no dropout there)."""
    qkvw, qkvb, ow, ob, anw, anb, iw, ib, outw, outb, nw, nb = weights
    B, S, Hd = x.shape
    nh, T = spec.heads, B * S
    d = Hd // nh
    s_hid = 1.0 / (1.0 - spec.hidden_dropout)
    x2 = x.reshape(T, Hd)
    a_in = ref.residual_norm(x2, None, None, None, 1.0, nw, nb, spec.eps, want_r=False)[1] \
        if spec.pre_layer_norm else x2
    q, k, v = F.linear(a_in, qkvw, qkvb).view(B, S, 3, nh, d).permute(2, 0, 3, 1, 4)
    probs = ref.softmax(torch.matmul(q, k.transpose(-1, -2)), mask, d ** -0.5)
    if keep_attn is not None:
        probs = probs * keep_attn * (1.0 / (1.0 - spec.attn_dropout))
    ctx = torch.matmul(probs, v).transpose(1, 2).reshape(T, Hd)
    r1, h1, _, _ = ref.residual_norm(F.linear(ctx, ow), ob, x2, keep1, s_hid, anw, anb, spec.eps, want_r=True)
    o = F.linear(ref.gelu(F.linear(h1, iw), ib), outw)
    if spec.pre_layer_norm:
        out = ref.residual_norm(o, outb, r1, keep2, s_hid, None, None, spec.eps, want_r=True)[0]
    else:
        out = ref.residual_norm(o, outb, h1, keep2, s_hid, nw, nb, spec.eps, want_r=False)[1]
    return out.view(B, S, Hd)


def transformed_forward(spec, x: torch.Tensor, mask: Optional[torch.Tensor],
                        weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The forward under a torch.func transform: fresh masks from torch's RNG."""
    B, S, Hd = x.shape
    keep_attn = draw_keep((B, spec.heads, S, S), spec.attn_dropout, x.device)
    keep1 = draw_keep((B * S, Hd), spec.hidden_dropout, x.device)
    keep2 = draw_keep((B * S, Hd), spec.hidden_dropout, x.device)
    return layer_forward(spec, x, mask, weights, keep_attn, keep1, keep2)


def differentiable_backward(spec, x: Optional[torch.Tensor], mask: Optional[torch.Tensor],
                            weights: Sequence[torch.Tensor], keeps: tuple, needs: Sequence[bool],
                            dout: torch.Tensor) -> list[Optional[torch.Tensor]]:
    """Gradients for x and the weights (None where `needs` says not) that carry their own graph: the forward
    recomputed from the saved input x with the forward's masks, then torch.autograd.grad with create_graph."""
    if x is None:
        raise RuntimeError("DeepSpeedTransformerLayer: a differentiable backward (create_graph=True) recomputes the "
                           "layer from its input, which pre_layer_norm with normalize_invertible=True does not keep; "
                           "set normalize_invertible=False in the DeepSpeedTransformerConfig for gradient penalties "
                           "or double backward")
    if spec.fused_attention and spec.attn_dropout > 0.0:
        raise RuntimeError("DeepSpeedTransformerLayer: a differentiable backward (create_graph=True) cannot replay "
                           "the attention dropout of the fused SDPA path; set attn_dropout_ratio=0, call "
                           "layer.eval(), or set layer.attention_impl = 'softmax' (its masks are kept)")
    with torch.enable_grad():
        out = layer_forward(spec, x, mask, weights, *keeps)
        inputs = [t for t, need in zip([x, *weights], needs) if need]
        with tensor_hooks_paused(inputs):  # the edges deliver these gradients: hooks run there, once
            grads = iter(torch.autograd.grad(out, inputs, dout, create_graph=True, allow_unused=True))
    return [next(grads) if need else None for need in needs]
