/* Fused fake quantization on CUDA (contract: dsc/compress_quant.h; reference: csrc/cpu/compress_quant.c, which
 * these kernels match bit for bit). Every intermediate goes through the same IEEE operations (the __f*_rn
 * intrinsics, which nvcc never contracts into FMAs) and the same rounding to the storage dtype.
 *
 *   ranges     grid (blocks, groups): each block reduces a strided share of its group (vectors of 4 where the
 *              group length allows), warp shuffles then shared memory, then one atomicMin / atomicMax per block
 *              on order-preserving integer keys of the floats (symmetric: the bits of |x|, which order like
 *              the values), into stream-ordered scratch from a pool of our own
 *   params     one thread per group: scale, 1/scale, zero point from the keys (or the given range)
 *   apply      grid-stride over the elements, 4 per thread per iteration where the group length is a
 *              multiple of 4 (16-byte fp32 loads and stores)
 *   groups of at most 4096 elements skip the three steps: one block per group keeps it in registers
 *              (16-byte loads and stores where the group length and alignment allow)
 * Two reads and one write per element: at 2^28 elements a pass streams from HBM like a copy does. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <mutex>

#include "dsc/compress_quant.h"
#include "dsc/compress_quant_cuda.h"
#include "device_guard.cuh"

namespace {

constexpr int kThreads = 256;

template <typename T> struct Io;
template <> struct Io<float> {
    static __device__ __forceinline__ float ld(const float *p, int64_t i) { return p[i]; }
    static __device__ __forceinline__ void put(float *p, int64_t i, float v) { p[i] = v; }
    static __device__ __forceinline__ float st(float v) { return v; }
};
template <> struct Io<__half> {
    static __device__ __forceinline__ float ld(const __half *p, int64_t i) { return __half2float(p[i]); }
    static __device__ __forceinline__ void put(__half *p, int64_t i, float v) { p[i] = __float2half_rn(v); }
    static __device__ __forceinline__ float st(float v) { return __half2float(__float2half_rn(v)); }
};
template <> struct Io<__nv_bfloat16> {
    static __device__ __forceinline__ float ld(const __nv_bfloat16 *p, int64_t i) { return __bfloat162float(p[i]); }
    static __device__ __forceinline__ void put(__nv_bfloat16 *p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }
    static __device__ __forceinline__ float st(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
};

__device__ __forceinline__ unsigned int order_key(float f) {
    const unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float from_key(unsigned int k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

/* One element into a thread's running range: min / max order keys (asym), or the largest |x| bits (sym). */
__device__ __forceinline__ void take_key(float v, int asym, unsigned int &kmin, unsigned int &kmax) {
    if (asym) {
        const unsigned int k = order_key(v);
        kmin = k < kmin ? k : kmin;
        kmax = k > kmax ? k : kmax;
    } else {
        const unsigned int b = __float_as_uint(v) & 0x7fffffffu;
        kmax = b > kmax ? b : kmax;
    }
}

/* The block's range: warp shuffles, then the warps' partials through smin / smax. Only thread 0's kmin / kmax
 * hold the block's result. Ends with the block synchronised, so the slots may be reused at once. */
__device__ __forceinline__ void block_keys(unsigned int &kmin, unsigned int &kmax, unsigned int *smin,
                                           unsigned int *smax) {
    for (int off = 16; off > 0; off >>= 1) {
        const unsigned int a = __shfl_xor_sync(0xffffffffu, kmin, off), b = __shfl_xor_sync(0xffffffffu, kmax, off);
        kmin = a < kmin ? a : kmin;
        kmax = b > kmax ? b : kmax;
    }
    if ((threadIdx.x & 31) == 0) {
        smin[threadIdx.x >> 5] = kmin;
        smax[threadIdx.x >> 5] = kmax;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < kThreads / 32; w++) {
            kmin = smin[w] < kmin ? smin[w] : kmin;
            kmax = smax[w] > kmax ? smax[w] : kmax;
        }
    }
    __syncthreads();
}

