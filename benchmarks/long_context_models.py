"""Models and training steps of benchmarks/long_context.py.

ALST (either implementation, `ds` is the deepspeed module under test): a transformers LLaMA (random init,
bf16) with HF gradient checkpointing whose layer inputs go to host memory
(get_checkpoint_hidden_states_offloading_ctx_manager), TiledMLP on every MLP and TiledFusedLogitsLoss for
the LM head, so no [tokens, 14336] or [tokens, vocab] tensor exists whole; with more than one rank,
UlyssesSPAttentionHF shards the sequence.

FPDT (deepspeed_c): a LLaMA-shaped stack in Megatron layout ([s, b, h]) built from FPDT_Attention (GQA,
rotary, chunked, KV offload), a SwiGLU MLP cut into sequence tiles, RMSNorm, and FPDT_LogitsLoss; each
block is checkpointed with its input held in pinned host memory (CpuCheckpoint)."""
from __future__ import annotations

import math
import types
from importlib import import_module
from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch import Tensor, nn


def flops_per_token(a: Any, seq: int) -> float:
    """Model FLOPs of one training token (forward + backward, no recompute): 6 x matmul parameters plus
    causal attention's 6 x layers x seq x (heads x head_dim) (QK^T and AV, halved by the mask, x3)."""
    hd = a.hidden // a.heads
    per_layer = a.hidden * (a.heads * hd + 2 * a.kv_heads * hd) + a.heads * hd * a.hidden + 3 * a.hidden * a.inter
    dense = a.layers * per_layer + a.vocab * a.hidden  # the LM head (the embedding is a lookup)
    return 6.0 * dense + 6.0 * a.layers * seq * a.heads * hd


# ---------------------------------------------------------------- ALST (transformers LLaMA)

def submodule(ds: Any, path: str) -> Any:
    """ds.<path> of either implementation (imported on first use)."""
    return import_module(f"{ds.__name__}.{path}")


