// Scaled, masked softmax of the transformer layer's attention scores (in place, between the
// q k^T and p v GEMMs) and its backward. One block per score row, the row in shared memory as
// float32. The additive mask is float32 [B, mask_rows, Sk]: one row for all queries (BERT's
// padding mask) or one per query.
#include <type_traits>

#include "inference_common.cuh"
#include "dsc/transformer_cuda.h"

namespace {
using namespace dsc_inf;

template <typename T>
__global__ void softmax_kernel(T *__restrict__ s, const float *__restrict__ mask, int64_t heads, int Sq, int Sk,
                               int mask_rows, float scale) {
    extern __shared__ float row_s[];  // [Sk]
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const int q = (int)(row % Sq);
    const int64_t b = row / ((int64_t)Sq * heads);
    const float *m = mask ? mask + (b * mask_rows + (mask_rows == 1 ? 0 : q)) * Sk : nullptr;
    T *p = s + row * Sk;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < Sk; j += blockDim.x) {
        const float v = load(p + j) * scale + (m ? m[j] : 0.f);
        row_s[j] = v;
        mx = fmaxf(mx, v);
    }
    {  // block max
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
        mx = warp_max(mx);
        __syncthreads();
        if (lane == 0) scratch[warp] = mx;
        __syncthreads();
        mx = warp_max(lane < nwarps ? scratch[lane] : -INFINITY);
    }
    float sum = 0.f;
    for (int j = threadIdx.x; j < Sk; j += blockDim.x) {
        const float e = mx == -INFINITY ? 0.f : __expf(row_s[j] - mx);
        row_s[j] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int j = threadIdx.x; j < Sk; j += blockDim.x) store(p + j, row_s[j] * inv);
}

template <typename T>
__global__ void softmax_backward_kernel(T *__restrict__ dp, const T *__restrict__ p, int cols, float scale) {
    __shared__ float scratch[32];
    const int64_t off = (int64_t)blockIdx.x * cols;
    float dot = 0.f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) dot += load(p + off + j) * load(dp + off + j);
    dot = block_sum(dot, scratch);
    for (int j = threadIdx.x; j < cols; j += blockDim.x)
        store(dp + off + j, scale * load(p + off + j) * (load(dp + off + j) - dot));
}

int threads_for(int64_t cols) {
    int t = 32;
    while (t < 1024 && t * 4 < cols) t *= 2;
    return t;
}
} // namespace

extern "C" int dsc_tf_softmax(void *scores, const float *mask, int64_t B, int64_t heads, int64_t Sq, int64_t Sk,
                              int64_t mask_rows, float scale, int dtype, int device, cudaStream_t stream) {
    const int64_t rows = B * heads * Sq;
    if (!scores || B < 0 || heads < 1 || Sq < 1 || Sk < 1 || Sk > DSC_TF_MAX_COLS || rows > 0x7fffffffLL ||
        (mask && mask_rows != 1 && mask_rows != Sq))
        return DSC_CUDA_EARG;
    if (rows == 0) return 0;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    const size_t smem = sizeof(float) * (size_t)Sk;
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        const int rc = allow_smem(softmax_kernel<E>, smem, 32 * sizeof(float));
        if (rc != 0) return rc;
        softmax_kernel<E><<<(unsigned)rows, threads_for(Sk), smem, stream>>>(
            static_cast<E *>(scores), mask, heads, (int)Sq, (int)Sk, (int)mask_rows, scale);
        return launch_error();
    });
}

extern "C" int dsc_tf_softmax_backward(void *dp, const void *p, int64_t rows, int64_t cols, float scale, int dtype,
                                       int device, cudaStream_t stream) {
    if (!dp || !p || rows < 0 || cols < 1 || rows > 0x7fffffffLL || cols > 0x7fffffffLL) return DSC_CUDA_EARG;
    if (rows == 0) return 0;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        softmax_backward_kernel<E><<<(unsigned)rows, threads_for(cols), 0, stream>>>(
            static_cast<E *>(dp), static_cast<const E *>(p), (int)cols, scale);
        return launch_error();
    });
}