/* x[i] of a group as floats: element i of T, or the 4 floats of float4 i (the 16-byte path of fp32) */
template <typename T> struct Elems {
    static constexpr int kWidth = 1;
    static __device__ __forceinline__ void get(const T *src, int64_t i, float *e) { e[0] = Io<T>::ld(src, i); }
};
template <> struct Elems<float4> {
    static constexpr int kWidth = 4;
    static __device__ __forceinline__ void get(const float4 *src, int64_t i, float *e) {
        const float4 v = src[i];
        e[0] = v.x, e[1] = v.y, e[2] = v.z, e[3] = v.w;
    }
};

/* keys[g] = min key, keys[groups + g] = max key (asym), or keys[groups + g] = bits of amax (sym), for the group
 * g = blockIdx.y (the launcher covers more than 65535 groups in several launches); n counts loads (elements, or
 * float4s) per group. One group per block row: with a loop over groups around it, the one-group pass ran at
 * 0.84 of copy instead of 0.88 on an H200. */
template <typename T>
__global__ void ranges_kernel(const T *__restrict__ x, int64_t n, int64_t groups, int asym, unsigned int *keys) {
    __shared__ unsigned int smin[kThreads / 32], smax[kThreads / 32];
    const int64_t g = blockIdx.y;
    const T *src = x + g * n;
    unsigned int kmin = 0xffffffffu, kmax = 0u;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float e[Elems<T>::kWidth];
        Elems<T>::get(src, i, e);
#pragma unroll
        for (int j = 0; j < Elems<T>::kWidth; j++) take_key(e[j], asym, kmin, kmax);
    }
    block_keys(kmin, kmax, smin, smax);
    if (threadIdx.x == 0) {
        if (asym) atomicMin(&keys[g], kmin);
        atomicMax(&keys[groups + g], kmax);
    }
}

struct Params {
    float s, inv, zp;
};

/* scale, its reciprocal and the zero point of a group whose range is [vlo, vhi] (sym: vhi = amax) */
template <typename T>
__device__ __forceinline__ Params make_params(float vlo, float vhi, float q, int asym, int recip) {
    Params p;
    p.s = asym ? Io<T>::st(__fdiv_rn(Io<T>::st(__fsub_rn(vhi, vlo)), q))
               : Io<T>::st(__fdiv_rn(Io<T>::st(__fmul_rn(2.0f, vhi)), q));
    p.inv = __fdiv_rn(1.0f, p.s);
    p.zp = 0.0f;
    if (asym) {
        const float d = Io<T>::st(recip ? __fmul_rn(vlo, p.inv) : __fdiv_rn(vlo, p.s));
        p.zp = Io<T>::st(__fmul_rn(rintf(d), p.s));
    }
    return p;
}

/* the range [vlo, vhi] the keys of ranges_kernel / block_keys stand for */
__device__ __forceinline__ void keys_range(unsigned int kmin, unsigned int kmax, int asym, float &vlo, float &vhi) {
    vhi = asym ? from_key(kmax) : __uint_as_float(kmax);
    vlo = asym ? from_key(kmin) : vhi;
}

template <typename T>
__global__ void params_kernel(const unsigned int *keys, const float *lo, const float *hi, int64_t groups, int bits,
                              int asym, int recip, Params *out) {
    const int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= groups) return;
    float vlo, vhi;
    if (lo) {
        vlo = lo[g];
        vhi = hi[g];
    } else {
        keys_range(keys[g], keys[groups + g], asym, vlo, vhi);
    }
    out[g] = make_params<T>(vlo, vhi, (float)(1 << bits), asym, recip);
}

template <typename T>
__device__ __forceinline__ float quant_one(float v, const Params &p, float qlo, float qhi, int asym, int recip,
                                           uint64_t seed, int64_t i) {
    const float a = asym ? Io<T>::st(__fsub_rn(v, p.zp)) : v;
    float r = Io<T>::st(recip ? __fmul_rn(a, p.inv) : __fdiv_rn(a, p.s));
    if (seed) r = Io<T>::st(__fadd_rn(r, Io<T>::st(dsc_cq_noise(seed, (uint64_t)i))));
    r = rintf(r);
    r = r < qlo ? qlo : r;
    r = r > qhi ? qhi : r;
    float o = Io<T>::st(__fmul_rn(r, p.s));
    if (asym) o = Io<T>::st(__fadd_rn(o, p.zp));
    return o;
}

