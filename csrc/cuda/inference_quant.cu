// Weight-only quantized linear layers (quant section / dtype=torch.int8 of init_inference): weights
// stored as int8 or packed int4 with one float scale per (output row, group of `group` inputs).
//   int8: q[n, k] = round(w / s) in [-127, 127]
//   int4: byte q[n, k / 2] holds k even in its low nibble, k odd in its high one, each as
//         round(w / s) + 8 in [1, 15]
// quant_gemv: out[m, n] = sum_k x[m, k] * s[n, k / group] * q[n, k] for a few rows m (decode): one
// warp a weight row, 16 weights a lane a step read as one 16- or 8-byte load, the activations staged
// in shared memory once a block; memory-bound on the weights, which is the point of quantizing them.
// dequantize: the weights back in the activation dtype (for prefill's tensor-core GEMM).
#include "inference_common.cuh"

namespace {
using namespace dsc_inf;

constexpr int kMaxRows = 8;
constexpr int kWarps = 8;
constexpr int kPerLane = 16;

__device__ __forceinline__ void unpack16(const uint8_t *p, int bits, float w[kPerLane]) {
    if (bits == 8) {
        const uint4 v = *reinterpret_cast<const uint4 *>(p);
        const int8_t *b = reinterpret_cast<const int8_t *>(&v);
#pragma unroll
        for (int j = 0; j < kPerLane; j++) w[j] = static_cast<float>(b[j]);
    } else {
        const uint2 v = *reinterpret_cast<const uint2 *>(p);
        const uint8_t *b = reinterpret_cast<const uint8_t *>(&v);
#pragma unroll
        for (int j = 0; j < kPerLane / 2; j++) {
            w[2 * j] = static_cast<float>(static_cast<int>(b[j] & 15) - 8);
            w[2 * j + 1] = static_cast<float>(static_cast<int>(b[j] >> 4) - 8);
        }
    }
}

// 16 consecutive activations (16-element aligned) as floats: vector loads from shared memory (a lane's
// scalar loads at a 32-byte stride would hit the same banks 8 lanes at a time).
__device__ __forceinline__ void load16(const float *p, float v[kPerLane]) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float4 f = reinterpret_cast<const float4 *>(p)[i];
        v[4 * i] = f.x, v[4 * i + 1] = f.y, v[4 * i + 2] = f.z, v[4 * i + 3] = f.w;
    }
}
__device__ __forceinline__ void load16(const __half *p, float v[kPerLane]) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const uint4 u = reinterpret_cast<const uint4 *>(p)[i];
        const __half2 *h = reinterpret_cast<const __half2 *>(&u);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 f = __half22float2(h[j]);
            v[8 * i + 2 * j] = f.x, v[8 * i + 2 * j + 1] = f.y;
        }
    }
}
__device__ __forceinline__ void load16(const __nv_bfloat16 *p, float v[kPerLane]) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const uint4 u = reinterpret_cast<const uint4 *>(p)[i];
        const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 f = __bfloat1622float2(h[j]);
            v[8 * i + 2 * j] = f.x, v[8 * i + 2 * j + 1] = f.y;
        }
    }
}

template <typename T>
__global__ void quant_gemv_kernel(const T *__restrict__ x, const uint8_t *__restrict__ q,
                                  const float *__restrict__ scales, T *__restrict__ out, int M, int64_t N, int64_t K,
                                  int bits, int64_t group) {
    extern __shared__ unsigned char smem_raw[];
    T *xs = reinterpret_cast<T *>(smem_raw);
    for (int64_t i = threadIdx.x; i < (int64_t)M * K; i += blockDim.x) xs[i] = x[i];
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t n = (int64_t)blockIdx.x * kWarps + warp;
    if (n >= N) return;
    const int64_t row_bytes = bits == 8 ? K : K / 2;
    const int64_t groups = K / group;
    const uint8_t *qr = q + n * row_bytes;
    const float *sr = scales + n * groups;
    float acc[kMaxRows];
#pragma unroll
    for (int m = 0; m < kMaxRows; m++) acc[m] = 0.f;
    for (int64_t k0 = (int64_t)lane * kPerLane; k0 < K; k0 += 32 * kPerLane) {
        float w[kPerLane];
        unpack16(qr + (bits == 8 ? k0 : k0 / 2), bits, w);
        const float s = sr[k0 / group];
#pragma unroll
        for (int m = 0; m < kMaxRows; m++) {
            if (m >= M) break;
            float xv[kPerLane];
            load16(xs + (int64_t)m * K + k0, xv);
            float part = 0.f;
#pragma unroll
            for (int j = 0; j < kPerLane; j++) part += w[j] * xv[j];
            acc[m] += s * part;
        }
    }
#pragma unroll
    for (int m = 0; m < kMaxRows; m++) {
        if (m >= M) break;
        const float v = warp_sum(acc[m]);
        if (lane == 0) store(out + (int64_t)m * N + n, v);
    }
}

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
} // namespace

extern "C" int dsc_inf_quant_gemv(const void *x, const void *q, const float *scales, void *out, int64_t M, int64_t N,
                                  int64_t K, int bits, int64_t group, int dtype, int device, cudaStream_t stream) {
    if (!x || !q || !scales || !out || M < 1 || M > kMaxRows || N < 1 || K < kPerLane || K % kPerLane ||
        group < kPerLane || group % kPerLane || K % group || (bits != 8 && bits != 4))
        return DSC_CUDA_EARG;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        const size_t smem = static_cast<size_t>(M * K) * sizeof(E);
        int rc = allow_smem(quant_gemv_kernel<E>, smem, 0);
        if (rc != 0) return rc;
        const unsigned blocks = static_cast<unsigned>((N + kWarps - 1) / kWarps);
        quant_gemv_kernel<E><<<blocks, 32 * kWarps, smem, stream>>>(
            static_cast<const E *>(x), static_cast<const uint8_t *>(q), scales, static_cast<E *>(out),
            static_cast<int>(M), N, K, bits, group);
        return launch_error();
    });
}

extern "C" int dsc_inf_dequantize(const void *q, const float *scales, void *out, int64_t N, int64_t K, int bits,
                                  int64_t group, int dtype, int device, cudaStream_t stream) {
    if (!q || !scales || !out || N < 1 || K < 1 || group < 1 || K % group || (bits != 8 && bits != 4) ||
        (bits == 4 && K % 2))
        return DSC_CUDA_EARG;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        dequantize_kernel<E><<<grid_for(N * K, 256), 256, 0, stream>>>(static_cast<const uint8_t *>(q), scales,
                                                                       static_cast<E *>(out), N, K, bits, group);
        return launch_error();
    });
}
