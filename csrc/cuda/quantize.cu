/* Block-wise symmetric int8/int4 quantization on CUDA (contract: dsc/quantize_cuda.h; reference:
 * csrc/cpu/quantize.c, which these kernels match code for code and scale for scale: the same fp32
 * division, round-half-even and clamp).
 *
 *   quantize        one thread block per quantization block: a strided pass for the largest
 *                   magnitude (integer max of the sign-cleared bits, warp shuffles then shared
 *                   memory), then a strided pass writing the codes (int8: one byte per thread and
 *                   element; int4: one byte per thread and element pair)
 *   dequantize      one thread block per quantization block, elementwise
 *   dequantize_sum  one thread block per block of one segment; each element sums its segments in
 *                   segment order (the reference's order) in fp32
 * A second pass re-reads a block of at most a few thousand elements, which L1/L2 still hold. Aligned
 * layouts whose lengths are multiples of 8 take the vector kernels below (one pass, 16-byte accesses).
 * Nothing here synchronises the device or allocates memory. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "dsc/quantize.h"
#include "dsc/quantize_cuda.h"

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float load(const float *x, int64_t i) { return x[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16 *x, int64_t i) { return __bfloat162float(x[i]); }
__device__ __forceinline__ float load(const __half *x, int64_t i) { return __half2float(x[i]); }

__device__ __forceinline__ void store(float *o, int64_t i, float v) { o[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16 *o, int64_t i, float v) { o[i] = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(__half *o, int64_t i, float v) { o[i] = __float2half_rn(v); }

__device__ __forceinline__ int code_of(float v, float scale, float qmax) {
    if (scale == 0.0f) return 0;
    float r = rintf(__fdiv_rn(v, scale));
    r = r == r ? r : 0.0f; /* as the reference: NaN codes 0, the NaN scale carries it */
    r = r > qmax ? qmax : r;
    r = r < -qmax ? -qmax : r;
    return static_cast<int>(r);
}

__device__ __forceinline__ int nibble_code(uint8_t byte, int64_t j) {
    const int nib = (byte >> ((j & 1) * 4)) & 0xf;
    return nib - ((nib & 0x8) << 1);
}

/* block b of the layout: its segment, its first element inside the segment, its length */
struct Block {
    int64_t s, start, len;
};

__device__ __forceinline__ Block block_of(int64_t b, int64_t seg, int64_t block, int64_t bps) {
    Block r;
    r.s = b / bps;
    r.start = (b - r.s * bps) * block;
    r.len = seg - r.start < block ? seg - r.start : block;
    return r;
}

template <typename T>
__global__ void quantize_kernel(const T *__restrict__ x, int64_t seg, int64_t block, int64_t bps, int bits,
                                int64_t sbytes, uint8_t *__restrict__ q, float *__restrict__ scales) {
    __shared__ unsigned int warp_max[kThreads / 32];
    const int64_t b = blockIdx.x;
    const Block blk = block_of(b, seg, block, bps);
    const T *src = x + blk.s * seg + blk.start;
    unsigned int m = 0;
    for (int64_t k = threadIdx.x; k < blk.len; k += blockDim.x) {
        const unsigned int bitsv = __float_as_uint(load(src, k)) & 0x7fffffffu;
        m = bitsv > m ? bitsv : m;
    }
    for (int off = 16; off > 0; off >>= 1) {
        const unsigned int o = __shfl_xor_sync(0xffffffffu, m, off);
        m = o > m ? o : m;
    }
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        m = threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0u;
        for (int off = 16; off > 0; off >>= 1) {
            const unsigned int o = __shfl_xor_sync(0xffffffffu, m, off);
            m = o > m ? o : m;
        }
        if (threadIdx.x == 0) warp_max[0] = m;
    }
    __syncthreads();
    const float qmax = bits == 4 ? 7.0f : 127.0f;
    const float scale = __fdiv_rn(__uint_as_float(warp_max[0]), qmax);
    if (threadIdx.x == 0) scales[b] = scale;
    uint8_t *qseg = q + blk.s * sbytes;
    if (bits == 8) {
        int8_t *dst = reinterpret_cast<int8_t *>(qseg) + blk.start;
        for (int64_t k = threadIdx.x; k < blk.len; k += blockDim.x)
            dst[k] = static_cast<int8_t>(code_of(load(src, k), scale, qmax));
    } else { /* start is even: pairs never straddle blocks */
        uint8_t *dst = qseg + blk.start / 2;
        const int64_t pairs = (blk.len + 1) / 2;
        for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x) {
            const int lo = code_of(load(src, 2 * p), scale, qmax);
            const int hi = 2 * p + 1 < blk.len ? code_of(load(src, 2 * p + 1), scale, qmax) : 0;
            dst[p] = static_cast<uint8_t>((lo & 0xf) | ((hi & 0xf) << 4));
        }
    }
}