template <typename T>
__global__ void apply_kernel(const T *__restrict__ x, T *__restrict__ out, int64_t total, int64_t n,
                             const Params *__restrict__ params, float qlo, float qhi, int asym, int recip,
                             uint64_t seed) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const Params p = params[n == total ? 0 : i / n];
        Io<T>::put(out, i, quant_one<T>(Io<T>::ld(x, i), p, qlo, qhi, asym, recip, seed, i));
    }
}

__global__ void apply_kernel_f32x4(const float4 *__restrict__ x, float4 *__restrict__ out, int64_t total4, int64_t n4,
                                   const Params *__restrict__ params, float qlo, float qhi, int asym, uint64_t seed) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total4; i += stride) {
        const Params p = params[n4 == total4 ? 0 : i / n4];
        const float4 v = x[i];
        float4 o;
        o.x = quant_one<float>(v.x, p, qlo, qhi, asym, 0, seed, 4 * i);
        o.y = quant_one<float>(v.y, p, qlo, qhi, asym, 0, seed, 4 * i + 1);
        o.z = quant_one<float>(v.z, p, qlo, qhi, asym, 0, seed, 4 * i + 2);
        o.w = quant_one<float>(v.w, p, qlo, qhi, asym, 0, seed, 4 * i + 3);
        out[i] = o;
    }
}

/* Small groups (n <= kGroupMax): one block per group holds the group in registers between the range and the
 * quantization, so x is read once (per-token activations, fine weight groups). Every thread folds the warps'
 * partials and derives the group's parameters itself: one barrier per group instead of a serial fold by
 * thread 0 and a second barrier to publish its result (0.58 -> 0.98 of copy at 4096-element groups, fp32 on an
 * H200, with the 16-byte loads below). The partials are double-buffered by group parity, so a block that loops
 * over groups never overwrites slots a slower warp still reads. */
constexpr int kGroupThreads = 128;
constexpr int kGroupPerThread = 32;  // elements a thread holds: groups up to 128 x 32 = 4096 elements
constexpr int64_t kGroupMax = (int64_t)kGroupThreads * kGroupPerThread;

/* the group's range from every warp's partial, folded by every thread (after the one barrier) */
__device__ __forceinline__ void group_keys(unsigned int &kmin, unsigned int &kmax, unsigned int (*smin)[kGroupThreads / 32],
                                           unsigned int (*smax)[kGroupThreads / 32], int par) {
    for (int off = 16; off > 0; off >>= 1) {
        const unsigned int a = __shfl_xor_sync(0xffffffffu, kmin, off), b = __shfl_xor_sync(0xffffffffu, kmax, off);
        kmin = a < kmin ? a : kmin;
        kmax = b > kmax ? b : kmax;
    }
    if ((threadIdx.x & 31) == 0) {
        smin[par][threadIdx.x >> 5] = kmin;
        smax[par][threadIdx.x >> 5] = kmax;
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kGroupThreads / 32; w++) {
        kmin = smin[par][w] < kmin ? smin[par][w] : kmin;
        kmax = smax[par][w] > kmax ? smax[par][w] : kmax;
    }
}

/* the group's scale / zero point from the threads' partial keys (group_keys' one barrier included) */
template <typename T>
__device__ __forceinline__ Params group_params(unsigned int kmin, unsigned int kmax,
                                               unsigned int (*smin)[kGroupThreads / 32],
                                               unsigned int (*smax)[kGroupThreads / 32], int par, float q, int asym,
                                               int recip) {
    group_keys(kmin, kmax, smin, smax, par);
    float vlo, vhi;
    keys_range(kmin, kmax, asym, vlo, vhi);
    return make_params<T>(vlo, vhi, q, asym, recip);
}

/* 16 bytes of T as floats and back, in registers: 4 floats, or 8 halves / bfloat16s (two to a 32-bit word;
 * each rounded to T as Io<T>::put rounds it) */
