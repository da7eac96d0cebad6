/* Block-sparse attention (csrc/cuda/sparse_attn_{fwd,bwd}.cu), DeepSpeed's sparse self-attention:
 * o_i = softmax_j(scale * q_i . k_j + rpe[i, j] + kpm[j] + am[i, j]) v over the keys j whose block
 * the layout marks for query i's block row. One fused flash-style kernel per direction: the scores
 * of a query block live in registers, the softmax runs online over the row's nonzero blocks, and
 * the backward recomputes the probabilities from the saved log-sum-exp, so memory is linear in the
 * number of layout blocks (nothing L x L is ever stored).
 *
 * Shapes (contiguous):
 *   q, k, v, o, d_o, dq, dk, dv    [B, H, L, D]   fp16 or bf16 (`dtype`); L a multiple of `block`,
 *                                                 D a multiple of 8, at most DSC_SA_MAX_HEAD_DIM
 *   lse, delta                     float32 [B, H, L]
 *   row_ptr [H * nb + 1], cols     int32: head h's block row r attends to key blocks
 *                                  cols[row_ptr[h*nb+r] .. row_ptr[h*nb+r+1]) (nb = L / block)
 *   col_ptr [H * nb + 1], rows     int32: the transpose (query block rows of each key block column)
 *   kpm   float32 [B, L] additive key-padding bias, or NULL
 *   am    float32 [L, L] additive attention-mask bias, or NULL
 *   rpe   float32 additive bias with element (b, h, i, j) at b*rpe_sb + h*rpe_sh + i*L + j, or NULL
 * block: 16, 32, 64 or 128 (kernels: cp.async double buffering, ldmatrix). A row whose every score
 * is -inf gets o = 0 and lse = +inf.
 * plan (NULL: one CTA per block row / column in index order): the balanced grid of
 * deepspeed_c/ops/sparse_attention/work_plan.py: `items` int32 [n_items][4] (row id h * nb + r, lo, hi,
 * slot), one CTA per item and batch, walking the row's (column's) blocks [lo, hi) of its CSR (CSC)
 * range; slot -1 writes the result, slot s >= 0 writes float32 partials to `part` slot s, which the
 * combine kernel merges per `merges` int32 [n_merges][4] (row id, first slot, parts, 0) row.
 * part (float32 scratch, 16-byte aligned): forward B * slots * block * (D + 1) floats (o parts, then
 * lse parts); backward max(rows' slots, 2 x columns' slots) * B * block * D.
 * Launchers run on `stream` without synchronising and return 0, a cudaError_t (> 0) or a
 * DSC_CUDA_E* code (< 0). Plain C: the binding (gcc) includes this header. */
#ifndef DSC_SPARSE_ATTN_CUDA_H
#define DSC_SPARSE_ATTN_CUDA_H

#include "dsc/cuda_multi_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DSC_SA_MAX_HEAD_DIM 128

typedef struct {
    const int *items, *merges;
    int64_t n_items, n_merges, slots;
} dsc_sa_plan;

int dsc_sa_forward(const void *q, const void *k, const void *v, void *o, float *lse, const int *row_ptr,
                   const int *cols, const float *kpm, const float *am, const float *rpe, int64_t rpe_sb,
                   int64_t rpe_sh, int64_t B, int64_t H, int64_t L, int64_t D, int block, float scale, int dtype,
                   const dsc_sa_plan *plan, float *part, int device, cudaStream_t stream);

/* delta: float32 [B, H, L] scratch the launcher fills (rowsum of d_o * o) before the gradient kernels. */
int dsc_sa_backward(const void *d_o, const void *q, const void *k, const void *v, const void *o, const float *lse,
                    float *delta, const int *row_ptr, const int *cols, const int *col_ptr, const int *rows,
                    const float *kpm, const float *am, const float *rpe, int64_t rpe_sb, int64_t rpe_sh, void *dq,
                    void *dk, void *dv, int64_t B, int64_t H, int64_t L, int64_t D, int block, float scale,
                    int dtype, const dsc_sa_plan *row_plan, const dsc_sa_plan *col_plan, float *part, int device,
                    cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
