from .multi_tensor import MT_COMMON, MultiTensorCUDABuilder


class SparseAttnBuilder(MultiTensorCUDABuilder):
    """Block-sparse attention (DeepSpeed's `sparse_attn` op): fused flash-style forward and backward
    over a block layout on tensor cores (mma.sync, fp16/bf16, blocks 16-128, head dims up to 128)."""

    NAME = "sparse_attn"

    def sources(self) -> list[str]:
        return [*MT_COMMON, "cuda/sparse_attn_fwd.cu", "cuda/sparse_attn_bwd.cu",
                "cuda/sparse_attn_dq.cu", "cuda/sparse_attn_dkv.cu", "py/sparse_attn_binding.c"]