template <typename T>
__global__ void dequantize_kernel(const uint8_t *__restrict__ q, const float *__restrict__ scales, int64_t seg,
                                  int64_t block, int64_t bps, int bits, int64_t sbytes, T *__restrict__ out) {
    const int64_t b = blockIdx.x;
    const Block blk = block_of(b, seg, block, bps);
    const float scale = scales[b];
    const uint8_t *qseg = q + blk.s * sbytes;
    T *dst = out + blk.s * seg + blk.start;
    if (bits == 8) {
        const int8_t *src = reinterpret_cast<const int8_t *>(qseg) + blk.start;
        for (int64_t k = threadIdx.x; k < blk.len; k += blockDim.x) store(dst, k, static_cast<float>(src[k]) * scale);
    } else {
        for (int64_t k = threadIdx.x; k < blk.len; k += blockDim.x) {
            const int64_t j = blk.start + k;
            store(dst, k, static_cast<float>(nibble_code(qseg[j / 2], j)) * scale);
        }
    }
}

__global__ void dequantize_sum_kernel(const uint8_t *__restrict__ q, const float *__restrict__ scales,
                                      int64_t segments, int64_t seg, int64_t block, int64_t bps, int bits,
                                      int64_t sbytes, float *__restrict__ out) {
    const int64_t k = blockIdx.x; /* block k of every segment */
    const int64_t start = k * block, len = seg - start < block ? seg - start : block;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
        const int64_t j = start + i;
        float acc = 0.0f;
        for (int64_t s = 0; s < segments; s++) {
            const uint8_t *qseg = q + s * sbytes;
            const int code = bits == 8 ? static_cast<int>(reinterpret_cast<const int8_t *>(qseg)[j])
                                       : nibble_code(qseg[j / 2], j);
            /* no FMA: the reference rounds the product and the sum separately */
            acc = __fadd_rn(acc, __fmul_rn(static_cast<float>(code), scales[s * bps + k]));
        }
        out[j] = acc;
    }
}

/* ---- vector paths: 8 elements a thread at a time (16-byte loads of 16-bit values, two of fp32) ----
 * Taken when every segment and block length is a multiple of 8 and the unquantized side is 16-byte
 * aligned: every block then starts on a whole vector, codes on 8 (int8) or 4 (int4) bytes. A block of at
 * most kThreads * 8 * kMaxVec elements is held in registers between its max and its codes (one pass over
 * memory). Same arithmetic as the scalar kernels above, element by element. */
constexpr int kVec = 8;
constexpr int kMaxVec = 4;

