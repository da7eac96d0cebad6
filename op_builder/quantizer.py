from .builder import CPUOpBuilder, CUDAOpBuilder


class QuantizerBuilder(CPUOpBuilder):
    """Block-wise symmetric int8/int4 quantization of host tensors (ZeRO++ qwZ/qgZ,
    csrc/cpu/quantize.c). DeepSpeed's builder of the same name builds its CUDA quantizer."""

    NAME = "quantizer"

    def sources(self) -> list[str]:
        return ["cpu/quantize.c", "py/quantizer_binding.c"]


class QuantizerCUDABuilder(CUDAOpBuilder):
    """The same contract on CUDA tensors (csrc/cuda/quantize.cu), on torch's current stream."""

    NAME = "quantizer_cuda"

    def sources(self) -> list[str]:
        return ["cuda/quantize.cu", "py/quantizer_binding.c"]

    def cxx_args(self) -> list[str]:
        return [*super().cxx_args(), "-DDSC_Q_ON_CUDA"]
