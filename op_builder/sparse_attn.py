from .multi_tensor import MT_COMMON, MultiTensorCUDABuilder


class SparseAttnBuilder(MultiTensorCUDABuilder):
    """Block-sparse attention (DeepSpeed's `sparse_attn` op): fused flash-style forward and backward
    over a block layout on tensor cores (mma.sync, fp16/bf16, blocks 16-128, head dims up to 128),
    in a simple and a pipelined (cp.async, ldmatrix) form. One file per pass: they build in parallel."""

    NAME = "sparse_attn"

    def sources(self) -> list[str]:
        passes = [f"cuda/sparse_attn_{p}{v}.cu" for p in ("fwd", "dq", "dkv") for v in ("", "_v2")]
        return [*MT_COMMON, "cuda/sparse_attn.cu", *passes, "py/sparse_attn_binding.c"]
