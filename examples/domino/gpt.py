"""A GPT built on Domino, and the same GPT run as plain tensor parallelism (AutoTP's layers), sharing weights.

GPT: token + position embeddings (replicated), a DominoTransformer ([sequence, batch, hidden]), logits
from the tied embedding. `PlainTPTransformer(domino)` runs the same layers, on the same Parameter objects,
as plain synchronous TP: deepspeed_c's AutoTP LinearLayer (identity forward, all-reduce backward) and
LinearAllreduce (all-reduce forward), over the whole micro-batch. Swap `gpt.transformer` to compare them."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from deepspeed_c.accelerator import get_accelerator
from deepspeed_c.module_inject.layers import LinearAllreduce, LinearLayer
from deepspeed_c.runtime.domino import DominoConfig, DominoTransformer, ModelType

SIZES = {  # name: (layers, hidden, heads)
    "tiny": (2, 64, 4),
    "125M": (12, 768, 12),
    "1.3B": (24, 2048, 16),
    "2.7B": (32, 2560, 32),
}


def domino_config(size: str, dtype: torch.dtype, **kw: Any) -> DominoConfig:
    layers, hidden, heads = SIZES[size]
    return DominoConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, params_dtype=dtype, **kw)


class GPT(torch.nn.Module):
    def __init__(self, config: DominoConfig, mpu: Any, vocab: int, max_seq: int) -> None:
        super().__init__()
        device = get_accelerator().current_device_name()  # where Domino puts its layers
        self.embed = torch.nn.Embedding(vocab, config.hidden_size, device=device, dtype=config.params_dtype)
        self.pos = torch.nn.Embedding(max_seq, config.hidden_size, device=device, dtype=config.params_dtype)
        torch.nn.init.normal_(self.embed.weight, std=0.02)
        torch.nn.init.normal_(self.pos.weight, std=0.02)
        self.transformer: torch.nn.Module = DominoTransformer(config, mpu, None, ModelType.encoder_or_decoder)

    def forward(self, ids: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ids [b, s] -> mean cross-entropy against labels (or logits [b, s, vocab] without labels)."""
        s = ids.shape[1]
        h = (self.embed(ids) + self.pos(torch.arange(s, device=ids.device))).transpose(0, 1)  # [s, b, h]
        h = self.transformer(h, None)
        logits = torch.matmul(h.transpose(0, 1), self.embed.weight.t())
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _row_parallel(linear: torch.nn.Module, group: Any, tp: int) -> LinearAllreduce:
    # LinearAllreduce cuts its shard from a whole weight: give it a placeholder, then hand it Domino's shard
    out_f, in_f = linear.weight.shape
    whole = torch.nn.Linear(in_f * tp, out_f, bias=False, device="meta")
    layer = LinearAllreduce(whole, group)
    layer.weight, layer.bias = linear.weight, linear.bias
    layer._mark(layer.weight, True)
    layer._mark(layer.bias, False)
    return layer


class PlainTPTransformer(torch.nn.Module):
    """DominoTransformer's layers, unsplit and synchronous, through AutoTP's layers (same parameters)."""

    def __init__(self, domino: DominoTransformer) -> None:
        super().__init__()
        self.domino = domino
        group, tp = domino.TP_group, domino.layers[0].tp_world_size if len(domino.layers) else 1
        self.qkv = torch.nn.ModuleList(LinearLayer(l.self_attention.query_key_value, group, skip_partition=True)
                                       for l in domino.layers)
        self.dense = torch.nn.ModuleList(_row_parallel(l.self_attention.dense, group, tp) for l in domino.layers)
        self.fc1 = torch.nn.ModuleList(LinearLayer(l.linear_fc1, group, skip_partition=True) for l in domino.layers)
        self.fc2 = torch.nn.ModuleList(_row_parallel(l.linear_fc2, group, tp) for l in domino.layers)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor],
                rotary_pos_emb: Any = None) -> torch.Tensor:
        for i, layer in enumerate(self.domino.layers):
            normed = layer.input_layernorm(x)
            context = layer.self_attention.domino_core_attention_forward(self.qkv[i](normed), attention_mask,
                                                                         rotary_pos_emb)
            x = layer.bias_dropout_add_func(self.dense[i](context), None, x)
            normed = layer.post_attention_layernorm(x)
            x = layer.bias_dropout_add_func(self.fc2[i](layer.mlp_activation_func(self.fc1[i](normed))), None, x)
        return self.domino._final(x)
