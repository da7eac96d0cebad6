// Evoformer attention backward on tensor cores with mma.sync (evoformer_mma.cuh). Probabilities are
// recomputed from the forward's log-sum-exp; every product runs on tensor cores with the operands
// of the second product of each pair (P, dS) kept in registers. Three kernels, none with atomics
// on a [B, N, L, H, D] gradient:
//   dQ      by query rows: S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K
//   dK, dV  by key rows:   S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q; the mask bias's
//           gradient (a sum over heads and queries) as one atomic per key and head
//   dpair   by (query block, key block) of one (b, h) plane, looping over the N rows of the stack
//           and summing dS in registers: the pair bias is shared by the N rows, so its gradient is
//           one register sum per element instead of N atomics (the stack is split over a few blocks
//           when the planes alone do not fill the GPU; those add with atomics).
#include "evoformer_mma.cuh"

namespace dsc_evo {

template <typename T, int DP>
__global__ void __launch_bounds__(32 * kMmaWarps)
    evo_dq_mma_kernel(const T *__restrict__ d_o, const T *__restrict__ q, const T *__restrict__ k,
                      const T *__restrict__ v, const float *__restrict__ lse, const float *__restrict__ delta,
                      const T *__restrict__ bias1, const T *__restrict__ bias2, T *__restrict__ dq, int N, int L,
                      int H, int D, float scale, bool vec, bool bvec) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap();
#else
    __shared__ MmaSmem<T, DP> t;  // a: Q rows, b: dO rows, c: K tile, d: V tile
    const Geometry g(N, L, H, D);
    const Slice sl(g);
    const T *b1 = bias1 ? bias1 + sl.b1_off : nullptr;
    const T *b2 = bias2 ? bias2 + sl.b2_off : nullptr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
    const int q0 = blockIdx.y * kMmaRows, wr = warp * 16;
    load_tile<T, DP>(t.a, q + sl.base, g.HD, L, D, q0, kMmaRows, vec);
    load_tile<T, DP>(t.b, d_o + sl.base, g.HD, L, D, q0, kMmaRows, vec);
    __syncthreads();
    uint32_t qf[DP / 16][4], dof[DP / 16][4];
    load_a<T, DP>(qf, t.a, wr);
    load_a<T, DP>(dof, t.b, wr);
    float li[2], di[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int i = q0 + wr + gr + h * 8;
        li[h] = i < L ? lse[sl.lse_row + i] * kLog2e : INFINITY;  // +inf: p = 0 on rows past L
        di[h] = i < L ? delta[sl.lse_row + i] : 0.f;
    }
    float acc[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    const float sl2 = scale * kLog2e;
    for (int k0 = 0; k0 < L; k0 += kMmaTile) {
        __syncthreads();
        load_tile<T, DP>(t.c, k + sl.base, g.HD, L, D, k0, kMmaTile, vec);
        load_tile<T, DP>(t.d, v + sl.base, g.HD, L, D, k0, kMmaTile, vec);
        if (b2) load_bias_tile<T>(t.pair, b2, L, q0, k0, bvec);
        for (int c = threadIdx.x; c < kMmaTile; c += blockDim.x) {
            const int j = k0 + c;
            t.mask[c] = j < L ? (b1 ? load(b1 + j) * kLog2e : 0.f) : -INFINITY;
        }
        __syncthreads();
        float s[kMmaTile / 8][4], dp[kMmaTile / 8][4];
        rows_x_tile_t<T, DP>(s, qf, t.c);
        rows_x_tile_t<T, DP>(dp, dof, t.d);
#pragma unroll
        for (int n = 0; n < kMmaTile / 8; n++) {
            const int col = n * 8 + 2 * tq;
            const float2 mk = *reinterpret_cast<const float2 *>(&t.mask[col]);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float x0 = fmaf(s[n][2 * h], sl2, mk.x), x1 = fmaf(s[n][2 * h + 1], sl2, mk.y);
                if (b2) {
                    const float2 pb = pair2(t.pair, wr + gr + h * 8, col);
                    x0 = fmaf(pb.x, kLog2e, x0);
                    x1 = fmaf(pb.y, kLog2e, x1);
                }
                s[n][2 * h] = exp2f(x0 - li[h]) * (dp[n][2 * h] - di[h]);
                s[n][2 * h + 1] = exp2f(x1 - li[h]) * (dp[n][2 * h + 1] - di[h]);
            }
        }
        uint32_t dsf[kMmaTile / 16][4];
        c_to_a<T>(dsf, s);
        acc_p_x_tile<T, DP>(acc, dsf, t.c);
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int i = q0 + wr + gr + h * 8;
        if (i >= L) continue;
        T *row = dq + sl.base + (int64_t)i * g.HD;
#pragma unroll
        for (int n = 0; n < DP / 8; n++) {
            const int c = n * 8 + 2 * tq;
            if (vec && c < D) {
                *reinterpret_cast<uint32_t *>(row + c) = Mma<T>::pack(acc[n][2 * h] * scale, acc[n][2 * h + 1] * scale);
            } else {
                if (c < D) store(row + c, acc[n][2 * h] * scale);
                if (c + 1 < D) store(row + c + 1, acc[n][2 * h + 1] * scale);
            }
        }
    }
#endif
}