__device__ __forceinline__ void load8(const float *p, float v[kVec]) {
    const float4 a = reinterpret_cast<const float4 *>(p)[0], b = reinterpret_cast<const float4 *>(p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
__device__ __forceinline__ void load8(const __half *p, float v[kVec]) {
    const uint4 u = *reinterpret_cast<const uint4 *>(p);
    const __half2 *h = reinterpret_cast<const __half2 *>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = __half22float2(h[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
}
__device__ __forceinline__ void load8(const __nv_bfloat16 *p, float v[kVec]) {
    const uint4 u = *reinterpret_cast<const uint4 *>(p);
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = __bfloat1622float2(h[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void store8(float *p, const float v[kVec]) {
    reinterpret_cast<float4 *>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4 *>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store8(__half *p, const float v[kVec]) {
    uint4 u;
    __half2 *h = reinterpret_cast<__half2 *>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) h[i] = __halves2half2(__float2half_rn(v[2 * i]), __float2half_rn(v[2 * i + 1]));
    *reinterpret_cast<uint4 *>(p) = u;
}
__device__ __forceinline__ void store8(__nv_bfloat16 *p, const float v[kVec]) {
    uint4 u;
    __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        h[i].x = __float2bfloat16_rn(v[2 * i]);
        h[i].y = __float2bfloat16_rn(v[2 * i + 1]);
    }
    *reinterpret_cast<uint4 *>(p) = u;
}

template <typename T>
__global__ void quantize_vec_kernel(const T *__restrict__ x, int64_t seg, int64_t block, int64_t bps, int bits,
                                    int64_t sbytes, uint8_t *__restrict__ q, float *__restrict__ scales) {
    __shared__ unsigned int warp_max[kThreads / 32];
    const int64_t b = blockIdx.x;
    const Block blk = block_of(b, seg, block, bps);
    const T *src = x + blk.s * seg + blk.start;
    const int nvec = static_cast<int>(blk.len / kVec);
    float v[kMaxVec][kVec];
    unsigned int m = 0;
#pragma unroll
    for (int k = 0; k < kMaxVec; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < nvec) {
            load8(src + static_cast<int64_t>(i) * kVec, v[k]);
#pragma unroll
            for (int e = 0; e < kVec; e++) {
                const unsigned int bitsv = __float_as_uint(v[k][e]) & 0x7fffffffu;
                m = bitsv > m ? bitsv : m;
            }
        }
    }
    for (int off = 16; off > 0; off >>= 1) {
        const unsigned int o = __shfl_xor_sync(0xffffffffu, m, off);
        m = o > m ? o : m;
    }
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        m = threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0u;
        for (int off = 16; off > 0; off >>= 1) {
            const unsigned int o = __shfl_xor_sync(0xffffffffu, m, off);
            m = o > m ? o : m;
        }
        if (threadIdx.x == 0) warp_max[0] = m;
    }
    __syncthreads();
    const float qmax = bits == 4 ? 7.0f : 127.0f;
    const float scale = __fdiv_rn(__uint_as_float(warp_max[0]), qmax);
    if (threadIdx.x == 0) scales[b] = scale;
    uint8_t *qseg = q + blk.s * sbytes;
#pragma unroll
    for (int k = 0; k < kMaxVec; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i >= nvec) continue;
        const int64_t j = blk.start + static_cast<int64_t>(i) * kVec; /* element index inside the segment */
        uint32_t lo = 0, hi = 0;
        if (bits == 8) {
#pragma unroll
            for (int e = 0; e < 4; e++) lo |= (static_cast<uint32_t>(code_of(v[k][e], scale, qmax)) & 0xffu) << (8 * e);
#pragma unroll
            for (int e = 0; e < 4; e++)
                hi |= (static_cast<uint32_t>(code_of(v[k][4 + e], scale, qmax)) & 0xffu) << (8 * e);
            *reinterpret_cast<uint2 *>(qseg + j) = make_uint2(lo, hi);
        } else {
#pragma unroll
            for (int e = 0; e < kVec; e++)
                lo |= (static_cast<uint32_t>(code_of(v[k][e], scale, qmax)) & 0xfu) << (4 * e);
            *reinterpret_cast<uint32_t *>(qseg + j / 2) = lo;
        }
    }
}

template <typename T>
__global__ void dequantize_vec_kernel(const uint8_t *__restrict__ q, const float *__restrict__ scales, int64_t n,
                                      int64_t segments, int64_t seg, int64_t block, int64_t bps, int bits,
                                      int64_t sbytes, T *__restrict__ out) {
    const int64_t nvec = n / kVec;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t e = i * kVec;
        const int64_t s = segments == 1 ? 0 : e / seg;
        const int64_t j = e - s * seg;
        const float scale = scales[s * bps + j / block];
        const uint8_t *qseg = q + s * sbytes;
        float v[kVec];
        if (bits == 8) {
            const uint2 c = *reinterpret_cast<const uint2 *>(qseg + j);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                v[k] = static_cast<float>(static_cast<int8_t>((c.x >> (8 * k)) & 0xffu)) * scale;
                v[4 + k] = static_cast<float>(static_cast<int8_t>((c.y >> (8 * k)) & 0xffu)) * scale;
            }
        } else {
            const uint32_t c = *reinterpret_cast<const uint32_t *>(qseg + j / 2);
#pragma unroll
            for (int k = 0; k < kVec; k++) {
                const int nib = static_cast<int>((c >> (4 * k)) & 0xfu);
                v[k] = static_cast<float>(nib - ((nib & 0x8) << 1)) * scale;
            }
        }
        store8(out + e, v);
    }
}

bool vec_ok(const void *p, int64_t seg, int64_t block) {
    return seg % kVec == 0 && block % kVec == 0 && (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

int launched() { return static_cast<int>(cudaGetLastError()); }

bool grid_fits(int64_t blocks) { return blocks <= 0x7fffffffLL; }

}  // namespace

extern "C" int dsc_quantize_cuda(const void *x, int dtype, int64_t segments, int64_t seg, int64_t block, int bits,
                                 uint8_t *q, float *scales, cudaStream_t stream) {
    if (dsc_q_check(segments, seg, block, bits, dtype) != DSC_Q_OK) return DSC_Q_EINVAL;
    if (segments == 0 || seg == 0) return 0;
    const int64_t bps = dsc_q_blocks_per_segment(seg, block), nblocks = segments * bps;
    if (!grid_fits(nblocks)) return DSC_Q_EINVAL;
    const int64_t sbytes = dsc_q_segment_bytes(seg, bits);
    const dim3 grid(static_cast<unsigned int>(nblocks));
    if (vec_ok(x, seg, block) && (reinterpret_cast<uintptr_t>(q) & 7u) == 0 && block <= kThreads * kVec * kMaxVec) {
        switch (dtype) {
        case DSC_Q_F32:
            quantize_vec_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const float *>(x), seg, block, bps, bits,
                                                               sbytes, q, scales);
            break;
        case DSC_Q_BF16:
            quantize_vec_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16 *>(x), seg, block, bps,
                                                               bits, sbytes, q, scales);
            break;
        default:
            quantize_vec_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const __half *>(x), seg, block, bps, bits,
                                                               sbytes, q, scales);
        }
        return launched();
    }
    switch (dtype) {
    case DSC_Q_F32:
        quantize_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const float *>(x), seg, block, bps, bits, sbytes, q,
                                                       scales);
        break;
    case DSC_Q_BF16:
        quantize_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16 *>(x), seg, block, bps, bits,
                                                       sbytes, q, scales);
        break;
    default:
        quantize_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const __half *>(x), seg, block, bps, bits, sbytes,
                                                       q, scales);
    }
    return launched();
}

