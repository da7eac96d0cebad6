"""FPDT's argument checks in one process (no group needed): FPDT_InputConstruct names the args attribute the
chunk size came from and the nearest valid sequence lengths (issue 40's bad input)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepspeed_c.sequence.fpdt_layer import FPDT_InputConstruct

KEY = "args.ds_sequence_parallel_fpdt_chunk_size"


def _construct(seq: int, chunk: object, sp: int) -> FPDT_InputConstruct:
    return FPDT_InputConstruct(torch.zeros(1, seq, dtype=torch.long), None, None, None, None,
                               SimpleNamespace(ds_sequence_parallel_fpdt_chunk_size=chunk), sp, 0)


@pytest.mark.parametrize("seq,chunk,sp,needles", [
    (35, 8, 2, ("global sequence length 35 is not", "nearest valid sequence lengths: 32 or 40")),
    (36, 8, 2, ("local 18 x sequence parallel size 2", "nearest valid sequence lengths: 32 or 40")),
    (4, 8, 2, ("nearest valid sequence lengths: 8 ",)),
    (40, 8, 3, (f"{KEY}=8 is not a multiple of the sequence parallel size 3", "nearest valid chunk sizes: 6 or 9")),
    (40, "8", 2, (f"{KEY} must be a positive int, got '8'",)),
    (40, 0, 2, (f"{KEY} must be a positive int, got 0",)),
])
def test_input_construct_names_the_chunk_key_and_nearest_lengths(seq, chunk, sp, needles):
    with pytest.raises(ValueError) as info:
        _construct(seq, chunk, sp)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_input_construct_without_chunk_size_and_bad_rank():
    with pytest.raises(ValueError, match=KEY.replace(".", r"\.") + " is not set"):
        FPDT_InputConstruct(torch.zeros(1, 8, dtype=torch.long), None, None, None, None, SimpleNamespace(), 2, 0)
    with pytest.raises(ValueError, match=r"sp_rank=2 is outside \[0, sp_size=2\)"):
        FPDT_InputConstruct(torch.zeros(1, 8, dtype=torch.long), None, None, None, None,
                            SimpleNamespace(ds_sequence_parallel_fpdt_chunk_size=4), 2, 2)


def test_input_construct_layout_of_a_valid_length():
    """48 tokens, chunk 12 over 4 ranks: rank 0 holds tokens 0-2, 12-14, 24-26, 36-38."""
    ids = torch.arange(48).view(1, 48)
    tokens, *_ = FPDT_InputConstruct(ids, None, None, None, None,
                                     SimpleNamespace(ds_sequence_parallel_fpdt_chunk_size=12), 4, 0).generate()
    assert tokens.tolist() == [[0, 1, 2, 12, 13, 14, 24, 25, 26, 36, 37, 38]]


def test_fpdt_without_a_sequence_parallel_group_names_it():
    """FPDT without a sequence-parallel group (issue 40's bad input), for the attention and the loss: refused
    before torch.distributed is even needed."""
    from deepspeed_c.sequence.fpdt_layer import FPDT_Attention, FPDT_LogitsLoss

    cfg = SimpleNamespace(kv_channels=8, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                          attention_dropout=0.0)
    with pytest.raises(ValueError, match="FPDT_Attention: sequence_process_group is None"):
        FPDT_Attention(cfg, torch.zeros(64, 32), None, torch.zeros(32, 32), None, None)
    with pytest.raises(ValueError, match="FPDT_LogitsLoss: sequence_process_group is None"):
        FPDT_LogitsLoss.apply(torch.zeros(8, 1, 4, requires_grad=True), torch.zeros(1, 8, dtype=torch.long),
                              torch.zeros(5, 4, requires_grad=True), 0, 2, None, 2)
