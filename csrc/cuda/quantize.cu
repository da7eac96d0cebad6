/* Block-wise symmetric int8/int4 quantization on CUDA (contract: dsc/quantize_cuda.h; reference:
 * csrc/cpu/quantize.c, which these kernels match code for code and scale for scale: the same fp32
 * division for the scale, the codes of round-half-even(x / scale) and the same clamp).
 *
 *   quantize        aligned layouts whose lengths are multiples of 8 (the usual case): a group of lanes
 *                   of one warp per quantization block, its vectors held in registers between the
 *                   largest magnitude (warp shuffles) and the codes, many blocks a CTA (see "vector
 *                   paths" below; blocks beyond the register budget: a warp per block, two passes);
 *                   other layouts: one thread block per quantization block, a strided pass for the
 *                   largest magnitude (integer max of the sign-cleared bits, warp shuffles then shared
 *                   memory), then a strided pass writing the codes (int8: one byte per thread and
 *                   element; int4: one byte per thread and element pair)
 *   dequantize      aligned multiples of 8: 16-byte vectors, grid-stride; else one thread block per
 *                   quantization block, elementwise
 *   dequantize_sum  one thread block per block of one segment; each element sums its segments in
 *                   segment order (the reference's order) in fp32
 * A second pass re-reads a block of at most a few thousand elements, which L1/L2 still hold.
 * Nothing here synchronises the device or allocates memory. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "dsc/quantize.h"
#include "dsc/quantize_cuda.h"
#include "device_guard.cuh"

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
/* ---- vector paths ----
 * Taken when every segment and block length is a multiple of 8 and the unquantized side is 16-byte
 * aligned (codes 8-byte aligned): every block then starts on a whole 16-byte vector of its input and
 * its codes on whole words. Same arithmetic as the scalar kernels above, element by element. */
constexpr int kVec = 8; /* dequantize: elements a thread handles at a time */

/* quantize: a group of G lanes of one warp per quantization block (G = 32, or fewer for blocks of at
 * most 32 vectors, several blocks a warp), kWarpCta threads a CTA, one thread per lane of every group:
 * the grid covers all blocks, no grid-stride loop. Each lane loads up to V 16-byte vectors of its block
 * (vector lane + k * G: every load instruction of the warp reads whole contiguous lines), keeps them in
 * registers, takes the largest magnitude over the group with shuffles (no shared memory, no barrier),
 * then writes the codes from the registers: one read of the input. V <= kMaxVecPerLane is the register
 * budget (64 registers of raw input a lane: blocks up to 4096 16-bit or 2048 fp32 elements); larger
 * blocks take quantize_warp_loop_kernel, a warp per block in two passes over chunks of the block (the
 * second reads what the first left in L2). */
constexpr int kWarpCta = 256;
constexpr int kMaxVecPerLane = 16;
constexpr int kLoopUnroll = 8; /* vectors a lane has in flight per chunk of the two-pass kernel */

