from .multi_tensor import MT_COMMON, MultiTensorCUDABuilder


class FusedLionBuilder(MultiTensorCUDABuilder):
    """Multi-tensor Lion on CUDA (DeepSpeed's `fused_lion` op, `multi_tensor_lion`)."""

    NAME = "fused_lion"

    def sources(self) -> list[str]:
        return [*MT_COMMON, "cuda/lion.cu", "py/cuda_lion_binding.c"]
