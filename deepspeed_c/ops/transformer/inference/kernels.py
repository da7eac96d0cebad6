"""Front end of the fused inference kernels: tensors on a GPU go to the CUDA op
`transformer_inference` (csrc/cuda/inference_*.cu, built by op_builder on first use), tensors on
the host to the torch reference (`reference.py`). Callers allocate every output.

The past length reaches the kernels as a device int32 (`past_dev`), not as an argument: a
captured CUDA graph of the decode step replays with a new length without being recaptured."""
from __future__ import annotations

from types import ModuleType

import torch

from deepspeed_c.ops.transformer.inference import reference as ref

_op: ModuleType | None = None


def cuda_op() -> ModuleType:
    """The built CUDA op (built on first call; OpBuildError quotes the compiler when it fails)."""
    global _op
    if _op is None:
        from deepspeed_c.ops.op_builder import InferenceBuilder
        _op = InferenceBuilder().load()
    return _op


def add_norm(x: torch.Tensor, y: torch.Tensor | None, bias: torch.Tensor | None, gamma: torch.Tensor,
             beta: torch.Tensor | None, eps: float, r_out: torch.Tensor | None, n_out: torch.Tensor) -> None:
    if x.is_cuda:
        cuda_op().add_norm(x, y, bias, gamma, beta, float(eps), r_out, n_out)
    else:
        ref.add_norm(x, y, bias, gamma, beta, eps, r_out, n_out)


def qkv_rotary_cache(qkv: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor | None,
                     sin: torch.Tensor | None, positions: torch.Tensor | None, past: int,
                     past_dev: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     q_out: torch.Tensor, n_heads: int, n_kv: int, head_dim: int, rot: int) -> None:
    if qkv.is_cuda:
        cuda_op().qkv_rotary_cache(qkv, bias, cos, sin, positions, past_dev, k_cache, v_cache, q_out,
                                   n_heads, n_kv, head_dim, rot)
    else:
        ref.qkv_rotary_cache(qkv, bias, cos, sin, positions, past, k_cache, v_cache, q_out,
                             n_heads, n_kv, head_dim, rot)


# Blocks that keep an H100's 132 SMs busy; fewer query-row blocks than this split the keys.
_BUSY_BLOCKS = 264


def attention_splits(batch: int, t: int, n_heads: int, n_kv: int, capacity: int, splits: int | None = None) -> int:
    """How many blocks share one query row's keys: 1 for prefill, more for decode at small batch.
    Depends on shapes only (never on the past length), so a captured graph stays valid."""
    if splits is not None:
        return splits
    blocks = -(-t * (n_heads // n_kv) // 4) * batch * n_kv
    if blocks >= _BUSY_BLOCKS:
        return 1
    return max(1, min(16, -(-_BUSY_BLOCKS // blocks), -(-capacity // 128)))


# Query tokens from which prefill attention runs as GEMMs + masked softmax (tensor cores) instead
# of the fused kernel (CUDA cores), and the most keys the softmax kernel's row buffer holds.
GEMM_MIN_TOKENS = 8
_SOFTMAX_MAX_KEYS = 16384


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, past: int,
              past_dev: torch.Tensor, key_mask: torch.Tensor | None, scale: float, out: torch.Tensor,
              splits: int | None = None, method: str | None = None) -> None:
    """Causal GQA attention over the cache (see reference.attention). On a GPU: `method` "fused"
    (one kernel, online softmax; decode) or "gemm" (q k^T and p v through cuBLAS around the
    masked-softmax kernel; prefill); None picks by the number of query tokens."""
    if q.is_cuda:
        b, t, h, d = q.shape
        if method is None:
            method = "gemm" if t >= GEMM_MIN_TOKENS and past + t <= _SOFTMAX_MAX_KEYS else "fused"
        if method == "gemm":
            _attention_gemm(q, k_cache, v_cache, past, past_dev, key_mask, scale, out)
            return
        n = attention_splits(b, t, h, k_cache.shape[1], k_cache.shape[2], splits)
        ws = torch.empty(n * b * t * h * (d + 2), dtype=torch.float32, device=q.device) if n > 1 else None
        cuda_op().attention(q, k_cache, v_cache, past_dev, key_mask, float(scale), out, ws, n)
    else:
        ref.attention(q, k_cache, v_cache, past, key_mask, scale, out)


def bias_gelu(h: torch.Tensor, bias: torch.Tensor | None, approximate: bool) -> None:
    if h.is_cuda:
        cuda_op().bias_gelu(h, bias, bool(approximate))
    else:
        ref.bias_gelu(h, bias, approximate)


def silu_mul(gu: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    if gu.is_cuda:
        cuda_op().silu_mul(gu, bias, out)
    else:
        ref.silu_mul(gu, bias, out)


def _attention_gemm(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, past: int,
                    past_dev: torch.Tensor, key_mask: torch.Tensor | None, scale: float, out: torch.Tensor) -> None:
    # The heads sharing a kv head become one GEMM's rows ([B, Hkv, G*T, D] against that head's
    # keys), so GQA needs no repeated K/V. Reads past + T rows of the cache (a host length: prefill
    # is never inside a captured graph).
    b, t, h, d = q.shape
    hkv = k_cache.shape[1]
    g = h // hkv
    kv_len = past + t
    qg = q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    scores = torch.matmul(qg, k_cache[:, :, :kv_len].transpose(-1, -2)).contiguous()
    cuda_op().masked_softmax(scores, t, hkv * g * t, past_dev, key_mask, float(scale))
    o = torch.matmul(scores, v_cache[:, :, :kv_len])  # [B, Hkv, G*T, D]
    out.copy_(o.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h, d))


def moe_gemv(x: torch.Tensor, idx: torch.Tensor, wts: torch.Tensor | None, w: torch.Tensor, out: torch.Tensor,
             combine: bool) -> None:
    """Expert GEMVs of MoE decode (see reference.moe_gemv): the experts idx [T, k] chose, read from the stacked
    weights w [E, N, C] on the device (no host round trip)."""
    if x.is_cuda:
        cuda_op().moe_gemv(x, idx, wts, w, out, bool(combine))
    else:
        ref.moe_gemv(x, idx, wts, w, out, combine)
