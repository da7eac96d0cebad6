"""Import stand-in for NVIDIA apex (see ../README.md): what Megatron-DeepSpeed imports on CUDA."""
