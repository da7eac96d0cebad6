/* random-LTD's token moves on CUDA (contract: dsc/random_ltd_cuda.h; reference: csrc/cpu/random_ltd.c).
 *
 *   gather       one warp per kept token copies its row, four vectors in flight per lane (16-byte
 *                vectors when the row and both pointers allow, else the widest that fits)
 *   scatter      a first pass writes each position's kept slot (or -1) into `inv`; then one warp per
 *                output row copies either the hidden row or the layer's row: one read and one write
 *                of the whole tensor, no copy-then-overwrite
 *   accumulate   the same walk element by element, adding in fp32 (fp64 for double) and rounding once
 *   mask_gather  one thread per output element
 * Nothing here synchronises the device or allocates memory. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "dsc/random_ltd_cuda.h"
#include "device_guard.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;

/* where the rows of a [batch, len, hidden] / [len, batch, hidden] tensor sit */
struct Geo {
    int64_t batch, seq, keep;
    int batch_first;
    __device__ __forceinline__ int64_t row(int64_t b, int64_t t, int64_t len) const {
        return batch_first ? b * len + t : t * batch + b;
    }
    /* (b, t) of row r of a tensor with `len` tokens per sample */
    __device__ __forceinline__ void split(int64_t r, int64_t len, int64_t *b, int64_t *t) const {
        if (batch_first) {
            *b = r / len;
            *t = r - *b * len;
        } else {
            *t = r / batch;
            *b = r - *t * batch;
        }
    }
};

template <typename V>
__device__ __forceinline__ void copy_row(V *__restrict__ dst, const V *__restrict__ src, int64_t n, int lane) {
    int64_t c = lane;
    for (; c + (kUnroll - 1) * 32 < n; c += kUnroll * 32) {
        V v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; u++) v[u] = src[c + u * 32];
#pragma unroll
        for (int u = 0; u < kUnroll; u++) dst[c + u * 32] = v[u];
    }
    for (; c < n; c += 32) dst[c] = src[c];
}

template <typename V>
__device__ __forceinline__ void zero_row(V *__restrict__ dst, int64_t n, int lane) {
    V z;
    memset(&z, 0, sizeof z);
    for (int64_t c = lane; c < n; c += 32) dst[c] = z;
}

template <typename V>
__global__ void gather_kernel(const V *__restrict__ in, const int32_t *__restrict__ idx, Geo g, int64_t vpr,
                              V *__restrict__ out) {
    const int lane = threadIdx.x & 31;
    const int64_t rows = g.batch * g.keep;
    const int64_t stride = (int64_t)gridDim.x * kWarps;
    for (int64_t r = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5); r < rows; r += stride) {
        int64_t b, j;
        g.split(r, g.keep, &b, &j);
        const int32_t p = idx[b * g.keep + j];
        if (p < 0 || p >= g.seq)
            zero_row(out + r * vpr, vpr, lane);
        else
            copy_row(out + r * vpr, in + g.row(b, p, g.seq) * vpr, vpr, lane);
    }
}

__global__ void inverse_kernel(const int32_t *__restrict__ idx, Geo g, int32_t *__restrict__ inv) {
    const int64_t n = g.batch * g.keep;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t b = i / g.keep;
        const int32_t p = idx[i];
        if (p >= 0 && p < g.seq) inv[b * g.seq + p] = (int32_t)(i - b * g.keep);
    }
}

/* the kept slot of output row r, or -1 */
__device__ __forceinline__ int64_t slot_of(const int32_t *__restrict__ inv, const Geo &g, int64_t r, int64_t *b) {
    int64_t s;
    g.split(r, g.seq, b, &s);
    return inv[*b * g.seq + s];
}