template <typename T> struct Vec16;
template <> struct Vec16<float> {
    static constexpr int kN = 4;
    using Raw = float4;
    static __device__ __forceinline__ void unpack(const float4 &r, float *f) { f[0] = r.x, f[1] = r.y, f[2] = r.z, f[3] = r.w; }
    static __device__ __forceinline__ float4 pack(const float *f) { return make_float4(f[0], f[1], f[2], f[3]); }
};
template <typename H> struct Vec16Half {
    static constexpr int kN = 8;
    using Raw = uint4;
    static __device__ __forceinline__ void unpack(const uint4 &r, float *f) {
        const unsigned int w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            f[2 * i] = Vec16<H>::half_to_float((unsigned short)(w[i] & 0xffffu));
            f[2 * i + 1] = Vec16<H>::half_to_float((unsigned short)(w[i] >> 16));
        }
    }
    static __device__ __forceinline__ uint4 pack(const float *f) {
        unsigned int w[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            w[i] = (unsigned int)Vec16<H>::float_to_half(f[2 * i]) |
                   ((unsigned int)Vec16<H>::float_to_half(f[2 * i + 1]) << 16);
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
};
template <> struct Vec16<__half> : Vec16Half<__half> {
    static __device__ __forceinline__ float half_to_float(unsigned short h) { return __half2float(__ushort_as_half(h)); }
    static __device__ __forceinline__ unsigned short float_to_half(float f) { return __half_as_ushort(__float2half_rn(f)); }
};
template <> struct Vec16<__nv_bfloat16> : Vec16Half<__nv_bfloat16> {
    static __device__ __forceinline__ float half_to_float(unsigned short h) {
        return __bfloat162float(__ushort_as_bfloat16(h));
    }
    static __device__ __forceinline__ unsigned short float_to_half(float f) {
        return __bfloat16_as_ushort(__float2bfloat16_rn(f));
    }
};

/* vectorised: n % Vec16<T>::kN == 0 and x, out 16-byte aligned; np counts 16-byte vectors per group. recip
 * is a template argument: the CUDA path divides (recip = 0) unless a caller asks for torch's CPU form. */
template <typename T, bool kRecip>
__global__ __launch_bounds__(kGroupThreads) void group_vec_kernel(const typename Vec16<T>::Raw *__restrict__ x,
                                                                typename Vec16<T>::Raw *__restrict__ out,
                                                                int64_t groups, int64_t np, int bits, int asym,
                                                                uint64_t seed) {
    using V = Vec16<T>;
    constexpr int kN = V::kN, kV = kGroupPerThread / kN;
    __shared__ unsigned int smin[2][kGroupThreads / 32], smax[2][kGroupThreads / 32];
    const float q = (float)(1 << bits);
    const float qlo = asym ? 0.0f : -q / 2, qhi = asym ? q - 1 : q / 2 - 1;
    int par = 0;
    for (int64_t g = blockIdx.x; g < groups; g += gridDim.x, par ^= 1) {
        const int64_t base = g * np;
        /* every load is issued before the first value is used: folded into the range one by one, each load
         * would wait for the one before it */
        typename V::Raw raw[kV];
#pragma unroll
        for (int j = 0; j < kV; j++) {
            const int64_t k = threadIdx.x + (int64_t)j * kGroupThreads;
            if (k < np) raw[j] = __ldcs(x + base + k);
        }
        float v[kV * kN];
        unsigned int kmin = 0xffffffffu, kmax = 0u;
#pragma unroll
        for (int j = 0; j < kV; j++) {
            if (threadIdx.x + (int64_t)j * kGroupThreads < np) {
                V::unpack(raw[j], v + j * kN);
#pragma unroll
                for (int e = 0; e < kN; e++) take_key(v[j * kN + e], asym, kmin, kmax);
            }
        }
        const Params p = group_params<T>(kmin, kmax, smin, smax, par, q, asym, kRecip);
#pragma unroll
        for (int j = 0; j < kV; j++) {
            const int64_t k = threadIdx.x + (int64_t)j * kGroupThreads;
            if (k < np) {
                float o[kN];
#pragma unroll
                for (int e = 0; e < kN; e++)
                    o[e] = quant_one<T>(v[j * kN + e], p, qlo, qhi, asym, kRecip, seed, (base + k) * kN + e);
                __stcs(out + base + k, V::pack(o));
            }
        }
    }
}

/* any group length up to kGroupMax, element by element */
template <typename T>
__global__ __launch_bounds__(kGroupThreads) void group_kernel(const T *__restrict__ x, T *__restrict__ out,
                                                            int64_t groups, int64_t n, int bits, int asym, int recip,
                                                            uint64_t seed) {
    __shared__ unsigned int smin[2][kGroupThreads / 32], smax[2][kGroupThreads / 32];
    const float q = (float)(1 << bits);
    const float qlo = asym ? 0.0f : -q / 2, qhi = asym ? q - 1 : q / 2 - 1;
    int par = 0;
    for (int64_t g = blockIdx.x; g < groups; g += gridDim.x, par ^= 1) {
        const int64_t base = g * n;
        float v[kGroupPerThread];
        unsigned int kmin = 0xffffffffu, kmax = 0u;
#pragma unroll
        for (int j = 0; j < kGroupPerThread; j++) {  // all loads first, as above
            const int64_t k = threadIdx.x + (int64_t)j * kGroupThreads;
            v[j] = k < n ? Io<T>::ld(x, base + k) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kGroupPerThread; j++)
            if (threadIdx.x + (int64_t)j * kGroupThreads < n) take_key(v[j], asym, kmin, kmax);
        const Params p = group_params<T>(kmin, kmax, smin, smax, par, q, asym, recip);
#pragma unroll
        for (int j = 0; j < kGroupPerThread; j++) {
            const int64_t k = threadIdx.x + (int64_t)j * kGroupThreads;
            if (k < n) Io<T>::put(out, base + k, quant_one<T>(v[j], p, qlo, qhi, asym, recip, seed, base + k));
        }
    }
}

template <typename T>
__global__ void ternary_kernel(const T *__restrict__ x, T *__restrict__ out, int64_t total, int64_t n,
                               const float *thres, const float *alpha) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int64_t g = i / n;
        const float v = Io<T>::ld(x, i), t = thres[g], a = alpha[g];
        const float pos = v > t ? 1.0f : 0.0f, neg = v < -t ? 1.0f : 0.0f;
        Io<T>::put(out, i, Io<T>::st(__fsub_rn(Io<T>::st(__fmul_rn(a, pos)), Io<T>::st(__fmul_rn(a, neg)))));
    }
}

