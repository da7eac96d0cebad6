"""deepspeed.linear: OptimizedLinear with LoRA (base-weight sharding, offload) and FP quantization of the
frozen base weight (DeepSpeed 0.19.8's public names)."""
from .config import LoRAConfig, QuantizationConfig
from .context_manager import Init, init_lora
from .optimized_linear import LoRAOptimizedLinear, OptimizedLinear
from .quantization import QuantizedLinear, QuantizedParameter

__all__ = ["OptimizedLinear", "LoRAOptimizedLinear", "LoRAConfig", "QuantizationConfig", "QuantizedLinear",
           "QuantizedParameter", "Init", "init_lora"]
