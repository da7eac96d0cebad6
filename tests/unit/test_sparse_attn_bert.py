"""The BERT tutorial flow on a tiny Hugging Face BertForMaskedLM: SparseAttentionUtils swaps every
self-attention for BertSparseSelfAttention (keeping the projections), pads inputs to the block
size, and the result equals the unmodified HF model given the layout as a 4D additive mask
(logits and parameter gradients); a dense layout equals the plain model with its padding mask."""
from __future__ import annotations

import copy

import pytest
import torch

from deepspeed_c.ops import sparse_attention as sa
from deepspeed_c.ops.sparse_attention.reference import token_mask

transformers = pytest.importorskip("transformers")


def tiny_bert(max_pos: int = 64):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=48, max_position_embeddings=max_pos, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return transformers.BertForMaskedLM(cfg).eval()


def grads(model, out):
    model.zero_grad()
    out.logits.square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_sparse_bert_equals_hf_bert_with_the_layout_as_mask():
    dense = tiny_bert()
    sparse = copy.deepcopy(dense)
    cfg = sa.FixedSparsityConfig(num_heads=2, block=16, num_local_blocks=2)
    sa.SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(sparse, 64, cfg)
    assert all(isinstance(l.attention.self, sa.BertSparseSelfAttention) for l in sparse.bert.encoder.layer)
    assert sparse.bert.encoder.layer[0].attention.self.query is dense.bert.encoder.layer[0].attention.self.query or \
        torch.equal(sparse.bert.encoder.layer[0].attention.self.query.weight,
                    dense.bert.encoder.layer[0].attention.self.query.weight)

    ids = torch.randint(1, 60, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 30:] = 0
    pad_len, ids_p, mask_p, types_p, _, _ = sa.SparseAttentionUtils.pad_to_block_size(
        16, ids, mask, torch.zeros_like(ids), None, None, 0, None)
    assert pad_len == 8 and ids_p.shape == (2, 48) and int(mask_p[:, 40:].sum()) == 0
    out = sparse(input_ids=ids_p, attention_mask=mask_p, token_type_ids=types_p)
    g_sparse = grads(sparse, out)
    # the reference: plain HF attention over the layout's tokens and the unpadded keys
    # (the layout is the module's master layout, built for max_seq_length, cut to 48 tokens: DeepSpeed's rule)
    layout = sparse.bert.encoder.layer[0].attention.self.sparse_self_attention.get_layout(48)
    allowed = token_mask(layout, 16)[None] & mask_p.bool()[:, None, None, :]
    mask4d = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)  # HF adds it as is
    ref = dense(input_ids=ids_p, attention_mask=mask4d, token_type_ids=types_p)
    g_ref = grads(dense, ref)
    logits = sa.SparseAttentionUtils.unpad_sequence_output(pad_len, out.logits)
    assert logits.shape == (2, 40, 60)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    assert g_sparse.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g_sparse[name], g_ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_dense_layout_equals_plain_bert_and_position_helpers():
    plain = tiny_bert()
    sparse = copy.deepcopy(plain)
    sa.SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        sparse, 64, sa.DenseSparsityConfig(num_heads=2, block=16))
    ids = torch.randint(1, 60, (1, 32))
    mask = torch.ones(1, 32, dtype=torch.long)
    mask[0, 20:] = 0
    torch.testing.assert_close(sparse(input_ids=ids, attention_mask=mask).logits,
                               plain(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)
    emb = plain.bert.embeddings.position_embeddings.weight.detach().clone()
    sa.SparseAttentionUtils.extend_position_embedding(plain, 128)
    grown = plain.bert.embeddings.position_embeddings.weight
    assert grown.shape == (128, 32) and torch.equal(grown[64:], emb) and plain.config.max_position_embeddings == 128
    with pytest.raises(ValueError, match="max_position"):
        sa.SparseAttentionUtils.extend_position_embedding(plain, 100)

    class Tok:
        model_max_length = 512
        init_kwargs: dict = {}

    assert sa.SparseAttentionUtils.update_tokenizer_model_max_length(Tok(), 4096).init_kwargs["model_max_length"] == 4096
