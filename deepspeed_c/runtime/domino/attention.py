"""Domino's sharded self-attention: each tensor-parallel rank holds num_attention_heads / tp heads.

The fused QKV projection is Megatron's layout: per head, [q | k | v] of kv_channels rows each, heads
in order, so rank r's column shard is the contiguous rows of heads [r*np, (r+1)*np). Activations are
[sequence, batch, hidden]. The output projection returns this rank's partial sum; the caller starts
its all-reduce asynchronously (transformer.py)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from deepspeed_c.runtime.domino.async_linear import DominoAsyncColumnParallelLinear, RowParallelLinearNoComm
from deepspeed_c.runtime.domino.config import check_config, tp_group_of
from deepspeed_c.runtime.domino.enums import AttnMaskType, AttnType
from deepspeed_c.runtime.domino.handles import DominoUtil, _Wait_bwd_comm

__all__ = ["DominoModule", "CoreAttention", "ShardedAttention"]


class DominoModule(torch.nn.Module):
    """Base class of Domino's modules (DeepSpeed's name)."""


class CoreAttention(DominoModule):
    """softmax(q k^T / sqrt(d)) v over this rank's heads: [b, np, s, hn] x3 -> [s, b, np * hn]."""

    def __init__(self, config: Any, tp_world_size: int, attn_mask_type: AttnMaskType = AttnMaskType.causal) -> None:
        super().__init__()
        projection_size = config.kv_channels * config.num_attention_heads
        if projection_size % tp_world_size:
            raise ValueError(f"CoreAttention: kv_channels x num_attention_heads ({projection_size}) is not divisible "
                             f"by the tensor-parallel world size ({tp_world_size})")
        self.attn_mask_type = attn_mask_type
        self.hidden_size_per_partition = projection_size // tp_world_size
        self.attention_dropout_rate = config.attention_dropout

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor,
                attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        causal = self.attn_mask_type == AttnMaskType.causal
        # Megatron's mask marks the positions to drop (True); SDPA's boolean mask marks those kept
        mask = None if causal or attention_mask is None else ~attention_mask.bool()
        context = F.scaled_dot_product_attention(query_layer, key_layer, value_layer, attn_mask=mask,
                                                 dropout_p=self.attention_dropout_rate if self.training else 0.0,
                                                 is_causal=causal)
        b, heads, s, hn = context.shape
        return context.permute(2, 0, 1, 3).reshape(s, b, heads * hn)


class ShardedAttention(DominoModule):
    """Self-attention with the QKV projection column-parallel (asynchronous backward all-reduce) and the
    output projection row-parallel without communication. Only self-attention, as DeepSpeed's."""

    def __init__(self, config: Any, mpu: Any, apply_rotary_pos_emb: Optional[Callable], layer_number: int,
                 attention_type: AttnType = AttnType.self_attn,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal) -> None:
        super().__init__()
        if attention_type != AttnType.self_attn:
            raise NotImplementedError(f"ShardedAttention: attention_type {attention_type} is not supported; only "
                                      "AttnType.self_attn")
        group, tp = tp_group_of(mpu, "ShardedAttention")
        check_config(config, tp, "ShardedAttention")
        self.layer_number = max(1, layer_number)
        self.attention_type, self.attn_mask_type = attention_type, attn_mask_type
        self.params_dtype = config.params_dtype
        self.apply_rotary_pos_emb = apply_rotary_pos_emb
        projection = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_attention_head = config.kv_channels
        self.num_attention_heads_per_partition = config.num_attention_heads // tp
        self.query_key_value = DominoAsyncColumnParallelLinear(config.hidden_size, 3 * projection // tp, group,
                                                               config=config, init_method=config.init_method,
                                                               bias=config.add_bias_linear)
        self.core_attention = CoreAttention(config, tp, attn_mask_type)
        self.dense = RowParallelLinearNoComm(projection // tp, config.hidden_size, config=config,
                                             init_method=config.output_layer_init_method,
                                             bias=config.add_bias_linear, skip_bias_add=True)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor], micro_batch_num: Any,
                rotary_pos_emb: Any = None) -> tuple:
        """[s, b, h] -> (this rank's partial [s, b, h], the dense bias to add after the sum)."""
        # the QKV backward's all-reduce of this input's gradient is waited right where autograd reads it
        hidden_states = _Wait_bwd_comm(hidden_states, DominoUtil.HANDLE_DIC, micro_batch_num)
        mixed, _ = self.query_key_value(hidden_states, DominoUtil.HANDLE_DIC, micro_batch_num)
        context = self.domino_core_attention_forward(mixed, attention_mask, rotary_pos_emb)
        return self.dense(context)

    def domino_core_attention_forward(self, mixed_x_layer: torch.Tensor, attention_mask: Optional[torch.Tensor],
                                      rotary_pos_emb: Any = None) -> torch.Tensor:
        """The attention after the QKV projection: [s, b, 3 * np * hn] -> [s, b, np * hn]."""
        s, b = mixed_x_layer.shape[:2]
        hn = self.hidden_size_per_attention_head
        mixed = mixed_x_layer.view(s, b, self.num_attention_heads_per_partition, 3 * hn).permute(1, 2, 0, 3)
        query, key, value = torch.split(mixed, [hn, hn, hn], dim=3)
        if rotary_pos_emb is not None:
            q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb, rotary_pos_emb)
            query = self.apply_rotary_pos_emb(query, q_emb)
            key = self.apply_rotary_pos_emb(key, k_emb)
        return self.core_attention(query, key, value, attention_mask)
