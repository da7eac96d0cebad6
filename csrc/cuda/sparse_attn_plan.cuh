// The balanced grid of the block-sparse kernels (dsc_sa_plan, deepspeed_c/ops/sparse_attention/work_plan.py):
// each CTA resolves its work (a whole block row / column, or one part of a long one), and the split rows'
// float32 partials are merged by the combine kernels below, one CTA per (split row, batch).
#pragma once
#include "sparse_attn_common.cuh"

namespace dsc_sa {

// One CTA's work: batch b, head h (bh = b * H + h), block row (column) rb, its blocks [lo, hi) of the
// CSR (CSC) arrays (its scratch slot: work_slot below).
struct Work {
    int b, h, bh, rb, lo, hi;
};

// Without a plan the grid is (nb, B * H); with one it is (n_items * B): batch fastest, so every batch's
// copy of the longest items starts in the first wave.
__device__ __forceinline__ Work resolve_work(const int *items, const int *ptr, int B, int H, int nb) {
    Work w;
    if (items) {
        const int4 it = reinterpret_cast<const int4 *>(items)[blockIdx.x / B];
        w.b = blockIdx.x % B, w.h = it.x / nb, w.rb = it.x % nb, w.lo = it.y, w.hi = it.z;
    } else {
        w.h = blockIdx.y % H, w.b = blockIdx.y / H, w.rb = blockIdx.x;
        w.lo = ptr[w.h * nb + w.rb], w.hi = ptr[w.h * nb + w.rb + 1];
    }
    w.bh = w.b * H + w.h;
    return w;
}

// The CTA's scratch slot (-1: write the result) and, when it has one, its batch: re-read after the main
// loop rather than kept live across it (registers).
__device__ __forceinline__ int work_slot(const int *items, int B) {
    return items ? __ldg(items + (int64_t)(blockIdx.x / B) * 4 + 3) : -1;
}
__device__ __forceinline__ int work_batch(int B) { return (int)(blockIdx.x % B); }

inline dim3 work_grid(const dsc_sa_plan *plan, int64_t B, int64_t H, int64_t nb) {
    return plan ? dim3((unsigned)(plan->n_items * B)) : dim3((unsigned)nb, (unsigned)(B * H));
}

// Slot s of batch b in a [B, slots, BLK, D] float32 partial array.
template <typename P>
__device__ __forceinline__ P *part_tile(P *part, int b, int64_t slots, int slot, int BLK, int D) {
    return part + ((int64_t)b * slots + slot) * BLK * D;
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Rows i0 / i1 (local to the block) of a forward partial: O normalised by its own sum, and its
// log-sum-exp (+inf when the part saw no key), so parts merge as sum_p exp(lse_p - lse) o_p.
template <int DP>
__device__ __forceinline__ void store_forward_part(const float (&acc)[DP / 8][4], float m0, float m1, float l0,
                                                   float l1, float *po, float *plse, int i0, int i1, int D, int t) {
    l0 = quad_sum(l0), l1 = quad_sum(l1);
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
#pragma unroll
    for (int n = 0; n < DP / 8; n++) {
        const int d = n * 8 + 2 * t;
        if (d < D) {
            *reinterpret_cast<float2 *>(po + (int64_t)i0 * D + d) = make_float2(acc[n][0] * inv0, acc[n][1] * inv0);
            *reinterpret_cast<float2 *>(po + (int64_t)i1 * D + d) = make_float2(acc[n][2] * inv1, acc[n][3] * inv1);
        }
    }
    if (t == 0) {
        plse[i0] = l0 > 0.f ? m0 + logf(l0) : INFINITY;
        plse[i1] = l1 > 0.f ? m1 + logf(l1) : INFINITY;
    }
}

// Rows i0 / i1 (local) of a gradient partial, times `mul`.
template <int DP>
__device__ __forceinline__ void store_grad_part(const float (&acc)[DP / 8][4], float mul, float *p, int i0, int i1,
                                                int D, int t) {
#pragma unroll
    for (int n = 0; n < DP / 8; n++) {
        const int d = n * 8 + 2 * t;
        if (d < D) {
            *reinterpret_cast<float2 *>(p + (int64_t)i0 * D + d) = make_float2(acc[n][0] * mul, acc[n][1] * mul);
            *reinterpret_cast<float2 *>(p + (int64_t)i1 * D + d) = make_float2(acc[n][2] * mul, acc[n][3] * mul);
        }
    }
}

// The forward's merge: o = sum_p w_p o_p / sum_p w_p with w_p = exp(lse_p - max), lse = max + log(sum w_p);
// a row no part saw a key for keeps o = 0, lse = +inf. part: o parts [B, slots, BLK, D], then lse parts
// [B, slots, BLK].
template <typename T>
__global__ void sa_forward_combine_kernel(const int *__restrict__ merges, const float *__restrict__ part,
                                          T *__restrict__ o, float *__restrict__ lse, int B, int H, int nb, int BLK,
                                          int L, int D, int64_t slots) {
    const int4 m = reinterpret_cast<const int4 *>(merges)[blockIdx.x / B];
    const int b = blockIdx.x % B, h = m.x / nb, rb = m.x % nb;
    const int64_t bh = (int64_t)b * H + h, row0 = bh * L + (int64_t)rb * BLK;
    const float *po = part_tile(part, b, slots, m.y, BLK, D);
    const float *pl = part + (int64_t)B * slots * BLK * D + ((int64_t)b * slots + m.y) * BLK;
    for (int e = threadIdx.x; e < BLK * D; e += blockDim.x) {
        const int r = e / D;
        float mx = -INFINITY;
        for (int p = 0; p < m.z; p++) {
            const float x = pl[p * BLK + r];
            if (x != INFINITY) mx = fmaxf(mx, x);
        }
        float acc = 0.f, tot = 0.f;
        if (mx != -INFINITY) {
            for (int p = 0; p < m.z; p++) {
                const float x = pl[p * BLK + r];
                if (x == INFINITY) continue;
                const float w = __expf(x - mx);
                tot += w, acc += w * po[(int64_t)p * BLK * D + e];
            }
        }
        o[row0 * D + e] = from_float<T>(tot > 0.f ? acc / tot : 0.f);
        if (e % D == 0) lse[row0 + r] = tot > 0.f ? mx + logf(tot) : INFINITY;
    }
}

// A gradient's merge: the sum of the parts (fixed order: deterministic).
template <typename T>
__global__ void sa_sum_combine_kernel(const int *__restrict__ merges, const float *__restrict__ part,
                                      T *__restrict__ out, int B, int H, int nb, int BLK, int L, int D,
                                      int64_t slots) {
    const int4 m = reinterpret_cast<const int4 *>(merges)[blockIdx.x / B];
    const int b = blockIdx.x % B, h = m.x / nb, rb = m.x % nb;
    const int64_t row0 = ((int64_t)b * H + h) * L + (int64_t)rb * BLK;
    const float *pt = part_tile(part, b, slots, m.y, BLK, D);
    for (int e = threadIdx.x; e < BLK * D; e += blockDim.x) {
        float s = 0.f;
        for (int p = 0; p < m.z; p++) s += pt[(int64_t)p * BLK * D + e];
        out[row0 * D + e] = from_float<T>(s);
    }
}

template <typename T>
inline int launch_sum_combine(const dsc_sa_plan &plan, const float *part, void *out, int64_t B, int64_t H, int64_t L,
                              int64_t D, int block, cudaStream_t stream) {
    if (plan.n_merges == 0) return 0;
    sa_sum_combine_kernel<T><<<(unsigned)(plan.n_merges * B), 256, 0, stream>>>(
        plan.merges, part, static_cast<T *>(out), (int)B, (int)H, (int)(L / block), block, (int)L, (int)D,
        plan.slots);
    return launch_error();
}
} // namespace dsc_sa