template <typename T, int DP>
__global__ void __launch_bounds__(32 * kMmaWarps)
    evo_dkv_mma_kernel(const T *__restrict__ d_o, const T *__restrict__ q, const T *__restrict__ k,
                       const T *__restrict__ v, const float *__restrict__ lse, const float *__restrict__ delta,
                       const T *__restrict__ bias1, const T *__restrict__ bias2, T *__restrict__ dk,
                       T *__restrict__ dv, float *__restrict__ dbias1, int N, int L, int H, int D, float scale,
                       bool vec, bool bvec) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap();
#else
    __shared__ MmaSmem<T, DP> t;  // a: K rows, b: V rows, c: Q tile, d: dO tile
    const Geometry g(N, L, H, D);
    const Slice sl(g);
    const T *b2 = bias2 ? bias2 + sl.b2_off : nullptr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
    const int j0 = blockIdx.y * kMmaRows, wr = warp * 16;
    load_tile<T, DP>(t.a, k + sl.base, g.HD, L, D, j0, kMmaRows, vec);
    load_tile<T, DP>(t.b, v + sl.base, g.HD, L, D, j0, kMmaRows, vec);
    __syncthreads();
    uint32_t kf[DP / 16][4], vf[DP / 16][4];
    load_a<T, DP>(kf, t.a, wr);
    load_a<T, DP>(vf, t.b, wr);
    float bj[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int j = j0 + wr + gr + h * 8;
        bj[h] = j < L ? (bias1 ? load(bias1 + sl.b1_off + j) * kLog2e : 0.f) : -INFINITY;
    }
    float dka[DP / 8][4], dva[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; n++)
        dka[n][0] = dka[n][1] = dka[n][2] = dka[n][3] = dva[n][0] = dva[n][1] = dva[n][2] = dva[n][3] = 0.f;
    float db1[2] = {0.f, 0.f};
    const float sl2 = scale * kLog2e;
    for (int i0 = 0; i0 < L; i0 += kMmaTile) {
        __syncthreads();
        load_tile<T, DP>(t.c, q + sl.base, g.HD, L, D, i0, kMmaTile, vec);
        load_tile<T, DP>(t.d, d_o + sl.base, g.HD, L, D, i0, kMmaTile, vec);
        if (b2) load_bias_tile<T>(t.pair, b2, L, i0, j0, bvec);  // [query][key]
        for (int c = threadIdx.x; c < kMmaTile; c += blockDim.x) {
            const int i = i0 + c;
            t.rowf[0][c] = i < L ? lse[sl.lse_row + i] * kLog2e : INFINITY;
            t.rowf[1][c] = i < L ? delta[sl.lse_row + i] : 0.f;
        }
        __syncthreads();
        float st[kMmaTile / 8][4], dpt[kMmaTile / 8][4];
        rows_x_tile_t<T, DP>(st, kf, t.c);
        rows_x_tile_t<T, DP>(dpt, vf, t.d);
#pragma unroll
        for (int n = 0; n < kMmaTile / 8; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int h = e >> 1, key = wr + gr + h * 8, col = n * 8 + 2 * tq + (e & 1);
                float x = fmaf(st[n][e], sl2, bj[h]);
                if (b2) x = fmaf(load(&t.pair[col * kBiasStride + key]), kLog2e, x);
                const float p = exp2f(x - t.rowf[0][col]);
                const float ds = p * (dpt[n][e] - t.rowf[1][col]);
                db1[h] += ds;
                st[n][e] = p;
                dpt[n][e] = ds;
            }
        }
        uint32_t af[kMmaTile / 16][4];
        c_to_a<T>(af, st);
        acc_p_x_tile<T, DP>(dva, af, t.d);
        c_to_a<T>(af, dpt);
        acc_p_x_tile<T, DP>(dka, af, t.c);
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        db1[h] += __shfl_xor_sync(0xffffffffu, db1[h], 1);
        db1[h] += __shfl_xor_sync(0xffffffffu, db1[h], 2);
        const int j = j0 + wr + gr + h * 8;
        if (j >= L) continue;
        if (dbias1 && tq == 0) atomicAdd(dbias1 + sl.b1_off + j, db1[h]);
        T *krow = dk + sl.base + (int64_t)j * g.HD, *vrow = dv + sl.base + (int64_t)j * g.HD;
