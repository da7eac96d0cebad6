"""deepspeed.ops.transformer.inference: the fused decoder kernels behind kernel injection
(`kernels`: CUDA op on a GPU, the torch reference of `reference` on the host)."""