/* a 16-byte vector of input as fp32 (4 fp32 or 8 16-bit elements) */
__device__ __forceinline__ void unpack(const float *, const uint4 &u, float v[4]) {
    v[0] = __uint_as_float(u.x);
    v[1] = __uint_as_float(u.y);
    v[2] = __uint_as_float(u.z);
    v[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void unpack(const __half *, const uint4 &u, float v[8]) {
    const __half2 *h = reinterpret_cast<const __half2 *>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = __half22float2(h[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
}
__device__ __forceinline__ void unpack(const __nv_bfloat16 *, const uint4 &u, float v[8]) {
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = __bfloat1622float2(h[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
}

template <typename T>
__device__ __forceinline__ unsigned int absmax_bits(const uint4 &u, unsigned int m) {
    constexpr int E = 16 / sizeof(T);
    float v[E];
    unpack(static_cast<const T *>(nullptr), u, v);
#pragma unroll
    for (int e = 0; e < E; e++) {
        const unsigned int b = __float_as_uint(v[e]) & 0x7fffffffu;
        m = b > m ? b : m;
    }
    return m;
}

/* Fast code of v for a finite normal scale, without a division per element: t = v * (1/scale) is
 * within 3 * 2^-24 * |t| < 2^-15 of the reference's correctly rounded v / scale (|t| <= qmax + tiny),
 * so unless t lies within kNearHalf of a half-integer both round (half-even) to the same integer, and
 * clamping before or after rounding to the integer qmax agrees. Near a half-integer (ties included) the
 * reference's division decides. Adding 1.5 * 2^23 rounds t half-even to an integer and leaves it, two's
 * complement, in the low bits of the sum's encoding. Returns the code in the low bits. */
constexpr float kMagic = 12582912.0f; /* 1.5 * 2^23 */
constexpr float kNearHalf = 0x1p-12f;

__device__ __noinline__ unsigned int code_exact(float v, float scale, float qmax) {
    return static_cast<unsigned int>(code_of(v, scale, qmax));
}

/* fast: the block's scale is finite and normal (else every element takes the reference's division) */
__device__ __forceinline__ unsigned int code_bits(float v, float scale, float inv, float qmax, bool fast) {
    float t = __fmul_rn(v, inv);
    t = fminf(fmaxf(t, -qmax), qmax);
    const float y = __fadd_rn(t, kMagic);
    if (!fast || fabsf(__fsub_rn(t, __fsub_rn(y, kMagic))) > 0.5f - kNearHalf) return code_exact(v, scale, qmax);
    return __float_as_uint(y);
}

/* the codes of the E elements of one vector at element j of a segment */
template <typename T>
__device__ __forceinline__ void store_codes(uint8_t *qseg, int64_t j, const uint4 &u, int bits, float scale, float inv,
                                            float qmax, bool fast) {
    constexpr int E = 16 / sizeof(T);
    float v[E];
    unpack(static_cast<const T *>(nullptr), u, v);
    unsigned int c[E];
#pragma unroll
    for (int e = 0; e < E; e++) c[e] = code_bits(v[e], scale, inv, qmax, fast);
    if (bits == 8) {
        uint32_t w[E / 4];
#pragma unroll
        for (int h = 0; h < E / 4; h++)
            w[h] = (c[4 * h] & 0xffu) | ((c[4 * h + 1] & 0xffu) << 8) | ((c[4 * h + 2] & 0xffu) << 16) |
                   ((c[4 * h + 3] & 0xffu) << 24);
        if constexpr (E == 8)
            *reinterpret_cast<uint2 *>(qseg + j) = make_uint2(w[0], w[1]);
        else
            *reinterpret_cast<uint32_t *>(qseg + j) = w[0];
    } else {
        uint32_t w = 0;
#pragma unroll
        for (int e = 0; e < E; e++) w |= (c[e] & 0xfu) << (4 * e);
        if constexpr (E == 8)
            *reinterpret_cast<uint32_t *>(qseg + j / 2) = w;
        else
            *reinterpret_cast<uint16_t *>(qseg + j / 2) = static_cast<uint16_t>(w);
    }
}

/* the scale of a block of largest magnitude bits m; inv and fast for code_bits */
__device__ __forceinline__ float scale_of(unsigned int m, float qmax, float *inv, bool *fast) {
    const float scale = __fdiv_rn(__uint_as_float(m), qmax);
    *fast = scale >= 0x1p-126f && scale <= 0x1.fffffep127f; /* finite normal: 1 / scale finite and normal */
    *inv = *fast ? __frcp_rn(scale) : 0.0f;
    return scale;
}

template <typename T, int V>
__global__ void __launch_bounds__(kWarpCta)
    quantize_warp_kernel(const T *__restrict__ x, int64_t seg, int64_t block, int64_t bps, int64_t nblocks, int bits,
                         int64_t sbytes, int glog, uint8_t *__restrict__ q, float *__restrict__ scales) {
    constexpr int E = 16 / sizeof(T);
    const int G = V > 1 ? 32 : 1 << glog; /* lanes a block */
    const int64_t b = (static_cast<int64_t>(blockIdx.x) * kWarpCta + threadIdx.x) >> (V > 1 ? 5 : glog);
    const int lane = static_cast<int>(threadIdx.x) & (G - 1);
    Block blk{0, 0, 0};
    if (b < nblocks) blk = block_of(b, seg, block, bps); /* past the last block: no vectors, still shuffles */
    const int nvec = static_cast<int>(blk.len / E);
    const uint4 *src = reinterpret_cast<const uint4 *>(x + blk.s * seg + blk.start);
    uint4 raw[V];
#pragma unroll
    for (int k = 0; k < V; k++)
        if (lane + k * G < nvec) raw[k] = src[lane + k * G];
    unsigned int m = 0;
#pragma unroll
    for (int k = 0; k < V; k++)
        if (lane + k * G < nvec) m = absmax_bits<T>(raw[k], m);
    for (int off = G >> 1; off > 0; off >>= 1) { /* groups are aligned runs of G lanes: xor stays inside */
        const unsigned int o = __shfl_xor_sync(0xffffffffu, m, off);
        m = o > m ? o : m;
    }
    const float qmax = bits == 4 ? 7.0f : 127.0f;
    float inv;
    bool fast;
    const float scale = scale_of(m, qmax, &inv, &fast);
    if (b < nblocks && lane == 0) scales[b] = scale;
    uint8_t *qseg = q + blk.s * sbytes;
#pragma unroll
    for (int k = 0; k < V; k++)
        if (lane + k * G < nvec)
            store_codes<T>(qseg, blk.start + static_cast<int64_t>(lane + k * G) * E, raw[k], bits, scale, inv, qmax,
                           fast);
}

/* blocks beyond the register budget: a warp per block, chunks of 32 * kLoopUnroll vectors, two passes */
template <typename T>
__global__ void __launch_bounds__(kWarpCta)
    quantize_warp_loop_kernel(const T *__restrict__ x, int64_t seg, int64_t block, int64_t bps, int64_t nblocks,
                              int bits, int64_t sbytes, uint8_t *__restrict__ q, float *__restrict__ scales) {
    constexpr int E = 16 / sizeof(T), U = kLoopUnroll;
    const int64_t b = (static_cast<int64_t>(blockIdx.x) * kWarpCta + threadIdx.x) >> 5;
    const int lane = static_cast<int>(threadIdx.x) & 31;
    if (b >= nblocks) return; /* the whole warp: b is the warp's */
    const Block blk = block_of(b, seg, block, bps);
    const int64_t nvec = blk.len / E;
    const uint4 *src = reinterpret_cast<const uint4 *>(x + blk.s * seg + blk.start);
    unsigned int m = 0;
    for (int64_t base = lane; base < nvec; base += 32 * U) {
        uint4 raw[U];
#pragma unroll
        for (int k = 0; k < U; k++)
            if (base + 32 * k < nvec) raw[k] = src[base + 32 * k];
#pragma unroll
        for (int k = 0; k < U; k++)
            if (base + 32 * k < nvec) m = absmax_bits<T>(raw[k], m);
    }
    for (int off = 16; off > 0; off >>= 1) {
        const unsigned int o = __shfl_xor_sync(0xffffffffu, m, off);
        m = o > m ? o : m;
    }
    const float qmax = bits == 4 ? 7.0f : 127.0f;
    float inv;
    bool fast;
    const float scale = scale_of(m, qmax, &inv, &fast);
    if (lane == 0) scales[b] = scale;
    uint8_t *qseg = q + blk.s * sbytes;
    for (int64_t base = lane; base < nvec; base += 32 * U) {
        uint4 raw[U];
#pragma unroll
        for (int k = 0; k < U; k++)
            if (base + 32 * k < nvec) raw[k] = src[base + 32 * k];
#pragma unroll
        for (int k = 0; k < U; k++) {
            if (base + 32 * k >= nvec) continue;
            const int64_t j = blk.start + (base + 32 * k) * E;
            store_codes<T>(qseg, j, raw[k], bits, scale, inv, qmax, fast);
        }
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

/* the vector quantize path for input type T: the register kernel with the fewest vectors a lane that
 * holds a whole block, else the two-pass loop kernel */
template <typename T>
void launch_quantize_warp(const T *x, int64_t seg, int64_t block, int64_t bps, int64_t nblocks, int bits,
                          int64_t sbytes, uint8_t *q, float *scales, cudaStream_t stream) {
    constexpr int64_t E = 16 / sizeof(T);
    const int64_t nvec = block / E; /* vectors in a whole block (a segment's last may have fewer) */
    if (nvec > 32 * kMaxVecPerLane) {
        const int64_t ctas = (nblocks + kWarpCta / 32 - 1) / (kWarpCta / 32);
        quantize_warp_loop_kernel<T><<<static_cast<unsigned int>(ctas), kWarpCta, 0, stream>>>(
            x, seg, block, bps, nblocks, bits, sbytes, q, scales);
        return;
    }
    int glog = 5, vpl = 1; /* lanes a block (log2), vectors a lane */
    if (nvec <= 32)
        for (glog = 0; (int64_t{1} << glog) < nvec;) glog++;
    else
        while (32 * vpl < nvec) vpl *= 2;
    const int64_t ctas = ((nblocks << glog) + kWarpCta - 1) / kWarpCta;
    const dim3 grid(static_cast<unsigned int>(ctas));
    static_assert(kMaxVecPerLane == 16, "the table below covers 1 .. kMaxVecPerLane vectors a lane");
    using WarpKernel = void (*)(const T *, int64_t, int64_t, int64_t, int64_t, int, int64_t, int, uint8_t *, float *);
    const WarpKernel kernel = vpl == 1   ? quantize_warp_kernel<T, 1>
                              : vpl == 2 ? quantize_warp_kernel<T, 2>
                              : vpl == 4 ? quantize_warp_kernel<T, 4>
                              : vpl == 8 ? quantize_warp_kernel<T, 8>
                                         : quantize_warp_kernel<T, 16>;
    kernel<<<grid, kWarpCta, 0, stream>>>(x, seg, block, bps, nblocks, bits, sbytes, glog, q, scales);
}

}  // namespace

extern "C" int dsc_quantize_cuda(const void *x, int dtype, int64_t segments, int64_t seg, int64_t block, int bits,
                                 uint8_t *q, float *scales, cudaStream_t stream) {
    if (dsc_q_check(segments, seg, block, bits, dtype) != DSC_Q_OK) return DSC_Q_EINVAL;
    if (segments == 0 || seg == 0) return 0;
    const int64_t bps = dsc_q_blocks_per_segment(seg, block), nblocks = segments * bps;
    if (!grid_fits(nblocks)) return DSC_Q_EINVAL;
    const int64_t sbytes = dsc_q_segment_bytes(seg, bits);
    if (vec_ok(x, seg, block) && (reinterpret_cast<uintptr_t>(q) & 7u) == 0) {
        switch (dtype) {
        case DSC_Q_F32:
            launch_quantize_warp(static_cast<const float *>(x), seg, block, bps, nblocks, bits, sbytes, q, scales,
                                 stream);
            break;
        case DSC_Q_BF16:
            launch_quantize_warp(static_cast<const __nv_bfloat16 *>(x), seg, block, bps, nblocks, bits, sbytes, q,
                                 scales, stream);
            break;
        default:
            launch_quantize_warp(static_cast<const __half *>(x), seg, block, bps, nblocks, bits, sbytes, q, scales,
                                 stream);
        }
        return launched();
    }
    const dim3 grid(static_cast<unsigned int>(nblocks));
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

DSC_CUDA_ENTER_LEAVE(dsc_q)
