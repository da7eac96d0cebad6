/* The 1-bit compression core on CUDA (contract: dsc/onebit_cuda.h; reference: the scalar build of
 * csrc/cpu/onebit.c).
 *
 * compensate, pack and accumulating unpack: one thread owns one byte of bits, i.e. 8 consecutive
 * elements: two 16-byte loads (or stores) when the segment is aligned, so a warp moves 1 KiB of
 * floats and 32 consecutive bytes of bits. Plain unpack only writes floats, so it is laid out for
 * its stores instead: one thread writes a quad (4 elements, one float4, from one nibble of bits),
 * consecutive threads consecutive quads, so each warp store fills 512 contiguous bytes (whole
 * 32-byte sectors, where the byte-per-thread layout left every sector half-written per
 * instruction); each thread loads the nibbles of kQuadsPerThread quads before storing any. Its
 * scalar path (an output not 16-byte aligned, and the last len % 4 elements) writes one element
 * per thread. blockIdx.y walks the segments (strided by gridDim.y), blockIdx.x a segment's work
 * (grid-stride). compensate reduces its squares per block in double (warp shuffles) and adds one
 * atomic per block into sumsq[scale_index]. Nothing here synchronises or allocates. */
#include <cuda_runtime.h>

#include <cstdint>

#include "dsc/onebit.h"
#include "dsc/onebit_cuda.h"
#include "device_guard.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocksX = 8192;
constexpr int64_t kMaxBlocksY = 65535;
constexpr int kQuadsPerThread = 4; /* float4 stores a thread of unpack_set_kernel has per pass */

struct Seg {
    int64_t off, len, idx;
};

__device__ __forceinline__ Seg seg_at(const int64_t *segs, int64_t s) {
    return Seg{segs[3 * s], segs[3 * s + 1], segs[3 * s + 2]};
}

__device__ __forceinline__ bool positive(float x) { return !(x < 0.0f); }

/* 8 elements starting at p (n of them valid, n <= 8) into v; unvalid lanes 0 */
__device__ __forceinline__ void load8(const float *p, int n, bool vec, float v[8]) {
    if (vec && n == 8) {
        const float4 a = reinterpret_cast<const float4 *>(p)[0], b = reinterpret_cast<const float4 *>(p)[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        return;
    }
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = j < n ? p[j] : 0.0f;
}

__device__ __forceinline__ void store8(float *p, int n, bool vec, const float v[8]) {
    if (vec && n == 8) {
        reinterpret_cast<float4 *>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4 *>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
        return;
    }
#pragma unroll
    for (int j = 0; j < 8; j++)
        if (j < n) p[j] = v[j];
}

__device__ __forceinline__ bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

__global__ void compensate_kernel(float *__restrict__ y, const float *__restrict__ err, const int64_t *segs,
                                  int64_t nseg, double *sumsq) {
    __shared__ double warp_sums[kThreads / 32];
    for (int64_t s = blockIdx.y; s < nseg; s += gridDim.y) {
        const Seg g = seg_at(segs, s);
        const int64_t nbytes = (g.len + 7) >> 3;
        const bool vec = aligned16(y + g.off) && (err == nullptr || aligned16(err + g.off));
        double acc = 0.0;
        for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < nbytes;
             b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
            const int64_t k = g.off + 8 * b;
            const int n = static_cast<int>(g.len - 8 * b < 8 ? g.len - 8 * b : 8);
            float v[8], e[8];
            load8(y + k, n, vec, v);
            if (err != nullptr) {
                load8(err + k, n, vec, e);
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] += e[j];
                store8(y + k, n, vec, v);
            }
#pragma unroll
            for (int j = 0; j < 8; j++) acc += static_cast<double>(v[j]) * static_cast<double>(v[j]);
        }
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
        if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
        __syncthreads();
        if (threadIdx.x == 0) {
            double total = 0.0;
            for (int w = 0; w < kThreads / 32; w++) total += warp_sums[w];
            if (total != 0.0) atomicAdd(sumsq + g.idx, total);
        }
        __syncthreads(); /* warp_sums is reused by the next segment */
    }
}

__global__ void pack_kernel(const float *__restrict__ y, float *__restrict__ err, uint8_t *__restrict__ bits,
                            const int64_t *segs, int64_t nseg, const float *scales) {
    for (int64_t s = blockIdx.y; s < nseg; s += gridDim.y) {
        const Seg g = seg_at(segs, s);
        const int64_t nbytes = (g.len + 7) >> 3;
        const float scale = scales[g.idx];
        const bool vec = aligned16(y + g.off) && (err == nullptr || aligned16(err + g.off));
        for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < nbytes;
             b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
            const int64_t k = g.off + 8 * b;
            const int n = static_cast<int>(g.len - 8 * b < 8 ? g.len - 8 * b : 8);
            float v[8];
            load8(y + k, n, vec, v);
            unsigned byte = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const bool pos = j < n && positive(v[j]);
                byte |= static_cast<unsigned>(pos) << j;
                v[j] = v[j] - (pos ? scale : -scale);
            }
            bits[(g.off >> 3) + b] = static_cast<uint8_t>(byte);
            if (err != nullptr) store8(err + k, n, vec, v);
        }
    }
}

/* out += scale * sign */
__global__ void unpack_add_kernel(const uint8_t *__restrict__ bits, float *__restrict__ out, const int64_t *segs,
                                  int64_t nseg, const float *scales) {
    for (int64_t s = blockIdx.y; s < nseg; s += gridDim.y) {
        const Seg g = seg_at(segs, s);
        const int64_t nbytes = (g.len + 7) >> 3;
        const float scale = scales[g.idx];
        const bool vec = aligned16(out + g.off);
        for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < nbytes;
             b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
            const int64_t k = g.off + 8 * b;
            const int n = static_cast<int>(g.len - 8 * b < 8 ? g.len - 8 * b : 8);
            const unsigned byte = bits[(g.off >> 3) + b];
            float v[8];
            load8(out + k, n, vec, v);
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] += (byte >> j) & 1u ? scale : -scale;
            store8(out + k, n, vec, v);
        }
    }
}

