"""Block-wise symmetric int8/int4 quantization (the C/CUDA core under ZeRO++'s qwZ and qgZ)."""
from deepspeed_c.ops.quantizer.quantizer import (GRAD_BLOCK, WEIGHT_BLOCK, dequantize, dequantize_sum, packed_sizes,
                                                 quantize)

__all__ = ["GRAD_BLOCK", "WEIGHT_BLOCK", "dequantize", "dequantize_sum", "packed_sizes", "quantize"]
