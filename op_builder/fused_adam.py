from .multi_tensor import MT_COMMON, MultiTensorCUDABuilder


class FusedAdamBuilder(MultiTensorCUDABuilder):
    """Multi-tensor Adam/AdamW on CUDA (DeepSpeed's `fused_adam` op, `multi_tensor_adam`)."""

    NAME = "fused_adam"

    def sources(self) -> list[str]:
        return [*MT_COMMON, "cuda/adam.cu", "py/cuda_adam_binding.c"]