extern "C" int dsc_dequantize_cuda(const uint8_t *q, const float *scales, int64_t segments, int64_t seg,
                                   int64_t block, int bits, void *out, int dtype, cudaStream_t stream) {
    if (dsc_q_check(segments, seg, block, bits, dtype) != DSC_Q_OK) return DSC_Q_EINVAL;
    if (segments == 0 || seg == 0) return 0;
    const int64_t bps = dsc_q_blocks_per_segment(seg, block), nblocks = segments * bps;
    if (!grid_fits(nblocks)) return DSC_Q_EINVAL;
    const int64_t sbytes = dsc_q_segment_bytes(seg, bits);
    const dim3 grid(static_cast<unsigned int>(nblocks));
    if (vec_ok(out, seg, block) && (reinterpret_cast<uintptr_t>(q) & 7u) == 0) {
        const int64_t n = segments * seg, nvec = n / kVec;
        const int64_t want = (nvec + kThreads - 1) / kThreads;
        const unsigned int vgrid = static_cast<unsigned int>(want < 65535 * 8 ? want : 65535 * 8);
        switch (dtype) {
        case DSC_Q_F32:
            dequantize_vec_kernel<<<vgrid, kThreads, 0, stream>>>(q, scales, n, segments, seg, block, bps, bits, sbytes,
                                                                  static_cast<float *>(out));
            break;
        case DSC_Q_BF16:
            dequantize_vec_kernel<<<vgrid, kThreads, 0, stream>>>(q, scales, n, segments, seg, block, bps, bits, sbytes,
                                                                  static_cast<__nv_bfloat16 *>(out));
            break;
        default:
            dequantize_vec_kernel<<<vgrid, kThreads, 0, stream>>>(q, scales, n, segments, seg, block, bps, bits, sbytes,
                                                                  static_cast<__half *>(out));
        }
        return launched();
    }
    switch (dtype) {
    case DSC_Q_F32:
        dequantize_kernel<<<grid, kThreads, 0, stream>>>(q, scales, seg, block, bps, bits, sbytes,
                                                         static_cast<float *>(out));
        break;
    case DSC_Q_BF16:
        dequantize_kernel<<<grid, kThreads, 0, stream>>>(q, scales, seg, block, bps, bits, sbytes,
                                                         static_cast<__nv_bfloat16 *>(out));
        break;
    default:
        dequantize_kernel<<<grid, kThreads, 0, stream>>>(q, scales, seg, block, bps, bits, sbytes,
                                                         static_cast<__half *>(out));
    }
    return launched();
}

extern "C" int dsc_dequantize_sum_cuda(const uint8_t *q, const float *scales, int64_t segments, int64_t seg,
                                       int64_t block, int bits, float *out, cudaStream_t stream) {
    if (dsc_q_check(segments, seg, block, bits, DSC_Q_F32) != DSC_Q_OK) return DSC_Q_EINVAL;
    if (seg == 0) return 0;
    const int64_t bps = dsc_q_blocks_per_segment(seg, block);
    if (!grid_fits(bps)) return DSC_Q_EINVAL;
    const int64_t sbytes = dsc_q_segment_bytes(seg, bits);
    dequantize_sum_kernel<<<static_cast<unsigned int>(bps), kThreads, 0, stream>>>(q, scales, segments, seg, block,
                                                                                   bps, bits, sbytes, out);
    return launched();
}

extern "C" const char *dsc_q_cuda_strerror(int code) {
    if (code == DSC_Q_EINVAL) return "invalid sizes";
    return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : "unknown deepspeed_c quantizer error";
}

extern "C" int dsc_q_cuda_enter(int device, int *prev) {
    cudaError_t err = cudaGetDevice(prev);
    if (err == cudaSuccess && *prev != device) err = cudaSetDevice(device);
    return static_cast<int>(err);
}

extern "C" void dsc_q_cuda_leave(int device, int prev) {
    if (prev >= 0 && prev != device) (void)cudaSetDevice(prev);
}
