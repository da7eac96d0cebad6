// Chunked loads and stores of the transformer layer's kernels: a chunk is V consecutive elements
// read or written in one instruction (16 bytes for the vectorised path: 8 bf16/fp16 or 4 float;
// V = 1 for the fallback when a row's length or a pointer's alignment forbids it), converted
// to float32 in registers. A kernel instantiates both and the launcher picks one.
#pragma once

#include "inference_common.cuh"

namespace dsc_tf {
using namespace dsc_inf;

template <typename T, int V> struct alignas(sizeof(T) * V) Chunk { T e[V]; };
template <int V> struct alignas(V) KeepChunk { uint8_t e[V]; };

// Elements per 16-byte chunk.
template <typename T> constexpr int vec_width() { return 16 / (int)sizeof(T); }

template <typename T, int V> __device__ __forceinline__ void load_chunk(const T *p, float (&out)[V]) {
    const Chunk<T, V> c = *reinterpret_cast<const Chunk<T, V> *>(p);
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = load(&c.e[i]);
}

template <typename T, int V> __device__ __forceinline__ void store_chunk(T *p, const float (&in)[V]) {
    Chunk<T, V> c;
#pragma unroll
    for (int i = 0; i < V; ++i) store(&c.e[i], in[i]);
    *reinterpret_cast<Chunk<T, V> *>(p) = c;
}

template <int V> __device__ __forceinline__ void load_keep(const uint8_t *p, float scale, float (&out)[V]) {
    const KeepChunk<V> c = *reinterpret_cast<const KeepChunk<V> *>(p);
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = c.e[i] ? scale : 0.f;
}

// Sums of two values over the block (blockDim.x a multiple of 32); every thread gets both.
__device__ __forceinline__ void block_sum2(float &a, float &b, float2 *scratch32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
    }
    if (nwarps == 1) return;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch32[warp] = make_float2(a, b);
    __syncthreads();
    const float2 v = lane < nwarps ? scratch32[lane] : make_float2(0.f, 0.f);
    a = v.x;
    b = v.y;
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
    }
}

inline bool aligned(const void *p, size_t bytes) {
    return p == nullptr || (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

inline int round_up32(int64_t n) { return (int)((n + 31) / 32 * 32); }

// Streaming multiprocessors of the current device (sizes the grids that walk rows).
inline int sm_count() {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
        return 108;
    return n > 0 ? n : 108;
}

} // namespace dsc_tf
