/* Multi-tensor apply: one launch runs an elementwise (or reducing) kernel over many tensors.
 *
 * The host cuts every tensor into chunks of kChunk elements and packs up to Meta<D>::kCap
 * tensors (their slot pointers, lengths and a running chunk count) into the kernel's own
 * parameter block (__grid_constant__, up to ~30 KB, so there is no device-side metadata to
 * allocate or copy). Block b finds its tensor by binary search over the running chunk count and
 * processes chunk b of it: 16-byte (fp32) or 8-byte (fp16/bf16) vector accesses when every slot
 * of that tensor is aligned, scalar ones otherwise and for the tail.
 *
 * A tensor longer than kMaxSeg elements is split into segments so lengths fit in 32 bits; a
 * segment keeps its tensor's index for per-tensor outputs. Empty tensors launch nothing.
 *
 * Layout of the kernels that include this (llm.c style): device helpers, then __global__
 * kernels, then the extern "C" launcher that takes the cudaStream_t. */
#ifndef DSC_MULTI_TENSOR_APPLY_CUH
#define DSC_MULTI_TENSOR_APPLY_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "device_guard.cuh"
#include "dsc/cuda_multi_tensor.h"

namespace dsc_mt {

using dsc_cuda::DeviceGuard;

constexpr int kBlock = 512;                  // threads per block
constexpr int kVec = 4;                      // elements per vector access
constexpr int kChunk = 16384;                // elements per block: 8 vector steps per thread
constexpr int64_t kMaxSeg = int64_t(1) << 30; // elements per segment (a multiple of kChunk)
constexpr int kMetaBudget = 30 * 1024;       // bytes of metadata per launch (limit: 32764 with args)

constexpr int capacity(int depth) { return (kMetaBudget - 8) / (depth * 8 + 12); }

// The per-launch table, passed by value as the kernel's parameter.
template <int D>
struct Meta {
    static constexpr int kCap = capacity(D);
    void *ptr[D][kCap];           // slot k of segment s (already offset to the segment start)
    int32_t len[kCap];            // elements in segment s
    int32_t tensor[kCap];         // index of segment s's tensor in the caller's table
    int32_t chunk_start[kCap + 1]; // chunks before segment s in this launch
    int32_t nseg;
};
static_assert(sizeof(Meta<1>) <= kMetaBudget && sizeof(Meta<5>) <= kMetaBudget, "metadata too large");
static_assert(kChunk % (kBlock * kVec) == 0 && kMaxSeg % kChunk == 0, "chunking");

struct NoOut {}; // marks an absent optional output slot

// --- device helpers -------------------------------------------------------------------------

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

template <typename T>
struct alignas(sizeof(T) * kVec) Pack {
    T v[kVec];
};

// W == kVec: one vector access (pointer aligned to sizeof(Pack<T>)); W == 1: one element.
template <int W, typename T>
__device__ __forceinline__ void load(const T *p, float (&out)[W]) {
    if constexpr (W == kVec) {
        const Pack<T> pk = *reinterpret_cast<const Pack<T> *>(p);
#pragma unroll
        for (int k = 0; k < W; k++) out[k] = to_f(pk.v[k]);
    } else {
#pragma unroll
        for (int k = 0; k < W; k++) out[k] = to_f(p[k]);
    }
}

template <int W, typename T>
__device__ __forceinline__ void store(T *p, const float (&in)[W]) {
    if constexpr (W == kVec) {
        Pack<T> pk;
#pragma unroll
        for (int k = 0; k < W; k++) pk.v[k] = from_f<T>(in[k]);
        *reinterpret_cast<Pack<T> *>(p) = pk;
    } else {
#pragma unroll
        for (int k = 0; k < W; k++) p[k] = from_f<T>(in[k]);
    }
}

template <typename T>
__device__ __forceinline__ bool vec_aligned(const void *p) {
    return (reinterpret_cast<uintptr_t>(p) % sizeof(Pack<T>)) == 0;
}

struct Where {
    int seg;     // segment in this launch
    int64_t off; // element offset of this block's chunk within the segment
    int n;       // elements in this chunk
};

template <int D>
__device__ __forceinline__ Where locate(const Meta<D> &m) {
    const int chunk = static_cast<int>(blockIdx.x);
    int lo = 0, hi = m.nseg - 1;
    while (lo < hi) { // last segment whose first chunk is <= this block's
        const int mid = (lo + hi + 1) >> 1;
        if (m.chunk_start[mid] <= chunk) lo = mid; else hi = mid - 1;
    }
    Where w;
    w.seg = lo;
    w.off = static_cast<int64_t>(chunk - m.chunk_start[lo]) * kChunk;
    const int64_t rem = m.len[lo] - w.off;
    w.n = rem < kChunk ? static_cast<int>(rem) : kChunk;
    return w;
}

template <typename T, int D>
__device__ __forceinline__ T *slot(const Meta<D> &m, int k, const Where &w) {
    return static_cast<T *>(m.ptr[k][w.seg]) + w.off;
}

// Calls body(Wc, Uc, i, stride) over the chunk, where Wc/Uc are std::integral_constant: the
// body handles U groups of W consecutive elements starting at i, i + stride, ... and should
// load all of them before storing any (two vector groups per thread keep more bytes in flight,
// which matters for kernels whose stores could alias their next loads). W == kVec at
// vector-aligned indices when `vec`; W == 1 for the rest. Consecutive threads touch
// consecutive vectors, so every warp access is coalesced.
template <class Body>
__device__ __forceinline__ void for_each_elem(int n, bool vec, Body &&body) {
    using V = std::integral_constant<int, kVec>;
    using One = std::integral_constant<int, 1>;
    using Two = std::integral_constant<int, 2>;
    int start = 0;
    if (vec) {
        constexpr int step = kBlock * kVec;
        const int nv = n & ~(kVec - 1);
        int i = static_cast<int>(threadIdx.x) * kVec;
        for (; i + step < nv; i += 2 * step) body(V{}, Two{}, i, step);
        for (; i < nv; i += step) body(V{}, One{}, i, step);
        start = nv;
    }
    for (int i = start + static_cast<int>(threadIdx.x); i < n; i += kBlock) body(One{}, One{}, i, kBlock);
}

// U groups of W elements from p + i, p + i + stride, ...
template <int U, int W, typename T>
__device__ __forceinline__ void load_u(const T *p, int i, int stride, float (&out)[U][W]) {
#pragma unroll
    for (int u = 0; u < U; u++) load<W>(p + i + u * stride, out[u]);
}

template <int U, int W, typename T>
__device__ __forceinline__ void store_u(T *p, int i, int stride, const float (&in)[U][W]) {
#pragma unroll
    for (int u = 0; u < U; u++) store<W>(p + i + u * stride, in[u]);
}

// Block-wide sums of N doubles; the result is valid in thread 0. One call per kernel (the
// shared scratch is not re-synchronised for a second call).
template <int N>
__device__ __forceinline__ void block_sum(double (&v)[N]) {
    __shared__ double partial[N][kBlock / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int k = 0; k < N; k++) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v[k] += __shfl_down_sync(0xffffffffu, v[k], o);
        if (lane == 0) partial[k][warp] = v[k];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int k = 0; k < N; k++) {
            v[k] = lane < kBlock / 32 ? partial[k][lane] : 0.0;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v[k] += __shfl_down_sync(0xffffffffu, v[k], o);
        }
    }
}