template <typename V>
__global__ void scatter_kernel(const V *__restrict__ hidden, const V *__restrict__ part,
                               const int32_t *__restrict__ inv, Geo g, int64_t vpr, V *__restrict__ out) {
    const int lane = threadIdx.x & 31;
    const int64_t rows = g.batch * g.seq;
    const int64_t stride = (int64_t)gridDim.x * kWarps;
    for (int64_t r = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5); r < rows; r += stride) {
        int64_t b;
        const int64_t j = slot_of(inv, g, r, &b);
        const V *src = j >= 0 ? (part ? part + g.row(b, j, g.keep) * vpr : nullptr) : (hidden ? hidden + r * vpr : nullptr);
        if (src)
            copy_row(out + r * vpr, src, vpr, lane);
        else
            zero_row(out + r * vpr, vpr, lane);
    }
}

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ double widen(double v) { return v; }
__device__ __forceinline__ float widen(__half v) { return __half2float(v); }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T narrow(typename Acc<T>::type v);
template <> __device__ __forceinline__ float narrow<float>(float v) { return v; }
template <> __device__ __forceinline__ double narrow<double>(double v) { return v; }
template <> __device__ __forceinline__ __half narrow<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__global__ void scatter_add_kernel(const T *__restrict__ hidden, const T *__restrict__ part,
                                   const int32_t *__restrict__ inv, Geo g, int64_t h, T *__restrict__ out) {
    const int lane = threadIdx.x & 31;
    const int64_t rows = g.batch * g.seq;
    const int64_t stride = (int64_t)gridDim.x * kWarps;
    using A = typename Acc<T>::type;
    for (int64_t r = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5); r < rows; r += stride) {
        int64_t b;
        const int64_t j = slot_of(inv, g, r, &b);
        const T *p = j >= 0 && part ? part + g.row(b, j, g.keep) * h : nullptr;
        const T *base = hidden ? hidden + r * h : nullptr;
        T *o = out + r * h;
        for (int64_t c = lane; c < h; c += 32) {
            const A x = base ? widen(base[c]) : A(0);
            o[c] = narrow<T>(p ? x + widen(p[c]) : x);
        }
    }
}

template <typename E>
__global__ void mask_kernel(const E *__restrict__ mask, int64_t mask_batch, int64_t heads, int64_t seq,
                            const int32_t *__restrict__ idx, int64_t batch, int64_t keep, E *__restrict__ out) {
    const int64_t n = batch * heads * keep * keep;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t j = e % keep, i = (e / keep) % keep, bh = e / (keep * keep);
        const int64_t h = bh % heads, b = bh / heads;
        const int32_t pi = idx[b * keep + i], pj = idx[b * keep + j];
        const int64_t mb = mask_batch == 1 ? 0 : b;
        E v;
        memset(&v, 0, sizeof v);
        if (pi >= 0 && pi < seq && pj >= 0 && pj < seq) v = mask[((mb * heads + h) * seq + pi) * seq + pj];
        out[e] = v;
    }
}

int grid_for(int64_t items, int per_block) {
    const int64_t blocks = (items + per_block - 1) / per_block;
    return (int)(blocks < 1 ? 1 : (blocks > (1 << 20) ? (1 << 20) : blocks));
}

/* the widest of 16/8/4/2/1 bytes that divides a row and every base pointer */
int vector_bytes(int64_t row_bytes, const void *a, const void *b, const void *c) {
    for (int w = 16; w > 1; w /= 2) {
        if (row_bytes % w) continue;
        if ((uintptr_t)a % w || (uintptr_t)b % w || (uintptr_t)c % w) continue;
        return w;
    }
    return 1;
}

bool shape_ok(const dsc_rltd_shape *s) {
    return s && s->batch >= 0 && s->seq >= 0 && s->hidden >= 0 && s->keep >= 0 && s->keep <= s->seq &&
           (s->itemsize == 1 || s->itemsize == 2 || s->itemsize == 4 || s->itemsize == 8) &&
           s->seq <= INT32_MAX;
}

int finish() { return static_cast<int>(cudaGetLastError()); }

template <typename V>
void launch_gather(const void *hidden, const int32_t *idx, const Geo &g, int64_t row_bytes, void *out,
                   cudaStream_t st) {
    gather_kernel<V><<<grid_for(g.batch * g.keep, kWarps), kThreads, 0, st>>>(
        static_cast<const V *>(hidden), idx, g, row_bytes / (int64_t)sizeof(V), static_cast<V *>(out));
}

template <typename V>
void launch_scatter(const void *hidden, const void *part, const int32_t *inv, const Geo &g, int64_t row_bytes,
                    void *out, cudaStream_t st) {
    scatter_kernel<V><<<grid_for(g.batch * g.seq, kWarps), kThreads, 0, st>>>(
        static_cast<const V *>(hidden), static_cast<const V *>(part), inv, g, row_bytes / (int64_t)sizeof(V),
        static_cast<V *>(out));
}

template <typename T>
void launch_add(const void *hidden, const void *part, const int32_t *inv, const Geo &g, int64_t h, void *out,
                cudaStream_t st) {
    scatter_add_kernel<T><<<grid_for(g.batch * g.seq, kWarps), kThreads, 0, st>>>(
        static_cast<const T *>(hidden), static_cast<const T *>(part), inv, g, h, static_cast<T *>(out));
}

}  // namespace

