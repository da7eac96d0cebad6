// Weight-only quantized linear layers (quant section / dtype=torch.int8 of init_inference): weights
// stored as int8 or packed int4 with one float scale per (output row, group of `group` inputs).
//   int8: q[n, k] = round(w / s) in [-127, 127]
//   int4: byte q[n, k / 2] holds k even in its low nibble, k odd in its high one, each as
//         round(w / s) + 8 in [1, 15]
// quant_gemv: out[m, n] = sum_k x[m, k] * s[n, k / group] * q[n, k] for a few rows m (decode). At
// batch 1 this is bound by the weight bytes read, which is the point of quantizing them, so the
// kernel is built to keep HBM busy: one warp a weight row (two in a tuning variant), each lane
// streams 16-byte weight chunks (16 int8 or 32 int4 values) with U of them in flight before any
// is used (the loads bypass L1,
// the weights are read once), the activations are read straight from global memory (a few KiB,
// L1-resident after the first warp of an SM), and the integer -> float conversion is a byte
// permute into a float's mantissa plus one subtraction (no int -> float convert instructions,
// which run at a quarter of the FMA rate and would make the kernel compute-bound, int4 most).
// dequantize: the weights back in the activation dtype (for prefill's tensor-core GEMM).
#include "inference_common.cuh"

namespace {
using namespace dsc_inf;

constexpr int kMaxRows = 8;

// Bytes 0..255 become 2^23 + byte as a float (the byte in the low mantissa bits under exponent
// 0x4B); subtracting 2^23 + offset leaves byte - offset exactly.
template <int I> __device__ __forceinline__ float byte_as_float(uint32_t word, float magic_minus) {
    return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7440u + I)) - magic_minus;
}
constexpr float kInt8Magic = 8388608.f + 128.f;  // int8 bytes are flipped to offset binary (v + 128)
constexpr float kInt4Magic = 8388608.f + 8.f;    // int4 nibbles are stored as v + 8

