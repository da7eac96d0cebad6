from .builder import CPUOpBuilder, CUDAOpBuilder


class OnebitBuilder(CPUOpBuilder):
    """The 1-bit compression core on the host: sign pack/unpack fused with error feedback and the
    scale (csrc/cpu/onebit.c; AVX-512, AVX2 or scalar build chosen from the running CPU)."""

    NAME = "onebit"

    def sources(self) -> list[str]:
        return ["cpu/onebit.c", "py/onebit_binding.c"]


class OnebitCUDABuilder(CUDAOpBuilder):
    """The same contract on CUDA tensors (csrc/cuda/onebit.cu), on torch's current stream."""

    NAME = "onebit_cuda"

    def sources(self) -> list[str]:
        return ["cuda/onebit.cu", "py/onebit_binding.c"]

    def nvcc_args(self) -> list[str]:
        return [*super().nvcc_args(), "-Xcompiler=-Wall,-Wextra"]

    def cxx_args(self) -> list[str]:
        return [*super().cxx_args(), "-DDSC_ONEBIT_ON_CUDA"]