extern "C" int dsc_rltd_gather_cuda(const void *hidden, const int32_t *idx, const dsc_rltd_shape *s, void *out,
                                    cudaStream_t stream) {
    if (!shape_ok(s)) return DSC_RLTD_EINVAL;
    const Geo g{s->batch, s->seq, s->keep, s->batch_first};
    const int64_t row_bytes = s->hidden * s->itemsize;
    if (g.batch * g.keep == 0 || row_bytes == 0) return DSC_RLTD_OK;
    switch (vector_bytes(row_bytes, hidden, out, nullptr)) {
    case 16: launch_gather<uint4>(hidden, idx, g, row_bytes, out, stream); break;
    case 8: launch_gather<uint2>(hidden, idx, g, row_bytes, out, stream); break;
    case 4: launch_gather<uint32_t>(hidden, idx, g, row_bytes, out, stream); break;
    case 2: launch_gather<uint16_t>(hidden, idx, g, row_bytes, out, stream); break;
    default: launch_gather<uint8_t>(hidden, idx, g, row_bytes, out, stream);
    }
    return finish();
}

extern "C" int dsc_rltd_scatter_cuda(const void *hidden, const void *part, const int32_t *idx,
                                     const dsc_rltd_shape *s, int accumulate, int32_t *inv, void *out,
                                     cudaStream_t stream) {
    if (!shape_ok(s)) return DSC_RLTD_EINVAL;
    const Geo g{s->batch, s->seq, s->keep, s->batch_first};
    const int64_t row_bytes = s->hidden * s->itemsize;
    if (g.batch * g.seq == 0 || row_bytes == 0) return DSC_RLTD_OK;
    cudaError_t err = cudaMemsetAsync(inv, 0xFF, sizeof(int32_t) * (size_t)(g.batch * g.seq), stream); /* -1 */
    if (err != cudaSuccess) return static_cast<int>(err);
    if (g.keep) inverse_kernel<<<grid_for(g.batch * g.keep, kThreads), kThreads, 0, stream>>>(idx, g, inv);
    if (accumulate) {
        switch (s->dtype) {
        case DSC_RLTD_F32: launch_add<float>(hidden, part, inv, g, s->hidden, out, stream); break;
        case DSC_RLTD_F64: launch_add<double>(hidden, part, inv, g, s->hidden, out, stream); break;
        case DSC_RLTD_F16: launch_add<__half>(hidden, part, inv, g, s->hidden, out, stream); break;
        case DSC_RLTD_BF16: launch_add<__nv_bfloat16>(hidden, part, inv, g, s->hidden, out, stream); break;
        default: return DSC_RLTD_EINVAL;
        }
        return finish();
    }
    switch (vector_bytes(row_bytes, hidden, part, out)) {
    case 16: launch_scatter<uint4>(hidden, part, inv, g, row_bytes, out, stream); break;
    case 8: launch_scatter<uint2>(hidden, part, inv, g, row_bytes, out, stream); break;
    case 4: launch_scatter<uint32_t>(hidden, part, inv, g, row_bytes, out, stream); break;
    case 2: launch_scatter<uint16_t>(hidden, part, inv, g, row_bytes, out, stream); break;
    default: launch_scatter<uint8_t>(hidden, part, inv, g, row_bytes, out, stream);
    }
    return finish();
}

extern "C" int dsc_rltd_mask_gather_cuda(const void *mask, int64_t mask_batch, int64_t heads, int64_t seq,
                                         const int32_t *idx, int64_t batch, int64_t keep, int itemsize, void *out,
                                         cudaStream_t stream) {
    if (batch < 0 || keep < 0 || keep > seq || heads < 0 || (mask_batch != 1 && mask_batch != batch))
        return DSC_RLTD_EINVAL;
    const int64_t n = batch * heads * keep * keep;
    if (n == 0) return DSC_RLTD_OK;
    const int grid = grid_for(n, kThreads);
    switch (itemsize) {
    case 1: mask_kernel<uint8_t><<<grid, kThreads, 0, stream>>>(static_cast<const uint8_t *>(mask), mask_batch, heads, seq, idx, batch, keep, static_cast<uint8_t *>(out)); break;
    case 2: mask_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(static_cast<const uint16_t *>(mask), mask_batch, heads, seq, idx, batch, keep, static_cast<uint16_t *>(out)); break;
    case 4: mask_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(static_cast<const uint32_t *>(mask), mask_batch, heads, seq, idx, batch, keep, static_cast<uint32_t *>(out)); break;
    case 8: mask_kernel<uint64_t><<<grid, kThreads, 0, stream>>>(static_cast<const uint64_t *>(mask), mask_batch, heads, seq, idx, batch, keep, static_cast<uint64_t *>(out)); break;
    default: return DSC_RLTD_EINVAL;
    }
    return finish();
}

extern "C" const char *dsc_rltd_cuda_strerror(int code) {
    if (code == DSC_RLTD_EINVAL) return "invalid sizes";
    return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : "unknown deepspeed_c random-LTD error";
}

DSC_CUDA_ENTER_LEAVE(dsc_rltd)
