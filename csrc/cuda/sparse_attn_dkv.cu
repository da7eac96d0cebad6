// Block-sparse attention backward, dK and dV: per layout block column, over the query block rows
// that attend to it (the layout's transpose), dV = P^T dO, dK = scale * dS^T Q (see sparse_attn.cu);
// Q/dO chunks (and their lse/delta) double-buffered with cp.async (sparse_attn_pipe.cuh), read
// transposed by ldmatrix for P^T dO and dS^T Q.
#include "sparse_attn_pipe.cuh"
#include "sparse_attn_plan.cuh"

namespace dsc_sa {

template <typename T, int C, int DP>
__device__ __forceinline__ void stage_queries(T (*sq)[DP + 8], T (*sd)[DP + 8], float *slse, float *sdl,
                                              const T *q, const T *d_o, const float *lse, const float *delta,
                                              int64_t base, int64_t row_base, int i0, int D) {
    stage_rows_async<T, C, DP>(sq, q + base + (int64_t)i0 * D, D);
    stage_rows_async<T, C, DP>(sd, d_o + base + (int64_t)i0 * D, D);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        cp_async4(slse + c, lse + row_base + i0 + c);
        cp_async4(sdl + c, delta + row_base + i0 + c);
    }
}

template <typename T, int BLK, int DP>
__global__ void __launch_bounds__(BLK * 2)
    sa_dkv_kernel(const T *__restrict__ d_o, const T *__restrict__ q, const T *__restrict__ k,
                     const T *__restrict__ v, const float *__restrict__ lse, const float *__restrict__ delta,
                     const int *__restrict__ col_ptr, const int *__restrict__ rows, const float *kpm, const float *am,
                     const float *rpe, int64_t rpe_sb, int64_t rpe_sh, T *__restrict__ dk, T *__restrict__ dv,
                     const int *__restrict__ items, float *__restrict__ part, int64_t slots, int B, int H, int L, int D,
                     float scale) {
    constexpr int C = chunk<BLK, DP>();
    __shared__ __align__(16) T sq[2][C][DP + 8];
    __shared__ __align__(16) T sd[2][C][DP + 8];
    __shared__ __align__(16) float slse[2][C];
    __shared__ __align__(16) float sdl[2][C];
    const int nb = L / BLK;
    const Work w = resolve_work(items, col_ptr, B, H, nb);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int64_t base = (int64_t)w.bh * L * D, row_base = (int64_t)w.bh * L;
    const int r0 = w.rb * BLK + warp * 16, j0 = r0 + g;
    const Bias bias(kpm, am, rpe, rpe_sb, rpe_sh, w.b, w.h, L);
    const ChunkWalk<BLK, C> walk(rows, w.lo, w.hi);

    if (walk.total > 0)
        stage_queries<T, C, DP>(sq[0], sd[0], slse[0], sdl[0], q, d_o, lse, delta, base, row_base, walk.first_row(0),
                                D);
    cp_async_commit();
    uint32_t kf[DP / 16][4], vf[DP / 16][4];
#pragma unroll
    for (int kk = 0; kk < DP / 16; kk++) {
        frag_a_global(kf[kk], k + base, D, r0, kk * 16, lane);
        frag_a_global(vf[kk], v + base, D, r0, kk * 16, lane);
    }
    float gk[DP / 8][4], gv[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; n++)
        gk[n][0] = gk[n][1] = gk[n][2] = gk[n][3] = gv[n][0] = gv[n][1] = gv[n][2] = gv[n][3] = 0.f;

    for (int x = 0; x < walk.total; x++) {
        const int cur = x & 1, i0 = walk.first_row(x);
        if (x + 1 < walk.total) {
            stage_queries<T, C, DP>(sq[cur ^ 1], sd[cur ^ 1], slse[cur ^ 1], sdl[cur ^ 1], q, d_o, lse, delta, base,
                                    row_base, walk.first_row(x + 1), D);
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
            mma_row<T, C / 8, false>(s, kf[kk], &sq[cur][0][0], DP + 8, kk * 16, lane);   // S^T = K Q^T
            mma_row<T, C / 8, false>(dp, vf[kk], &sd[cur][0][0], DP + 8, kk * 16, lane);  // dP^T = V dO^T
        }
        probabilities<C / 8, true>(s, bias, scale, j0, i0, t, nullptr, slse[cur]);
#pragma unroll
        for (int kk = 0; kk < C / 16; kk++) {  // dV += P^T dO
            uint32_t a[4];
            acc_to_a<T>(a, s, kk);
            mma_row<T, DP / 8, true>(gv, a, &sd[cur][0][0], DP + 8, kk * 16, lane);
        }
#pragma unroll
        for (int n = 0; n < C / 8; n++) {
            const int c = n * 8 + 2 * t;
            s[n][0] *= dp[n][0] - sdl[cur][c], s[n][1] *= dp[n][1] - sdl[cur][c + 1];
            s[n][2] *= dp[n][2] - sdl[cur][c], s[n][3] *= dp[n][3] - sdl[cur][c + 1];
        }
#pragma unroll
        for (int kk = 0; kk < C / 16; kk++) {  // dK += dS^T Q
            uint32_t a[4];
            acc_to_a<T>(a, s, kk);
            mma_row<T, DP / 8, true>(gk, a, &sq[cur][0][0], DP + 8, kk * 16, lane);
        }
        __syncthreads();
    }
    if (const int slot = work_slot(items, B); slot >= 0) {  // dK parts [B, slots, BLK, D], then dV parts
        const int l0 = warp * 16 + g, pb = work_batch(B);
        store_grad_part<DP>(gk, scale, part_tile(part, pb, slots, slot, BLK, D), l0, l0 + 8, D, t);
        store_grad_part<DP>(gv, 1.f, part_tile(part + (int64_t)B * slots * BLK * D, pb, slots, slot, BLK, D), l0,
                            l0 + 8, D, t);
        return;
    }
    T *k0 = dk + base + (int64_t)j0 * D, *k1 = k0 + 8 * (int64_t)D;
    T *v0 = dv + base + (int64_t)j0 * D, *v1 = v0 + 8 * (int64_t)D;
#pragma unroll
    for (int n = 0; n < DP / 8; n++) {
        const int d = n * 8 + 2 * t;
        if (d < D) {
            *reinterpret_cast<uint32_t *>(k0 + d) = pack2<T>(gk[n][0] * scale, gk[n][1] * scale);
            *reinterpret_cast<uint32_t *>(k1 + d) = pack2<T>(gk[n][2] * scale, gk[n][3] * scale);
            *reinterpret_cast<uint32_t *>(v0 + d) = pack2<T>(gv[n][0], gv[n][1]);
            *reinterpret_cast<uint32_t *>(v1 + d) = pack2<T>(gv[n][2], gv[n][3]);
        }
    }
}

