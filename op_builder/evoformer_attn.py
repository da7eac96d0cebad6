from .multi_tensor import MT_COMMON, MultiTensorCUDABuilder


class EvoformerAttnBuilder(MultiTensorCUDABuilder):
    """DS4Sci Evoformer attention (DeepSpeed's `evoformer_attn` op): flash-style forward and
    backward with a mask bias and a pair bias, online softmax in float32, bias gradients."""

    NAME = "evoformer_attn"

    def sources(self) -> list[str]:
        return [*MT_COMMON, "cuda/evoformer_fwd.cu", "cuda/evoformer_fwd_mma.cu", "cuda/evoformer_bwd.cu",
                "cuda/evoformer_bwd_mma.cu", "py/evoformer_binding.c"]

    def nvcc_args(self) -> list[str]:
        # nvcc's -O is the host compiler's level; host code here is only launchers, and -O1 takes ~6% off
        # the op's cold build (the device code, optimised by cicc/ptxas at their defaults, is byte-identical)
        return ["-O1" if a == "-O3" else a for a in super().nvcc_args()]
