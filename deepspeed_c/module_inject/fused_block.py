"""One decoder block as fused kernels: norm, one QKV GEMM, rotary + KV-cache append, cached
causal attention, output GEMM, bias + residual + norm, MLP GEMM, bias + GELU (GPT-2) or SiLU-gated
(LLaMA family) activation, down GEMM. GEMMs run through torch (cuBLAS on a GPU); everything
between them is one kernel of deepspeed_c.ops.transformer.inference.kernels.

The block's output residual add is left pending: it returns (residual, mlp_out, mlp_bias) and the
next block's (or the final) norm adds them in its fused add + norm, so no separate add pass runs."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepspeed_c.ops.transformer.inference import kernels as K


@dataclass(frozen=True)
class BlockSpec:
    """The shape of one architecture's block (what differs between GPT-2 and LLaMA)."""
    hidden: int
    n_heads: int
    n_kv: int
    head_dim: int
    eps: float
    layer_norm: bool          # LayerNorm with bias (GPT-2) or RMSNorm (LLaMA family)
    gated_silu: bool          # SiLU-gated MLP (LLaMA) or bias + GELU (GPT-2)
    gelu_tanh: bool = True    # GPT-2's gelu_new / gelu_pytorch_tanh; False for exact erf GELU
    rotary: bool = False


@dataclass
class StepContext:
    """What every block of one forward shares: the past length (host and device copies), the
    positions, the key mask and the KV cache."""
    past: int
    past_dev: torch.Tensor              # int32 [1] on the activations' device
    positions: torch.Tensor | None      # int64 [B, T] (rotary models)
    key_mask: torch.Tensor | None       # int32 [B, S]
    cache: torch.Tensor                 # [layers, 2, B, Hkv, S, D]
    cos: torch.Tensor | None            # float32 [S, D]
    sin: torch.Tensor | None


def _frozen(t: torch.Tensor | None) -> torch.nn.Parameter | None:
    return None if t is None else torch.nn.Parameter(t.detach().clone().contiguous(), requires_grad=False)


class FusedDecoderBlock(torch.nn.Module):
    """Weights are copied from the HF block at injection: wqkv [(H + 2 Hkv) D, C] (q, k, v rows
    stacked), wo [C, H D], w1 [F or 2F, C] (gate rows then up rows for SiLU-gated MLPs), w2 [C, F]."""

    def __init__(self, spec: BlockSpec, layer: int, scale: float, ln1: tuple, ln2: tuple,
                 wqkv: torch.Tensor, bqkv: torch.Tensor | None, wo: torch.Tensor, bo: torch.Tensor | None,
                 w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None) -> None:
        super().__init__()
        self.spec, self.layer, self.scale = spec, layer, float(scale)
        self.ln1_w, self.ln1_b = _frozen(ln1[0]), _frozen(ln1[1])
        self.ln2_w, self.ln2_b = _frozen(ln2[0]), _frozen(ln2[1])
        self.wqkv, self.bqkv = _frozen(wqkv), _frozen(bqkv)
        self.wo, self.bo = _frozen(wo), _frozen(bo)
        self.w1, self.b1 = _frozen(w1), _frozen(b1)
        self.w2, self.b2 = _frozen(w2), _frozen(b2)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None, yb: torch.Tensor | None, batch: int,
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x: residual stream [B*T, C]; y, yb: the previous block's pending MLP output and bias."""
        s = self.spec
        n_tok = x.shape[0]
        t = n_tok // batch
        r = torch.empty_like(x) if y is not None else None
        n = torch.empty_like(x)
        K.add_norm(x, y, yb, self.ln1_w, self.ln1_b, s.eps, r, n)
        r = x if r is None else r

        qkv = self._linear(n, "wqkv").view(batch, t, -1)
        q = torch.empty(batch, t, s.n_heads, s.head_dim, dtype=x.dtype, device=x.device)
        kc, vc = ctx.cache[self.layer, 0], ctx.cache[self.layer, 1]
        K.qkv_rotary_cache(qkv, self.bqkv, ctx.cos, ctx.sin, ctx.positions, ctx.past, ctx.past_dev,
                           kc, vc, q, s.n_heads, s.n_kv, s.head_dim, s.head_dim)
        a = torch.empty_like(q)
        K.attention(q, kc, vc, ctx.past, ctx.past_dev, ctx.key_mask, self.scale, a)
        o = self._sum_partial(self._linear(a.view(n_tok, s.n_heads * s.head_dim), "wo"))

        r2 = torch.empty_like(x)
        n2 = torch.empty_like(x)
        K.add_norm(r, o, self.bo, self.ln2_w, self.ln2_b, s.eps, r2, n2)
        y2, b2 = self._mlp(n2)
        return r2, y2, b2

    def _mlp(self, n2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MLP of the normed residual: (output before its bias, the bias the next norm adds)."""
        h = self._linear(n2, "w1")
        if self.spec.gated_silu:
            act = torch.empty(n2.shape[0], h.shape[1] // 2, dtype=n2.dtype, device=n2.device)
            K.silu_mul(h, self.b1, act)
        else:
            K.bias_gelu(h, self.b1, self.spec.gelu_tanh)
            act = h
        return self._sum_partial(self._linear(act, "w2")), self.b2

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ W^T for one of the block's GEMM weights, through its quantized form when the quant section
        made one (module_inject.quant_linear: `q_<name>`)."""
        q = self._modules.get("q_" + name)
        return F.linear(x, getattr(self, name)) if q is None else q(x)

    def _sum_partial(self, t: torch.Tensor) -> torch.Tensor:
        """The two GEMM outputs before their bias; a tensor-parallel block holds partial sums and reduces them."""
        return t
