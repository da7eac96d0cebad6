// Bias + residual + LayerNorm/RMSNorm in one pass: one block per row; the residual sum is kept in
// shared memory (float32) so x, y and bias are read once, r is written once and n once.
#include "inference_common.cuh"

namespace {
using namespace dsc_inf;

template <typename T>
__global__ void add_norm_kernel(const T *__restrict__ x, const T *__restrict__ y, const T *__restrict__ bias,
                                const T *__restrict__ gamma, const T *__restrict__ beta, T *__restrict__ r_out,
                                T *__restrict__ n_out, int cols, float eps) {
    extern __shared__ float row_s[];  // [cols]
    __shared__ float scratch[32];
    const int64_t off = (int64_t)blockIdx.x * cols;
    float sum = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = load(x + off + c);
        if (y) v += load(y + off + c);
        if (bias) v += load(bias + c);
        if (r_out) {
            store(r_out + off + c, v);
            v = round_to<T>(v);  // the norm sees the residual the next block will read
        }
        row_s[c] = v;
        sum += v;
    }
    float mean = 0.f;
    if (beta) mean = block_sum(sum, scratch) / cols;
    float sq = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float d = row_s[c] - mean;
        sq += d * d;
    }
    const float inv = rsqrtf(block_sum(sq, scratch) / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = (row_s[c] - mean) * inv * load(gamma + c);
        if (beta) v += load(beta + c);
        store(n_out + off + c, v);
    }
}
} // namespace

extern "C" int dsc_inf_add_norm(const void *x, const void *y, const void *bias, const void *gamma, const void *beta,
                                void *r_out, void *n_out, int64_t rows, int64_t cols, float eps, int dtype, int device,
                                cudaStream_t stream) {
    if (!x || !gamma || !n_out || rows < 0 || cols < 1 || cols > DSC_INF_MAX_NORM_COLS || rows > 0x7fffffffLL)
        return DSC_CUDA_EARG;
    if (rows == 0) return 0;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    int threads = 32;
    while (threads < 1024 && threads * 4 < cols) threads *= 2;
    const size_t smem = sizeof(float) * (size_t)cols;
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        const int rc = allow_smem(add_norm_kernel<E>, smem, 32 * sizeof(float));
        if (rc != 0) return rc;
        add_norm_kernel<E><<<(unsigned)rows, threads, smem, stream>>>(
            static_cast<const E *>(x), static_cast<const E *>(y), static_cast<const E *>(bias),
            static_cast<const E *>(gamma), static_cast<const E *>(beta), static_cast<E *>(r_out),
            static_cast<E *>(n_out), (int)cols, eps);
        return launch_error();
    });
}
