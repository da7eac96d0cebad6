"""What Domino reads from its `config`, and the checks DeepSpeed leaves to an assert or a shape error.

DeepSpeed's Domino takes Megatron's TransformerConfig (any object with its attribute names will do);
DominoConfig is a plain dataclass with those names and Megatron's defaults, for users without Megatron.
`recompute_granularity` ("full") is Megatron's name for activation checkpointing; Domino recomputes
each computation between two all-reduces, so recomputation never communicates."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import torch

__all__ = ["DominoConfig", "check_config", "tp_group_of", "split_micro_batch"]


def _normal(std: float = 0.02) -> Callable[[torch.Tensor], Any]:
    return lambda w: torch.nn.init.normal_(w, mean=0.0, std=std)


@dataclasses.dataclass
class DominoConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: Optional[int] = None        # 4 x hidden_size when None
    kv_channels: Optional[int] = None            # hidden_size // num_attention_heads when None
    params_dtype: torch.dtype = torch.float32
    perform_initialization: bool = True
    init_method: Optional[Callable[[torch.Tensor], Any]] = None
    output_layer_init_method: Optional[Callable[[torch.Tensor], Any]] = None
    add_bias_linear: bool = True
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    apply_residual_connection_post_layernorm: bool = False
    layernorm_epsilon: float = 1e-5
    gated_linear_unit: bool = False              # read as DeepSpeed reads it: accepted, not used
    domino_intra_layer_overlap: bool = False
    recompute_granularity: Optional[str] = None  # None, or "full": recompute between the all-reduces

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            if self.num_attention_heads <= 0:
                raise ValueError(f"DominoConfig: num_attention_heads must be positive, got {self.num_attention_heads}")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.init_method is None:
            self.init_method = _normal()
        if self.output_layer_init_method is None:  # Megatron's scaled init for the layers writing the residual
            self.output_layer_init_method = _normal(0.02 / math.sqrt(2.0 * max(1, self.num_layers)))


_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels", "params_dtype",
             "perform_initialization", "init_method", "output_layer_init_method", "add_bias_linear",
             "attention_dropout", "hidden_dropout", "apply_residual_connection_post_layernorm", "layernorm_epsilon")


def tp_group_of(mpu: Any, who: str) -> tuple[Any, int]:
    """The mpu's tensor-parallel group and size; Domino has nothing to overlap without one."""
    if mpu is None:
        raise ValueError(f"{who}: mpu is None; Domino needs a tensor-parallel group: pass an mpu with "
                         "get_tensor_model_parallel_group() / get_tensor_model_parallel_world_size() (Megatron's "
                         "parallel_state, or deepspeed.runtime.pipe.topology.PipelineParallelGrid)")
    for name in ("get_tensor_model_parallel_group", "get_tensor_model_parallel_world_size"):
        if not callable(getattr(mpu, name, None)):
            raise TypeError(f"{who}: the mpu ({type(mpu).__name__}) has no method {name}(); Domino needs the "
                            "tensor-parallel group of Megatron's mpu protocol")
    group = mpu.get_tensor_model_parallel_group()
    size = int(mpu.get_tensor_model_parallel_world_size())
    if group is None or size < 1:
        raise ValueError(f"{who}: mpu.get_tensor_model_parallel_group() is {group!r} (size {size}); Domino "
                         "needs a tensor-parallel process group (initialise torch.distributed and build the mpu's "
                         "groups first)")
    return group, size


def check_config(config: Any, tp_world_size: int, who: str) -> None:
    """Refuses, naming the attribute, what would otherwise fail deep inside a forward."""
    missing = [k for k in _REQUIRED if not hasattr(config, k)]
    if missing:
        raise TypeError(f"{who}: config ({type(config).__name__}) lacks attribute(s) {missing}; pass Megatron's "
                        "TransformerConfig or deepspeed.runtime.domino.DominoConfig")
    heads = int(config.num_attention_heads)
    if heads <= 0 or heads % tp_world_size:
        raise ValueError(f"{who}: config.num_attention_heads ({heads}) is not divisible by the tensor-parallel "
                         f"world size ({tp_world_size}); each rank must hold whole heads")
    if int(config.ffn_hidden_size) % tp_world_size:
        raise ValueError(f"{who}: config.ffn_hidden_size ({config.ffn_hidden_size}) is not divisible by the "
                         f"tensor-parallel world size ({tp_world_size})")
    if config.params_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{who}: config.params_dtype must be torch.float32, float16 or bfloat16, got "
                         f"{config.params_dtype}")
    granularity = getattr(config, "recompute_granularity", None)
    if granularity not in (None, "full"):
        raise ValueError(f"{who}: config.recompute_granularity must be None or 'full', got {granularity!r}")


def split_micro_batch(hidden_states: Any, who: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The two halves along the batch dimension (dim 1 of [s, b, h]); equal halves or an error."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        raise ValueError(f"{who}: hidden_states must be a [sequence, batch, hidden] tensor, got "
                         f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
    batch = hidden_states.shape[1]
    if batch < 2 or batch % 2:
        raise ValueError(f"{who}: hidden_states has micro-batch size {batch} (dimension 1 of shape "
                         f"{tuple(hidden_states.shape)}), which cannot be split in two equal halves; Domino "
                         "overlaps one half's all-reduce with the other half's computation: use an even micro-batch")
    half0, half1 = torch.chunk(hidden_states, 2, dim=1)
    return half0, half1