template <typename T>
__global__ void binary_kernel(const T *__restrict__ x, T *__restrict__ out, int64_t total, int64_t n, const float *m) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const float v = Io<T>::ld(x, i);
        const float sign = v > 0 ? 1.0f : (v < 0 ? -1.0f : (v != v ? v : 0.0f));
        Io<T>::put(out, i, Io<T>::st(__fmul_rn(sign, m[i / n])));
    }
}

/* Scratch of the two-pass path (range keys, parameters: 16 B a group) comes from a pool of our own per device
 * that keeps up to kScratchKeep bytes between calls. From the device's default pool (release threshold 0) each
 * call's few bytes were mapped and unmapped around every synchronisation: ~40 us of a 0.9 ms pass at 2^28
 * elements on an H200. The pools live as long as the process, as CUDA's default pool does. */
constexpr int kMaxDevices = 64;
constexpr uint64_t kScratchKeep = 4u << 20;

cudaError_t scratch_pool(int dev, cudaMemPool_t *pool) {
    static std::mutex lock;
    static cudaMemPool_t pools[kMaxDevices] = {};
    if (dev < 0 || dev >= kMaxDevices) return cudaErrorInvalidDevice;
    std::lock_guard<std::mutex> hold(lock);
    if (!pools[dev]) {
        cudaMemPoolProps props = {};
        props.allocType = cudaMemAllocationTypePinned;
        props.location.type = cudaMemLocationTypeDevice;
        props.location.id = dev;
        cudaMemPool_t made = nullptr;
        cudaError_t err = cudaMemPoolCreate(&made, &props);
        if (err != cudaSuccess) return err;
        uint64_t keep = kScratchKeep;
        err = cudaMemPoolSetAttribute(made, cudaMemPoolAttrReleaseThreshold, &keep);
        if (err != cudaSuccess) {
            (void)cudaMemPoolDestroy(made);
            return err;
        }
        pools[dev] = made;
    }
    *pool = pools[dev];
    return cudaSuccess;
}

