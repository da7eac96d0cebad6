from .builder import CPUOpBuilder, CUDAOpBuilder


class CompressQuantBuilder(CPUOpBuilder):
    """Fused fake quantization of the compression library and MoQ on host tensors
    (csrc/cpu/compress_quant.c)."""

    NAME = "compress_quant"

    def sources(self) -> list[str]:
        return ["cpu/compress_quant.c", "py/compress_quant_binding.c"]


class CompressQuantCUDABuilder(CUDAOpBuilder):
    """The same contract on CUDA tensors (csrc/cuda/compress_quant.cu), on torch's current stream."""

    NAME = "compress_quant_cuda"

    def sources(self) -> list[str]:
        return ["cuda/compress_quant.cu", "py/compress_quant_binding.c"]

    def cxx_args(self) -> list[str]:
        return [*super().cxx_args(), "-DDSC_CQ_ON_CUDA"]