__device__ __forceinline__ uint32_t word_of(const uint4 &v, int j) {
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// The 8 weights of 16-byte chunk `raw` that meet activations [8 j, 8 j + 8) of the chunk, in order.
template <int BITS> __device__ __forceinline__ void weights8(const uint4 &raw, int j, float w[8]) {
    if (BITS == 8) {
        const uint32_t a = word_of(raw, 2 * j) ^ 0x80808080u, b = word_of(raw, 2 * j + 1) ^ 0x80808080u;
        w[0] = byte_as_float<0>(a, kInt8Magic), w[1] = byte_as_float<1>(a, kInt8Magic);
        w[2] = byte_as_float<2>(a, kInt8Magic), w[3] = byte_as_float<3>(a, kInt8Magic);
        w[4] = byte_as_float<0>(b, kInt8Magic), w[5] = byte_as_float<1>(b, kInt8Magic);
        w[6] = byte_as_float<2>(b, kInt8Magic), w[7] = byte_as_float<3>(b, kInt8Magic);
    } else {
        const uint32_t word = word_of(raw, j);
        const uint32_t lo = word & 0x0F0F0F0Fu, hi = (word >> 4) & 0x0F0F0F0Fu;
        w[0] = byte_as_float<0>(lo, kInt4Magic), w[1] = byte_as_float<0>(hi, kInt4Magic);
        w[2] = byte_as_float<1>(lo, kInt4Magic), w[3] = byte_as_float<1>(hi, kInt4Magic);
        w[4] = byte_as_float<2>(lo, kInt4Magic), w[5] = byte_as_float<2>(hi, kInt4Magic);
        w[6] = byte_as_float<3>(lo, kInt4Magic), w[7] = byte_as_float<3>(hi, kInt4Magic);
    }
}

// 8 consecutive activations (16-byte aligned) as floats, through the read-only cache.
__device__ __forceinline__ void load8(const float *p, float v[8]) {
    const float4 a = __ldg(reinterpret_cast<const float4 *>(p)), b = __ldg(reinterpret_cast<const float4 *>(p) + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load8(const __half *p, float v[8]) {
    const uint4 u = __ldg(reinterpret_cast<const uint4 *>(p));
    const __half2 *h = reinterpret_cast<const __half2 *>(&u);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float2 f = __half22float2(h[j]);
        v[2 * j] = f.x, v[2 * j + 1] = f.y;
    }
}
__device__ __forceinline__ void load8(const __nv_bfloat16 *p, float v[8]) {
    const uint4 u = __ldg(reinterpret_cast<const uint4 *>(p));
#pragma unroll
    for (int j = 0; j < 4; j++) {  // a bfloat16 is the top half of a float
        const uint32_t w = word_of(u, j);
        v[2 * j] = __uint_as_float(w << 16), v[2 * j + 1] = __uint_as_float(w & 0xFFFF0000u);
    }
}

// Weights are streamed once: no L1 allocation, so the activations stay cached.
__device__ __forceinline__ uint4 load_stream(const uint4 *p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// One warp an output row n. Chunk c of the row (16 bytes) holds weights [c W, c W + W) with
// W = 16 (int8) or 32 (int4); its scale is scales[n, c / (group / W)], the division done as a
// multiply-high by ceil(2^32 / (group / W)) (exact for c < 2^16, checked by the launcher; 0 when
// group == W: one scale a chunk).
template <typename T, int BITS, int U, int R>
__global__ void __launch_bounds__(256, R == 1 ? 4 : 1) quant_gemv_kernel(const T *__restrict__ x, const uint8_t *__restrict__ q,
                                                         const float *__restrict__ scales, T *__restrict__ out, int M,
                                                         int N, int K, int groups, uint32_t scale_div) {
    constexpr int W = BITS == 8 ? 16 : 32;
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= N) return;
    const int chunks = K / W;
    const uint4 *qr = reinterpret_cast<const uint4 *>(q + static_cast<int64_t>(n) * (K / (8 / BITS)));
    const float *sr = scales + static_cast<int64_t>(n) * groups;
    float acc[R];
#pragma unroll
    for (int m = 0; m < R; m++) acc[m] = 0.f;
    for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
        uint4 raw[U];
        float s[U];
#pragma unroll
        for (int u = 0; u < U; u++) {  // every load of this round issued before any is used
            const int c = c0 + 32 * u;
            raw[u] = make_uint4(0u, 0u, 0u, 0u), s[u] = 0.f;
            if (c < chunks) {
                const uint32_t g = scale_div ? __umulhi(static_cast<uint32_t>(c), scale_div) : c;
                raw[u] = load_stream(qr + c);
                s[u] = __ldg(sr + g);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = c0 + 32 * u;
            if (c >= chunks) break;
            float part[R];
#pragma unroll
            for (int m = 0; m < R; m++) part[m] = 0.f;
#pragma unroll
            for (int j = 0; j < W / 8; j++) {
                float w[8];
                weights8<BITS>(raw[u], j, w);
#pragma unroll
                for (int m = 0; m < R; m++) {
                    if (R > 1 && m >= M) break;
                    float xv[8];
                    load8(x + static_cast<int64_t>(m) * K + c * W + 8 * j, xv);
#pragma unroll
                    for (int i = 0; i < 8; i++) part[m] = fmaf(w[i], xv[i], part[m]);
                }
            }
#pragma unroll
            for (int m = 0; m < R; m++) acc[m] = fmaf(s[u], part[m], acc[m]);
        }
    }
#pragma unroll
    for (int m = 0; m < R; m++) {
        if (R > 1 && m >= M) break;
        const float v = warp_sum(acc[m]);
        if (lane == 0) store(out + static_cast<int64_t>(m) * N + n, v);
    }
}

// Batch 1, two weight rows a warp (a tuning variant): each activation load and conversion serves both rows,
// which matters most for int4 (a byte of weights meets 4 bytes of bf16 activations).
template <typename T, int BITS, int U>
__global__ void __launch_bounds__(256, 3) quant_gemv_rows2_kernel(const T *__restrict__ x, const uint8_t *__restrict__ q,
                                                                  const float *__restrict__ scales, T *__restrict__ out,
                                                                  int N, int K, int groups, uint32_t scale_div) {
    constexpr int W = BITS == 8 ? 16 : 32;
    const int lane = threadIdx.x & 31;
    const int n0 = 2 * (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5));
    if (n0 >= N) return;
    const bool second = n0 + 1 < N;
    const int chunks = K / W;
    const int64_t row_bytes = K / (8 / BITS);
    const uint4 *qr0 = reinterpret_cast<const uint4 *>(q + static_cast<int64_t>(n0) * row_bytes);
    const uint4 *qr1 = reinterpret_cast<const uint4 *>(q + static_cast<int64_t>(second ? n0 + 1 : n0) * row_bytes);
    const float *sr0 = scales + static_cast<int64_t>(n0) * groups;
    const float *sr1 = scales + static_cast<int64_t>(second ? n0 + 1 : n0) * groups;
    float acc0 = 0.f, acc1 = 0.f;
    for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
        uint4 raw0[U], raw1[U];
        float s0[U], s1[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = c0 + 32 * u;
            raw0[u] = raw1[u] = make_uint4(0u, 0u, 0u, 0u), s0[u] = s1[u] = 0.f;
            if (c < chunks) {
                const uint32_t g = scale_div ? __umulhi(static_cast<uint32_t>(c), scale_div) : c;
                raw0[u] = load_stream(qr0 + c), raw1[u] = load_stream(qr1 + c);
                s0[u] = __ldg(sr0 + g), s1[u] = __ldg(sr1 + g);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = c0 + 32 * u;
            if (c >= chunks) break;
            float p0 = 0.f, p1 = 0.f;
#pragma unroll
            for (int j = 0; j < W / 8; j++) {
                float xv[8], w[8];
                load8(x + c * W + 8 * j, xv);
                weights8<BITS>(raw0[u], j, w);
#pragma unroll
                for (int i = 0; i < 8; i++) p0 = fmaf(w[i], xv[i], p0);
                weights8<BITS>(raw1[u], j, w);
#pragma unroll
                for (int i = 0; i < 8; i++) p1 = fmaf(w[i], xv[i], p1);
            }
            acc0 = fmaf(s0[u], p0, acc0), acc1 = fmaf(s1[u], p1, acc1);
        }
    }
    acc0 = warp_sum(acc0), acc1 = warp_sum(acc1);
    if (lane == 0) {
        store(out + n0, acc0);
        if (second) store(out + n0 + 1, acc1);
    }
}

template <typename T> __device__ __forceinline__ void store8(T *p, const float v[8]);
template <> __device__ __forceinline__ void store8(float *p, const float v[8]) {
    reinterpret_cast<float4 *>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4 *>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
template <> __device__ __forceinline__ void store8(__half *p, const float v[8]) {
    uint4 u;
    __half2 *h = reinterpret_cast<__half2 *>(&u);
#pragma unroll
    for (int j = 0; j < 4; j++) h[j] = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
    *reinterpret_cast<uint4 *>(p) = u;
}
template <> __device__ __forceinline__ void store8(__nv_bfloat16 *p, const float v[8]) {
    uint4 u;
    __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&u);
#pragma unroll
    for (int j = 0; j < 4; j++) h[j] = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
    *reinterpret_cast<uint4 *>(p) = u;
}

// One thread a 16-byte chunk (the layout of quant_gemv_kernel), written as 16-byte stores.
template <typename T, int BITS>
__global__ void dequantize_vec_kernel(const uint8_t *__restrict__ q, const float *__restrict__ scales,
                                      T *__restrict__ out, int64_t chunks, int64_t chunks_per_group) {
    constexpr int W = BITS == 8 ? 16 : 32;
    for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < chunks; c += (int64_t)gridDim.x * blockDim.x) {
        const uint4 raw = load_stream(reinterpret_cast<const uint4 *>(q) + c);
        const float s = __ldg(scales + c / chunks_per_group);
#pragma unroll
        for (int j = 0; j < W / 8; j++) {
            float w[8];
            weights8<BITS>(raw, j, w);
#pragma unroll
            for (int i = 0; i < 8; i++) w[i] *= s;
            store8(out + c * W + 8 * j, w);
        }
    }
}

