from .builder import CUDAOpBuilder

# Every multi-tensor op links the shared launch geometry/error text and the binding helpers.
MT_COMMON = ["cuda/mt_common.cu", "py/cuda_util_binding.c"]


class MultiTensorCUDABuilder(CUDAOpBuilder):
    """Shared flags of the multi-tensor CUDA ops: host-side warnings on for the .cu files too."""

    def nvcc_args(self) -> list[str]:
        return [*super().nvcc_args(), "-Xcompiler=-Wall,-Wextra"]

    def shared_sources(self) -> list[str]:
        return [*super().shared_sources(), *MT_COMMON]  # compiled once for all the multi-tensor ops


class MultiTensorOpsBuilder(MultiTensorCUDABuilder):
    """The engine's CUDA utility kernels over tensor lists: L2 norm (global and per tensor, with
    an inf/nan flag), scale, casting copy, flatten/unflatten, and the fused AdamW epilogue."""

    NAME = "multi_tensor_ops"

    def sources(self) -> list[str]:
        return [*MT_COMMON, "cuda/l2norm.cu", "cuda/copy.cu", "cuda/epilogue.cu",
                "py/cuda_multi_tensor_binding.c"]
