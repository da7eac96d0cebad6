from .builder import CPUOpBuilder, CUDAOpBuilder


class MoEGatingBuilder(CPUOpBuilder):
    """The MoE gating core on the host: top-k selection, capacity plan, dispatch and combine
    without one-hot tensors (csrc/core/moe_gating.c)."""

    NAME = "moe_gating"

    def sources(self) -> list[str]:
        return ["core/moe_gating.c", "py/moe_gating_binding.c"]


class MoEGatingCUDABuilder(CUDAOpBuilder):
    """The same contract on CUDA tensors (csrc/cuda/moe_gating.cu), on torch's current stream."""

    NAME = "moe_gating_cuda"

    def sources(self) -> list[str]:
        return ["cuda/moe_gating.cu", "py/moe_gating_binding.c"]

    def cxx_args(self) -> list[str]:
        return [*super().cxx_args(), "-DDSC_MOE_ON_CUDA"]
