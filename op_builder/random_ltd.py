from .builder import CPUOpBuilder, CUDAOpBuilder


class RandomLTDBuilder(CPUOpBuilder):
    """random-LTD's token gather/scatter and mask slicing on the host: the plain-loop reference
    (csrc/cpu/random_ltd.c) of the CUDA kernels."""

    NAME = "random_ltd"

    def sources(self) -> list[str]:
        return ["cpu/random_ltd.c", "py/random_ltd_binding.c"]


class RandomLTDCUDABuilder(CUDAOpBuilder):
    """The same moves on CUDA tensors (csrc/cuda/random_ltd.cu), on torch's current stream."""

    NAME = "random_ltd_cuda"

    def sources(self) -> list[str]:
        return ["cuda/random_ltd.cu", "py/random_ltd_binding.c"]

    def cxx_args(self) -> list[str]:
        return [*super().cxx_args(), "-DDSC_RLTD_ON_CUDA"]