// --- host helpers ---------------------------------------------------------------------------

inline int itemsize(int dtype) { return dtype == DSC_CUDA_F32 ? 4 : 2; }

inline bool valid_dtype(int dtype) {
    return dtype == DSC_CUDA_F32 || dtype == DSC_CUDA_F16 || dtype == DSC_CUDA_BF16;
}


// Tensors sharing one dtype tuple (and the same optional slots present): one launch family.
struct Group {
    uint8_t dtype[DSC_MT_MAX_DEPTH];
    bool present[DSC_MT_MAX_DEPTH];
    std::vector<int64_t> idx;
};

// Groups the non-empty tensors of the table by dtype tuple over `depth` slots, keeping the
// order in which tuples first appear. Returns DSC_CUDA_EARG/EDTYPE on a malformed table.
inline int group_by_dtype(const dsc_mt_tensor *t, int64_t n, int depth, std::vector<Group> &groups) {
    if (n < 0 || n > INT32_MAX || (n > 0 && t == nullptr)) return DSC_CUDA_EARG;
    for (int64_t i = 0; i < n; i++) {
        if (t[i].numel < 0) return DSC_CUDA_EARG;
        if (t[i].numel == 0) continue;
        Group key{};
        for (int k = 0; k < depth; k++) {
            key.present[k] = t[i].ptr[k] != nullptr;
            key.dtype[k] = key.present[k] ? t[i].dtype[k] : 0;
            if (key.present[k] && !valid_dtype(key.dtype[k])) return DSC_CUDA_EDTYPE;
        }
        Group *hit = nullptr;
        for (Group &g : groups) {
            bool same = true;
            for (int k = 0; k < depth && same; k++)
                same = g.present[k] == key.present[k] && g.dtype[k] == key.dtype[k];
            if (same) { hit = &g; break; }
        }
        if (!hit) {
            groups.push_back(key);
            hit = &groups.back();
        }
        hit->idx.push_back(i);
    }
    return DSC_CUDA_OK;
}

