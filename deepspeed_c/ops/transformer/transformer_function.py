"""Forward and backward of DeepSpeedTransformerLayer as one autograd node: the GEMMs run through
torch (cuBLAS on a GPU), the pieces between them through `fused_ops` (CUDA kernels on a GPU, torch
on the host). The forward keeps only what the backward needs, and the memory flags trade stored
activations for recomputation as DeepSpeed documents:

  normalize_invertible     the LayerNorms' inputs are not kept: their backward recovers
                           xhat = (y - beta) / gamma from the outputs, which are kept anyway
                           (needs gamma without zeros, as DeepSpeed's kernel does)
  gelu_checkpoint          the GELU output is not kept: recomputed from the pre-activation
                           (kept as the GEMM output before its bias; the bias is added again)
  attn_dropout_checkpoint  the dropped-out attention probabilities are not kept: recomputed
                           from the softmax output and the dropout mask

Weight names follow DeepSpeed: attn_qkvw/attn_qkvb (Q, K, V rows stacked), attn_ow/attn_ob,
attn_nw/attn_nb (the LayerNorm after attention in post-LN, before the FFN in pre-LN),
inter_w/inter_b, output_w/output_b, norm_w/norm_b (the LayerNorm after the FFN in post-LN, before
attention in pre-LN)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepspeed_c.ops.transformer import fused_ops as ops
from deepspeed_c.ops.transformer.layer_math import differentiable_backward
from deepspeed_c.ops.transformer.mask_cache import ConvertedMask
from deepspeed_c.ops.transformer.sdpa_core import attention_core

WEIGHT_NAMES = ("attn_qkvw", "attn_qkvb", "attn_ow", "attn_ob", "attn_nw", "attn_nb", "inter_w", "inter_b",
                "output_w", "output_b", "norm_w", "norm_b")


@dataclass(frozen=True)
class LayerSpec:
    """What one call needs from the config (taken once per forward)."""
    heads: int
    pre_layer_norm: bool
    eps: float
    attn_dropout: float  # 0 when not training
    hidden_dropout: float
    normalize_invertible: bool
    gelu_checkpoint: bool
    attn_dropout_checkpoint: bool
    # True: the attention core is torch's fused SDPA (flash / memory-efficient kernels: the S x S
    # probabilities are never stored, so attn_dropout_checkpoint has nothing left to drop); False: q k^T
    # GEMM, the masked-softmax kernel, p v GEMM, with the probabilities kept for backward.
    fused_attention: bool = False


def _drop_backward(dy: torch.Tensor, keep: torch.Tensor | None, p: float) -> torch.Tensor:
    return dy if keep is None else dy * keep * (1.0 / (1.0 - p))


def _dropped_probs(P: torch.Tensor, keep: torch.Tensor | None, p: float) -> torch.Tensor:
    return P if keep is None else P * keep * (1.0 / (1.0 - p))


_SDPA_MASK = ConvertedMask()
_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def _keeps_graph() -> bool:
    """This backward retains the graph (retain_graph / create_graph): another backward may come through the node.
    A torch that cannot say is taken as retaining (the attention state then lives as long as the graph)."""
    return True if _keep_graph is None else bool(_keep_graph())


def _sdpa_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # [B, 1 | S, S] float32 -> [B, 1, 1 | S, S] in the activation dtype, -inf clamped to the dtype's
    # lowest finite value (a fully padded row then averages, as in Hugging Face, instead of NaN).
    if mask is None:
        return None
    return _SDPA_MASK.get(mask, dtype, lambda: mask.clamp_min(torch.finfo(dtype).min).to(dtype)[:, None])


class DeepSpeedTransformerFunction(torch.autograd.Function):
    """apply(spec, generator, x [B, S, H], mask [B, 1 | S, S] additive or None, *weights)."""

    @staticmethod
    def forward(ctx, spec: LayerSpec, gen, x, mask, *w):
        (qkvw, qkvb, ow, ob, anw, anb, iw, ib, outw, outb, nw, nb) = w
        B, S, Hd = x.shape
        nh, d, T = spec.heads, Hd // spec.heads, B * S
        scale = d ** -0.5
        inv = spec.normalize_invertible
        x2 = x.reshape(T, Hd)
        k_attn = None if spec.fused_attention else ops.keep_mask((B, nh, S, S), spec.attn_dropout, x.device, gen)
        k12 = ops.keep_mask((2, T, Hd), spec.hidden_dropout, x.device, gen)  # both hidden dropouts, one launch
        k1, k2 = (None, None) if k12 is None else k12.unbind(0)
        s_hid = 1.0 / (1.0 - spec.hidden_dropout)

        h0 = mean0 = rstd0 = None
        if spec.pre_layer_norm:
            _, h0, mean0, rstd0 = ops.residual_norm(x2, None, None, None, 1.0, nw, nb, spec.eps, want_r=False)
        a_in = h0 if spec.pre_layer_norm else x2
        qkv = F.linear(a_in, qkvw, qkvb)
        q, k, v = qkv.view(B, S, 3, nh, d).permute(2, 0, 3, 1, 4)
        P = Pd = sdpa = None
        if spec.fused_attention:
            sdpa = attention_core(q, k, v, _sdpa_mask(mask, x.dtype), spec.attn_dropout, scale,
                                  track=any(ctx.needs_input_grad))
            ctx2 = sdpa.out.detach().transpose(1, 2).reshape(T, Hd)
        else:
            P = ops.softmax(torch.matmul(q, k.transpose(-1, -2)), mask, scale)
            Pd = _dropped_probs(P, k_attn, spec.attn_dropout)
            ctx2 = torch.matmul(Pd, v).transpose(1, 2).reshape(T, Hd)
        a = F.linear(ctx2, ow)
        # r1 stays for the pre-LN output residual either way; it is saved unless invertible.
        r1, h1, mean1, rstd1 = ops.residual_norm(a, ob, x2, k1, s_hid, anw, anb, spec.eps,
                                                 want_r=spec.pre_layer_norm or not inv)
        u, g = ops.bias_gelu(F.linear(h1, iw), ib)  # u: the FFN GEMM's output, before its bias
        o = F.linear(g, outw)
        r2 = mean2 = rstd2 = None
        if spec.pre_layer_norm:
            out, _, _, _ = ops.residual_norm(o, outb, r1, k2, s_hid, None, None, spec.eps, want_r=True)
        else:
            r2, out, mean2, rstd2 = ops.residual_norm(o, outb, h1, k2, s_hid, nw, nb, spec.eps, want_r=not inv)

        keep_x = not (spec.pre_layer_norm and inv)
        ctx.spec, ctx.shape, ctx.sdpa, ctx.mask = spec, (B, S, Hd), sdpa, mask
        # x is the input itself (not a view of it): a create_graph backward recomputes the layer from it
        ctx.save_for_backward(
            x if keep_x else None, h0, None if inv else mean0, rstd0, qkv, P,
            None if (spec.attn_dropout_checkpoint or k_attn is None) else Pd, k_attn,
            None if sdpa is not None else ctx2,  # SDPA keeps its output: ctx2 is rebuilt from it
            None if inv else r1, h1, None if inv else mean1, rstd1, k1, u, None if spec.gelu_checkpoint else g, k2,
            out if (inv and not spec.pre_layer_norm) else None, r2, None if inv else mean2, rstd2)
        # the parameters ride on ctx, not through save_for_backward: saved-tensor hooks (save_on_cpu, offload)
        # then leave them alone, and twelve saved-variable packs and unpacks a layer leave the host's step
        ctx.weights = w
        return out.view(B, S, Hd)

    @staticmethod
    def backward(ctx, dout):
        spec: LayerSpec = ctx.spec
        B, S, Hd = ctx.shape
        nh, d, T = spec.heads, Hd // spec.heads, B * S
        scale = d ** -0.5
        inv = spec.normalize_invertible
        (x, h0, mean0, rstd0, qkv, P, Pd, k_attn, ctx2, r1, h1, mean1, rstd1, k1, u, g, k2, out, r2, mean2,
         rstd2) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: gradients that carry their own graph, through torch's ops
            grads = differentiable_backward(spec, x, ctx.mask, ctx.weights, (k_attn, k1, k2),
                                            (ctx.needs_input_grad[2],) + ctx.needs_input_grad[4:], dout)
            return (None, None, grads[0], None, *grads[1:])
        x2 = None if x is None else x.reshape(T, Hd)
        qkvw, qkvb, ow, ob, anw, anb, iw, ib, outw, outb, nw, nb = ctx.weights
        dout = dout.reshape(T, Hd).contiguous()
        dnw = dnb = None

        # FFN output: pre-LN out = r1 + drop(o + outb); post-LN out = LN(h1 + drop(o + outb)).
        # The bias gradients come out of the kernels that already read the data (column sums).
        s_hid = 1.0 / (1.0 - spec.hidden_dropout)
        if spec.pre_layer_norm:
            dr2 = dout
            do_ = _drop_backward(dr2, k2, spec.hidden_dropout)
            doutb = do_.sum(dim=0)
        else:
            dr2, dnw, dnb, do_, doutb = ops.norm_backward(dout, out if inv else r2, nw, nb, mean2, rstd2, inv, None,
                                                          k2, s_hid, want_bias=True)
        doutw = do_.t().mm(g if g is not None else ops.gelu(u, ib))
        du, dib = ops.gelu_backward(do_.mm(outw), u, ib, want_bias=True)
        diw = du.t().mm(h1)
        dh1 = du.mm(iw) if spec.pre_layer_norm else torch.addmm(dr2, du, iw)

        # Attention output: r1 = x + drop(a + ob), h1 = LN(r1); pre-LN's r1 also feeds the output.
        dr1, danw, danb, da, dob = ops.norm_backward(dh1, h1 if inv else r1, anw, anb, mean1, rstd1, inv,
                                                     dout if spec.pre_layer_norm else None, k1, s_hid,
                                                     want_bias=True)
        sdpa = ctx.sdpa
        retained = _keeps_graph()
        if not retained:  # its output and log-sum-exp go now, as saved tensors do, not when the graph is dropped
            ctx.sdpa = None
        if sdpa is not None:
            ctx2 = sdpa.out.detach().transpose(1, 2).reshape(T, Hd)
        dow = da.t().mm(ctx2)
        dctx = da.mm(ow).view(B, S, nh, d).transpose(1, 2)

        dqkvb = None
        if sdpa is not None:  # [B, nh, S, d] each -> [B, S, 3, nh, d], with the bias gradient, in one kernel
            grads = [t.transpose(1, 2) for t in sdpa.backward(dctx, retain_graph=retained)]
            if all(t.is_contiguous() for t in grads):
                dqkv, dqkvb = ops.stack_qkv_grad(*(t.view(T, Hd) for t in grads))
            else:
                dqkv = torch.stack(grads, dim=2)
        else:
            dqkv = torch.empty(B, S, 3, nh, d, dtype=qkv.dtype, device=qkv.device)
            dq, dk, dv = dqkv.permute(2, 0, 3, 1, 4)
            q, k, v = qkv.view(B, S, 3, nh, d).permute(2, 0, 3, 1, 4)
            if Pd is None:
                Pd = _dropped_probs(P, k_attn, spec.attn_dropout)
            dv.copy_(torch.matmul(Pd.transpose(-1, -2), dctx))
            dP = _drop_backward(torch.matmul(dctx, v.transpose(-1, -2)), k_attn, spec.attn_dropout)
            dS = ops.softmax_backward(dP.contiguous(), P, scale)
            dq.copy_(torch.matmul(dS, k))
            dk.copy_(torch.matmul(dS.transpose(-1, -2), q))
        dqkv = dqkv.view(T, 3 * Hd)
        if dqkvb is None:
            dqkvb = dqkv.sum(dim=0)
        a_in = h0 if spec.pre_layer_norm else x2
        dqkvw = dqkv.t().mm(a_in)
        if spec.pre_layer_norm:
            dx, dnw, dnb, _, _ = ops.norm_backward(dqkv.mm(qkvw), h0 if inv else x2, nw, nb, mean0, rstd0, inv, dr1)
        else:
            dx = torch.addmm(dr1, dqkv, qkvw)
        return (None, None, dx.view(B, S, Hd), None, dqkvw, dqkvb, dow, dob, danw, danb, diw, dib, doutw, doutb,
                dnw, dnb)