cudaError_t scratch_alloc(void **ptr, size_t bytes, cudaStream_t stream) {
    int dev = 0;
    cudaMemPool_t pool = nullptr;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaSuccess) err = scratch_pool(dev, &pool);
    if (err != cudaSuccess) return err;
    return cudaMallocFromPoolAsync(ptr, bytes, pool, stream);
}

int grid_for(int64_t work) {
    int dev = 0, sms = 132;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const int64_t want = (work + kThreads - 1) / kThreads;
    const int64_t cap = (int64_t)sms * 8;
    return (int)(want < cap ? (want > 0 ? want : 1) : cap);
}

template <typename T>
int fake_quant_t(const T *x, T *out, int64_t groups, int64_t n, int bits, int asym, const float *lo, const float *hi,
                 int recip, uint64_t seed, cudaStream_t stream) {
    const int64_t total = groups * n;
    if (!lo && n <= kGroupMax) {
        const unsigned int blocks = (unsigned int)(groups < 65535 * 8 ? groups : 65535 * 8);
        constexpr int kN = Vec16<T>::kN;
        using Raw = typename Vec16<T>::Raw;
        const bool vec = n % kN == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0 &&
                         (reinterpret_cast<uintptr_t>(out) & 15) == 0;
        const Raw *xv = reinterpret_cast<const Raw *>(x);
        Raw *ov = reinterpret_cast<Raw *>(out);
        if (vec && recip)
            group_vec_kernel<T, true><<<blocks, kGroupThreads, 0, stream>>>(xv, ov, groups, n / kN, bits, asym, seed);
        else if (vec)
            group_vec_kernel<T, false><<<blocks, kGroupThreads, 0, stream>>>(xv, ov, groups, n / kN, bits, asym, seed);
        else
            group_kernel<T><<<blocks, kGroupThreads, 0, stream>>>(x, out, groups, n, bits, asym, recip, seed);
        return static_cast<int>(cudaGetLastError());
    }
    unsigned int *keys = nullptr;
    Params *params = nullptr;
    cudaError_t err = scratch_alloc(reinterpret_cast<void **>(&keys),
                                    sizeof(unsigned int) * 2 * groups + sizeof(Params) * groups + 16, stream);
    if (err != cudaSuccess) return static_cast<int>(err);
    params = reinterpret_cast<Params *>(keys + 2 * groups + ((2 * groups) & 1));
    if (!lo) {
        err = cudaMemsetAsync(keys, 0xff, sizeof(unsigned int) * groups, stream);
        if (err == cudaSuccess) err = cudaMemsetAsync(keys + groups, 0, sizeof(unsigned int) * groups, stream);
        const bool vec = sizeof(T) == 4 && n % 4 == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0;
        const int64_t per_group = vec ? n / 4 : n;
        int64_t bx = grid_for(total / (vec ? 4 : 1)) / (groups > 0 ? groups : 1);
        const int64_t need = (per_group + kThreads - 1) / kThreads;
        bx = bx < 1 ? 1 : (bx > need ? need : bx);
        for (int64_t g0 = 0; err == cudaSuccess && g0 < groups; g0 += 65535) {
            const int64_t rows = groups - g0 < 65535 ? groups - g0 : 65535;
            const dim3 grid((unsigned int)bx, (unsigned int)rows);
            /* keys of this launch's first group: its min keys at keys + g0, its max keys `groups` further on */
            if (vec)
                ranges_kernel<float4><<<grid, kThreads, 0, stream>>>(reinterpret_cast<const float4 *>(x) + g0 * per_group,
                                                                     per_group, groups, asym, keys + g0);
            else
                ranges_kernel<T><<<grid, kThreads, 0, stream>>>(x + g0 * n, n, groups, asym, keys + g0);
        }
    }
    if (err == cudaSuccess) {
        params_kernel<T><<<(unsigned int)((groups + 127) / 128), 128, 0, stream>>>(keys, lo, hi, groups, bits, asym,
                                                                                  recip, params);
        const float q = (float)(1 << bits);
        const float qlo = asym ? 0.0f : -q / 2, qhi = asym ? q - 1 : q / 2 - 1;
        const bool vec = sizeof(T) == 4 && n % 4 == 0 && !recip && (reinterpret_cast<uintptr_t>(x) & 15) == 0 &&
                         (reinterpret_cast<uintptr_t>(out) & 15) == 0;
        if (vec)
            apply_kernel_f32x4<<<grid_for(total / 4), kThreads, 0, stream>>>(
                reinterpret_cast<const float4 *>(x), reinterpret_cast<float4 *>(out), total / 4, n / 4, params, qlo,
                qhi, asym, seed);
        else
            apply_kernel<T><<<grid_for(total), kThreads, 0, stream>>>(x, out, total, n, params, qlo, qhi, asym, recip,
                                                                     seed);
        err = cudaGetLastError();
    }
    const cudaError_t freed = cudaFreeAsync(keys, stream);  // stream-ordered: after the kernels above
    return static_cast<int>(err != cudaSuccess ? err : freed);
}

}  // namespace

