from .multi_tensor import MT_COMMON, MultiTensorCUDABuilder


class FusedLambBuilder(MultiTensorCUDABuilder):
    """Multi-tensor LAMB on CUDA (DeepSpeed's `fused_lamb` op)."""

    NAME = "fused_lamb"

    def sources(self) -> list[str]:
        return [*MT_COMMON, "cuda/lamb.cu", "py/cuda_lamb_binding.c"]
