/* The MoE gating core on CUDA (contract: dsc/moe_gating_cuda.h; reference: csrc/core/moe_gating.c).
 *
 *   select     one warp per token: k successive warp argmaxes (ties to the lower expert id)
 *   counts     atomics into exp_counts
 *   plan       one block per expert scans the routes in the chosen order (block prefix sums):
 *              positional drops keep the first C; scored drops first find, by a 32-step bitwise
 *              search on order-preserving keys, the score threshold T with fewer than C routes
 *              above it, then keep every route above T and the earliest routes equal to it
 *   dispatch   one block per slot copies its token's row (16-byte vectors when aligned)
 *   combine    one block per token sums its kept routes' rows in fp32 (fp64 for double)
 *   route_dots one warp per route
 * Nothing here synchronises the device or allocates memory. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "dsc/moe_gating.h"
#include "dsc/moe_gating_cuda.h"
#include "device_guard.cuh"

namespace {

constexpr int kPlanThreads = 1024;
constexpr int kRowThreads = 256;

__device__ __forceinline__ bool ranks_above(float a, float b) { return a > b || (isnan(a) && !isnan(b)); }

/* ---- element access ---------------------------------------------------------------------- */
template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_acc(typename Acc<T>::type v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }

/* ---- select ---------------------------------------------------------------------------------- */
__global__ void select_kernel(const float *__restrict__ p, const float *__restrict__ q, int64_t S, int64_t E,
                              int64_t k, int64_t *__restrict__ idx) {
    const int lane = threadIdx.x & 31;
    const int64_t s = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    if (s >= S) return; /* whole warps leave together */
    int64_t *out = idx + s * k;
    for (int64_t r = 0; r < k; r++) {
        const float *row = (r == 0 || q == nullptr) ? p + s * E : q + s * E;
        float bv = 0.0f;
        int64_t be = -1;
        for (int64_t e = lane; e < E; e += 32) {
            bool taken = false;
            for (int64_t t = 0; t < r; t++) taken |= out[t] == e;
            if (taken) continue;
            const float v = row[e];
            if (be < 0 || ranks_above(v, bv)) {
                bv = v;
                be = e;
            }
        }
        for (int off = 16; off > 0; off >>= 1) {
            const float ov = __shfl_down_sync(0xffffffffu, bv, off);
            const long long oe = __shfl_down_sync(0xffffffffu, static_cast<long long>(be), off);
            if (oe >= 0 && (be < 0 || ranks_above(ov, bv) || (!ranks_above(bv, ov) && oe < be))) {
                bv = ov;
                be = oe;
            }
        }
        be = __shfl_sync(0xffffffffu, static_cast<long long>(be), 0);
        if (lane == 0) out[r] = be;
        __syncwarp(); /* lane 0's choice is visible to the warp before the next route excludes it */
    }
}

/* ---- counts ---------------------------------------------------------------------------------- */
__global__ void counts_kernel(const int64_t *__restrict__ idx, const uint8_t *__restrict__ used, int64_t S, int64_t k,
                              int64_t E, unsigned long long *__restrict__ counts) {
    const int64_t R = S * k;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < R;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        if (used && !used[i / k]) continue;
        const int64_t e = idx[i];
        if (e >= 0 && e < E) atomicAdd(counts + e, 1ull);
    }
}

