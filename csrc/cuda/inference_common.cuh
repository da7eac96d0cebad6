// Shared pieces of the inference kernels: dtype loads/stores in float32, warp and block
// reductions, the device guard and the dtype dispatch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "device_guard.cuh"
#include "dsc/inference_cuda.h"

namespace dsc_inf {

using dsc_cuda::DeviceGuard;

__device__ __forceinline__ float load(const float *p) { return *p; }
__device__ __forceinline__ float load(const __half *p) { return __half2float(*p); }
__device__ __forceinline__ float load(const __nv_bfloat16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store(float *p, float v) { *p = v; }
__device__ __forceinline__ void store(__half *p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }

template <typename T> __device__ __forceinline__ float round_to(float v) {
    T t;
    store(&t, v);
    return load(&t);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float *scratch32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch32[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch32[lane] : 0.f;
    return warp_sum(v);
}


inline int launch_error() { return static_cast<int>(cudaGetLastError()); }

// Dynamic shared memory past the default 48 KiB (static shared memory counts too) needs the
// kernel's opt-in; Hopper allows up to 227 KiB a block.
template <typename K> int allow_smem(K kernel, size_t dynamic_bytes, size_t static_bytes) {
    if (dynamic_bytes + static_bytes <= 48 * 1024) return 0;
    return static_cast<int>(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dynamic_bytes)));
}

// Calls f with a null pointer of the element type of `dtype` (a tag), or returns EDTYPE.
template <typename F> int dispatch(int dtype, F &&f) {
    switch (dtype) {
    case DSC_CUDA_F32: return f(static_cast<float *>(nullptr));
    case DSC_CUDA_F16: return f(static_cast<__half *>(nullptr));
    case DSC_CUDA_BF16: return f(static_cast<__nv_bfloat16 *>(nullptr));
    default: return DSC_CUDA_EDTYPE;
    }
}

inline unsigned grid_for(int64_t n, int threads, int64_t cap = 65535 * 8) {
    int64_t g = (n + threads - 1) / threads;
    if (g < 1) g = 1;
    return static_cast<unsigned>(g < cap ? g : cap);
}

} // namespace dsc_inf
