from .multi_tensor import MT_COMMON, MultiTensorCUDABuilder


class SparseAttnBuilder(MultiTensorCUDABuilder):
    """Block-sparse attention (DeepSpeed's `sparse_attn` op): fused flash-style forward and backward
    over a block layout on tensor cores (mma.sync, fp16/bf16, blocks 16-128, head dims up to 128;
    cp.async double buffering, ldmatrix). One file per pass: they build in parallel."""

    NAME = "sparse_attn"

    def sources(self) -> list[str]:
        # the longest compiles first (the build runs the sources in this order on every core): dK/dV, dQ, forward
        passes = [f"cuda/sparse_attn_{p}.cu" for p in ("dkv", "dq", "fwd")]
        return [*passes, "cuda/sparse_attn.cu", *MT_COMMON, "py/sparse_attn_binding.c"]