/* out = scale * sign. Element k of a segment is bit k & 7 of its byte k >> 3, so quad q (elements
 * 4q .. 4q + 3) is the nibble at bit 4 * (q & 1) of byte q >> 1. */
__global__ void unpack_set_kernel(const uint8_t *__restrict__ bits, float *__restrict__ out, const int64_t *segs,
                                  int64_t nseg, const float *scales) {
    const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (int64_t s = blockIdx.y; s < nseg; s += gridDim.y) {
        const Seg g = seg_at(segs, s);
        const float scale = scales[g.idx];
        const uint8_t *b = bits + (g.off >> 3);
        float *o = out + g.off;
        int64_t done = 0;
        if (aligned16(o)) {
            const int64_t nquads = g.len >> 2;
            float4 *o4 = reinterpret_cast<float4 *>(o);
            /* a block's pass covers blockDim.x * kQuadsPerThread consecutive quads; thread t takes
               t, t + blockDim.x, ... so every store instruction of a warp is 32 consecutive quads */
            for (int64_t q0 = static_cast<int64_t>(blockIdx.x) * blockDim.x * kQuadsPerThread + threadIdx.x;
                 q0 < nquads; q0 += threads * kQuadsPerThread) {
                unsigned nib[kQuadsPerThread];
#pragma unroll
                for (int i = 0; i < kQuadsPerThread; i++) {
                    const int64_t q = q0 + static_cast<int64_t>(i) * blockDim.x;
                    nib[i] = q < nquads ? static_cast<unsigned>(b[q >> 1]) >> ((q & 1) << 2) : 0u;
                }
#pragma unroll
                for (int i = 0; i < kQuadsPerThread; i++) {
                    const int64_t q = q0 + static_cast<int64_t>(i) * blockDim.x;
                    if (q < nquads)
                        o4[q] = make_float4(nib[i] & 1u ? scale : -scale, nib[i] & 2u ? scale : -scale,
                                            nib[i] & 4u ? scale : -scale, nib[i] & 8u ? scale : -scale);
                }
            }
            done = nquads << 2;
        }
        for (int64_t k = done + tid; k < g.len; k += threads) o[k] = (b[k >> 3] >> (k & 7)) & 1u ? scale : -scale;
    }
}

/* the grid for segments of at most max_len elements, each thread covering per_thread of them a pass */
bool geometry(int64_t nseg, int64_t max_len, int64_t per_thread, dim3 *grid) {
    if (nseg < 0 || max_len < 0) return false;
    const int64_t units = (max_len + per_thread - 1) / per_thread;
    int64_t gx = (units + kThreads - 1) / kThreads;
    gx = gx < 1 ? 1 : (gx > kMaxBlocksX ? kMaxBlocksX : gx);
    const int64_t gy = nseg > kMaxBlocksY ? kMaxBlocksY : nseg;
    *grid = dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy), 1);
    return true;
}

int launched() { return static_cast<int>(cudaGetLastError()); }

} // namespace

extern "C" int dsc_onebit_compensate_cuda(float *y, const float *err, const int64_t *segs, int64_t nseg,
                                          int64_t max_len, double *sumsq, cudaStream_t stream) {
    dim3 grid;
    if (!geometry(nseg, max_len, 8, &grid) || (nseg > 0 && (!y || !segs || !sumsq))) return DSC_ONEBIT_EINVAL;
    if (nseg == 0 || max_len == 0) return 0;
    compensate_kernel<<<grid, kThreads, 0, stream>>>(y, err, segs, nseg, sumsq);
    return launched();
}

extern "C" int dsc_onebit_pack_cuda(const float *y, float *err, uint8_t *bits, const int64_t *segs, int64_t nseg,
                                    int64_t max_len, const float *scales, cudaStream_t stream) {
    dim3 grid;
    if (!geometry(nseg, max_len, 8, &grid) || (nseg > 0 && (!y || !bits || !segs || !scales))) return DSC_ONEBIT_EINVAL;
    if (nseg == 0 || max_len == 0) return 0;
    pack_kernel<<<grid, kThreads, 0, stream>>>(y, err, bits, segs, nseg, scales);
    return launched();
}

extern "C" int dsc_onebit_unpack_cuda(const uint8_t *bits, float *out, const int64_t *segs, int64_t nseg,
                                      int64_t max_len, const float *scales, int accumulate, cudaStream_t stream) {
    dim3 grid;
    if (!geometry(nseg, max_len, accumulate ? 8 : 4 * kQuadsPerThread, &grid) ||
        (nseg > 0 && (!bits || !out || !segs || !scales)))
        return DSC_ONEBIT_EINVAL;
    if (nseg == 0 || max_len == 0) return 0;
    if (accumulate) {
        unpack_add_kernel<<<grid, kThreads, 0, stream>>>(bits, out, segs, nseg, scales);
    } else {
        unpack_set_kernel<<<grid, kThreads, 0, stream>>>(bits, out, segs, nseg, scales);
    }
    return launched();
}

extern "C" const char *dsc_onebit_cuda_strerror(int code) {
    if (code == DSC_ONEBIT_EINVAL) return "invalid sizes";
    return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : "unknown deepspeed_c 1-bit error";
}

DSC_CUDA_ENTER_LEAVE(dsc_onebit)