// Packs the group's tensors into launches; launch(meta, nblocks) issues one and returns 0 or
// an error code (stops at the first error).
template <int D, class Launch>
int plan_launches(const dsc_mt_tensor *t, const std::vector<int64_t> &idx, Launch &&launch) {
    Meta<D> m;
    m.nseg = 0;
    m.chunk_start[0] = 0;
    for (const int64_t i : idx) {
        for (int64_t done = 0; done < t[i].numel;) {
            const int64_t len = t[i].numel - done < kMaxSeg ? t[i].numel - done : kMaxSeg;
            const int s = m.nseg;
            for (int k = 0; k < D; k++) {
                m.ptr[k][s] = t[i].ptr[k] == nullptr
                                  ? nullptr
                                  : static_cast<char *>(t[i].ptr[k]) + done * itemsize(t[i].dtype[k]);
            }
            m.len[s] = static_cast<int32_t>(len);
            m.tensor[s] = static_cast<int32_t>(i);
            m.chunk_start[s + 1] = m.chunk_start[s] + static_cast<int32_t>((len + kChunk - 1) / kChunk);
            m.nseg = s + 1;
            done += len;
            if (m.nseg == Meta<D>::kCap) {
                const int rc = launch(m, m.chunk_start[m.nseg]);
                if (rc != 0) return rc;
                m.nseg = 0;
            }
        }
    }
    return m.nseg > 0 ? launch(m, m.chunk_start[m.nseg]) : 0;
}

template <typename T>
struct Tag {
    using type = T;
};

// f(Tag<T>{}) for the element type of a dsc_cuda_dtype code.
template <class F>
int with_type(int dtype, F &&f) {
    switch (dtype) {
    case DSC_CUDA_F32: return f(Tag<float>{});
    case DSC_CUDA_F16: return f(Tag<__half>{});
    case DSC_CUDA_BF16: return f(Tag<__nv_bfloat16>{});
    default: return DSC_CUDA_EDTYPE;
    }
}

// Like with_type for the optional low-precision output slot: NoOut when absent.
template <class F>
int with_out_type(bool present, int dtype, F &&f) {
    if (!present) return f(Tag<NoOut>{});
    switch (dtype) {
    case DSC_CUDA_F16: return f(Tag<__half>{});
    case DSC_CUDA_BF16: return f(Tag<__nv_bfloat16>{});
    default: return DSC_CUDA_EDTYPE;
    }
}

inline int last_launch_error() { return static_cast<int>(cudaGetLastError()); }

} // namespace dsc_mt

#endif
