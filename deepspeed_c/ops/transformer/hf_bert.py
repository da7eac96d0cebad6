"""Swapping a Hugging Face BERT's layers for DeepSpeedTransformerLayer, as DeepSpeed's
`module_inject` training replacement does: Q, K, V stacked into attn_qkvw/attn_qkvb, the attention
output dense and LayerNorm into attn_ow/attn_ob and attn_nw/attn_nb, the FFN into inter_*/output_*,
the output LayerNorm into norm_w/norm_b (post-LN). For a pre-LN BERT (NVIDIA's, DeepSpeed's
examples: PreAttentionLayerNorm, PostAttentionLayerNorm, intermediate.dense_act) the norms map as
DeepSpeed maps them: PostAttentionLayerNorm to attn_n*, PreAttentionLayerNorm to norm_*."""
from __future__ import annotations

import torch
from torch import nn

from deepspeed_c.ops.transformer.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer


def _returns_tuple() -> bool:
    # transformers 5 made BertLayer return the hidden states alone; earlier releases a tuple.
    try:
        import transformers
    except ImportError:
        return True
    return int(transformers.__version__.split(".")[0]) < 5


def layer_from_bert(child: nn.Module, config: DeepSpeedTransformerConfig) -> DeepSpeedTransformerLayer:
    """A DeepSpeedTransformerLayer holding a copy of one BERT layer's weights (same dtype and device)."""
    att = child.attention
    preln = config.pre_layer_norm
    attn_norm = child.PostAttentionLayerNorm if preln else att.output.LayerNorm
    inter = child.intermediate.dense_act if preln else child.intermediate.dense
    out_norm = child.PreAttentionLayerNorm if preln else child.output.LayerNorm
    s = att.self
    layer = DeepSpeedTransformerLayer(config)
    ref = s.query.weight
    layer.to(device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        layer.attn_qkvw.copy_(torch.cat([s.query.weight, s.key.weight, s.value.weight]))
        layer.attn_qkvb.copy_(torch.cat([s.query.bias, s.key.bias, s.value.bias]))
        pairs = [("attn_ow", att.output.dense.weight), ("attn_ob", att.output.dense.bias),
                 ("attn_nw", attn_norm.weight), ("attn_nb", attn_norm.bias), ("inter_w", inter.weight),
                 ("inter_b", inter.bias), ("output_w", child.output.dense.weight),
                 ("output_b", child.output.dense.bias), ("norm_w", out_norm.weight), ("norm_b", out_norm.bias)]
        for name, src in pairs:
            getattr(layer, name).copy_(src)
    layer.train(child.training)
    return layer


def module_inject(layer_obj: type, model: nn.Module, config, micro_batch_size: int, max_seq_length: int, seed: int,
                  preln: bool, fp16: bool = True) -> nn.Module:
    """DeepSpeed's `deepspeed.module_inject.inject.module_inject`: every `layer_obj` child of `model`
    (recursively) becomes a DeepSpeedTransformerLayer built from the BERT `config`."""
    act = getattr(config, "hidden_act", "gelu")
    if act != "gelu":
        raise NotImplementedError(f"DeepSpeedTransformerLayer computes the exact (erf) GELU; the model's "
                                  f"hidden_act is {act!r}")
    for name, child in model.named_children():
        if isinstance(child, layer_obj):
            ds_config = DeepSpeedTransformerConfig(
                batch_size=micro_batch_size, max_seq_length=max_seq_length, hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size, heads=config.num_attention_heads,
                attn_dropout_ratio=config.attention_probs_dropout_prob,
                hidden_dropout_ratio=config.hidden_dropout_prob, num_hidden_layers=config.num_hidden_layers,
                initializer_range=config.initializer_range, layer_norm_eps=getattr(config, "layer_norm_eps", 1e-12),
                seed=seed, fp16=fp16, pre_layer_norm=preln, return_tuple=_returns_tuple())
            setattr(model, name, layer_from_bert(child, ds_config))
        else:
            module_inject(layer_obj, child, config, micro_batch_size, max_seq_length, seed, preln, fp16)
    return model


def replace_hf_bert_layers(model: nn.Module, micro_batch_size: int = -1, max_seq_length: int = -1, seed: int = -1,
                           **flags) -> nn.Module:
    """Swaps every transformers BertLayer of `model` (a BertModel, BertForPreTraining, ...) in place.
    `flags`: DeepSpeedTransformerConfig's memory flags (normalize_invertible, gelu_checkpoint,
    attn_dropout_checkpoint), applied to every new layer."""
    from transformers.models.bert.modeling_bert import BertLayer

    config = model.config
    module_inject(BertLayer, model, config, micro_batch_size, max_seq_length, seed, preln=False,
                  fp16=next(model.parameters()).dtype == torch.float16)
    for m in model.modules():
        if isinstance(m, DeepSpeedTransformerLayer):
            for key, value in flags.items():
                if not hasattr(m.config, key):
                    raise ValueError(f"replace_hf_bert_layers: unknown DeepSpeedTransformerConfig field {key!r}")
                setattr(m.config, key, value)
    return model
