"""Vocabulary-parallel embedding and LM head for AutoTP inference.

The word embedding and the LM head are the largest single tensors of a small-hidden, big-vocab model,
so both are split along the vocabulary: rank r keeps rows [r*n, (r+1)*n) with n = ceil(V / P) (the last
rank's tail is zero padding when P does not divide V).
- VocabParallelEmbedding: each rank looks up the ids it holds (others give zeros); the all-reduce sums
  the one non-zero row per token, so the result is bit-identical to the full lookup.
- VocabParallelLMHead: each rank computes the logits of its vocabulary rows; an all-gather along the
  last dimension (then the padding dropped) gives every rank the full logits, each element the same
  dot product the unsharded head computes. When the head is tied to the embedding (GPT-2, OPT, BERT's
  decoder) both hold the same shard Parameter, so the tie survives and the rows are stored once.
(DeepSpeed's AutoTP inference instead splits the LM head along the hidden dimension and all-reduces the
full-vocabulary logits, and keeps the embedding whole or hidden-split.)"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepspeed_c import comm as dist
from deepspeed_c.module_inject.layers import TensorParallel_Layer, gather_full


def _rows(vocab: int, world: int) -> int:
    return -(-vocab // world)


def shard_rows(full: Tensor, world: int, rank: int) -> Tensor:
    """Rank `rank`'s rows of a [V, ...] tensor, zero-padded to ceil(V / world) rows."""
    n = _rows(full.shape[0], world)
    part = full[rank * n:(rank + 1) * n]
    if part.shape[0] < n:
        pad = torch.zeros((n - part.shape[0],) + tuple(full.shape[1:]), dtype=full.dtype, device=full.device)
        part = torch.cat([part, pad], dim=0)
    return part.clone()


class VocabParallelEmbedding(TensorParallel_Layer):
    """nn.Embedding split along the vocabulary; lookups all-reduced over the TP group."""

    partition_dim = 0

    def __init__(self, module: nn.Embedding, mp_group: Any, shared: Optional[nn.Parameter] = None,
                 **kwargs: Any) -> None:
        super().__init__(mp_group, **kwargs)
        self.num_embeddings, self.embedding_dim = module.weight.shape
        self.padding_idx = module.padding_idx
        self.rows = _rows(self.num_embeddings, self.tp_world_size)
        self.start = self.tp_index * self.rows
        self.weight = shared if shared is not None else nn.Parameter(
            shard_rows(module.weight.data, self.tp_world_size, self.tp_index), requires_grad=False)
        self.bias = None
        self._mark(self.weight, True)
        self.support_training = False

    def shard_of(self, key: str, full: Tensor) -> Tensor:
        """This rank's piece of a full checkpoint tensor named `key` ('weight')."""
        return shard_rows(full, self.tp_world_size, self.tp_index)

    def forward(self, input: Tensor) -> Tensor:
        if self.tp_world_size == 1:
            return F.embedding(input, self.weight[:self.num_embeddings])
        local = input - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(out, group=self.mp_group)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} (rows {self.start}.. of {self.rows}, shard " \
               f"{self.tp_index} of {self.tp_world_size})"


class VocabParallelLMHead(TensorParallel_Layer):
    """The output projection split along the vocabulary; logits all-gathered, padding dropped."""

    partition_dim = 0

    def __init__(self, module: nn.Linear, mp_group: Any, shared: Optional[nn.Parameter] = None,
                 **kwargs: Any) -> None:
        super().__init__(mp_group, **kwargs)
        self.out_features, self.in_features = module.weight.shape
        self.weight = shared if shared is not None else nn.Parameter(
            shard_rows(module.weight.data, self.tp_world_size, self.tp_index), requires_grad=False)
        bias = getattr(module, "bias", None)
        self.bias = None if bias is None else nn.Parameter(shard_rows(bias.data, self.tp_world_size, self.tp_index),
                                                           requires_grad=False)
        self._mark(self.weight, True)
        self._mark(self.bias, True)
        self.support_training = False

    def shard_of(self, key: str, full: Tensor) -> Tensor:
        return shard_rows(full, self.tp_world_size, self.tp_index)

    def forward(self, input: Tensor) -> Tensor:
        out = F.linear(input, self.weight, self.bias)
        if self.tp_world_size > 1:
            out = gather_full(out.contiguous(), out.dim() - 1, self.mp_group)
        return out[..., :self.out_features]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (vocabulary shard " \
               f"{self.tp_index} of {self.tp_world_size}), bias={self.bias is not None}"
