"""DeepSpeedTransformerLayer and DeepSpeedTransformerConfig (DeepSpeed's
`deepspeed.ops.transformer`): a BERT encoder layer, pre- or post-LayerNorm, trained through one
autograd node (`transformer_function`) whose fused pieces run as CUDA kernels on a GPU and as
torch on the host. Parameter names, shapes and order (hence the state dict) are DeepSpeed's, so
checkpoints of DeepSpeed's BERT examples load as they are."""
from __future__ import annotations

import json
import math
from typing import Any

import torch
from torch import nn

from deepspeed_c.ops.transformer.mask_cache import ConvertedMask
from deepspeed_c.ops.transformer.layer_math import transformed_forward
from deepspeed_c.ops.transformer.transformer_function import (WEIGHT_NAMES, DeepSpeedTransformerFunction,
                                                              LayerSpec)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LAYER_MASK = ConvertedMask()


class TransformerConfig:
    """The shape fields every transformer config carries."""

    def __init__(self, batch_size, hidden_size, intermediate_size, heads, attn_dropout_ratio, hidden_dropout_ratio,
                 num_hidden_layers, initializer_range):
        self.layer_id = -1
        self.batch_size = batch_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.heads = heads
        self.attn_dropout_ratio = attn_dropout_ratio
        self.hidden_dropout_ratio = hidden_dropout_ratio
        self.num_hidden_layers = num_hidden_layers
        self.initializer_range = initializer_range


class DeepSpeedTransformerConfig(TransformerConfig):
    """DeepSpeed's fields and defaults. `intermediate_size` <= 0 means 4 * hidden_size.
    `max_seq_length` (> 0) bounds the sequence a forward accepts (DeepSpeed's own module_inject
    passes it; -1: no bound). `stochastic_mode` is accepted: this kernel has one (deterministic)
    mode. `fp16` is informational: the layer computes in its parameters' dtype (fp32, fp16 or
    bf16), which the input must share."""

    def __init__(self, batch_size=-1, hidden_size=-1, intermediate_size=-1, heads=-1, attn_dropout_ratio=-1,
                 hidden_dropout_ratio=-1, num_hidden_layers=-1, initializer_range=-1, layer_norm_eps=1e-12,
                 local_rank=-1, seed=-1, fp16=False, pre_layer_norm=True, normalize_invertible=False,
                 gelu_checkpoint=False, adjust_init_range=True, attn_dropout_checkpoint=False, stochastic_mode=False,
                 return_tuple=False, training=True, max_seq_length=-1):
        super().__init__(batch_size, hidden_size, intermediate_size if intermediate_size > 0 else 4 * hidden_size,
                         heads, attn_dropout_ratio, hidden_dropout_ratio, num_hidden_layers, initializer_range)
        self.fp16 = fp16
        self.pre_layer_norm = pre_layer_norm
        self.local_rank = local_rank
        self.seed = seed
        self.normalize_invertible = normalize_invertible
        self.gelu_checkpoint = gelu_checkpoint
        self.adjust_init_range = adjust_init_range
        self.test_gemm = False
        self.layer_norm_eps = layer_norm_eps
        self.training = training
        self.is_grad_enabled = True
        self.attn_dropout_checkpoint = attn_dropout_checkpoint
        self.stochastic_mode = stochastic_mode
        self.return_tuple = return_tuple
        self.max_seq_length = max_seq_length

    @classmethod
    def from_dict(cls, json_object: dict[str, Any]) -> "DeepSpeedTransformerConfig":
        config = cls()
        for key, value in json_object.items():
            config.__dict__[key] = value
        return config

    @classmethod
    def from_json_file(cls, json_file: str) -> "DeepSpeedTransformerConfig":
        # DeepSpeed reads these files as UTF-16.
        with open(json_file, "r", encoding="utf-16") as reader:
            return cls.from_dict(json.loads(reader.read()))


def _validate_config(c: DeepSpeedTransformerConfig) -> None:
    for key in ("hidden_size", "heads", "intermediate_size"):
        if not isinstance(getattr(c, key), int) or getattr(c, key) <= 0:
            raise ValueError(f"DeepSpeedTransformerConfig.{key} must be a positive int, got {getattr(c, key)!r}")
    if c.hidden_size % c.heads != 0:
        raise ValueError(f"DeepSpeedTransformerConfig: hidden_size ({c.hidden_size}) must be divisible by heads "
                         f"({c.heads})")
    for key in ("attn_dropout_ratio", "hidden_dropout_ratio"):
        p = getattr(c, key)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"DeepSpeedTransformerConfig.{key} must be in [0, 1), got {p!r}")


