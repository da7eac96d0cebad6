"""deepspeed.sequence.fpdt_layer: FPDT (Ulysses-Offload), the fully pipelined distributed transformer.

The sequence is cut into chunks; attention runs chunk by chunk over the Ulysses all-to-all with an online
softmax across chunks, and each chunk's activations and key/value (when offloading) wait in pinned host
memory, prefetched one chunk ahead on a side CUDA stream. The FFN and the LM-head loss are chunked too.

Names and call signatures follow DeepSpeed 0.19.8 (Megatron layouts: hidden states [s, b, hidden]):

- FPDT_InputConstruct(tokens, labels, loss_mask, attention_mask, position_ids, args, sp_size, sp_rank)
  .generate() -> this rank's (tokens, labels, loss_mask, attention_mask, position_ids) in FPDT's layout
  (args.ds_sequence_parallel_fpdt_chunk_size is the global chunk size).
- FPDT_Attention(config, first_weight, first_bias, second_weight, second_bias, sequence_process_group,
  gather_idx=0, scatter_idx=2, return_bias=True, chunk_size=65536, enable_offloading=True)
  (x, attention_mask, inference_params, rotary_pos_emb, cpu_offloading=True) -> (out, bias|None).
- FPDT_FFN.apply(x, w1, b1, w2, b2, add_bias, chunk_size); FPDT_LogitsLoss.apply(lm_output, labels,
  logit_weights, rank, spg_size, spg, num_chunk).

Differences from DeepSpeed: no flash-attn dependency (torch's flash kernels on a GPU in fp16/bf16, an
exact math path elsewhere, so it runs and is tested on the host); attention dropout must be 0 (a
non-zero value raises; FPDT targets long-context pre-training without it); an attention_mask is not
supported (causal only, as in DeepSpeed, which asserts it is None); offloading happens when both the
constructor's enable_offloading and the call's cpu_offloading are true and there is more than one chunk.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from deepspeed_c.sequence.fpdt_attention import FPDTAttentionFunction, _Plan
from deepspeed_c.sequence.fpdt_checks import check_chunk_size, check_heads, num_chunks, sp_world, token_order
from deepspeed_c.sequence.fpdt_ffn import FPDT_FFN, bias_gelu, bias_gelu_back
from deepspeed_c.sequence.fpdt_loss import FPDT_LogitsLoss
from deepspeed_c.sequence.layer import apply_rotary_pos_emb

__all__ = ["FPDT_InputConstruct", "FPDT_Attention", "FPDT_FFN", "FPDT_LogitsLoss", "bias_gelu", "bias_gelu_back",
           "apply_rotary_pos_emb", "token_order"]


class FPDT_InputConstruct(torch.nn.Module):
    """Cuts this rank's tokens out of the whole batch in FPDT's load-balanced order: rank r holds the
    per-rank chunks r, r + sp, r + 2 sp, ... (chunk_size / sp tokens each). The loss mask is returned for
    the whole sequence, reordered the same way (FPDT_LogitsLoss's gathered losses come in that order);
    attention_mask passes through."""

    def __init__(self, tokens: Tensor, labels: Optional[Tensor], loss_mask: Optional[Tensor],
                 attention_mask: Any, position_ids: Optional[Tensor], args: Any, sp_size: int,
                 sp_rank: int) -> None:
        super().__init__()
        chunk = getattr(args, "ds_sequence_parallel_fpdt_chunk_size", None)
        if chunk is None:
            raise ValueError("FPDT_InputConstruct: args.ds_sequence_parallel_fpdt_chunk_size is not set")
        if not 0 <= sp_rank < sp_size:
            raise ValueError(f"FPDT_InputConstruct: sp_rank={sp_rank} is outside [0, sp_size={sp_size})")
        self.tokens, self.labels, self.loss_mask = tokens, labels, loss_mask
        self.attention_mask, self.position_ids = attention_mask, position_ids
        self.global_seq_len, self.batch_size = tokens.shape[1], tokens.shape[0]
        self.num_chunk_per_gpu = num_chunks("FPDT_InputConstruct", self.global_seq_len, chunk, sp_size,
                                            "args.ds_sequence_parallel_fpdt_chunk_size")
        self.sp_size, self.sp_rank = sp_size, sp_rank
        self.local_seq_len = self.global_seq_len // sp_size
        self.chunk_size = chunk // sp_size
        self.device = tokens.device
        self._chunk = chunk

    def generate(self) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor], Any, Optional[Tensor]]:
        order = token_order(self.global_seq_len, self._chunk, self.sp_size, self.device)
        mine = order.view(self.sp_size, -1)[self.sp_rank]
        pick = lambda t, idx: None if t is None else t[:, idx]  # noqa: E731
        return (pick(self.tokens, mine), pick(self.labels, mine), pick(self.loss_mask, order),
                self.attention_mask, pick(self.position_ids, mine))


class FPDT_Attention(torch.nn.Module):
    """Megatron self-attention core under FPDT: x [s_local, b, hidden] -> QKV projection (first_weight
    [q + 2 kv projection, hidden], first_bias) -> chunked Ulysses attention -> output projection
    (second_weight [hidden, q projection]). Returns (out, second_bias) with return_bias, else
    (out + second_bias, None), as DeepSpeed does."""

    def __init__(self, config: Any, first_weight: Tensor, first_bias: Optional[Tensor], second_weight: Tensor,
                 second_bias: Optional[Tensor], sequence_process_group: Any, gather_idx: int = 0,
                 scatter_idx: int = 2, return_bias: bool = True, chunk_size: int = 65536,
                 enable_offloading: bool = True) -> None:
        super().__init__()
        sp = sp_world(sequence_process_group, "FPDT_Attention")
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        check_heads("FPDT_Attention", heads, kv_heads, sp)
        check_chunk_size("FPDT_Attention", chunk_size, sp)
        dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
        if dropout != 0.0:
            raise ValueError(f"FPDT_Attention: config.attention_dropout={dropout}; FPDT supports only 0 (the "
                             "chunked online softmax recomputes blocks without a dropout mask)")
        if scatter_idx != 2:
            raise ValueError(f"FPDT_Attention: scatter_idx={scatter_idx} must be 2 (the head dimension)")
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.config = config
        self.projection_size = config.kv_channels * heads
        self.hidden_size_per_attention_head = config.kv_channels
        self.kv_projection_size = config.kv_channels * kv_heads
        self.hidden_size = config.hidden_size
        rows = self.projection_size + 2 * self.kv_projection_size
        if tuple(first_weight.shape) != (rows, self.hidden_size):
            raise ValueError(f"FPDT_Attention: first_weight has shape {tuple(first_weight.shape)}, expected "
                             f"(q + 2 kv projection, hidden) = {(rows, self.hidden_size)}")
        self.qkv_linear_weight, self.qkv_linear_bias = first_weight, first_bias
        self.qkv_dense_weight, self.qkv_dense_bias = second_weight, second_bias
        self.return_bias = return_bias
        self.dropout = dropout
        self.chunk_size = chunk_size
        self.double_buffer = enable_offloading
        self.num_chunks_attn = 0

    def forward(self, layernorm_output: Tensor, attention_mask: Any, inference_params: Any, rotary_pos_emb: Any,
                cpu_offloading: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
        if attention_mask is not None:
            raise ValueError("FPDT_Attention: attention_mask must be None (FPDT attention is causal)")
        if layernorm_output.dim() != 3 or layernorm_output.shape[-1] != self.hidden_size:
            raise ValueError(f"FPDT_Attention: input must be [s_local, batch, hidden={self.hidden_size}], got "
                             f"{tuple(layernorm_output.shape)}")
        sp = sp_world(self.spg, "FPDT_Attention")
        n = num_chunks("FPDT_Attention", layernorm_output.shape[0] * sp, self.chunk_size, sp)
        self.num_chunks_attn = n
        plan = _Plan(self.spg, n, layernorm_output.shape[0] // n, self.projection_size, self.kv_projection_size,
                     self.hidden_size_per_attention_head, rotary_pos_emb)
        offload = bool(cpu_offloading and self.double_buffer and n > 1)
        out = FPDTAttentionFunction.apply(layernorm_output, self.qkv_linear_weight, self.qkv_linear_bias, plan,
                                          offload)
        out = torch.matmul(out.flatten(2).permute(1, 0, 2), self.qkv_dense_weight.t())  # [s, b, hidden]
        if self.return_bias:
            return out, self.qkv_dense_bias
        return (out if self.qkv_dense_bias is None else out + self.qkv_dense_bias), None
