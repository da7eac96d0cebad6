"""RandomLayerTokenDrop: wraps one layer so that, while training, it runs on a random subset of the tokens
(random-LTD, https://arxiv.org/abs/2211.11586): the scheduler says how many to keep; the first random-LTD
layer of a forward draws the kept positions for every random-LTD layer, each layer gathers its own, runs
on them and scatters its outputs back; the dropped tokens pass the layer unchanged. In eval mode, or once
the kept length reaches the sequence length, the layer runs on every token.

`init_config` takes the random_ltd section (model_mask_name, model_type encoder/decoder,
hidden_state_order batch_seq_dim/seq_batch_dim), the engine's RandomLTDScheduler and this layer's rank
among the random-LTD layers, as DeepSpeed's engine hands them in `random_ltd_initialize`."""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch.nn import Module

from deepspeed_c.ops.random_ltd.dropping_utils import (GatherTokens, ScatterTokens, bert_sample_tokens,
                                                       gpt_sample_tokens)
from deepspeed_c.runtime.config.utils import DeepSpeedConfigError

_PATH = "data_efficiency.data_routing.random_ltd"
_ORDERS = {"batch_seq_dim": True, "seq_batch_dim": False}  # -> batch_first
_SAMPLERS = {"encoder": bert_sample_tokens, "decoder": gpt_sample_tokens}


class RandomLayerTokenDrop(Module):

    def __init__(self, layer: Module) -> None:
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler: Optional[Any] = None
        self.random_ltd_layer_id = -1
        self.max_length: Optional[int] = None
        self.reserved_length = -1
        self.curr_seq = -1
        self.curr_micro_batch = -1
        self.batch_first = False
        self.mask_name: Optional[str] = None
        self.model_type = "decoder"

    def init_config(self, config: Mapping[str, Any], scheduler: Any, random_ltd_layer_id: int) -> None:
        order = config.get("hidden_state_order")
        if order not in _ORDERS:
            raise DeepSpeedConfigError(f"Invalid value {order!r} for config key '{_PATH}.hidden_state_order': "
                                       f"expected one of {', '.join(_ORDERS)}")
        model_type = config.get("model_type")
        if model_type not in _SAMPLERS:
            raise DeepSpeedConfigError(f"Invalid value {model_type!r} for config key '{_PATH}.model_type': "
                                       f"expected one of {', '.join(_SAMPLERS)}")
        self.random_ltd_scheduler = scheduler
        self.random_ltd_layer_id = random_ltd_layer_id
        self.max_length = scheduler.state["max_value"]
        self.mask_name = config.get("model_mask_name")
        self.batch_first = _ORDERS[order]
        self.model_type = model_type

    def _shape(self, hidden: torch.Tensor) -> None:
        seq_dim, batch_dim = (1, 0) if self.batch_first else (0, 1)
        self.curr_seq, self.curr_micro_batch = hidden.shape[seq_dim], hidden.shape[batch_dim]

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> Any:
        sched = self.random_ltd_scheduler
        if sched is not None:
            self.reserved_length = sched.get_current_seq()
            self._shape(hidden_states)
        if not (self.training and sched is not None and self.reserved_length < self.curr_seq):
            return self.random_ltd_layer(hidden_states, **kwargs)
        mask = kwargs[self.mask_name] if self.mask_name is not None else None
        if self.random_ltd_layer_id == 0:  # the first random-LTD layer draws for all of them
            indices, part_mask = _SAMPLERS[self.model_type](self.reserved_length, self.curr_seq, self.curr_micro_batch,
                                                            sched.get_random_ltd_layer_num(), hidden_states.device,
                                                            mask)
            sched.set_sample(indices, part_mask)
        else:
            indices, part_mask = sched.get_sample()
        layer_indices = indices[self.random_ltd_layer_id]
        hidden_states, part = GatherTokens.apply(hidden_states, layer_indices, self.batch_first)
        if self.mask_name is not None:
            kwargs[self.mask_name] = part_mask[self.random_ltd_layer_id] if self.model_type == "encoder" else part_mask
        outputs = self.random_ltd_layer(part, **kwargs)
        if isinstance(outputs, torch.Tensor):
            return ScatterTokens.apply(hidden_states, outputs, layer_indices, self.batch_first)
        if isinstance(outputs, tuple) and outputs and isinstance(outputs[0], torch.Tensor):
            return (ScatterTokens.apply(hidden_states, outputs[0], layer_indices, self.batch_first), ) + outputs[1:]
        raise TypeError(f"RandomLayerTokenDrop: the wrapped {type(self.random_ltd_layer).__name__} returned "
                        f"{type(outputs).__name__}; random-LTD needs a tensor or a tuple whose first item is the "
                        "hidden states")
