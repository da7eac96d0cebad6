from .multi_tensor import MultiTensorCUDABuilder


class InferenceBuilder(MultiTensorCUDABuilder):
    """The fused decoder inference kernels behind kernel injection (DeepSpeed's
    `transformer_inference` op): bias + residual + norm, QKV bias + rotary + KV-cache append,
    cached causal GQA attention (fused for decode; GEMMs around a masked
    softmax kernel for prefill), bias + GELU and SiLU-gated activations, weight-only quantized GEMVs and
    MoE expert GEMVs. Other GEMMs stay in torch."""

    NAME = "transformer_inference"

    def sources(self) -> list[str]:
        return ["cuda/inference_norm.cu", "cuda/inference_rotary.cu", "cuda/inference_attention.cu",
                "cuda/inference_softmax.cu",
                "cuda/inference_activation.cu", "cuda/inference_quant.cu", "cuda/inference_moe.cu",
                "py/inference_binding.c"]
