// Bias + dropout + residual + LayerNorm of the transformer layer, and the LayerNorm backward.
// Forward: one block per row, the row kept in shared memory as float32 (two-pass variance).
// Backward: each block walks a strided set of rows, writes dx, and keeps its own float32 partial
// column sums of dy * xhat and dy (the gamma and beta gradients) in shared memory; the caller sums
// the blocks' partials. With normalize_invertible the norm's input is never stored: xhat is
// recovered from the output as (y - beta) / gamma.
#include <type_traits>

#include "inference_common.cuh"
#include "dsc/transformer_cuda.h"

namespace {
using namespace dsc_inf;

template <typename T>
__global__ void residual_norm_kernel(const T *__restrict__ x, const T *__restrict__ bias, const T *__restrict__ res,
                                     const uint8_t *__restrict__ keep, float drop_scale, const T *__restrict__ gamma,
                                     const T *__restrict__ beta, T *__restrict__ r_out, T *__restrict__ y_out,
                                     float *__restrict__ mean_out, float *__restrict__ rstd_out, int cols,
                                     float eps) {
    extern __shared__ float row_s[];  // [cols]
    __shared__ float scratch[32];
    const int64_t off = (int64_t)blockIdx.x * cols;
    float sum = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = load(x + off + c);
        if (bias) v += load(bias + c);
        if (keep) v = keep[off + c] ? v * drop_scale : 0.f;
        if (res) v += load(res + off + c);
        v = round_to<T>(v);
        if (r_out) store(r_out + off + c, v);
        row_s[c] = v;
        sum += v;
    }
    if (!gamma) return;
    const float mean = block_sum(sum, scratch) / cols;
    float sq = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float d = row_s[c] - mean;
        sq += d * d;
    }
    const float rstd = rsqrtf(block_sum(sq, scratch) / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float y = (row_s[c] - mean) * rstd * load(gamma + c) + (beta ? load(beta + c) : 0.f);
        store(y_out + off + c, y);
    }
    if (threadIdx.x == 0) {
        mean_out[blockIdx.x] = mean;
        rstd_out[blockIdx.x] = rstd;
    }
}

template <typename T>
__global__ void norm_backward_kernel(const T *__restrict__ dy, const T *__restrict__ src, const T *__restrict__ gamma,
                                     const T *__restrict__ beta, const float *__restrict__ mean,
                                     const float *__restrict__ rstd, const T *__restrict__ extra, T *__restrict__ dx,
                                     float *__restrict__ dgamma_part, float *__restrict__ dbeta_part, int64_t rows,
                                     int cols, int invertible) {
    extern __shared__ float smem[];  // xhat, g, dgamma partial, dbeta partial: [cols] each
    __shared__ float scratch[32];
    float *xh_s = smem, *g_s = smem + cols, *dg_s = smem + 2 * cols, *db_s = smem + 3 * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dg_s[c] = db_s[c] = 0.f;
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const int64_t off = row * cols;
        const float rs = rstd[row], mu = invertible ? 0.f : mean[row];
        float s1 = 0.f, s2 = 0.f;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const float gm = load(gamma + c), d = load(dy + off + c), v = load(src + off + c);
            const float xh = invertible ? (v - (beta ? load(beta + c) : 0.f)) / gm : (v - mu) * rs;
            const float g = d * gm;
            xh_s[c] = xh;
            g_s[c] = g;
            dg_s[c] += d * xh;
            db_s[c] += d;
            s1 += g;
            s2 += g * xh;
        }
        const float m1 = block_sum(s1, scratch) / cols;
        const float m2 = block_sum(s2, scratch) / cols;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            float v = rs * (g_s[c] - m1 - xh_s[c] * m2);
            if (extra) v += load(extra + off + c);
            store(dx + off + c, v);
        }
    }
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        dgamma_part[(int64_t)blockIdx.x * cols + c] = dg_s[c];
        dbeta_part[(int64_t)blockIdx.x * cols + c] = db_s[c];
    }
}

int threads_for(int64_t cols) {
    int t = 32;
    while (t < 1024 && t * 4 < cols) t *= 2;
    return t;
}
} // namespace

extern "C" int dsc_tf_residual_norm(const void *x, const void *bias, const void *res, const uint8_t *keep,
                                    float drop_scale, const void *gamma, const void *beta, void *r_out, void *y_out,
                                    float *mean_out, float *rstd_out, int64_t rows, int64_t cols, float eps,
                                    int dtype, int device, cudaStream_t stream) {
    if (!x || rows < 0 || cols < 1 || cols > DSC_TF_MAX_COLS || rows > 0x7fffffffLL ||
        (gamma && (!y_out || !mean_out || !rstd_out)) || (!gamma && !r_out))
        return DSC_CUDA_EARG;
    if (rows == 0) return 0;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    const size_t smem = sizeof(float) * (size_t)cols;
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        const int rc = allow_smem(residual_norm_kernel<E>, smem, 32 * sizeof(float));
        if (rc != 0) return rc;
        residual_norm_kernel<E><<<(unsigned)rows, threads_for(cols), smem, stream>>>(
            static_cast<const E *>(x), static_cast<const E *>(bias), static_cast<const E *>(res), keep, drop_scale,
            static_cast<const E *>(gamma), static_cast<const E *>(beta), static_cast<E *>(r_out),
            static_cast<E *>(y_out), mean_out, rstd_out, (int)cols, eps);
        return launch_error();
    });
}

extern "C" int dsc_tf_norm_backward(const void *dy, const void *src, const void *gamma, const void *beta,
                                    const float *mean, const float *rstd, const void *extra, void *dx,
                                    float *dgamma_part, float *dbeta_part, int64_t rows, int64_t cols, int64_t parts,
                                    int invertible, int dtype, int device, cudaStream_t stream) {
    if (!dy || !src || !gamma || !rstd || !dx || !dgamma_part || !dbeta_part || (!invertible && !mean) || rows < 0 ||
        cols < 1 || cols > DSC_TF_MAX_COLS || parts < 1 || parts > 65535)
        return DSC_CUDA_EARG;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    const size_t smem = 4 * sizeof(float) * (size_t)cols;
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        const int rc = allow_smem(norm_backward_kernel<E>, smem, 32 * sizeof(float));
        if (rc != 0) return rc;
        norm_backward_kernel<E><<<(unsigned)parts, threads_for(cols), smem, stream>>>(
            static_cast<const E *>(dy), static_cast<const E *>(src), static_cast<const E *>(gamma),
            static_cast<const E *>(beta), mean, rstd, static_cast<const E *>(extra), static_cast<E *>(dx),
            dgamma_part, dbeta_part, rows, (int)cols, invertible);
        return launch_error();
    });
}
