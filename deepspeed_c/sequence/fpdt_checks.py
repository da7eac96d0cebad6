"""Argument checks and the token layout shared by FPDT's pieces.

FPDT's chunk size is global: a chunk of `chunk_size` consecutive tokens is split over the sp ranks, each
holding chunk_size / sp of them. So the global sequence length must be a multiple of chunk_size, and
chunk_size a multiple of sp (equivalently: the sequence is a multiple of sp x the per-rank chunk)."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from deepspeed_c import comm as dist


def sp_world(group: Any, who: str) -> int:
    """The size of the sequence-parallel group; FPDT without one is an error (not a silent single rank)."""
    if group is None:
        raise ValueError(f"{who}: sequence_process_group is None; FPDT needs a sequence-parallel process group "
                         "(e.g. deepspeed.utils.groups._get_sequence_parallel_group(), or a new_group of the ranks "
                         "sharing a sequence; a group of one rank is allowed)")
    if not dist.is_initialized():
        raise RuntimeError(f"{who}: torch.distributed is not initialised; call deepspeed.init_distributed() first")
    return dist.get_world_size(group)


def check_heads(who: str, heads: int, kv_heads: int, sp: int) -> None:
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if n <= 0 or n % sp != 0:
            raise ValueError(f"{who}: {name}={n} is not divisible by the sequence parallel size {sp}; the "
                             "all-to-all gives each rank an equal share of the heads")
    if heads % kv_heads != 0:
        raise ValueError(f"{who}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")


def check_chunk_size(who: str, chunk_size: int, sp: int, key: str = "chunk_size") -> None:
    """`key` is the name the caller gave the chunk size under (an argument or an args attribute)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"{who}: {key} must be a positive int, got {chunk_size!r}")
    if chunk_size % sp != 0:
        raise ValueError(f"{who}: {key}={chunk_size} is not a multiple of the sequence parallel size {sp} "
                         f"(each rank holds chunk_size / sp tokens of a chunk); nearest valid chunk sizes: "
                         f"{_nearest(chunk_size, sp)}")


def _nearest(n: int, step: int) -> str:
    low, high = (n // step) * step, -(-n // step) * step
    return f"{high}" if low == 0 else f"{low} or {high}"


def num_chunks(who: str, global_len: int, chunk_size: int, sp: int, key: str = "chunk_size") -> int:
    """Chunks of the sequence; raises, naming the nearest valid lengths, when it does not divide."""
    check_chunk_size(who, chunk_size, sp, key)
    if global_len <= 0 or global_len % chunk_size != 0:
        # the local length is only meaningful where the caller split the sequence evenly over the ranks
        split = f" (local {global_len // sp} x sequence parallel size {sp})" if global_len % sp == 0 else ""
        raise ValueError(f"{who}: the global sequence length {global_len}{split} is not a multiple of the FPDT "
                         f"chunk size {chunk_size} "
                         f"(= sp {sp} x per-rank chunk {chunk_size // sp}); nearest valid sequence lengths: "
                         f"{_nearest(global_len, chunk_size)} (pad the sequence or change "
                         "ds_sequence_parallel_fpdt_chunk_size)")
    return global_len // chunk_size


def token_order(global_len: int, chunk_size: int, sp: int, device: Any = None) -> Tensor:
    """The global token indices in FPDT's rank-major layout: rank r's slice (row r of .view(sp, -1)) is the
    per-rank chunks r, r + sp, r + 2 sp, ... of chunk_size / sp tokens, so that gathering local chunk i of
    every rank in rank order gives the contiguous span [i * chunk_size, (i + 1) * chunk_size)."""
    n = num_chunks("FPDT_InputConstruct", global_len, chunk_size, sp)
    local_chunk = chunk_size // sp
    idx = torch.arange(global_len, device=device).view(n, sp, local_chunk)  # [chunk i, rank r, token]
    return idx.permute(1, 0, 2).reshape(-1)