// Any shape the vector kernel does not take (group or width not a multiple of a chunk).
template <typename T>
__global__ void dequantize_kernel(const uint8_t *__restrict__ q, const float *__restrict__ scales, T *__restrict__ out,
                                  int64_t N, int64_t K, int bits, int64_t group) {
    const int64_t total = N * K, groups = K / group;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t n = i / K, k = i - n * K;
        float v;
        if (bits == 8) {
            v = static_cast<float>(reinterpret_cast<const int8_t *>(q)[i]);
        } else {
            const uint8_t b = q[n * (K / 2) + k / 2];
            v = static_cast<float>(static_cast<int>((k & 1) ? (b >> 4) : (b & 15)) - 8);
        }
        store(out + i, v * scales[n * groups + k / group]);
    }
}

bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <typename T, int BITS, int U>
int launch_gemv(const void *x, const void *q, const float *scales, void *out, int M, int N, int K, int group, int warps,
                bool rows2, cudaStream_t stream) {
    constexpr int W = BITS == 8 ? 16 : 32;
    const uint32_t per_scale = static_cast<uint32_t>(group / W);
    const uint32_t div = per_scale == 1 ? 0u : static_cast<uint32_t>((0x100000000ull + per_scale - 1) / per_scale);
    const unsigned blocks = static_cast<unsigned>((N + warps - 1) / warps);
    const T *xt = static_cast<const T *>(x);
    T *ot = static_cast<T *>(out);
    const uint8_t *qb = static_cast<const uint8_t *>(q);
    if constexpr (sizeof(T) < 4) {
        if (M == 1 && rows2) {  // two rows' loads in flight a chunk: at most 4 chunks deep
            constexpr int U2 = U > 4 ? 4 : U;
            const unsigned blocks2 = static_cast<unsigned>((N + 2 * warps - 1) / (2 * warps));
            quant_gemv_rows2_kernel<T, BITS, U2><<<blocks2, 32 * warps, 0, stream>>>(xt, qb, scales, ot, N, K,
                                                                                      K / group, div);
            return launch_error();
        }
    }
    if (M == 1)  // decode at batch 1: no row loop
        quant_gemv_kernel<T, BITS, U, 1><<<blocks, 32 * warps, 0, stream>>>(xt, qb, scales, ot, M, N, K, K / group, div);
    else
        quant_gemv_kernel<T, BITS, U, kMaxRows><<<blocks, 32 * warps, 0, stream>>>(xt, qb, scales, ot, M, N, K,
                                                                                  K / group, div);
    return launch_error();
}