#pragma unroll
        for (int n = 0; n < DP / 8; n++) {
            const int c = n * 8 + 2 * tq;
            if (vec && c < D) {
                *reinterpret_cast<uint32_t *>(krow + c) = Mma<T>::pack(dka[n][2 * h] * scale, dka[n][2 * h + 1] * scale);
                *reinterpret_cast<uint32_t *>(vrow + c) = Mma<T>::pack(dva[n][2 * h], dva[n][2 * h + 1]);
            } else {
                if (c < D) store(krow + c, dka[n][2 * h] * scale), store(vrow + c, dva[n][2 * h]);
                if (c + 1 < D) store(krow + c + 1, dka[n][2 * h + 1] * scale), store(vrow + c + 1, dva[n][2 * h + 1]);
            }
        }
    }
#endif
}

// dbias2[b, h, i, j] += sum over n in this block's share of the stack of dS[b, n, h, i, j].
// grid: x = B * H, y = query blocks, z = key blocks * splits of the stack.
template <typename T, int DP>
__global__ void __launch_bounds__(32 * kMmaWarps)
    evo_dpair_mma_kernel(const T *__restrict__ d_o, const T *__restrict__ q, const T *__restrict__ k,
                         const T *__restrict__ v, const float *__restrict__ lse, const float *__restrict__ delta,
                         const T *__restrict__ bias1, const T *__restrict__ bias2, float *__restrict__ dbias2, int N,
                         int L, int H, int D, float scale, int n_per_block, bool vec, bool bvec) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap();
#else
    __shared__ MmaSmem<T, DP> t;  // a: Q rows, b: dO rows, c: K tile, d: V tile
    const int64_t HD = (int64_t)H * D;
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int jblocks = (L + kMmaTile - 1) / kMmaTile;
    const int i0 = blockIdx.y * kMmaRows, j0 = (blockIdx.z % jblocks) * kMmaTile;
    const int n_lo = (blockIdx.z / jblocks) * n_per_block, n_hi = min(N, n_lo + n_per_block);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3, wr = warp * 16;
    const int64_t plane = (int64_t)bh * L * L;
    load_bias_tile<T>(t.pair, bias2 + plane, L, i0, j0, bvec);
    __syncthreads();
    float pb[kMmaTile / 8][4], acc[kMmaTile / 8][4];
#pragma unroll
    for (int n = 0; n < kMmaTile / 8; n++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            pb[n][e] = load(&t.pair[(wr + gr + (e >> 1) * 8) * kBiasStride + n * 8 + 2 * tq + (e & 1)]) * kLog2e;
            acc[n][e] = 0.f;
        }
    }
    const float sl2 = scale * kLog2e;
    for (int n = n_lo; n < n_hi; n++) {
        const int64_t bn = (int64_t)b * N + n, base = bn * L * HD + (int64_t)h * D, row0 = (bn * H + h) * L;
        __syncthreads();
        load_tile<T, DP>(t.a, q + base, HD, L, D, i0, kMmaRows, vec);
        load_tile<T, DP>(t.b, d_o + base, HD, L, D, i0, kMmaRows, vec);
        load_tile<T, DP>(t.c, k + base, HD, L, D, j0, kMmaTile, vec);
        load_tile<T, DP>(t.d, v + base, HD, L, D, j0, kMmaTile, vec);
        for (int c = threadIdx.x; c < kMmaTile; c += blockDim.x) {
            const int j = j0 + c;
            t.mask[c] = j < L ? (bias1 ? load(bias1 + bn * L + j) * kLog2e : 0.f) : -INFINITY;
        }
        __syncthreads();
        uint32_t qf[DP / 16][4], dof[DP / 16][4];
        load_a<T, DP>(qf, t.a, wr);
        load_a<T, DP>(dof, t.b, wr);
        float li[2], di[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int i = i0 + wr + gr + r * 8;
            li[r] = i < L ? lse[row0 + i] * kLog2e : INFINITY;
            di[r] = i < L ? delta[row0 + i] : 0.f;
        }
        float s[kMmaTile / 8][4], dp[kMmaTile / 8][4];
        rows_x_tile_t<T, DP>(s, qf, t.c);
        rows_x_tile_t<T, DP>(dp, dof, t.d);
#pragma unroll
        for (int c = 0; c < kMmaTile / 8; c++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e >> 1, col = c * 8 + 2 * tq + (e & 1);
                const float x = fmaf(s[c][e], sl2, t.mask[col]) + pb[c][e];
                acc[c][e] += exp2f(x - li[r]) * (dp[c][e] - di[r]);
            }
        }
    }
