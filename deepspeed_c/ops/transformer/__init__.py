"""deepspeed.ops.transformer: the fused BERT training layer (DeepSpeedTransformerLayer,
DeepSpeedTransformerConfig) and the fused inference kernels (`inference`)."""
from deepspeed_c.ops.transformer.transformer import (  # noqa: F401
    DeepSpeedTransformerConfig, DeepSpeedTransformerLayer, TransformerConfig)
from deepspeed_c.ops.transformer.transformer_function import DeepSpeedTransformerFunction  # noqa: F401

__all__ = ["DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer", "TransformerConfig",
           "DeepSpeedTransformerFunction"]
