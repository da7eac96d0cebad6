// Expert GEMVs of MoE decode (kernel-injected Mixtral-family blocks). The few tokens of a decode step each
// meet their top-k experts' weights, read straight out of the stacked expert tensors at the indices the
// router chose on the device: no host round trip (Hugging Face's expert loop asks the host which experts
// were hit), so the decode step stays one captured CUDA graph.
//   expand:  out[p, n] = sum_c x[p / k, c] w[idx[p], n, c]                      p = t k + j, one row a pair
//   combine: out[t, n] = sum_j wts[t k + j] sum_c x[t k + j, c] w[idx[t k + j], n, c]   the k experts' outputs
//            weighted and summed in float32 before the one rounding to the activation dtype
// One warp an output n of one pair (expand) or one token (combine); lanes stream 16-byte chunks of the weight
// row (8 bf16/fp16 or 4 float) with kInFlight chunks loaded before any is used, the activation row is
// L1-resident. An index outside [0, E) contributes zeros (a router's top-k indices always lie inside). The
// CPU reference is deepspeed_c/ops/transformer/inference/reference.py (moe_gemv).
#include <type_traits>

#include "transformer_vec.cuh"
#include "dsc/inference_cuda.h"

namespace {
using namespace dsc_tf;

constexpr int kWarps = 8;
constexpr int kInFlight = 4;

template <typename T, int V>
__global__ void __launch_bounds__(32 * kWarps) moe_gemv_kernel(const T *__restrict__ x, const int64_t *__restrict__ idx,
                                                               const float *__restrict__ wts, const T *__restrict__ w,
                                                               T *__restrict__ out, int k, int64_t experts, int N,
                                                               int C, int combine) {
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (n >= N) return;
    const int slot = blockIdx.y;  // a pair (expand) or a token (combine)
    const int first = combine ? slot * k : slot, count = combine ? k : 1;
    const int chunks = C / V;
    float total = 0.f;
    for (int j = 0; j < count; ++j) {
        const int p = first + j;
        const int64_t e = idx[p];  // the same for the whole warp: no divergence around warp_sum
        if (e < 0 || e >= experts) continue;
        const T *xr = x + (int64_t)(combine ? p : p / k) * C;
        const T *wr = w + (e * N + n) * (int64_t)C;
        float acc = 0.f;
        for (int c0 = lane; c0 < chunks; c0 += 32 * kInFlight) {
            Chunk<T, V> raw[kInFlight];
#pragma unroll
            for (int u = 0; u < kInFlight; ++u) {
                const int c = c0 + 32 * u;
                if (c < chunks) raw[u] = *reinterpret_cast<const Chunk<T, V> *>(wr + (int64_t)c * V);
            }
#pragma unroll
            for (int u = 0; u < kInFlight; ++u) {
                const int c = c0 + 32 * u;
                if (c >= chunks) break;
                float xv[V];
                load_chunk<T, V>(xr + (int64_t)c * V, xv);
#pragma unroll
                for (int i = 0; i < V; ++i) acc = fmaf(load(&raw[u].e[i]), xv[i], acc);
            }
        }
        acc = warp_sum(acc);
        total += combine ? wts[p] * acc : acc;
    }
    if (lane == 0) store(out + (int64_t)slot * N + n, total);
}
} // namespace

extern "C" int dsc_inf_moe_gemv(const void *x, const int64_t *idx, const float *wts, const void *w, void *out,
                                int64_t tokens, int64_t k, int64_t experts, int64_t N, int64_t C, int combine,
                                int dtype, int device, cudaStream_t stream) {
    const int64_t slots = combine ? tokens : tokens * k;
    if (!x || !idx || !w || !out || (combine && !wts) || tokens < 1 || k < 1 || experts < 1 || N < 1 ||
        N > INT32_MAX - kWarps || C < 1 || C > INT32_MAX || slots > 65535)
        return DSC_CUDA_EARG;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    const dim3 grid((unsigned)((N + kWarps - 1) / kWarps), (unsigned)slots);
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        constexpr int V = vec_width<E>();
        const E *xe = static_cast<const E *>(x), *we = static_cast<const E *>(w);
        E *oe = static_cast<E *>(out);
        if (C % V == 0 && aligned(x, 16) && aligned(w, 16))
            moe_gemv_kernel<E, V><<<grid, 32 * kWarps, 0, stream>>>(xe, idx, wts, we, oe, (int)k, experts, (int)N,
                                                                    (int)C, combine);
        else
            moe_gemv_kernel<E, 1><<<grid, 32 * kWarps, 0, stream>>>(xe, idx, wts, we, oe, (int)k, experts, (int)N,
                                                                    (int)C, combine);
        return launch_error();
    });
}
