/* DS4Sci Evoformer attention (csrc/cuda/evoformer_{fwd,fwd_mma,bwd,bwd_mma}.cu): flash-style attention with up to two
 * additive biases, forward and backward, never materialising the L x L scores in global memory.
 *
 * Shapes (contiguous; BN = B * N rows of the MSA or pair stack):
 *   q, k, v, o, d_o, dq, dk, dv   [B, N, L, H, D]           fp16 or bf16 (`dtype`), D at most DSC_EVO_MAX_HEAD_DIM
 *   bias1 (mask bias, optional)   [B, N, 1, 1, L]           dtype `dtype`, broadcast over heads and queries
 *   bias2 (pair bias, optional)   [B, 1, H, L, L]           dtype `dtype`, broadcast over N
 *   lse, delta                    float32 [B, N, H, L]      log-sum-exp of each score row; rowsum(dO * O)
 *   dbias1, dbias2                float32, the biases' shapes, zeroed by the caller (accumulated
 *                                 with atomics: dbias2 sums over N, dbias1 over heads and queries)
 * score(i, j) = scale * q_i . k_j + bias1[j] + bias2[i, j]; o_i = softmax_j(score) v. A row whose
 * every score is -inf gets o = 0 and lse = +inf. Math in float32.
 * Launchers run on `stream` without synchronising and return 0, a cudaError_t (> 0) or a
 * DSC_CUDA_E* code (< 0). Plain C: the binding (gcc) includes this header. */
#ifndef DSC_EVOFORMER_CUDA_H
#define DSC_EVOFORMER_CUDA_H

#include "dsc/cuda_multi_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Per-thread registers hold a query (forward, dQ) or a key and value (dK/dV) row. */
#define DSC_EVO_MAX_HEAD_DIM 64

int dsc_evo_forward(const void *q, const void *k, const void *v, const void *bias1, const void *bias2, void *o,
                    float *lse, int64_t B, int64_t N, int64_t L, int64_t H, int64_t D, float scale, int dtype,
                    int device, cudaStream_t stream);

/* The same forward on tensor cores (mma.sync tiles, evoformer_fwd_mma.cu; compute capability 8.0 or newer). */
int dsc_evo_forward_tc(const void *q, const void *k, const void *v, const void *bias1, const void *bias2, void *o,
                       float *lse, int64_t B, int64_t N, int64_t L, int64_t H, int64_t D, float scale, int dtype,
                       int device, cudaStream_t stream);

/* delta: float32 [B, N, H, L] scratch the launcher fills first. dbias1/dbias2 NULL: not wanted.
 * tc != 0: on tensor cores (mma.sync tiles, evoformer_bwd_mma.cu; sm_80+), else on CUDA cores (evoformer_bwd.cu;
 * built for GPUs before sm_80 only). */
int dsc_evo_backward(const void *d_o, const void *q, const void *k, const void *v, const void *o, const float *lse,
                     const void *bias1, const void *bias2, float *delta, void *dq, void *dk, void *dv, float *dbias1,
                     float *dbias2, int64_t B, int64_t N, int64_t L, int64_t H, int64_t D, float scale, int tc,
                     int dtype, int device, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
