"""SparseAttentionUtils: fitting a pretrained BERT/RoBERTa to sparse attention (DeepSpeed's helpers):
longer position embeddings, tokenizer length, swapping self-attention layers, and padding
inputs to a multiple of the block size (and unpadding the output)."""
from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from .bert_sparse_self_attention import BertSparseSelfAttention
from .hf_bert import HFBertSparseSelfAttention
from .sparsity_config import SparsityConfig


def _is_hf_layer(layer: Any) -> bool:
    return type(layer).__module__.startswith("transformers.")


class SparseAttentionUtils:
    """Static helpers; see each method."""

    @staticmethod
    def extend_position_embedding(model: Any, max_position: int) -> Any:
        """Tiles a BERT/RoBERTa model's position embeddings up to `max_position` (which must be
        larger than the current size); RoBERTa's two reserved positions stay in front."""
        if hasattr(model, "bert"):
            emb = model.bert.embeddings.position_embeddings
            original = emb.weight.size(0)
            if max_position <= original:
                raise ValueError(f"max_position ({max_position}) must be larger than the model's {original} positions")
            multiples = max(1, max_position // original)
            emb.weight.data = emb.weight.repeat(multiples, 1)
        elif hasattr(model, "roberta"):
            emb = model.roberta.embeddings.position_embeddings
            original, width = emb.weight.shape
            original -= 2
            if max_position <= original:
                raise ValueError(f"max_position ({max_position}) must be larger than the model's {original} positions")
            multiples = max(1, max_position // original)
            max_position += 2
            grown = emb.weight.new_empty(max_position, width)
            at = 2
            for _ in range(multiples):
                grown[at:at + original] = emb.weight[2:]
                at += original
            emb.weight.data = grown
        else:
            raise ValueError("extend_position_embedding supports models with a `bert` or `roberta` attribute; extend "
                             "it for other model types")
        emb.num_embeddings = emb.weight.size(0)
        model.config.max_position_embeddings = max_position
        print(f"Extended position embeddings to {original * multiples}")
        return model

    @staticmethod
    def update_tokenizer_model_max_length(tokenizer: Any, max_position: int) -> Any:
        """Sets the tokenizer's model_max_length (and its saved init kwarg) to max_position."""
        tokenizer.model_max_length = max_position
        tokenizer.init_kwargs["model_max_length"] = max_position
        print(f"updated tokenizer model max imum length to {max_position}")
        return tokenizer

    @staticmethod
    def replace_model_self_attention_with_sparse_self_attention(
            model: Any, max_position: int, sparsity_config: SparsityConfig = SparsityConfig(num_heads=4)) -> Any:
        """Swaps every encoder self-attention of a BERT/RoBERTa model for BertSparseSelfAttention
        (the projections' weights kept) and records the new max position in its config."""
        if hasattr(model, "bert"):
            model.config.max_position_embeddings = max_position
            layers = model.bert.encoder.layer
        elif hasattr(model, "roberta"):
            model.config.max_position_embeddings = max_position + 2
            layers = model.roberta.encoder.layer
        else:
            raise ValueError("replace_model_self_attention_with_sparse_self_attention supports models with a `bert` "
                             "or `roberta` attribute; extend it for other model types")
        SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer(
            model.config, layers, sparsity_config)
        return model

    @staticmethod
    def replace_self_attention_layer_with_sparse_self_attention_layer(
            config: Any, layers: Any, sparsity_config: SparsityConfig = SparsityConfig(num_heads=4)) -> Any:
        """Each layer's `attention.self` becomes a BertSparseSelfAttention sharing its query, key and
        value projections (Hugging Face layers get the variant that speaks HF's calling convention)."""
        for layer in layers:
            cls = HFBertSparseSelfAttention if _is_hf_layer(layer) else BertSparseSelfAttention
            old = layer.attention.self
            new = cls(config, sparsity_config)
            new.query, new.key, new.value = old.query, old.key, old.value
            new.to(old.query.weight.device)
            layer.attention.self = new
        return layers

    @staticmethod
    def pad_to_block_size(block_size: int, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                          token_type_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                          inputs_embeds: torch.Tensor | None, pad_token_id: int, model_embeddings: Any):
        """Pads the sequence dimension up to a multiple of block_size: ids with pad_token_id, the
        attention mask with 0 (padding is not attended), token types with 0, positions with
        pad_token_id, and inputs_embeds with the embeddings of pad tokens (model_embeddings).
        Returns (pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)."""
        if input_ids is None and inputs_embeds is None:
            raise ValueError("pad_to_block_size needs input_ids or inputs_embeds")
        batch, seq = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        pad_len = (block_size - seq % block_size) % block_size
        if pad_len > 0:
            if inputs_embeds is not None:
                pad_ids = inputs_embeds.new_full((batch, pad_len), pad_token_id, dtype=torch.long)
                inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_ids)], dim=-2)
            if input_ids is not None:
                input_ids = F.pad(input_ids, (0, pad_len), value=pad_token_id)
            if position_ids is not None:
                position_ids = F.pad(position_ids, (0, pad_len), value=pad_token_id)
            if attention_mask is not None:
                attention_mask = F.pad(attention_mask, (0, pad_len), value=False)
            if token_type_ids is not None:
                token_type_ids = F.pad(token_type_ids, (0, pad_len), value=0)
        return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds

    @staticmethod
    def unpad_sequence_output(pad_len: int, sequence_output: torch.Tensor) -> torch.Tensor:
        """Drops the pad_len positions pad_to_block_size added from the encoder's output."""
        return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output
