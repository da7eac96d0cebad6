"""DeepSpeed's `deepspeed.ops.fp_quantizer`: group-scaled FP4/6/8/12 weight quantization (plain torch)."""
from .quantize import FP_Quantize, Quantizer, UnsupportedQuantInput

__all__ = ["FP_Quantize", "Quantizer", "UnsupportedQuantInput"]
