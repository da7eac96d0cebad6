from .multi_tensor import MT_COMMON, MultiTensorCUDABuilder


class TransformerBuilder(MultiTensorCUDABuilder):
    """The fused pieces of DeepSpeedTransformerLayer's training kernel (DeepSpeed's `transformer`
    op): bias + GELU and its backward, bias + dropout + residual + LayerNorm, the LayerNorm backward
    (from the input or, normalize_invertible, from the output), the scaled masked softmax and its
    backward. GEMMs stay in cuBLAS through torch."""

    NAME = "transformer"

    def sources(self) -> list[str]:
        return [*MT_COMMON, "cuda/transformer_gelu.cu", "cuda/transformer_norm.cu", "cuda/transformer_softmax.cu",
                "cuda/transformer_dropout.cu",
                "cuda/transformer_qkv_grad.cu", "py/transformer_binding.c"]