#define DISPATCH(dtype, FN, ...)                                                                               \
    ((dtype) == DSC_CQ_F32    ? FN<float>(__VA_ARGS__)                                                         \
     : (dtype) == DSC_CQ_F16  ? FN<__half>(__VA_ARGS__)                                                        \
                              : FN<__nv_bfloat16>(__VA_ARGS__))

template <typename T>
static int fake_quant_any(const void *x, void *out, int64_t groups, int64_t n, int bits, int asym, const float *lo,
                          const float *hi, int recip, uint64_t seed, cudaStream_t stream) {
    return fake_quant_t<T>(static_cast<const T *>(x), static_cast<T *>(out), groups, n, bits, asym, lo, hi, recip,
                           seed, stream);
}

template <typename T>
static int ternary_any(const void *x, void *out, int64_t groups, int64_t n, const float *thres, const float *alpha,
                       cudaStream_t stream) {
    ternary_kernel<T><<<grid_for(groups * n), kThreads, 0, stream>>>(static_cast<const T *>(x), static_cast<T *>(out),
                                                                     groups * n, n, thres, alpha);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
static int binary_any(const void *x, void *out, int64_t groups, int64_t n, const float *m, cudaStream_t stream) {
    binary_kernel<T><<<grid_for(groups * n), kThreads, 0, stream>>>(static_cast<const T *>(x), static_cast<T *>(out),
                                                                    groups * n, n, m);
    return static_cast<int>(cudaGetLastError());
}

extern "C" int dsc_cq_fake_quant_cuda(const void *x, void *out, int dtype, int64_t groups, int64_t n, int bits,
                                      int asym, const float *lo, const float *hi, int recip, uint64_t seed,
                                      cudaStream_t stream) {
    if (!x || !out || dsc_cq_check(groups, n, bits, dtype) != DSC_CQ_OK || (!lo) != (!hi))
        return DSC_CQ_EINVAL;
    return DISPATCH(dtype, fake_quant_any, x, out, groups, n, bits, asym, lo, hi, recip, seed, stream);
}

extern "C" int dsc_cq_ternary_cuda(const void *x, void *out, int dtype, int64_t groups, int64_t n, const float *thres,
                                   const float *alpha, cudaStream_t stream) {
    if (!x || !out || !thres || !alpha || dsc_cq_check(groups, n, 2, dtype) != DSC_CQ_OK) return DSC_CQ_EINVAL;
    return DISPATCH(dtype, ternary_any, x, out, groups, n, thres, alpha, stream);
}

extern "C" int dsc_cq_binary_cuda(const void *x, void *out, int dtype, int64_t groups, int64_t n, const float *m,
                                  cudaStream_t stream) {
    if (!x || !out || !m || dsc_cq_check(groups, n, 2, dtype) != DSC_CQ_OK) return DSC_CQ_EINVAL;
    return DISPATCH(dtype, binary_any, x, out, groups, n, m, stream);
}

extern "C" const char *dsc_cq_cuda_strerror(int code) {
    if (code == DSC_CQ_EINVAL) return "invalid arguments";
    return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : "unknown compress_quant error";
}

DSC_CUDA_ENTER_LEAVE(dsc_cq)
