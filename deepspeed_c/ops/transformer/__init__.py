"""deepspeed.ops.transformer: the fused inference kernels (`inference`)."""
