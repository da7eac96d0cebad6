// The MLP activations between the two MLP GEMMs: bias + GELU in place (GPT-2) and the SiLU-gated
// product of the fused gate/up GEMM's halves (LLaMA family). Grid-stride elementwise loops.
#include "inference_common.cuh"

namespace {
using namespace dsc_inf;

__device__ __forceinline__ float gelu(float x, bool approximate) {
    if (approximate) {
        const float k = 0.7978845608028654f;  // sqrt(2 / pi)
        return 0.5f * x * (1.f + tanhf(k * (x + 0.044715f * x * x * x)));
    }
    return 0.5f * x * (1.f + erff(x * 0.7071067811865476f));
}

template <typename T>
__global__ void bias_gelu_kernel(T *__restrict__ h, const T *__restrict__ bias, int64_t n, int64_t cols,
                                 bool approximate) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v = load(h + i);
        if (bias) v += load(bias + i % cols);
        store(h + i, gelu(v, approximate));
    }
}

template <typename T>
__global__ void silu_mul_kernel(const T *__restrict__ gu, const T *__restrict__ bias, T *__restrict__ out, int64_t n,
                                int64_t f) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / f, c = i - r * f;
        float g = load(gu + r * 2 * f + c), u = load(gu + r * 2 * f + f + c);
        if (bias) {
            g += load(bias + c);
            u += load(bias + f + c);
        }
        store(out + i, g / (1.f + __expf(-g)) * u);
    }
}
} // namespace

extern "C" int dsc_inf_bias_gelu(void *h, const void *bias, int64_t rows, int64_t cols, int approximate, int dtype,
                                 int device, cudaStream_t stream) {
    if (!h || rows < 0 || cols < 1) return DSC_CUDA_EARG;
    if (rows == 0) return 0;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    const int64_t n = rows * cols;
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        bias_gelu_kernel<E><<<grid_for(n, 256), 256, 0, stream>>>(static_cast<E *>(h), static_cast<const E *>(bias), n,
                                                                   cols, approximate != 0);
        return launch_error();
    });
}

extern "C" int dsc_inf_silu_mul(const void *gu, const void *bias, void *out, int64_t rows, int64_t f, int dtype,
                                int device, cudaStream_t stream) {
    if (!gu || !out || rows < 0 || f < 1) return DSC_CUDA_EARG;
    if (rows == 0) return 0;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    const int64_t n = rows * f;
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        silu_mul_kernel<E><<<grid_for(n, 256), 256, 0, stream>>>(static_cast<const E *>(gu),
                                                                  static_cast<const E *>(bias), static_cast<E *>(out),
                                                                  n, f);
        return launch_error();
    });
}