/* ---- plan ------------------------------------------------------------------------------------ */
__device__ __forceinline__ uint32_t order_key(float f) {
    if (isnan(f)) return 0xffffffffu;
    uint32_t u = __float_as_uint(f == 0.0f ? 0.0f : f); /* -0 ranks with +0, as in the C reference */
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Exclusive prefix sum of v over the block; *total gets the block's sum. Every thread calls it. */
__device__ int block_exclusive_scan(int v, int *total) {
    __shared__ int warp_sums[kPlanThreads / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int x = v;
    for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = lane < nwarps ? warp_sums[lane] : 0;
        for (int off = 1; off < 32; off <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, off);
            if (lane >= off) w += y;
        }
        if (lane < nwarps) warp_sums[lane] = w; /* inclusive warp totals */
    }
    __syncthreads();
    const int before = (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
    *total = warp_sums[nwarps - 1];
    __syncthreads(); /* warp_sums is reused by the next call */
    return before;
}

struct RouteAt {
    int64_t S, k;
    int order;
    __device__ __forceinline__ int64_t operator()(int64_t p) const {
        if (order == DSC_MOE_TOKEN_MAJOR) return p;
        return (p % S) * k + p / S; /* route-major: position p is token p % S's route p / S */
    }
};

__global__ void __launch_bounds__(kPlanThreads)
plan_kernel(const int64_t *__restrict__ idx, const float *__restrict__ score, const uint8_t *__restrict__ used,
            int64_t S, int64_t k, int64_t capacity, int order, int64_t *__restrict__ route_slot,
            int64_t *__restrict__ slot_route) {
    const int64_t e = blockIdx.x, R = S * k;
    const RouteAt at{S, k, order};
    auto eligible = [&](int64_t route) { return idx[route] == e && (!used || used[route / k]); };
    /* how many routes this expert got */
    int64_t n = 0;
    for (int64_t base = 0; base < R; base += blockDim.x) {
        const int64_t p = base + threadIdx.x;
        n += __syncthreads_count(p < R && eligible(p));
    }
    const bool by_score = score != nullptr && n > capacity;
    uint32_t T = 0;
    int64_t ties_kept = 0;
    if (by_score) {
        /* the largest key T with at least `capacity` routes at or above it */
        for (int bit = 31; bit >= 0; bit--) {
            const uint32_t cand = T | (1u << bit);
            int64_t c = 0;
            for (int64_t base = 0; base < R; base += blockDim.x) {
                const int64_t p = base + threadIdx.x;
                c += __syncthreads_count(p < R && eligible(p) && order_key(score[p]) >= cand);
            }
            if (c >= capacity) T = cand;
        }
        int64_t above = 0;
        for (int64_t base = 0; base < R; base += blockDim.x) {
            const int64_t p = base + threadIdx.x;
            above += __syncthreads_count(p < R && eligible(p) && order_key(score[p]) > T);
        }
        ties_kept = capacity - above;
    }
    int64_t seen = 0, ties = 0, placed = 0;
    for (int64_t base = 0; base < R; base += blockDim.x) {
        const int64_t p = base + threadIdx.x;
        const int64_t route = p < R ? at(p) : 0;
        const bool mine = p < R && eligible(route);
        bool keep = false;
        int total;
        if (by_score) {
            const uint32_t key = mine ? order_key(score[route]) : 0;
            const bool tie = mine && key == T;
            const int tie_before = block_exclusive_scan(tie ? 1 : 0, &total);
            keep = mine && (key > T || (tie && ties + tie_before < ties_kept));
            ties += total;
        } else {
            const int before = block_exclusive_scan(mine ? 1 : 0, &total);
            keep = mine && seen + before < capacity;
            seen += total;
        }
        const int loc = block_exclusive_scan(keep ? 1 : 0, &total);
        if (keep) {
            const int64_t slot = e * capacity + placed + loc;
            route_slot[route] = slot;
            slot_route[slot] = route;
        }
        placed += total;
    }
}

/* ---- dispatch / combine / route dots ---------------------------------------------------------- */
template <typename T>
__global__ void dispatch_kernel(const T *__restrict__ x, int64_t M, const int64_t *__restrict__ slot_route, int64_t k,
                                const typename Acc<T>::type *__restrict__ w, T *__restrict__ out, bool vec16) {
    const int64_t j = blockIdx.x;
    const int64_t route = slot_route[j];
    T *dst = out + j * M;
    if (vec16 && w == nullptr) { /* whole 16-byte vectors: row bytes are a multiple of 16 and aligned */
        const int64_t nv = M * static_cast<int64_t>(sizeof(T)) / 16;
        uint4 *d = reinterpret_cast<uint4 *>(dst);
        if (route < 0) {
            for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) d[i] = make_uint4(0, 0, 0, 0);
        } else {
            const uint4 *src = reinterpret_cast<const uint4 *>(x + (route / k) * M);
            for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) d[i] = src[i];
        }
        return;
    }
    using A = typename Acc<T>::type;
    const A c = (route >= 0 && w) ? w[route] : A(1);
    for (int64_t m = threadIdx.x; m < M; m += blockDim.x) {
        dst[m] = route < 0 ? from_acc<T>(A(0)) : (w ? from_acc<T>(to_acc(x[(route / k) * M + m]) * c)
                                                      : x[(route / k) * M + m]);
    }
}

template <typename T>
__global__ void combine_kernel(const T *__restrict__ y, int64_t M, const int64_t *__restrict__ route_slot, int64_t k,
                               const typename Acc<T>::type *__restrict__ w, T *__restrict__ out, bool vec16) {
    using A = typename Acc<T>::type;
    const int64_t s = blockIdx.x;
    const int64_t *slots = route_slot + s * k;
    T *dst = out + s * M;
    constexpr int N = 16 / sizeof(T);
    if (vec16) {
        const int64_t nv = M / N;
        for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
            A acc[N];
#pragma unroll
            for (int t = 0; t < N; t++) acc[t] = A(0);
            for (int64_t r = 0; r < k; r++) {
                const int64_t slot = slots[r];
                if (slot < 0) continue;
                const A c = w ? w[s * k + r] : A(1);
                union { uint4 u; T v[N]; } in;
                in.u = reinterpret_cast<const uint4 *>(y + slot * M)[i];
#pragma unroll
                for (int t = 0; t < N; t++) acc[t] += to_acc(in.v[t]) * c;
            }
            union { uint4 u; T v[N]; } o;
#pragma unroll
            for (int t = 0; t < N; t++) o.v[t] = from_acc<T>(acc[t]);
            reinterpret_cast<uint4 *>(dst)[i] = o.u;
        }
        return;
    }
    for (int64_t m = threadIdx.x; m < M; m += blockDim.x) {
        A acc = A(0);
        for (int64_t r = 0; r < k; r++) {
            const int64_t slot = slots[r];
            if (slot < 0) continue;
            acc += to_acc(y[slot * M + m]) * (w ? w[s * k + r] : A(1));
        }
        dst[m] = from_acc<T>(acc);
    }
}