int launch_dkv(const BackwardArgs &a) {
    const dim3 grid = work_grid(a.col_plan, a.B, a.H, a.L / a.block);
    const int *items = a.col_plan ? a.col_plan->items : nullptr;
    const int64_t slots = a.col_plan ? a.col_plan->slots : 0;
    return dispatch(a.dtype, a.block, a.D, [&](auto *tag, auto blk, auto dp) {
        using E = std::remove_pointer_t<decltype(tag)>;
        constexpr int BLK = decltype(blk)::value, DP = decltype(dp)::value;
        sa_dkv_kernel<E, BLK, DP><<<grid, BLK * 2, 0, a.stream>>>(
            static_cast<const E *>(a.d_o), static_cast<const E *>(a.q), static_cast<const E *>(a.k),
            static_cast<const E *>(a.v), a.lse, a.delta, a.col_ptr, a.rows, a.kpm, a.am, a.rpe, a.rpe_sb, a.rpe_sh,
            static_cast<E *>(a.dk), static_cast<E *>(a.dv), items, a.part, slots, (int)a.B, (int)a.H, (int)a.L,
            (int)a.D, a.scale);
        if (const int rc = launch_error()) return rc;
        if (!a.col_plan || a.col_plan->n_merges == 0) return 0;
        const int64_t n = a.B * slots * BLK * a.D;
        if (const int rc = launch_sum_combine<E>(*a.col_plan, a.part, a.dk, a.B, a.H, a.L, a.D, BLK, a.stream))
            return rc;
        return launch_sum_combine<E>(*a.col_plan, a.part + n, a.dv, a.B, a.H, a.L, a.D, BLK, a.stream);
    });
}
} // namespace dsc_sa
