// Block-sparse attention forward: one block of BLK / 16 warps per (layout block row, batch x head),
// an online softmax over that row's nonzero key blocks (see sparse_attn_common.cuh); K/V chunks
// double-buffered with cp.async, B operands by ldmatrix (sparse_attn_pipe.cuh).
#include "sparse_attn_pipe.cuh"
#include "sparse_attn_plan.cuh"

namespace dsc_sa {

template <typename T, int BLK, int DP>
__global__ void __launch_bounds__(BLK * 2)
    sa_forward_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                         T *__restrict__ o, float *__restrict__ lse, const int *__restrict__ row_ptr,
                         const int *__restrict__ cols, const float *kpm, const float *am, const float *rpe,
                         int64_t rpe_sb, int64_t rpe_sh, const int *__restrict__ items, float *__restrict__ part,
                         int64_t slots, int B, int H, int L, int D, float scale) {
    constexpr int C = chunk<BLK, DP>();
    __shared__ __align__(16) T sk[2][C][DP + 8];
    __shared__ __align__(16) T sv[2][C][DP + 8];
    const int nb = L / BLK;
    const Work w = resolve_work(items, row_ptr, B, H, nb);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int64_t base = (int64_t)w.bh * L * D;
    const int r0 = w.rb * BLK + warp * 16, i0 = r0 + g, i1 = i0 + 8;
    const Bias bias(kpm, am, rpe, rpe_sb, rpe_sh, w.b, w.h, L);
    const ChunkWalk<BLK, C> walk(cols, w.lo, w.hi);

    if (walk.total > 0) {
        const int j = walk.first_row(0);
        stage_rows_async<T, C, DP>(sk[0], k + base + (int64_t)j * D, D);
        stage_rows_async<T, C, DP>(sv[0], v + base + (int64_t)j * D, D);
    }
    cp_async_commit();
    uint32_t qf[DP / 16][4];
#pragma unroll
    for (int kk = 0; kk < DP / 16; kk++) frag_a_global(qf[kk], q + base, D, r0, kk * 16, lane);
    float acc[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    for (int x = 0; x < walk.total; x++) {
        const int cur = x & 1, j0 = walk.first_row(x);
        if (x + 1 < walk.total) {  // the next chunk's copy overlaps this chunk's math
            const int jn = walk.first_row(x + 1);
            stage_rows_async<T, C, DP>(sk[cur ^ 1], k + base + (int64_t)jn * D, D);
            stage_rows_async<T, C, DP>(sv[cur ^ 1], v + base + (int64_t)jn * D, D);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        float s[C / 8][4];
#pragma unroll
        for (int n = 0; n < C / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < DP / 16; kk++) mma_row<T, C / 8, false>(s, qf[kk], &sk[cur][0][0], DP + 8, kk * 16, lane);
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int n = 0; n < C / 8; n++) {
#pragma unroll
            for (int u = 0; u < 2; u++) {
                const int j = j0 + n * 8 + 2 * t + u;
                float x0 = s[n][u] * scale, x1 = s[n][2 + u] * scale;
                if (bias.any()) x0 += bias.at(i0, j), x1 += bias.at(i1, j);
                s[n][u] = x0, s[n][2 + u] = x1;
                mx0 = fmaxf(mx0, x0), mx1 = fmaxf(mx1, x1);
            }
        }
        const float mn0 = fmaxf(m0, quad_max(mx0)), mn1 = fmaxf(m1, quad_max(mx1));
        const float corr0 = mn0 == -INFINITY ? 1.f : __expf(m0 - mn0);
        const float corr1 = mn1 == -INFINITY ? 1.f : __expf(m1 - mn1);
        float ls0 = 0.f, ls1 = 0.f;
#pragma unroll
        for (int n = 0; n < C / 8; n++) {
#pragma unroll
            for (int u = 0; u < 2; u++) {
                s[n][u] = mn0 == -INFINITY ? 0.f : __expf(s[n][u] - mn0);
                s[n][2 + u] = mn1 == -INFINITY ? 0.f : __expf(s[n][2 + u] - mn1);
                ls0 += s[n][u], ls1 += s[n][2 + u];
            }
        }
        l0 = l0 * corr0 + ls0, l1 = l1 * corr1 + ls1;
        m0 = mn0, m1 = mn1;
#pragma unroll
        for (int n = 0; n < DP / 8; n++) acc[n][0] *= corr0, acc[n][1] *= corr0, acc[n][2] *= corr1, acc[n][3] *= corr1;
#pragma unroll
        for (int kk = 0; kk < C / 16; kk++) {
            uint32_t a[4];
            acc_to_a<T>(a, s, kk);
            mma_row<T, DP / 8, true>(acc, a, &sv[cur][0][0], DP + 8, kk * 16, lane);
        }
        __syncthreads();  // every warp is done with this stage before the next copy lands in it
    }
    if (const int slot = work_slot(items, B); slot < 0) {
        store_forward_rows<T, DP>(acc, m0, m1, l0, l1, o + base + (int64_t)i0 * D, o + base + (int64_t)i1 * D,
                                  lse + (int64_t)w.bh * L, i0, i1, D, t);
    } else {
        const int pb = work_batch(B), r = warp * 16 + g;  // rows local to the block
        float *plse = part + (int64_t)B * slots * BLK * D + ((int64_t)pb * slots + slot) * BLK;
        store_forward_part<DP>(acc, m0, m1, l0, l1, part_tile(part, pb, slots, slot, BLK, D), plse, r, r + 8, D, t);
    }
}

int launch_forward(const ForwardArgs &a) {
    const dim3 grid = work_grid(a.plan, a.B, a.H, a.L / a.block);
    const int *items = a.plan ? a.plan->items : nullptr;
    const int64_t slots = a.plan ? a.plan->slots : 0;
    return dispatch(a.dtype, a.block, a.D, [&](auto *tag, auto blk, auto dp) {
        using E = std::remove_pointer_t<decltype(tag)>;
        constexpr int BLK = decltype(blk)::value, DP = decltype(dp)::value;
        sa_forward_kernel<E, BLK, DP><<<grid, BLK * 2, 0, a.stream>>>(
            static_cast<const E *>(a.q), static_cast<const E *>(a.k), static_cast<const E *>(a.v),
            static_cast<E *>(a.o), a.lse, a.row_ptr, a.cols, a.kpm, a.am, a.rpe, a.rpe_sb, a.rpe_sh, items, a.part,
            slots, (int)a.B, (int)a.H, (int)a.L, (int)a.D, a.scale);
        if (const int rc = launch_error()) return rc;
        if (!a.plan || a.plan->n_merges == 0) return 0;
        sa_forward_combine_kernel<E><<<(unsigned)(a.plan->n_merges * a.B), 256, 0, a.stream>>>(
            a.plan->merges, a.part, static_cast<E *>(a.o), a.lse, (int)a.B, (int)a.H, (int)(a.L / BLK), BLK,
            (int)a.L, (int)a.D, slots);
        return launch_error();
    });
}
} // namespace dsc_sa
