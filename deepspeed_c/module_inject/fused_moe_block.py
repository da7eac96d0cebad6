"""A Mixtral-family decoder block as fused kernels: FusedDecoderBlock's attention, and an MLP that is a top-k
mixture of SiLU-gated experts.

Routing as Hugging Face's Mixtral: router logits (a GEMM), softmax in float32, the top k, renormalised to sum
to one. Decode (few tokens, and anything under CUDA graph capture) runs the experts as two expert-GEMV kernels
that read the chosen experts' rows at the router's indices on the device (`moe_gemv`: no host round trip, so the
step stays in one captured graph; the k experts' outputs are weighted and summed in float32), with the fused
SiLU-gate kernel between them. Longer inputs (prefill) group their tokens by expert on the host and run one GEMM
pair per hit expert, each expert's weights read once. Expert weights stay in the activation dtype under the
quant section (the attention GEMMs are quantized)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deepspeed_c.module_inject.fused_block import BlockSpec, FusedDecoderBlock, _frozen
from deepspeed_c.ops.transformer.inference import kernels as K

# Tokens up to which the expert-GEMV kernels run (each token reads its k experts' weights): past it, grouping by
# expert reads every hit expert once.
DECODE_TOKENS = 8


class FusedMoEDecoderBlock(FusedDecoderBlock):
    """router [E, C]; gate_up [E, 2F, C] (gate rows then up rows, Hugging Face's layout); down [E, C, F]."""

    def __init__(self, spec: BlockSpec, layer: int, scale: float, ln1: tuple, ln2: tuple, wqkv: torch.Tensor,
                 bqkv: torch.Tensor | None, wo: torch.Tensor, bo: torch.Tensor | None, router: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor, top_k: int, norm_topk: bool) -> None:
        super().__init__(spec, layer, scale, ln1, ln2, wqkv, bqkv, wo, bo, None, None, None, None)
        experts = router.shape[0]
        if gate_up.shape[0] != experts or down.shape[0] != experts or gate_up.shape[1] != 2 * down.shape[2]:
            raise ValueError(f"MoE block {layer}: router {tuple(router.shape)}, gate_up {tuple(gate_up.shape)} and "
                             f"down {tuple(down.shape)} do not describe one set of SiLU-gated experts")
        if not 1 <= top_k <= experts:
            raise ValueError(f"MoE block {layer}: top_k={top_k} must be in [1, {experts}]")
        self.router, self.gate_up, self.down = _frozen(router), _frozen(gate_up), _frozen(down)
        self.top_k, self.norm_topk = int(top_k), bool(norm_topk)

    def _mlp(self, n2: torch.Tensor) -> tuple[torch.Tensor, None]:
        probs = torch.softmax(F.linear(n2, self.router).float(), dim=-1)
        wts, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            wts = wts / wts.sum(dim=-1, keepdim=True)
        tokens = n2.shape[0]
        if tokens <= DECODE_TOKENS or not n2.is_cuda or torch.cuda.is_current_stream_capturing():
            return self._experts_gemv(n2, idx, wts.contiguous()), None
        return self._experts_grouped(n2, idx, wts), None

    def _experts_gemv(self, n2: torch.Tensor, idx: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        tokens, k = idx.shape
        f2 = self.gate_up.shape[1]
        h = torch.empty(tokens * k, f2, dtype=n2.dtype, device=n2.device)
        K.moe_gemv(n2, idx, None, self.gate_up, h, combine=False)
        act = torch.empty(tokens * k, f2 // 2, dtype=n2.dtype, device=n2.device)
        K.silu_mul(h, None, act)
        out = torch.empty_like(n2)
        K.moe_gemv(act, idx, wts, self.down, out, combine=True)
        return out

    def _experts_grouped(self, n2: torch.Tensor, idx: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.router.shape[0]).tolist()  # the host learns the hit experts
        acc = torch.float64 if n2.dtype == torch.float64 else torch.float32
        out = torch.zeros(n2.shape, dtype=acc, device=n2.device)
        f2 = self.gate_up.shape[1]
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            pairs = order[start:start + c]
            start += c
            rows = pairs // k
            h = F.linear(n2[rows], self.gate_up[e])
            act = torch.empty(c, f2 // 2, dtype=n2.dtype, device=n2.device)
            K.silu_mul(h, None, act)
            y = F.linear(act, self.down[e]).to(acc) * wts.reshape(-1)[pairs, None]
            out.index_add_(0, rows, y)
        return out.to(n2.dtype)