template <typename T>
__global__ void route_dots_kernel(const T *__restrict__ g, const T *__restrict__ y, int64_t S, int64_t M,
                                  const int64_t *__restrict__ route_slot, int64_t k,
                                  typename Acc<T>::type *__restrict__ out) {
    using A = typename Acc<T>::type;
    const int lane = threadIdx.x & 31;
    const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    if (i >= S * k) return;
    const int64_t slot = route_slot[i], s = i / k;
    A acc = A(0);
    if (slot >= 0)
        for (int64_t m = lane; m < M; m += 32) acc += to_acc(g[s * M + m]) * to_acc(y[slot * M + m]);
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) out[i] = acc;
}

bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T>
int rows_dispatch(const void *x, int64_t M, const int64_t *slot_route, int64_t nslots, int64_t k, const void *w,
                  void *out, cudaStream_t stream) {
    const bool vec = (M * static_cast<int64_t>(sizeof(T))) % 16 == 0 && aligned16(x) && aligned16(out);
    dispatch_kernel<T><<<static_cast<unsigned>(nslots), kRowThreads, 0, stream>>>(
        static_cast<const T *>(x), M, slot_route, k, static_cast<const typename Acc<T>::type *>(w),
        static_cast<T *>(out), vec);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int rows_combine(const void *y, int64_t M, const int64_t *route_slot, int64_t S, int64_t k, const void *w, void *out,
                 cudaStream_t stream) {
    const bool vec = (M * static_cast<int64_t>(sizeof(T))) % 16 == 0 && aligned16(y) && aligned16(out);
    combine_kernel<T><<<static_cast<unsigned>(S), kRowThreads, 0, stream>>>(
        static_cast<const T *>(y), M, route_slot, k, static_cast<const typename Acc<T>::type *>(w),
        static_cast<T *>(out), vec);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int rows_dots(const void *g, const void *y, int64_t S, int64_t M, const int64_t *route_slot, int64_t k, void *out,
              cudaStream_t stream) {
    const int64_t warps = S * k, per_block = kRowThreads / 32;
    route_dots_kernel<T><<<static_cast<unsigned>((warps + per_block - 1) / per_block), kRowThreads, 0, stream>>>(
        static_cast<const T *>(g), static_cast<const T *>(y), S, M, route_slot, k,
        static_cast<typename Acc<T>::type *>(out));
    return static_cast<int>(cudaGetLastError());
}

bool grid_ok(int64_t blocks) { return blocks >= 0 && blocks <= 0x7fffffffLL; }

}  // namespace

extern "C" int dsc_moe_select_cuda(const float *primary, const float *secondary, int64_t S, int64_t E, int64_t k,
                                   int64_t *idx, cudaStream_t stream) {
    if (!primary || !idx || S < 0 || E <= 0 || k <= 0 || k > E) return DSC_MOE_EINVAL;
    if (S == 0) return 0;
    const int64_t per_block = kRowThreads / 32, blocks = (S + per_block - 1) / per_block;
    if (!grid_ok(blocks)) return DSC_MOE_EINVAL;
    select_kernel<<<static_cast<unsigned>(blocks), kRowThreads, 0, stream>>>(primary, secondary, S, E, k, idx);
    return static_cast<int>(cudaGetLastError());
}

extern "C" int dsc_moe_counts_cuda(const int64_t *idx, const uint8_t *used, int64_t S, int64_t k, int64_t E,
                                   int64_t *counts, cudaStream_t stream) {
    if (!counts || S < 0 || k <= 0 || E <= 0) return DSC_MOE_EINVAL;
    cudaError_t err = cudaMemsetAsync(counts, 0, sizeof(int64_t) * static_cast<size_t>(E), stream);
    if (err != cudaSuccess || S == 0) return static_cast<int>(err);
    const int64_t R = S * k;
    const int64_t blocks = (R + kRowThreads - 1) / kRowThreads < 1024 ? (R + kRowThreads - 1) / kRowThreads : 1024;
    counts_kernel<<<static_cast<unsigned>(blocks), kRowThreads, 0, stream>>>(
        idx, used, S, k, E, reinterpret_cast<unsigned long long *>(counts));
    return static_cast<int>(cudaGetLastError());
}

extern "C" int dsc_moe_plan_cuda(const int64_t *idx, const float *score, const uint8_t *used, int64_t S, int64_t k,
                                 int64_t E, int64_t capacity, int order, int64_t *route_slot, int64_t *slot_route,
                                 cudaStream_t stream) {
    if (S < 0 || k <= 0 || E <= 0 || capacity < 0 || !grid_ok(E)) return DSC_MOE_EINVAL;
    if (order != DSC_MOE_TOKEN_MAJOR && order != DSC_MOE_ROUTE_MAJOR) return DSC_MOE_EINVAL;
    /* every route starts dropped and every slot empty (all bytes 0xff: -1); the blocks fill the kept */
    cudaError_t err = cudaMemsetAsync(route_slot, 0xff, sizeof(int64_t) * static_cast<size_t>(S * k), stream);
    if (err == cudaSuccess && E * capacity > 0)
        err = cudaMemsetAsync(slot_route, 0xff, sizeof(int64_t) * static_cast<size_t>(E * capacity), stream);
    if (err != cudaSuccess || S == 0 || capacity == 0) return static_cast<int>(err);
    plan_kernel<<<static_cast<unsigned>(E), kPlanThreads, 0, stream>>>(idx, score, used, S, k, capacity, order,
                                                                       route_slot, slot_route);
    return static_cast<int>(cudaGetLastError());
}

extern "C" int dsc_moe_dispatch_cuda(const void *x, int dtype, int64_t S, int64_t M, const int64_t *slot_route,
                                     int64_t nslots, int64_t k, const void *w, void *out, cudaStream_t stream) {
    (void)S;
    if (M < 0 || nslots < 0 || k <= 0 || !grid_ok(nslots)) return DSC_MOE_EINVAL;
    if (nslots == 0 || M == 0) return 0;
    switch (dtype) {
    case DSC_MOE_F32: return rows_dispatch<float>(x, M, slot_route, nslots, k, w, out, stream);
    case DSC_MOE_BF16: return rows_dispatch<__nv_bfloat16>(x, M, slot_route, nslots, k, w, out, stream);
    case DSC_MOE_F16: return rows_dispatch<__half>(x, M, slot_route, nslots, k, w, out, stream);
    case DSC_MOE_F64: return rows_dispatch<double>(x, M, slot_route, nslots, k, w, out, stream);
    default: return DSC_MOE_EINVAL;
    }
}

extern "C" int dsc_moe_combine_cuda(const void *y, int dtype, int64_t nslots, int64_t M, const int64_t *route_slot,
                                    int64_t S, int64_t k, const void *w, void *out, cudaStream_t stream) {
    (void)nslots;
    if (M < 0 || S < 0 || k <= 0 || !grid_ok(S)) return DSC_MOE_EINVAL;
    if (S == 0 || M == 0) return 0;
    switch (dtype) {
    case DSC_MOE_F32: return rows_combine<float>(y, M, route_slot, S, k, w, out, stream);
    case DSC_MOE_BF16: return rows_combine<__nv_bfloat16>(y, M, route_slot, S, k, w, out, stream);
    case DSC_MOE_F16: return rows_combine<__half>(y, M, route_slot, S, k, w, out, stream);
    case DSC_MOE_F64: return rows_combine<double>(y, M, route_slot, S, k, w, out, stream);
    default: return DSC_MOE_EINVAL;
    }
}

extern "C" int dsc_moe_route_dots_cuda(const void *g, const void *y, int dtype, int64_t S, int64_t M, int64_t nslots,
                                       const int64_t *route_slot, int64_t k, void *out, cudaStream_t stream) {
    (void)nslots;
    if (M < 0 || S < 0 || k <= 0) return DSC_MOE_EINVAL;
    if (S == 0) return 0;
    switch (dtype) {
    case DSC_MOE_F32: return rows_dots<float>(g, y, S, M, route_slot, k, out, stream);
    case DSC_MOE_BF16: return rows_dots<__nv_bfloat16>(g, y, S, M, route_slot, k, out, stream);
    case DSC_MOE_F16: return rows_dots<__half>(g, y, S, M, route_slot, k, out, stream);
    case DSC_MOE_F64: return rows_dots<double>(g, y, S, M, route_slot, k, out, stream);
    default: return DSC_MOE_EINVAL;
    }
}

extern "C" const char *dsc_moe_cuda_strerror(int code) {
    if (code == DSC_MOE_EINVAL) return "invalid sizes";
    return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : "unknown deepspeed_c MoE error";
}

DSC_CUDA_ENTER_LEAVE(dsc_moe)
