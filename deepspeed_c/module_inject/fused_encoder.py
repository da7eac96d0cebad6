"""Encoder kernel injection: BERT / RoBERTa (XLM-R) / DistilBERT layers replaced by FusedEncoderLayer.

One post-LayerNorm encoder layer: one QKV GEMM, bidirectional attention under the model's padding mask
(no KV cache), output GEMM, bias + residual + LayerNorm (one kernel), FFN GEMM, bias + GELU (one kernel),
down GEMM, bias + residual + LayerNorm. GEMMs run through torch (cuBLAS) or the quantized GEMM
(module_inject.quant_linear); the norm and activation kernels are the decoder's
(ops.transformer.inference.kernels: CUDA on a GPU, their torch reference on the host); attention is
torch's scaled_dot_product_attention (flash / memory-efficient kernels on a GPU).

Each replaced layer keeps its Hugging Face call (hidden_states, attention_mask, ...) and return form
(a tensor under transformers 5, a 1-tuple under 4.x). The mask may be 2-D [B, S] (1 = attend: DistilBERT
under transformers 4.x), or broadcastable 4-D: additive float (eager) or boolean (True = attend, SDPA)."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from deepspeed_c.ops.transformer.inference import kernels as K

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert", "camembert")
_GELUS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}


def _returns_tuple() -> bool:
    import transformers

    return int(transformers.__version__.split(".")[0]) < 5


def _frozen(t: Optional[torch.Tensor]) -> Optional[nn.Parameter]:
    return None if t is None else nn.Parameter(t.detach().clone().contiguous(), requires_grad=False)


class FusedEncoderLayer(nn.Module):
    """wqkv [3C, C] (q, k, v rows), wo [C, C], w1 [F, C], w2 [C, F], each with its bias; ln1 after attention,
    ln2 after the FFN (post-LN)."""

    def __init__(self, n_heads: int, eps1: float, eps2: float, approximate_gelu: bool, wqkv: torch.Tensor,
                 bqkv: torch.Tensor, wo: torch.Tensor, bo: torch.Tensor, ln1: tuple, w1: torch.Tensor, b1: torch.Tensor,
                 w2: torch.Tensor, b2: torch.Tensor, ln2: tuple) -> None:
        super().__init__()
        self.n_heads, self.eps1, self.eps2, self.approximate = n_heads, float(eps1), float(eps2), approximate_gelu
        self.wqkv, self.bqkv, self.wo, self.bo = _frozen(wqkv), _frozen(bqkv), _frozen(wo), _frozen(bo)
        self.w1, self.b1, self.w2, self.b2 = _frozen(w1), _frozen(b1), _frozen(w2), _frozen(b2)
        self.ln1_w, self.ln1_b = _frozen(ln1[0]), _frozen(ln1[1])
        self.ln2_w, self.ln2_b = _frozen(ln2[0]), _frozen(ln2[1])
        self.tuple_out = _returns_tuple()

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        q = self._modules.get("q_" + name)
        return F.linear(x, getattr(self, name)) if q is None else q(x)

    @staticmethod
    def _mask(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The padding mask as SDPA takes it: bool (True = attend) or additive float, [B, 1|H, 1|T, S]."""
        if mask is None:
            return None
        if mask.dim() == 2:  # [B, S], 1 = attend
            return (mask != 0)[:, None, None, :]
        if mask.dim() != 4:
            raise ValueError(f"a kernel-injected encoder layer takes a 2-D [batch, seq] or 4-D attention mask, got "
                             f"shape {tuple(mask.shape)}")
        return mask if mask.dtype == torch.bool else mask.to(dtype)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("output_attentions"):
            raise NotImplementedError("output_attentions is not available from a kernel-injected encoder layer")
        for name in ("encoder_hidden_states", "head_mask"):
            if kwargs.get(name) is not None:
                raise NotImplementedError(f"{name} is not supported by a kernel-injected encoder layer")
        x = hidden_states
        b, t, c = x.shape
        h, d = self.n_heads, c // self.n_heads
        x2 = x.reshape(b * t, c).contiguous()
        qkv = self._linear(x2, "wqkv") + self.bqkv
        q, k, v = qkv.view(b, t, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, T, D] each
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask(attention_mask, x.dtype))
        ctx = ctx.transpose(1, 2).reshape(b * t, c)
        h1 = torch.empty_like(x2)
        K.add_norm(x2, self._linear(ctx, "wo"), self.bo, self.ln1_w, self.ln1_b, self.eps1, None, h1)
        f = self._linear(h1, "w1").contiguous()
        K.bias_gelu(f, self.b1, self.approximate)
        out = torch.empty_like(x2)
        K.add_norm(h1, self._linear(f, "w2"), self.b2, self.ln2_w, self.ln2_b, self.eps2, None, out)
        out = out.view(b, t, c)
        return (out,) if self.tuple_out else out