#pragma unroll
    for (int c = 0; c < kMmaTile / 8; c++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int i = i0 + wr + gr + (e >> 1) * 8, j = j0 + c * 8 + 2 * tq + (e & 1);
            if (i < L && j < L) atomicAdd(dbias2 + plane + (int64_t)i * L + j, acc[c][e]);
        }
    }
#endif
}

#ifndef DSC_EVO_EMULATE  // the host check calls the kernels itself
template <typename E, int DP>
int launch_bwd_mma_typed(const E *gO, const E *Q, const E *K, const E *V, const float *lse, const float *delta,
                         const E *b1, const E *b2, E *dq, E *dk, E *dv, float *db1, float *db2, int64_t B, int64_t N,
                         int64_t L, int64_t H, int64_t D, float scale, cudaStream_t stream) {
    const bool vec = vec_ok(D, {gO, Q, K, V, dq, dk, dv}), bvec = vec_ok(L, {b2});
    const unsigned blocks = (unsigned)((L + kMmaRows - 1) / kMmaRows);
    const dim3 grid((unsigned)(B * N * H), blocks);
    evo_dq_mma_kernel<E, DP><<<grid, 32 * kMmaWarps, 0, stream>>>(gO, Q, K, V, lse, delta, b1, b2, dq, (int)N, (int)L,
                                                                  (int)H, (int)D, scale, vec, bvec);
    int rc = launch_error();
    if (rc != 0) return rc;
    evo_dkv_mma_kernel<E, DP><<<grid, 32 * kMmaWarps, 0, stream>>>(gO, Q, K, V, lse, delta, b1, b2, dk, dv, db1,
                                                                   (int)N, (int)L, (int)H, (int)D, scale, vec, bvec);
    rc = launch_error();
    if (rc != 0 || !db2) return rc;
    // split the stack so that the (b, h) planes' blocks times the splits fill the GPU a few times over
    const int64_t planes = B * H * (int64_t)blocks * blocks;
    int64_t splits = (2048 + planes - 1) / planes;
    splits = splits < 1 ? 1 : splits > N ? N : splits;
    const int64_t per = (N + splits - 1) / splits;
    splits = (N + per - 1) / per;
    if ((int64_t)blocks * splits > 65535) return DSC_CUDA_EARG;
    const dim3 pgrid((unsigned)(B * H), blocks, (unsigned)(blocks * splits));
    evo_dpair_mma_kernel<E, DP><<<pgrid, 32 * kMmaWarps, 0, stream>>>(gO, Q, K, V, lse, delta, b1, b2, db2, (int)N,
                                                                      (int)L, (int)H, (int)D, scale, (int)per, vec,
                                                                      bvec);
    return launch_error();
}

int launch_bwd_mma(const void *d_o, const void *q, const void *k, const void *v, const float *lse, const float *delta,
                   const void *bias1, const void *bias2, void *dq, void *dk, void *dv, float *dbias1, float *dbias2,
                   int64_t B, int64_t N, int64_t L, int64_t H, int64_t D, float scale, int dtype, cudaStream_t stream) {
    return dispatch_half(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        return dispatch_dim(D, [&](auto dp) {
            return launch_bwd_mma_typed<E, decltype(dp)::value>(
                static_cast<const E *>(d_o), static_cast<const E *>(q), static_cast<const E *>(k),
                static_cast<const E *>(v), lse, delta, static_cast<const E *>(bias1), static_cast<const E *>(bias2),
                static_cast<E *>(dq), static_cast<E *>(dk), static_cast<E *>(dv), dbias1, dbias2, B, N, L, H, D,
                scale, stream);
        });
    });
}
#endif
} // namespace dsc_evo
