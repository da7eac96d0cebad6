// Evoformer attention backward on tensor cores with mma.sync (evoformer_mma.cuh). Probabilities are
// recomputed from the forward's log-sum-exp; every product runs on tensor cores with the operands
// of the second product of each pair (P, dS) kept in registers. Three kernels, none with atomics
// on a [B, N, L, H, D] gradient:
//   dQ      by query rows: delta = rowsum(dO O) first (written out for the other two), then
//           S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K
//   dK, dV  by key rows:   S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q; the mask bias's
//           gradient (a sum over heads and queries) as one atomic per key and head
//   dpair   by (query block, key block) of one (b, h) plane, looping over the N rows of the stack
//           and summing dS in registers: the pair bias is shared by the N rows, so its gradient is
//           one register sum per element instead of N atomics (the stack is split over a few blocks
//           when the planes alone do not fill the GPU; those add with atomics).
#include "evoformer_mma.cuh"

namespace dsc_evo {

// Shared tiles of the dQ and dK/dV kernels: two tiles kept for the whole block (a, b) and a two-stage
// ring of streamed tiles (c, d, the pair-bias block, per-column floats), so the next step's tiles are
// copied (cp.async) while this step's are used.
template <typename T, int DP> struct BwdSmem {
    __align__(16) T a[kMmaRows * Pad<DP>::S];
    __align__(16) T b[kMmaRows * Pad<DP>::S];
    __align__(16) T c[2][kMmaTile * Pad<DP>::S];
    __align__(16) T d[2][kMmaTile * Pad<DP>::S];
    __align__(16) T pair[2][kMmaTile * kBiasStride];
    __align__(16) float colf[2][2][kMmaTile];  // mask bias (dQ) or lse and delta (dK/dV) of a tile's columns
};

// grid: one block per 64 query rows of each (b, n, h) slice, the row blocks of a slice adjacent.
template <typename T, int DP>
__global__ void __launch_bounds__(32 * kMmaWarps, DP == 32 ? 4 : 2)
    evo_dq_mma_kernel(const T *__restrict__ d_o, const T *__restrict__ q, const T *__restrict__ k,
                      const T *__restrict__ v, const T *__restrict__ o, const float *__restrict__ lse,
                      float *__restrict__ delta, const T *__restrict__ bias1, const T *__restrict__ bias2,
                      T *__restrict__ dq, int N, int L, int H, int D, float scale, bool vec, bool bvec) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap();
#else
    using Smem = BwdSmem<T, DP>;
    // a: Q rows, b: dO rows, c: K tiles (first O rows), d: V tiles, colf[.][0]: mask bias, colf[1][1]: delta
    DSC_EVO_SMEM(Smem, t);
    const Geometry g(N, L, H, D);
    const int blocks = (L + kMmaRows - 1) / kMmaRows;
    const Slice sl(g, blockIdx.x / blocks);
    const T *b1 = bias1 ? bias1 + sl.b1_off : nullptr;
    const T *b2 = bias2 ? bias2 + sl.b2_off : nullptr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
    const int q0 = (blockIdx.x % blocks) * kMmaRows, wr = warp * 16;
    auto issue = [&](int k0, int st) {  // key tile k0 into stage st, one cp.async group
        load_tile<T, DP>(t.c[st], k + sl.base, g.HD, L, D, k0, kMmaTile, vec);
        load_tile<T, DP>(t.d[st], v + sl.base, g.HD, L, D, k0, kMmaTile, vec);
        if (b2) load_bias_tile<T>(t.pair[st], b2, L, q0, k0, bvec);
        cp_commit();
    };
    // the mask bias of key k0 + threadIdx.x: fetched into a register at issue, stored after the step
    auto fetch = [&](int k0) {
        const int j = k0 + (int)threadIdx.x;
        return threadIdx.x < kMmaTile ? (j < L ? (b1 ? load(b1 + j) * kLog2e : 0.f) : -INFINITY) : 0.f;
    };
    auto put = [&](int st, float m) {
        if (threadIdx.x < kMmaTile) t.colf[st][0][threadIdx.x] = m;
    };
    load_tile<T, DP>(t.a, q + sl.base, g.HD, L, D, q0, kMmaRows, vec);
    load_tile<T, DP>(t.b, d_o + sl.base, g.HD, L, D, q0, kMmaRows, vec);
    load_tile<T, DP>(t.c[1], o + sl.base, g.HD, L, D, q0, kMmaRows, vec);  // stage 1 is free until the loop
    cp_commit();
    issue(0, 0);
    put(0, fetch(0));
    float li[2], di[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int i = q0 + wr + gr + h * 8;
        li[h] = i < L ? lse[sl.lse_row + i] * kLog2e : INFINITY;  // +inf: p = 0 on rows past L
    }
    cp_wait<1>();  // Q, dO and O have landed
    __syncthreads();
    {
        // delta = rowsum(dO * O) of the block's rows, two threads a row; written out for the dK/dV and
        // dpair kernels, which run after this one
        static_assert(kMmaRows * 2 == 32 * kMmaWarps, "two threads per row");
        const int r = (int)threadIdx.x >> 1, c0 = ((int)threadIdx.x & 1) * (DP / 2);
        const T *x = t.b + r * Pad<DP>::S + c0, *y = t.c[1] + r * Pad<DP>::S + c0;
        float s = 0.f;
#pragma unroll
        for (int c = 0; c < DP / 2; c++) s = fmaf(load(x + c), load(y + c), s);
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        if ((threadIdx.x & 1) == 0) {
            t.colf[1][1][r] = s;
            if (q0 + r < L) delta[sl.lse_row + q0 + r] = s;
        }
    }
    __syncthreads();  // delta is in shared memory, and stage 1 (O) may be refilled
#pragma unroll
    for (int h = 0; h < 2; h++) di[h] = t.colf[1][1][wr + gr + h * 8];
    uint32_t qf[DP / 16][4], dof[DP / 16][4];
    load_a<T, DP>(qf, t.a, wr);
    load_a<T, DP>(dof, t.b, wr);
    float acc[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    const float sl2 = scale * kLog2e;
    for (int k0 = 0, st = 0; k0 < L; k0 += kMmaTile, st ^= 1) {
        const bool more = k0 + kMmaTile < L;
        float next_mask = 0.f;
        if (more) {
            issue(k0 + kMmaTile, st ^ 1);  // that stage was last read before the barrier ending the previous step
            next_mask = fetch(k0 + kMmaTile);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        float s[kMmaTile / 8][4], dp[kMmaTile / 8][4];
        rows_x_tile_t<T, DP>(s, qf, t.c[st]);
        rows_x_tile_t<T, DP>(dp, dof, t.d[st]);
        uint32_t pbr[4] = {0u, 0u, 0u, 0u};  // the bias of n-tiles n and n + 1 (n even)
#pragma unroll
        for (int n = 0; n < kMmaTile / 8; n++) {
            const int col = n * 8 + 2 * tq;
            const float2 mk = *reinterpret_cast<const float2 *>(&t.colf[st][0][col]);
            if (b2 && (n & 1) == 0) bias_x4<false>(pbr, t.pair[st], wr, n >> 1);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float x0 = fmaf(s[n][2 * h], sl2, mk.x), x1 = fmaf(s[n][2 * h + 1], sl2, mk.y);
                if (b2) {
                    const float2 pb = unpack2(pbr[2 * (n & 1) + h], t.pair[st]);
                    x0 = fmaf(pb.x, kLog2e, x0);
                    x1 = fmaf(pb.y, kLog2e, x1);
                }
                s[n][2 * h] = exp2f(x0 - li[h]) * (dp[n][2 * h] - di[h]);
                s[n][2 * h + 1] = exp2f(x1 - li[h]) * (dp[n][2 * h + 1] - di[h]);
            }
        }
        uint32_t dsf[kMmaTile / 16][4];
        c_to_a<T>(dsf, s);
        acc_p_x_tile<T, DP>(acc, dsf, t.c[st]);
        if (more) put(st ^ 1, next_mask);
        __syncthreads();  // this stage is refilled by the next step's issue
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

// grid: one block per 64 key rows of each (b, n, h) slice, the key blocks of a slice adjacent.
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
    using Smem = BwdSmem<T, DP>;
    DSC_EVO_SMEM(Smem, t);  // a: K rows, b: V rows, c: Q tiles, d: dO tiles, colf: lse and delta
    const Geometry g(N, L, H, D);
    const int blocks = (L + kMmaRows - 1) / kMmaRows;
    const Slice sl(g, blockIdx.x / blocks);
    const T *b2 = bias2 ? bias2 + sl.b2_off : nullptr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
    const int j0 = (blockIdx.x % blocks) * kMmaRows, wr = warp * 16;
    auto issue = [&](int i0, int st) {  // query tile i0 into stage st
        load_tile<T, DP>(t.c[st], q + sl.base, g.HD, L, D, i0, kMmaTile, vec);
        load_tile<T, DP>(t.d[st], d_o + sl.base, g.HD, L, D, i0, kMmaTile, vec);
        if (b2) load_bias_tile<T>(t.pair[st], b2, L, i0, j0, bvec);  // [query][key]
        cp_commit();
    };
    // lse (log2 units; +inf past L) and delta of query i0 + threadIdx.x: fetched at issue, stored after
    // the step
    auto fetch = [&](int i0) {
        const int i = i0 + (int)threadIdx.x;
        const bool in = threadIdx.x < kMmaTile && i < L;
        return make_float2(in ? lse[sl.lse_row + i] * kLog2e : INFINITY, in ? delta[sl.lse_row + i] : 0.f);
    };
    auto put = [&](int st, float2 f) {
        if (threadIdx.x < kMmaTile) t.colf[st][0][threadIdx.x] = f.x, t.colf[st][1][threadIdx.x] = f.y;
    };
    load_tile<T, DP>(t.a, k + sl.base, g.HD, L, D, j0, kMmaRows, vec);
    load_tile<T, DP>(t.b, v + sl.base, g.HD, L, D, j0, kMmaRows, vec);
    cp_commit();
    issue(0, 0);
    put(0, fetch(0));
    float bj[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int j = j0 + wr + gr + h * 8;
        bj[h] = j < L ? (bias1 ? load(bias1 + sl.b1_off + j) * kLog2e : 0.f) : -INFINITY;
    }
    cp_wait<1>();
    __syncthreads();
    uint32_t kf[DP / 16][4], vf[DP / 16][4];
    load_a<T, DP>(kf, t.a, wr);
    load_a<T, DP>(vf, t.b, wr);
    float dka[DP / 8][4], dva[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; n++)
        dka[n][0] = dka[n][1] = dka[n][2] = dka[n][3] = dva[n][0] = dva[n][1] = dva[n][2] = dva[n][3] = 0.f;
    float db1[2] = {0.f, 0.f};
    const float sl2 = scale * kLog2e;
    for (int i0 = 0, st = 0; i0 < L; i0 += kMmaTile, st ^= 1) {
        const bool more = i0 + kMmaTile < L;
        float2 next_rows = make_float2(0.f, 0.f);
        if (more) {
            issue(i0 + kMmaTile, st ^ 1);
            next_rows = fetch(i0 + kMmaTile);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        float sT[kMmaTile / 8][4], dpT[kMmaTile / 8][4];
        rows_x_tile_t<T, DP>(sT, kf, t.c[st]);
        rows_x_tile_t<T, DP>(dpT, vf, t.d[st]);
        uint32_t pbr[4] = {0u, 0u, 0u, 0u};  // the (transposed) bias of n-tiles n and n + 1 (n even)
#pragma unroll
        for (int n = 0; n < kMmaTile / 8; n++) {
            if (b2 && (n & 1) == 0) bias_x4<true>(pbr, t.pair[st], wr, n >> 1);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int h = e >> 1, col = n * 8 + 2 * tq + (e & 1);
                float x = fmaf(sT[n][e], sl2, bj[h]);
                if (b2) {
                    const float2 pb = unpack2(pbr[2 * (n & 1) + h], t.pair[st]);
                    x = fmaf((e & 1) ? pb.y : pb.x, kLog2e, x);
                }
                const float p = exp2f(x - t.colf[st][0][col]);
                const float ds = p * (dpT[n][e] - t.colf[st][1][col]);
                db1[h] += ds;
                sT[n][e] = p;
                dpT[n][e] = ds;
            }
        }
        uint32_t af[kMmaTile / 16][4];
        c_to_a<T>(af, sT);
        acc_p_x_tile<T, DP>(dva, af, t.d[st]);
        c_to_a<T>(af, dpT);
        acc_p_x_tile<T, DP>(dka, af, t.c[st]);
        if (more) put(st ^ 1, next_rows);
        __syncthreads();
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

// The dpair kernel's tiles: per stage (one row n of the stack) Q and dO of the query block, K and V of
// the key block, the mask bias of the key block, lse and delta of the query block; the pair-bias block
// once.
template <typename T, int DP> struct DpairSmem {
    __align__(16) T qo[2][2][kMmaRows * Pad<DP>::S];  // [stage][Q, dO]
    __align__(16) T kv[2][2][kMmaTile * Pad<DP>::S];  // [stage][K, V]
    __align__(16) T pair[kMmaRows * kBiasStride];
    __align__(16) float mask[2][kMmaTile];
    float rowf[2][2][kMmaRows];  // [stage][lse, delta]
};

// dbias2[b, h, i, j] += sum over n in this block's share of the stack of dS[b, n, h, i, j].
// grid (one dimension): key blocks fastest (they share the query block's Q and dO), then query
// blocks, then the splits of the stack, then the (b, h) planes.
template <typename T, int DP>
__global__ void __launch_bounds__(32 * kMmaWarps)
    evo_dpair_mma_kernel(const T *__restrict__ d_o, const T *__restrict__ q, const T *__restrict__ k,
                         const T *__restrict__ v, const float *__restrict__ lse, const float *__restrict__ delta,
                         const T *__restrict__ bias1, const T *__restrict__ bias2, float *__restrict__ dbias2, int N,
                         int L, int H, int D, float scale, int n_per_block, int splits, bool vec, bool bvec) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap();
#else
    using Smem = DpairSmem<T, DP>;
    DSC_EVO_SMEM(Smem, t);
    const int64_t HD = (int64_t)H * D;
    const int blocks = (L + kMmaRows - 1) / kMmaRows;
    int64_t idx = blockIdx.x;
    const int jb = (int)(idx % blocks);
    idx /= blocks;
    const int ib = (int)(idx % blocks);
    idx /= blocks;
    const int split = (int)(idx % splits);
    const int bh = (int)(idx / splits), b = bh / H, h = bh % H;
    const int i0 = ib * kMmaRows, j0 = jb * kMmaTile;
    const int n_lo = split * n_per_block, n_hi = min(N, n_lo + n_per_block);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3, wr = warp * 16;
    const int64_t plane = (int64_t)bh * L * L;
    auto issue = [&](int n, int st) {  // row n of the stack into stage st
        const int64_t bn = (int64_t)b * N + n, base = bn * L * HD + (int64_t)h * D;
        load_tile<T, DP>(t.qo[st][0], q + base, HD, L, D, i0, kMmaRows, vec);
        load_tile<T, DP>(t.qo[st][1], d_o + base, HD, L, D, i0, kMmaRows, vec);
        load_tile<T, DP>(t.kv[st][0], k + base, HD, L, D, j0, kMmaTile, vec);
        load_tile<T, DP>(t.kv[st][1], v + base, HD, L, D, j0, kMmaTile, vec);
        cp_commit();
    };
    // row n's mask bias of key j0 + threadIdx.x and lse, delta of query i0 + threadIdx.x: fetched at
    // issue, stored after the step
    auto fetch = [&](int n) {
        const int64_t bn = (int64_t)b * N + n, row0 = (bn * H + h) * L;
        const int j = j0 + (int)threadIdx.x, i = i0 + (int)threadIdx.x;
        const bool lane_in = threadIdx.x < kMmaTile;
        return make_float3(lane_in && j < L ? (bias1 ? load(bias1 + bn * L + j) * kLog2e : 0.f) : -INFINITY,
                           lane_in && i < L ? lse[row0 + i] * kLog2e : INFINITY,
                           lane_in && i < L ? delta[row0 + i] : 0.f);
    };
    auto put = [&](int st, float3 f) {
        if (threadIdx.x < kMmaTile)
            t.mask[st][threadIdx.x] = f.x, t.rowf[st][0][threadIdx.x] = f.y, t.rowf[st][1][threadIdx.x] = f.z;
    };
    load_bias_tile<T>(t.pair, bias2 + plane, L, i0, j0, bvec);
    cp_commit();
    if (n_lo < n_hi) {
        issue(n_lo, 0);
        put(0, fetch(n_lo));
    }
    cp_wait<1>();
    __syncthreads();
    float pb[kMmaTile / 8][4], acc[kMmaTile / 8][4];
#pragma unroll
    for (int c = 0; c < kMmaTile / 8; c++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            pb[c][e] = load(&t.pair[(wr + gr + (e >> 1) * 8) * kBiasStride + c * 8 + 2 * tq + (e & 1)]) * kLog2e;
            acc[c][e] = 0.f;
        }
    }
    const float sl2 = scale * kLog2e;
    for (int n = n_lo, st = 0; n < n_hi; n++, st ^= 1) {
        const bool more = n + 1 < n_hi;
        float3 next_f = make_float3(0.f, 0.f, 0.f);
        if (more) {
            issue(n + 1, st ^ 1);
            next_f = fetch(n + 1);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        uint32_t qf[DP / 16][4], dof[DP / 16][4];
        load_a<T, DP>(qf, t.qo[st][0], wr);
        load_a<T, DP>(dof, t.qo[st][1], wr);
        float li[2], di[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            li[r] = t.rowf[st][0][wr + gr + r * 8];
            di[r] = t.rowf[st][1][wr + gr + r * 8];
        }
        float s[kMmaTile / 8][4], dp[kMmaTile / 8][4];
        rows_x_tile_t<T, DP>(s, qf, t.kv[st][0]);
        rows_x_tile_t<T, DP>(dp, dof, t.kv[st][1]);
#pragma unroll
        for (int c = 0; c < kMmaTile / 8; c++) {
            const int col = c * 8 + 2 * tq;
            const float2 mk = *reinterpret_cast<const float2 *>(&t.mask[st][col]);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e >> 1;
                const float x = fmaf(s[c][e], sl2, (e & 1) ? mk.y : mk.x) + pb[c][e];
                acc[c][e] += exp2f(x - li[r]) * (dp[c][e] - di[r]);
            }
        }
        if (more) put(st ^ 1, next_f);
        __syncthreads();
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

// The stack split of the dpair kernel: enough (b, h) plane blocks times splits to fill the GPU a few
// times over, each split at least a few rows of the stack.
inline void dpair_split(int64_t B, int64_t N, int64_t L, int64_t H, int64_t &per, int64_t &splits) {
    const int64_t blocks = (L + kMmaRows - 1) / kMmaRows, planes = B * H * blocks * blocks;
    splits = (2048 + planes - 1) / planes;
    splits = splits < 1 ? 1 : splits > N ? N : splits;
    per = (N + splits - 1) / splits;
    splits = (N + per - 1) / per;
}

#ifndef DSC_EVO_EMULATE  // the host check calls the kernels itself
template <typename E, int DP>
int launch_bwd_mma_typed(const E *gO, const E *Q, const E *K, const E *V, const E *O, const float *lse, float *delta,
                         const E *b1, const E *b2, E *dq, E *dk, E *dv, float *db1, float *db2, int64_t B, int64_t N,
                         int64_t L, int64_t H, int64_t D, float scale, cudaStream_t stream) {
    const bool vec = vec_ok(D, {gO, Q, K, V, O, dq, dk, dv}), bvec = vec_ok(L, {b2});
    const int64_t blocks = (L + kMmaRows - 1) / kMmaRows, grid = B * N * H * blocks;
    int64_t per = 1, splits = 1;
    dpair_split(B, N, L, H, per, splits);
    if (grid > 0x7fffffffLL || B * H * splits * blocks * blocks > 0x7fffffffLL) return DSC_CUDA_EARG;
    const size_t smem = sizeof(BwdSmem<E, DP>);
    int rc = allow_smem(evo_dq_mma_kernel<E, DP>, smem, 0);
    if (rc == 0) rc = allow_smem(evo_dkv_mma_kernel<E, DP>, smem, 0);
    if (rc == 0) rc = allow_smem(evo_dpair_mma_kernel<E, DP>, sizeof(DpairSmem<E, DP>), 0);
    if (rc != 0) return rc;
    evo_dq_mma_kernel<E, DP><<<(unsigned)grid, 32 * kMmaWarps, smem, stream>>>(
        gO, Q, K, V, O, lse, delta, b1, b2, dq, (int)N, (int)L, (int)H, (int)D, scale, vec, bvec);
    rc = launch_error();
    if (rc != 0) return rc;
    evo_dkv_mma_kernel<E, DP><<<(unsigned)grid, 32 * kMmaWarps, smem, stream>>>(
        gO, Q, K, V, lse, delta, b1, b2, dk, dv, db1, (int)N, (int)L, (int)H, (int)D, scale, vec, bvec);
    rc = launch_error();
    if (rc != 0 || !db2) return rc;
    evo_dpair_mma_kernel<E, DP><<<(unsigned)(B * H * splits * blocks * blocks), 32 * kMmaWarps,
                                  sizeof(DpairSmem<E, DP>), stream>>>(gO, Q, K, V, lse, delta, b1, b2, db2, (int)N,
                                                                      (int)L, (int)H, (int)D, scale, (int)per,
                                                                      (int)splits, vec, bvec);
    return launch_error();
}

int launch_bwd_mma(const void *d_o, const void *q, const void *k, const void *v, const void *o, const float *lse,
                   float *delta, const void *bias1, const void *bias2, void *dq, void *dk, void *dv, float *dbias1,
                   float *dbias2, int64_t B, int64_t N, int64_t L, int64_t H, int64_t D, float scale, int dtype,
                   cudaStream_t stream) {
    return dispatch_half(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        return dispatch_dim(D, [&](auto dp) {
            return launch_bwd_mma_typed<E, decltype(dp)::value>(
                static_cast<const E *>(d_o), static_cast<const E *>(q), static_cast<const E *>(k),
                static_cast<const E *>(v), static_cast<const E *>(o), lse, delta, static_cast<const E *>(bias1),
                static_cast<const E *>(bias2), static_cast<E *>(dq), static_cast<E *>(dk), static_cast<E *>(dv), dbias1, dbias2, B, N, L, H, D,
                scale, stream);
        });
    });
}
#endif
} // namespace dsc_evo