def hf_llama(a: Any, device: torch.device) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=max(a.max_seq, 4096), rope_theta=500000.0, use_cache=False,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(a.dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def tile_mlps(ds: Any, model: nn.Module, tile_tokens: int) -> None:
    """ALST's TiledMLP on every LlamaMLP: the 3.5x-wide intermediate exists one tile of tokens at a time."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    tiled_mlp = submodule(ds, "runtime.sequence_parallel.ulysses_sp").TiledMLP

    def plain(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled(self, x):
        shards = max(1, math.ceil(x.shape[0] * x.shape[1] / tile_tokens))
        return tiled_mlp.apply(plain, self, x, shards, list(self.parameters()))

    for m in model.modules():
        if isinstance(m, LlamaMLP):
            m.forward = types.MethodType(tiled, m)


def alst_fwd_bwd(ds: Any, engine: Any, ids: Tensor, pos: Tensor, labels: Tensor, tile_tokens: int,
                 sp_group: Any) -> Tensor:
    """Forward and backward of the mean next-token loss: hidden states with checkpoint offload, tiled LM head.
    The backward runs inside the offload context: DeepSpeed 0.19.8 drops the offloaded checkpoints when the
    context exits (deepspeed_c keeps them until backward, so either order works there)."""
    usp = submodule(ds, "runtime.sequence_parallel.ulysses_sp")
    offload = submodule(ds, "runtime.activation_checkpointing.offload_activations")
    with offload.get_checkpoint_hidden_states_offloading_ctx_manager():
        hidden = engine.module.model(input_ids=ids, position_ids=pos).last_hidden_state
        head = engine.module.lm_head
        shards = max(1, math.ceil(ids.numel() / tile_tokens))

        def ce_sum(self, x, y):
            return nn.functional.cross_entropy(self(x).float(), y, ignore_index=-100, reduction="sum")

        loss_sum = usp.TiledFusedLogitsLoss.apply(ce_sum, head, hidden, labels, None, shards, [head.weight], "sum")
        good = (labels != -100).sum().float()
        if sp_group is not None and torch.distributed.get_world_size(sp_group) > 1:
            torch.distributed.all_reduce(good, group=sp_group)
        loss = loss_sum / good
        engine.backward(loss)
    return loss


# ---------------------------------------------------------------- FPDT (deepspeed_c.sequence.fpdt_layer)

class CpuCheckpoint(torch.autograd.Function):
    """Recompute `run(x)` in backward; x waits in pinned host memory meanwhile (reentrant style, so ZeRO-3's
    module hooks gather the block's parameters again for the recompute)."""

    @staticmethod
    def forward(ctx: Any, run: Callable, x: Tensor) -> Tensor:  # type: ignore[override]
        with torch.no_grad():
            y = run(x)
        host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=x.is_cuda)
        host.copy_(x, non_blocking=x.is_cuda)
        ctx.run, ctx.host, ctx.device = run, host, x.device
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        x = ctx.host.to(ctx.device, non_blocking=True).requires_grad_()
        with torch.enable_grad():
            y = ctx.run(x)
        torch.autograd.backward(y, grad)
        ctx.host = None
        return None, x.grad


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class SwiGLU(nn.Module):
    """LLaMA's MLP on [s, b, h], cut into sequence tiles by deepspeed_c's TiledMLP."""

    def __init__(self, hidden: int, inter: int, tile_tokens: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.tile_tokens = tile_tokens

    def _plain(self, x: Tensor) -> Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, x: Tensor) -> Tensor:
        from deepspeed_c.runtime.sequence_parallel.ulysses_sp import TiledMLP

        xb = x.transpose(0, 1)  # TiledMLP tiles dim 1 of [b, s, h]
        shards = max(1, math.ceil(xb.shape[0] * xb.shape[1] / self.tile_tokens))
        return TiledMLP.apply(lambda self_, t: self_._plain(t), self, xb, shards,
                              list(self.parameters())).transpose(0, 1)


class FPDTBlock(nn.Module):
    def __init__(self, a: Any, spg: Any) -> None:
        super().__init__()
        from deepspeed_c.sequence.fpdt_layer import FPDT_Attention

        hd = a.hidden // a.heads
        cfg = SimpleNamespace(kv_channels=hd, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                              hidden_size=a.hidden, attention_dropout=0.0)
        wqkv = nn.Parameter(torch.empty(hd * (a.heads + 2 * a.kv_heads), a.hidden))
        wo = nn.Parameter(torch.empty(a.hidden, a.heads * hd))
        for w in (wqkv, wo):
            nn.init.normal_(w, std=0.02)
        self.norm1, self.norm2 = RMSNorm(a.hidden), RMSNorm(a.hidden)
        # the weights become FPDT_Attention's parameters (ZeRO-3 gathers them around its forward)
        self.attn = FPDT_Attention(cfg, wqkv, None, wo, None, spg, chunk_size=a.chunk, enable_offloading=a.offload)
        self.mlp = SwiGLU(a.hidden, a.inter, a.tile)

    def forward(self, x: Tensor, rotary: tuple) -> Tensor:
        h, _ = self.attn(self.norm1(x), None, None, rotary)
        x = x + h
        return x + self.mlp(self.norm2(x))


class FPDTHead(nn.Module):
    """Final norm + LM head + FPDT_LogitsLoss (a module, so ZeRO-3 gathers the head weight around it)."""

    def __init__(self, a: Any, spg: Any) -> None:
        super().__init__()
        self.norm = RMSNorm(a.hidden)
        self.weight = nn.Parameter(torch.empty(a.vocab, a.hidden).normal_(std=0.02))
        self.spg, self.tile = spg, a.tile

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        from deepspeed_c.sequence.fpdt_layer import FPDT_LogitsLoss

        sp, rank = torch.distributed.get_world_size(self.spg), torch.distributed.get_rank(self.spg)
        chunks = max(1, x.shape[0] * x.shape[1] // self.tile)
        while x.shape[0] % chunks:
            chunks -= 1
        return FPDT_LogitsLoss.apply(self.norm(x), labels, self.weight, rank, sp, self.spg, chunks)


class FPDTLlama(nn.Module):
    def __init__(self, a: Any, spg: Any) -> None:
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.hidden)
        self.layers = nn.ModuleList(FPDTBlock(a, spg) for _ in range(a.layers))
        self.head = FPDTHead(a, spg)
        self.head_dim = a.hidden // a.heads

    def rotary(self, seq: int, device: torch.device) -> tuple:
        inv = 1.0 / (500000.0 ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim))
        ang = torch.outer(torch.arange(seq, device=device).float(), inv)
        ang = torch.cat((ang, ang), dim=-1)[:, None, None, :]  # [S, 1, 1, hd] over the global sequence
        return ang.cos(), ang.sin()

    def forward(self, tokens: Tensor, labels: Tensor, loss_mask: Tensor, global_seq: int) -> Tensor:
        rot = self.rotary(global_seq, tokens.device)
        x = self.embed(tokens).transpose(0, 1).contiguous()  # [s_local, b, h]
        for blk in self.layers:
            x = CpuCheckpoint.apply(lambda t, b=blk: b(t, rot), x)
        losses = self.head(x, labels)  # [S, b] in FPDT order
        return (losses.t() * loss_mask).sum() / loss_mask.sum()
