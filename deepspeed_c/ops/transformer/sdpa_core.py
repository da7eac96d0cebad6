"""The attention core of DeepSpeedTransformerLayer on a GPU: softmax(q k^T * scale + mask), dropout, times v,
through torch's fused SDPA kernels, kept inside our layer's one autograd node.

Two forms with the same contract (`.out`, `.backward(dctx) -> (dq, dk, dv)`):

  _CudnnCore   aten's cuDNN attention forward and backward ops called directly: the kernels torch's SDPA runs
               for these shapes on sm90, without building a nested autograd graph in the forward and running
               it with autograd.grad in the backward (~0.15 ms of host time a layer on an H200's host, and a
               BERT-Large step at batch 64 x seq 128 is bound by the host)
  _SDPAGraph   torch's public SDPA under autograd, asked for dq, dk, dv in our backward: any backend, any torch

_CudnnCore is taken where the ops exist with the argument names below, a mask is given (its backward takes the
bias as a tensor) and the activations are fp16 or bf16 (for float32 the op returns NaN on an H200 instead of
refusing); anything else, or DSC_TRANSFORMER_CUDNN_SDPA=0, takes _SDPAGraph, and a shape cuDNN refuses
once (device, dtype, lengths, head size, mask rows) takes _SDPAGraph for the rest of the process."""
from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F

_FORWARD_ARGS = ["query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
                 "return_debug_mask", "scale"]
_BACKWARD_ARGS = ["grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset",
                  "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale"]


def _schema_matches() -> bool:
    try:
        fwd = torch.ops.aten._scaled_dot_product_cudnn_attention.default._schema
        bwd = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default._schema
    except (AttributeError, RuntimeError):
        return False
    return [a.name for a in fwd.arguments] == _FORWARD_ARGS and [a.name for a in bwd.arguments] == _BACKWARD_ARGS


_ENABLED = os.environ.get("DSC_TRANSFORMER_CUDNN_SDPA", "1") != "0" and _schema_matches()
_REFUSED: set[tuple] = set()  # (device, dtype, lengths, head size, mask rows) cuDNN refused once
_LOCK = threading.Lock()
_CUDNN_DTYPES = (torch.float16, torch.bfloat16)


class _SDPAGraph:
    """SDPA under autograd inside our forward; our backward asks it for dq, dk, dv. It keeps what SDPA saves
    (q, k, v views of the stored qkv, the output, the log-sum-exp, the dropout seed)."""

    def __init__(self, q, k, v, mask, p: float, scale: float, track: bool):
        with torch.set_grad_enabled(track):
            self.inputs = [t.detach().requires_grad_(track) for t in (q, k, v)]
            self.out = F.scaled_dot_product_attention(*self.inputs, attn_mask=mask, dropout_p=p, scale=scale)

    def backward(self, dctx, retain_graph: bool = False):
        return torch.autograd.grad(self.out, self.inputs, dctx, retain_graph=retain_graph)


class _CudnnCore:
    """aten's cuDNN attention, forward now and backward on request, with the saved state torch's own autograd
    formula passes between them (output, log-sum-exp, dropout seed and offset, sequence bounds)."""

    def __init__(self, q, k, v, mask, p: float, scale: float):
        (self.out, self._lse, self._cum_q, self._cum_k, self._max_q, self._max_k, self._seed, self._offset,
         _) = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, mask, True, p, False, False, scale=scale)
        self._q, self._k, self._v, self._mask, self._p, self._scale = q, k, v, mask, p, scale

    def backward(self, dctx, retain_graph: bool = False):  # the saved state stays usable: nothing to retain
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dctx, self._q, self._k, self._v, self.out, self._lse, self._seed, self._offset, self._mask,
            self._cum_q, self._cum_k, self._max_q, self._max_k, self._p, False, scale=self._scale)


def attention_core(q, k, v, mask, p: float, scale: float, track: bool):
    """The core for one forward: _CudnnCore when it applies (see the module's doc), else _SDPAGraph."""
    if not (_ENABLED and track and mask is not None and q.is_cuda and q.dtype in _CUDNN_DTYPES):
        return _SDPAGraph(q, k, v, mask, p, scale, track)
    key = (q.device.index, q.dtype, q.shape[-2], k.shape[-2], q.shape[-1], mask.shape[-2])
    if key in _REFUSED:
        return _SDPAGraph(q, k, v, mask, p, scale, track)
    try:
        return _CudnnCore(q, k, v, mask, p, scale)
    except RuntimeError:  # cuDNN does not take this shape here: SDPA chooses for it from now on
        with _LOCK:
            _REFUSED.add(key)
        return _SDPAGraph(q, k, v, mask, p, scale, track)
