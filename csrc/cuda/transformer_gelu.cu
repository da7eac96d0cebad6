// Bias + GELU of the transformer layer's FFN and its backward. The pre-activation u is rounded to
// the activation dtype before GELU, so a gelu_checkpoint recompute from the stored u gives the
// very numbers the forward produced. Exact GELU (erf), as Hugging Face BERT's "gelu".
#include <type_traits>

#include "inference_common.cuh"
#include "dsc/transformer_cuda.h"

namespace {
using namespace dsc_inf;

__device__ __forceinline__ float gelu(float u) { return 0.5f * u * (1.f + erff(u * 0.70710678118654752f)); }

__device__ __forceinline__ float gelu_grad(float u) {
    const float cdf = 0.5f * (1.f + erff(u * 0.70710678118654752f));
    const float pdf = 0.39894228040143268f * __expf(-0.5f * u * u);
    return cdf + u * pdf;
}

// f and u_out may be the same buffer: each element is read, then written, by one thread.
template <typename T>
__global__ void bias_gelu_kernel(const T *f, const T *__restrict__ bias, T *u_out, T *__restrict__ g_out,
                                 int64_t n, int64_t cols) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float u = load(f + i);
        if (bias) u = round_to<T>(u + load(bias + i % cols));
        if (u_out) store(u_out + i, u);
        store(g_out + i, gelu(u));
    }
}

template <typename T>
__global__ void gelu_backward_kernel(T *dg, const T *__restrict__ u, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        store(dg + i, load(dg + i) * gelu_grad(load(u + i)));
}
} // namespace

extern "C" int dsc_tf_bias_gelu(const void *f, const void *bias, void *u_out, void *g_out, int64_t rows, int64_t cols,
                                int dtype, int device, cudaStream_t stream) {
    if (!f || !g_out || rows < 0 || cols < 1) return DSC_CUDA_EARG;
    const int64_t n = rows * cols;
    if (n == 0) return 0;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        bias_gelu_kernel<E><<<grid_for(n, 256), 256, 0, stream>>>(static_cast<const E *>(f),
                                                                  static_cast<const E *>(bias), static_cast<E *>(u_out),
                                                                  static_cast<E *>(g_out), n, cols);
        return launch_error();
    });
}

extern "C" int dsc_tf_gelu_backward(void *dg, const void *u, int64_t n, int dtype, int device, cudaStream_t stream) {
    if (!dg || !u || n < 0) return DSC_CUDA_EARG;
    if (n == 0) return 0;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        gelu_backward_kernel<E><<<grid_for(n, 256), 256, 0, stream>>>(static_cast<E *>(dg), static_cast<const E *>(u), n);
        return launch_error();
    });
}
