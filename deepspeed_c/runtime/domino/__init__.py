"""deepspeed.runtime.domino: tensor-parallel transformers whose all-reduces run behind computation."""
from deepspeed_c.runtime.domino.async_linear import (DominoAsyncColumnParallelLinear,
                                                     DominoAsyncColumnParallelLinearImpl, RowParallelLinearNoComm)
from deepspeed_c.runtime.domino.attention import CoreAttention, DominoModule, ShardedAttention
from deepspeed_c.runtime.domino.config import DominoConfig
from deepspeed_c.runtime.domino.enums import AttnMaskType, AttnType, LayerType, ModelType
from deepspeed_c.runtime.domino.handles import DominoUtil, NoOper
from deepspeed_c.runtime.domino.transformer import DominoTransformer, DominoTransformerLayer, bias_dropout_add

__all__ = ["DominoTransformer", "DominoTransformerLayer", "ShardedAttention", "CoreAttention", "DominoModule",
           "DominoAsyncColumnParallelLinear", "DominoAsyncColumnParallelLinearImpl", "RowParallelLinearNoComm",
           "DominoConfig", "DominoUtil", "NoOper", "bias_dropout_add", "LayerType", "AttnType", "AttnMaskType",
           "ModelType"]
