"""An independent float64 reference for Domino: the unsplit, unsharded transformer in plain torch ops
(explicit softmax attention, no SDPA), its full weights, and how a tensor-parallel rank's shard is cut
from them (Megatron's layout: QKV and fc1 by rows, dense and fc2 by columns, the rest replicated)."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

HIDDEN, HEADS, FFN, LAYERS, SEQ = 16, 4, 32, 2, 6
ROW_SPLIT = ("query_key_value.weight", "query_key_value.bias", "linear_fc1.weight", "linear_fc1.bias")
COL_SPLIT = ("dense.weight", "linear_fc2.weight")


def full_weights(seed: int, layers: int = LAYERS, hidden: int = HIDDEN, ffn: int = FFN) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    w: dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = f"layers.{i}."
        for ln in ("input_layernorm", "post_attention_layernorm"):
            w[p + ln + ".weight"] = 1.0 + rnd(hidden, scale=0.1)
            w[p + ln + ".bias"] = rnd(hidden, scale=0.1)
        w[p + "self_attention.query_key_value.weight"] = rnd(3 * hidden, hidden)
        w[p + "self_attention.query_key_value.bias"] = rnd(3 * hidden, scale=0.1)
        w[p + "self_attention.dense.weight"] = rnd(hidden, hidden)
        w[p + "self_attention.dense.bias"] = rnd(hidden, scale=0.1)
        w[p + "linear_fc1.weight"] = rnd(ffn, hidden)
        w[p + "linear_fc1.bias"] = rnd(ffn, scale=0.1)
        w[p + "linear_fc2.weight"] = rnd(hidden, ffn)
        w[p + "linear_fc2.bias"] = rnd(hidden, scale=0.1)
    w["final_layernorm.weight"] = 1.0 + rnd(hidden, scale=0.1)
    w["final_layernorm.bias"] = rnd(hidden, scale=0.1)
    return w


def split_dim(name: str) -> int | None:
    if name.endswith(ROW_SPLIT):
        return 0
    if name.endswith(COL_SPLIT):
        return 1
    return None


def shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    dim = split_dim(name)
    return full if dim is None else full.chunk(tp, dim=dim)[rank]


def load_shards(model: torch.nn.Module, weights: dict[str, torch.Tensor], tp: int, rank: int) -> None:
    state = model.state_dict()
    assert set(state) == set(weights), sorted(set(state) ^ set(weights))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shard(name, weights[name], tp, rank).to(p.dtype))


def dense_forward(w: dict[str, torch.Tensor], x: torch.Tensor, heads: int = HEADS, layers: int = LAYERS,
                  post_ln: bool = False, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """x: [s, b, h] float64 -> [s, b, h]. Causal attention unless padding_mask ([b, 1, s, s], True = masked)."""
    s, b, h = x.shape
    hn = h // heads

    def ln(t: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(t, (h,), w[name + ".weight"], w[name + ".bias"], eps=1e-5)

    for i in range(layers):
        p = f"layers.{i}."
        n1 = ln(x, p + "input_layernorm")
        qkv = n1 @ w[p + "self_attention.query_key_value.weight"].T + w[p + "self_attention.query_key_value.bias"]
        qkv = qkv.view(s, b, heads, 3 * hn).permute(1, 2, 0, 3)  # [b, heads, s, 3hn]
        q, k, v = qkv[..., :hn], qkv[..., hn:2 * hn], qkv[..., 2 * hn:]
        scores = q @ k.transpose(-1, -2) / math.sqrt(hn)
        if padding_mask is None:
            drop = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
        else:
            drop = padding_mask
        scores = scores.masked_fill(drop, float("-inf"))
        ctx = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(s, b, h)
        attn = ctx @ w[p + "self_attention.dense.weight"].T + w[p + "self_attention.dense.bias"]
        x = attn + (n1 if post_ln else x)
        n2 = ln(x, p + "post_attention_layernorm")
        mlp = F.gelu(n2 @ w[p + "linear_fc1.weight"].T + w[p + "linear_fc1.bias"])
        mlp = mlp @ w[p + "linear_fc2.weight"].T + w[p + "linear_fc2.bias"]
        x = mlp + (n2 if post_ln else x)
    return ln(x, "final_layernorm")


class MPU:
    """deepspeed_c's PipelineParallelGrid over (pipe 1, data world // tp, model tp): tensor ranks consecutive."""

    def __new__(cls, tp: int) -> Any:
        import torch.distributed as dist

        from deepspeed_c.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid

        topo = PipeModelDataParallelTopology(num_pp=1, num_mp=tp, num_dp=dist.get_world_size() // tp)
        return PipelineParallelGrid(topology=topo)
