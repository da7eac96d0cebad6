// Block-sparse attention backward, dQ: per layout block row, over its nonzero key blocks,
// P = exp(S - lse), dS = P (dO V^T - delta), dQ = scale * dS K (see sparse_attn.cu); K/V chunks
// double-buffered with cp.async (sparse_attn_pipe.cuh), K read transposed by ldmatrix for dS K
// instead of a second, transposed copy.
#include "sparse_attn_pipe.cuh"
#include "sparse_attn_plan.cuh"

namespace dsc_sa {

template <typename T, int BLK, int DP>
__global__ void __launch_bounds__(BLK * 2)
    sa_dq_kernel(const T *__restrict__ d_o, const T *__restrict__ q, const T *__restrict__ k,
                    const T *__restrict__ v, const float *__restrict__ lse, const float *__restrict__ delta,
                    const int *__restrict__ row_ptr, const int *__restrict__ cols, const float *kpm, const float *am,
                    const float *rpe, int64_t rpe_sb, int64_t rpe_sh, T *__restrict__ dq,
                    const int *__restrict__ items, float *__restrict__ part, int64_t slots, int B, int H, int L, int D,
                    float scale) {
    constexpr int C = chunk<BLK, DP>();
    __shared__ __align__(16) T sk[2][C][DP + 8];
    __shared__ __align__(16) T sv[2][C][DP + 8];
    const int nb = L / BLK;
    const Work w = resolve_work(items, row_ptr, B, H, nb);
    const int bh = w.bh;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int64_t base = (int64_t)bh * L * D;
    const int r0 = w.rb * BLK + warp * 16, i0 = r0 + g;
    const Bias bias(kpm, am, rpe, rpe_sb, rpe_sh, w.b, w.h, L);
    const ChunkWalk<BLK, C> walk(cols, w.lo, w.hi);

    if (walk.total > 0) {
        const int j = walk.first_row(0);
        stage_rows_async<T, C, DP>(sk[0], k + base + (int64_t)j * D, D);
        stage_rows_async<T, C, DP>(sv[0], v + base + (int64_t)j * D, D);
    }
    cp_async_commit();
    const float lse_r[2] = {lse[(int64_t)bh * L + i0], lse[(int64_t)bh * L + i0 + 8]};
    const float dl0 = delta[(int64_t)bh * L + i0], dl1 = delta[(int64_t)bh * L + i0 + 8];
    uint32_t qf[DP / 16][4], df[DP / 16][4];
#pragma unroll
    for (int kk = 0; kk < DP / 16; kk++) {
        frag_a_global(qf[kk], q + base, D, r0, kk * 16, lane);
        frag_a_global(df[kk], d_o + base, D, r0, kk * 16, lane);
    }
    float acc[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

    for (int x = 0; x < walk.total; x++) {
        const int cur = x & 1, j0 = walk.first_row(x);
        if (x + 1 < walk.total) {
            const int jn = walk.first_row(x + 1);
            stage_rows_async<T, C, DP>(sk[cur ^ 1], k + base + (int64_t)jn * D, D);
            stage_rows_async<T, C, DP>(sv[cur ^ 1], v + base + (int64_t)jn * D, D);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        float s[C / 8][4], dp[C / 8][4];
#pragma unroll
        for (int n = 0; n < C / 8; n++)
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < DP / 16; kk++) {
            mma_row<T, C / 8, false>(s, qf[kk], &sk[cur][0][0], DP + 8, kk * 16, lane);
            mma_row<T, C / 8, false>(dp, df[kk], &sv[cur][0][0], DP + 8, kk * 16, lane);
        }
        probabilities<C / 8, false>(s, bias, scale, i0, j0, t, lse_r, nullptr);
#pragma unroll
        for (int n = 0; n < C / 8; n++) {
            s[n][0] *= dp[n][0] - dl0, s[n][1] *= dp[n][1] - dl0;
            s[n][2] *= dp[n][2] - dl1, s[n][3] *= dp[n][3] - dl1;
        }
#pragma unroll
        for (int kk = 0; kk < C / 16; kk++) {
            uint32_t a[4];
            acc_to_a<T>(a, s, kk);
            mma_row<T, DP / 8, true>(acc, a, &sk[cur][0][0], DP + 8, kk * 16, lane);
        }
        __syncthreads();
    }
    if (const int slot = work_slot(items, B); slot >= 0) {
        const int l0 = warp * 16 + g;  // rows local to the block
        store_grad_part<DP>(acc, scale, part_tile(part, work_batch(B), slots, slot, BLK, D), l0, l0 + 8, D, t);
        return;
    }
    T *q0 = dq + base + (int64_t)i0 * D, *q1 = q0 + 8 * (int64_t)D;
#pragma unroll
    for (int n = 0; n < DP / 8; n++) {
        const int d = n * 8 + 2 * t;
        if (d < D) {
            *reinterpret_cast<uint32_t *>(q0 + d) = pack2<T>(acc[n][0] * scale, acc[n][1] * scale);
            *reinterpret_cast<uint32_t *>(q1 + d) = pack2<T>(acc[n][2] * scale, acc[n][3] * scale);
        }
    }
}

int launch_dq(const BackwardArgs &a) {
    const dim3 grid = work_grid(a.row_plan, a.B, a.H, a.L / a.block);
    const int *items = a.row_plan ? a.row_plan->items : nullptr;
    const int64_t slots = a.row_plan ? a.row_plan->slots : 0;
    return dispatch(a.dtype, a.block, a.D, [&](auto *tag, auto blk, auto dp) {
        using E = std::remove_pointer_t<decltype(tag)>;
        constexpr int BLK = decltype(blk)::value, DP = decltype(dp)::value;
        sa_dq_kernel<E, BLK, DP><<<grid, BLK * 2, 0, a.stream>>>(
            static_cast<const E *>(a.d_o), static_cast<const E *>(a.q), static_cast<const E *>(a.k),
            static_cast<const E *>(a.v), a.lse, a.delta, a.row_ptr, a.cols, a.kpm, a.am, a.rpe, a.rpe_sb, a.rpe_sh,
            static_cast<E *>(a.dq), items, a.part, slots, (int)a.B, (int)a.H, (int)a.L, (int)a.D, a.scale);
        if (const int rc = launch_error()) return rc;
        return a.row_plan ? launch_sum_combine<E>(*a.row_plan, a.part, a.dq, a.B, a.H, a.L, a.D, BLK, a.stream) : 0;
    });
}
} // namespace dsc_sa
