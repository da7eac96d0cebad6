// The C launchers of the block-sparse attention kernels (dsc/sparse_attn_cuda.h), and the delta pass.
// Backward, flash style from the saved log-sum-exp:
//   delta_i = rowsum(dO_i * O_i)                                   one warp per row
//   dQ: per layout block row, over its nonzero key blocks           P = exp(S - lse), dS = P (dO V^T - delta)
//   dK, dV: per layout block column, over the query block rows      dV = P^T dO, dK = dS^T Q
// that attend to it (the layout's transpose); two kernels, no atomics, so the result is deterministic.
#include "sparse_attn_common.cuh"

namespace dsc_sa {

template <typename T>
__global__ void sa_delta_kernel(const T *__restrict__ d_o, const T *__restrict__ o, float *__restrict__ delta,
                                int64_t rows, int D) {
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int lane = threadIdx.x & 31;
    float s = 0.f;
    for (int d = lane; d < D; d += 32) s += float(d_o[row * D + d]) * float(o[row * D + d]);
    for (int w = 16; w > 0; w >>= 1) s += __shfl_xor_sync(0xffffffffu, s, w);
    if (lane == 0) delta[row] = s;
}

// A plan's items (and merges when any) present, its grid within CUDA's x limit, scratch given when it
// has slots.
static bool bad_plan(const dsc_sa_plan *p, int64_t B, const float *part) {
    if (!p) return false;
    return !p->items || p->n_items < 1 || p->n_items * B > 0x7fffffffLL || p->n_merges < 0 || p->slots < 0 ||
           (p->n_merges > 0 && (!p->merges || !part || p->n_merges * B > 0x7fffffffLL));
}

} // namespace dsc_sa

using namespace dsc_sa;

extern "C" int dsc_sa_forward(const void *q, const void *k, const void *v, void *o, float *lse, const int *row_ptr,
                              const int *cols, const float *kpm, const float *am, const float *rpe, int64_t rpe_sb,
                              int64_t rpe_sh, int64_t B, int64_t H, int64_t L, int64_t D, int block, float scale,
                              int dtype, const dsc_sa_plan *plan, float *part, int device, cudaStream_t stream) {
    if (!q || !k || !v || !o || !lse || !row_ptr || !cols || block < 16 || bad_shape(B, H, L, D, block) ||
        bad_plan(plan, B, part))
        return DSC_CUDA_EARG;
    dsc_cuda::DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    if (const int rc = check_arch(device)) return rc;
    const ForwardArgs a{q, k, v, o, lse, row_ptr, cols, kpm, am, rpe, rpe_sb, rpe_sh, B, H, L, D, block, scale, dtype,
                        plan, part, stream};
    return launch_forward(a);
}

extern "C" int dsc_sa_backward(const void *d_o, const void *q, const void *k, const void *v, const void *o,
                               const float *lse, float *delta, const int *row_ptr, const int *cols, const int *col_ptr,
                               const int *rows, const float *kpm, const float *am, const float *rpe, int64_t rpe_sb,
                               int64_t rpe_sh, void *dq, void *dk, void *dv, int64_t B, int64_t H, int64_t L,
                               int64_t D, int block, float scale, int dtype, const dsc_sa_plan *row_plan,
                               const dsc_sa_plan *col_plan, float *part, int device, cudaStream_t stream) {
    if (!d_o || !q || !k || !v || !o || !lse || !delta || !row_ptr || !cols || !col_ptr || !rows || !dq || !dk ||
        !dv || block < 16 || bad_shape(B, H, L, D, block) || bad_plan(row_plan, B, part) ||
        bad_plan(col_plan, B, part))
        return DSC_CUDA_EARG;
    if (dtype != DSC_CUDA_F16 && dtype != DSC_CUDA_BF16) return DSC_CUDA_EDTYPE;
    dsc_cuda::DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    if (const int rc = check_arch(device)) return rc;
    const int64_t nrows = B * H * L;
    const unsigned grid = (unsigned)((nrows + 7) / 8);
    if (dtype == DSC_CUDA_F16)
        sa_delta_kernel<__half><<<grid, 256, 0, stream>>>(static_cast<const __half *>(d_o),
                                                          static_cast<const __half *>(o), delta, nrows, (int)D);
    else
        sa_delta_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(static_cast<const __nv_bfloat16 *>(d_o),
                                                                 static_cast<const __nv_bfloat16 *>(o), delta, nrows,
                                                                 (int)D);
    int rc = launch_error();
    if (rc) return rc;
    const BackwardArgs a{d_o, q, k, v, lse, delta, row_ptr, cols, col_ptr, rows, kpm, am, rpe, rpe_sb, rpe_sh,
                         dq, dk, dv, B, H, L, D, block, scale, dtype, row_plan, col_plan, part, stream};
    if ((rc = launch_dq(a))) return rc;
    return launch_dkv(a);
}