template <typename T, int BITS>
int launch_gemv_unroll(int unroll, const void *x, const void *q, const float *scales, void *out, int M, int N, int K,
                       int group, int warps, bool rows2, cudaStream_t stream) {
    if constexpr (sizeof(T) == 4) {  // float activations: the default launch only
        return launch_gemv<T, BITS, 4>(x, q, scales, out, M, N, K, group, warps, rows2, stream);
    } else {
        if (unroll == 0) {  // enough chunks in flight to cover a lane's share of the row in about one round
            const int per_lane = (K / (BITS == 8 ? 16 : 32) + 31) / 32;
            unroll = per_lane >= 6 ? 8 : per_lane >= 3 ? 4 : 2;
        }
        if (unroll == 2) return launch_gemv<T, BITS, 2>(x, q, scales, out, M, N, K, group, warps, rows2, stream);
        if (unroll == 8) return launch_gemv<T, BITS, 8>(x, q, scales, out, M, N, K, group, warps, rows2, stream);
        return launch_gemv<T, BITS, 4>(x, q, scales, out, M, N, K, group, warps, rows2, stream);
    }
}
} // namespace

extern "C" int dsc_inf_quant_gemv(const void *x, const void *q, const float *scales, void *out, int64_t M, int64_t N,
                                  int64_t K, int bits, int64_t group, int dtype, int device, cudaStream_t stream,
                                  int variant) {
    const int64_t w = bits == 8 ? 16 : 32;  // weights a 16-byte chunk
    int unroll = variant % 100;
    const int warps = (variant / 100) % 10 == 0 ? 8 : (variant / 100) % 10;
    bool rows2 = variant >= 1000;
    if (variant == 0 && M == 1 && dtype != DSC_CUDA_F32) {
        // batch 1 at 16-bit activations: two rows a warp, 2 chunks deep (H200, LLaMA-7B linears, session 4:
        // 1.73x (int8) / 2.00x (int4) cuBLAS bf16 over a layer's four GEMVs, the best of the launches swept)
        rows2 = true, unroll = 2;
    }
    if (!x || !q || !scales || !out || M < 1 || M > kMaxRows || N < 1 || N > INT32_MAX || K < w || K % w ||
        group < w || group % w || K % group || K / w >= 65536 || (bits != 8 && bits != 4) || variant < 0 ||
        (unroll != 0 && unroll != 2 && unroll != 4 && unroll != 8) || (warps != 4 && warps != 8) || variant > 1808 ||
        !aligned16(x) || !aligned16(q))
        return DSC_CUDA_EARG;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        const int m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K), g = static_cast<int>(group);
        return bits == 8 ? launch_gemv_unroll<E, 8>(unroll, x, q, scales, out, m, n, k, g, warps, rows2, stream)
                         : launch_gemv_unroll<E, 4>(unroll, x, q, scales, out, m, n, k, g, warps, rows2, stream);
    });
}

extern "C" int dsc_inf_dequantize(const void *q, const float *scales, void *out, int64_t N, int64_t K, int bits,
                                  int64_t group, int dtype, int device, cudaStream_t stream) {
    if (!q || !scales || !out || N < 1 || K < 1 || group < 1 || K % group || (bits != 8 && bits != 4) ||
        (bits == 4 && K % 2))
        return DSC_CUDA_EARG;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    const int64_t w = bits == 8 ? 16 : 32;
    const bool vec = group % w == 0 && aligned16(q) && aligned16(out);
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        if (vec) {
            const int64_t chunks = N * K / w;
            if (bits == 8)
                dequantize_vec_kernel<E, 8><<<grid_for(chunks, 256), 256, 0, stream>>>(
                    static_cast<const uint8_t *>(q), scales, static_cast<E *>(out), chunks, group / w);
            else
                dequantize_vec_kernel<E, 4><<<grid_for(chunks, 256), 256, 0, stream>>>(
                    static_cast<const uint8_t *>(q), scales, static_cast<E *>(out), chunks, group / w);
        } else {
            dequantize_kernel<E><<<grid_for(N * K, 256), 256, 0, stream>>>(static_cast<const uint8_t *>(q), scales,
                                                                           static_cast<E *>(out), N, K, bits, group);
        }
        return launch_error();
    });
}
