"""ZeRO-Infinity's swappers (DeepSpeed's `deepspeed.runtime.swap_tensor`): tensors moved between
host buffers and files under an `nvme_path` through the async I/O handle (deepspeed_c.ops.aio)."""
