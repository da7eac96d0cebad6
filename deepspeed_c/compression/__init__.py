"""DeepSpeed's model compression library (0.19.6's `deepspeed.compression`): layer reduction with
knowledge-distillation initialisation, weight / activation quantization, sparse / row / head / channel
pruning, and redundancy_clean. See compress.py."""
from deepspeed_c.compression.compress import init_compression, redundancy_clean
from deepspeed_c.compression.scheduler import compression_scheduler
from deepspeed_c.compression.helper import convert_conv1d_to_linear

__all__ = ["init_compression", "redundancy_clean", "compression_scheduler", "convert_conv1d_to_linear"]