def _cat(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.detach() for t in ts])


def _bert_layer(layer: nn.Module, act: str, n_heads: int) -> FusedEncoderLayer:
    s, so, inter, out = layer.attention.self, layer.attention.output, layer.intermediate, layer.output
    if getattr(layer, "crossattention", None) is not None or getattr(layer, "is_decoder", False):
        raise NotImplementedError("kernel injection of a BERT layer used as a decoder (cross-attention) is not built")
    pe = getattr(s, "position_embedding_type", "absolute")
    if pe != "absolute":
        raise NotImplementedError(f"kernel injection of BERT with position_embedding_type={pe!r} is not built")
    return FusedEncoderLayer(n_heads, so.LayerNorm.eps, out.LayerNorm.eps, _gelu(act),
                             _cat(s.query.weight, s.key.weight, s.value.weight),
                             _cat(s.query.bias, s.key.bias, s.value.bias), so.dense.weight, so.dense.bias,
                             (so.LayerNorm.weight, so.LayerNorm.bias), inter.dense.weight, inter.dense.bias,
                             out.dense.weight, out.dense.bias, (out.LayerNorm.weight, out.LayerNorm.bias))


def _distil_layer(layer: nn.Module, act: str, n_heads: int) -> FusedEncoderLayer:
    a, f = layer.attention, layer.ffn
    return FusedEncoderLayer(n_heads, layer.sa_layer_norm.eps, layer.output_layer_norm.eps, _gelu(act),
                             _cat(a.q_lin.weight, a.k_lin.weight, a.v_lin.weight),
                             _cat(a.q_lin.bias, a.k_lin.bias, a.v_lin.bias), a.out_lin.weight, a.out_lin.bias,
                             (layer.sa_layer_norm.weight, layer.sa_layer_norm.bias), f.lin1.weight, f.lin1.bias,
                             f.lin2.weight, f.lin2.bias, (layer.output_layer_norm.weight, layer.output_layer_norm.bias))


def _gelu(act: Any) -> bool:
    if not isinstance(act, str) or act not in _GELUS:
        raise NotImplementedError(f"kernel injection of an encoder with activation {act!r} is not built "
                                  f"(supported: {sorted(_GELUS)})")
    return _GELUS[act]


def _kind(layer: nn.Module) -> Optional[str]:
    if hasattr(layer, "attention") and hasattr(getattr(layer.attention, "self", None), "query") \
            and hasattr(layer, "intermediate"):
        return "bert"
    if hasattr(layer, "sa_layer_norm") and hasattr(layer, "ffn"):
        return "distilbert"
    return None


def inject_encoder(model: nn.Module, dtype: Optional[torch.dtype],
                   classes: Optional[tuple] = None) -> Optional[nn.Module]:
    """Replaces every encoder layer of `model` (only instances of `classes` when given: the keys of an
    injection_policy) by a FusedEncoderLayer, in place; None when `model` is no supported encoder."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) not in ENCODER_TYPES:
        return None
    act = getattr(cfg, "hidden_act", None) if cfg.model_type != "distilbert" else getattr(cfg, "activation", None)
    n_heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_heads")
    if dtype is not None:
        model.to(dtype)
    replaced = 0
    with torch.no_grad():
        for module in list(model.modules()):
            if not isinstance(module, nn.ModuleList):
                continue
            for i, layer in enumerate(module):
                kind = _kind(layer)
                if kind is None or (classes and not isinstance(layer, classes)):
                    continue
                build = _bert_layer if kind == "bert" else _distil_layer
                module[i] = build(layer, act, n_heads).to(next(layer.parameters()).device)
                replaced += 1
    if replaced == 0:
        names = ", ".join(c.__name__ for c in classes) if classes else "encoder"
        raise ValueError(f"kernel injection found no {names} layer to replace in {type(model).__name__}")
    return model