class DeepSpeedTransformerLayer(nn.Module):
    """A BERT layer with DeepSpeed's parameters. `layer_id` counts the layers built in this
    process (DeepSpeed's static counter). `attention_impl` (ours, not DeepSpeed's): "auto" runs the
    attention core through torch's fused SDPA on a GPU and through the explicit masked softmax on the
    host; "sdpa" or "softmax" force one. initial_weights / initial_biases (tests, as DeepSpeed's):
    [q, k, v, attn_ow, attn_nw, inter_w, output_w, norm_w] and the matching biases; the QKV bias is
    the concatenation of the given q, k, v biases (DeepSpeed zeroes it)."""

    layer_id = 0

    def __init__(self, config: DeepSpeedTransformerConfig, initial_weights=None, initial_biases=None):
        super().__init__()
        _validate_config(config)
        self.config = config
        self.config.layer_id = DeepSpeedTransformerLayer.layer_id
        DeepSpeedTransformerLayer.layer_id += 1
        if config.local_rank >= 0 and torch.cuda.is_available():
            torch.cuda.set_device(config.local_rank)
        H, I = config.hidden_size, config.intermediate_size
        shapes = {"attn_qkvw": (3 * H, H), "attn_qkvb": (3 * H,), "attn_ow": (H, H), "attn_ob": (H,),
                  "attn_nw": (H,), "attn_nb": (H,), "inter_w": (I, H), "inter_b": (I,), "output_w": (H, I),
                  "output_b": (H,), "norm_w": (H,), "norm_b": (H,)}
        if initial_weights is None and initial_biases is None:
            for name in WEIGHT_NAMES:
                setattr(self, name, nn.Parameter(torch.empty(shapes[name])))
            self.init_transformer_weights(config.adjust_init_range)
        else:
            self._adopt(initial_weights, initial_biases, shapes)
        self._generator: torch.Generator | None = None
        self._spec_cache: tuple | None = None
        self.attention_impl = "auto"

    def _adopt(self, weights, biases, shapes) -> None:
        w, b = list(weights), list(biases)
        if len(w) != 8 or len(b) != 8:
            raise ValueError("initial_weights and initial_biases must each hold 8 tensors "
                             "(q, k, v, attn_o, attn_norm, inter, output, norm)")
        tensors = {"attn_qkvw": torch.cat([t.data for t in w[:3]]), "attn_qkvb": torch.cat([t.data for t in b[:3]]),
                   "attn_ow": w[3], "attn_ob": b[3], "attn_nw": w[4], "attn_nb": b[4], "inter_w": w[5],
                   "inter_b": b[5], "output_w": w[6], "output_b": b[6], "norm_w": w[7], "norm_b": b[7]}
        for name in WEIGHT_NAMES:
            t = tensors[name]
            if tuple(t.shape) != shapes[name]:
                raise ValueError(f"DeepSpeedTransformerLayer: {name} must have shape {list(shapes[name])}, "
                                 f"got {list(t.shape)}")
            setattr(self, name, t if isinstance(t, nn.Parameter) else nn.Parameter(t.detach().clone()))

    def init_transformer_weights(self, adjust_init_range: bool = False) -> None:
        c = self.config
        output_std = c.initializer_range
        if adjust_init_range:
            output_std = c.initializer_range / math.sqrt(2.0 * c.num_hidden_layers)
        with torch.no_grad():
            self.attn_qkvw.normal_(mean=0.0, std=c.initializer_range)
            self.attn_ow.normal_(mean=0.0, std=output_std)
            self.inter_w.normal_(mean=0.0, std=c.initializer_range)
            self.output_w.normal_(mean=0.0, std=output_std)
            for name in ("attn_qkvb", "attn_ob", "attn_nb", "inter_b", "output_b", "norm_b"):
                getattr(self, name).zero_()
            self.attn_nw.fill_(1.0)
            self.norm_w.fill_(1.0)

    def _dropout_generator(self, device: torch.device) -> torch.Generator | None:
        # config.seed >= 0: the layer's dropout masks come from its own generator (seed + layer id).
        if self.config.seed < 0:
            return None
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.config.seed + self.config.layer_id)
        return self._generator

    def _mask(self, mask: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
        """An additive mask broadcastable to [B, 1, S, S] (HF's extended mask [B, 1, 1, S], a
        [B, 1, S, S] one, or a bool keep mask) as float32 (float64 for float64 input) [B, 1 | S, S]."""
        if mask is None:
            return None
        B, S, _ = x.shape
        md = torch.float64 if x.dtype == torch.float64 else torch.float32
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=md, device=mask.device).masked_fill(~mask, torch.finfo(md).min)
        if mask.dim() == 2:
            mask = mask[:, None, None, :]
        if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != S or mask.shape[2] not in (1, S) \
                or mask.shape[0] not in (1, B):
            raise ValueError(f"DeepSpeedTransformerLayer: attention_mask must be an additive mask of shape "
                             f"[{B}, 1, 1, {S}] or [{B}, 1, {S}, {S}] (or a bool keep mask of those shapes), "
                             f"got {list(mask.shape)}")
        if mask.device != x.device:
            raise ValueError(f"DeepSpeedTransformerLayer: attention_mask is on {mask.device}, the input on {x.device}")
        return _LAYER_MASK.get(mask, (B, S, md), lambda: mask[:, 0].to(md).expand(B, mask.shape[2], S).contiguous())

    def _check_input(self, x: torch.Tensor, weights: list) -> None:
        c = self.config
        if x.dim() != 3 or x.shape[-1] != c.hidden_size:
            raise ValueError(f"DeepSpeedTransformerLayer: hidden_states must be [batch, seq, {c.hidden_size}], "
                             f"got {list(x.shape)}")
        if c.max_seq_length > 0 and x.shape[1] > c.max_seq_length:
            raise ValueError(f"DeepSpeedTransformerLayer: sequence length {x.shape[1]} is longer than the config's "
                             f"max_seq_length ({c.max_seq_length})")
        allowed = _DTYPES + ((torch.float64,) if not x.is_cuda else ())
        if x.dtype not in allowed:
            raise TypeError(f"DeepSpeedTransformerLayer: unsupported dtype {x.dtype}; use "
                            f"{', '.join(str(d) for d in allowed)}")
        for name, p in zip(WEIGHT_NAMES, weights):
            if p.dtype != x.dtype or p.device != x.device:
                raise TypeError(f"DeepSpeedTransformerLayer: parameter {name} is {p.dtype} on {p.device} but the "
                                f"input is {x.dtype} on {x.device}; move the layer with .to(dtype, device)")

    def forward(self, hidden_states, attention_mask=None, head_mask=None, layer_head_mask=None,
                encoder_hidden_states=None, encoder_attention_mask=None, past_key_value=None,
                output_attentions=False, grads=None, **kwargs):
        for name, value in (("head_mask", head_mask), ("layer_head_mask", layer_head_mask),
                            ("encoder_hidden_states", encoder_hidden_states),
                            ("past_key_value", past_key_value if past_key_value is not None
                             else kwargs.get("past_key_values"))):
            if value is not None:
                raise NotImplementedError(f"DeepSpeedTransformerLayer does not support {name} (an encoder layer "
                                          f"without head masks, cross attention or a cache)")
        if output_attentions:
            raise NotImplementedError("DeepSpeedTransformerLayer does not return attention probabilities "
                                      "(output_attentions=True)")
        c = self.config
        c.is_grad_enabled = torch.is_grad_enabled()
        c.training = self.training
        x = hidden_states.contiguous()
        weights = [getattr(self, name) for name in WEIGHT_NAMES]
        self._check_input(x, weights)
        spec = self._spec(x)
        if grads is not None:
            self._record_grads(grads)
        if torch._C._are_functorch_transforms_active():  # torch.func: the same math in torch's own ops
            out = transformed_forward(spec, x, self._mask(attention_mask, x), weights)
        else:
            out = DeepSpeedTransformerFunction.apply(spec, self._dropout_generator(x.device), x,
                                                     self._mask(attention_mask, x), *weights)
        return (out,) if c.return_tuple else out

    def _spec(self, x: torch.Tensor) -> LayerSpec:
        # built once per distinct config state (the config is a plain object a user may edit between calls)
        c, train = self.config, self.training
        key = (c.heads, c.pre_layer_norm, c.layer_norm_eps, c.attn_dropout_ratio, c.hidden_dropout_ratio,
               c.normalize_invertible, c.gelu_checkpoint, c.attn_dropout_checkpoint, train,
               self._fused_attention(x))
        if self._spec_cache is None or self._spec_cache[0] != key:
            spec = LayerSpec(heads=c.heads, pre_layer_norm=bool(c.pre_layer_norm), eps=float(c.layer_norm_eps),
                             attn_dropout=float(c.attn_dropout_ratio) if train else 0.0,
                             hidden_dropout=float(c.hidden_dropout_ratio) if train else 0.0,
                             normalize_invertible=bool(c.normalize_invertible),
                             gelu_checkpoint=bool(c.gelu_checkpoint),
                             attn_dropout_checkpoint=bool(c.attn_dropout_checkpoint), fused_attention=key[-1])
            self._spec_cache = (key, spec)
        return self._spec_cache[1]

    def _fused_attention(self, x: torch.Tensor) -> bool:
        impl = self.attention_impl
        if impl not in ("auto", "sdpa", "softmax"):
            raise ValueError(f"DeepSpeedTransformerLayer.attention_impl must be 'auto', 'sdpa' or 'softmax', "
                             f"got {impl!r}")
        return impl == "sdpa" or (impl == "auto" and x.is_cuda)

    def _record_grads(self, grads: list) -> None:
        """DeepSpeed's test hook: each parameter's gradient is appended as [grad, name] (the V part
        of the QKV weight and bias, as DeepSpeed records)."""
        H = self.config.hidden_size
        labels = {"attn_ow": "O_W", "attn_ob": "O_B", "attn_nw": "N2_W", "attn_nb": "N2_B", "inter_w": "int_W",
                  "inter_b": "int_B", "output_w": "out_W", "output_b": "out_B", "norm_w": "norm_W",
                  "norm_b": "norm_B"}
        self.attn_qkvw.register_hook(lambda g: grads.append([g[2 * H:3 * H], "V_W"]))
        self.attn_qkvb.register_hook(lambda g: grads.append([g[2 * H:3 * H], "V_B"]))
        for name, label in labels.items():
            getattr(self, name).register_hook(lambda g, label=label: grads.append([g, label]))
