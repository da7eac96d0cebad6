// Bias + GELU of the transformer layer's FFN and its backward. The pre-activation u = f + bias is
// rounded to the activation dtype before GELU. The layer keeps f (the GEMM output) rather than u:
// the backward and a gelu_checkpoint recompute add the bias again the same way, so they see the
// very u the forward used, and the forward writes one tensor (g) instead of two. Exact GELU (erf),
// as Hugging Face BERT's "gelu".
//
// Layout: a thread owns one chunk of V columns (16 bytes when the row length and the pointers
// allow it, else V = 1) and walks a strip of rows (grid.y strips), so the bias chunk is read once
// and, in the backward, the bias gradient's column sums build up in registers: each strip writes
// its partial sums (float32 [parts, cols]), dsc_tf_sum_parts adds them. The CPU reference is
// deepspeed_c/ops/transformer/fused_reference.py (bias_gelu, gelu, gelu_backward).
#include <initializer_list>
#include <type_traits>

#include "transformer_vec.cuh"
#include "dsc/transformer_cuda.h"

namespace {
using namespace dsc_tf;

constexpr int kThreads = 128;

__device__ __forceinline__ float gelu(float u) { return 0.5f * u * (1.f + erff(u * 0.70710678118654752f)); }

__device__ __forceinline__ float gelu_grad(float u) {
    const float cdf = 0.5f * (1.f + erff(u * 0.70710678118654752f));
    const float pdf = 0.39894228040143268f * __expf(-0.5f * u * u);
    return cdf + u * pdf;
}

// f and u_out may be the same buffer: each chunk is read, then written, by one thread.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads) bias_gelu_kernel(const T *f, const T *__restrict__ bias, T *u_out,
                                                             T *__restrict__ g_out, int64_t rows, int cols) {
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (c >= cols) return;
    float b[V] = {};
    if (bias) load_chunk<T, V>(bias + c, b);
#pragma unroll 4
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        const int64_t off = r * cols + c;
        float u[V], g[V];
        load_chunk<T, V>(f + off, u);
#pragma unroll
        for (int i = 0; i < V; ++i) {
            if (bias) u[i] = round_to<T>(u[i] + b[i]);
            g[i] = gelu(u[i]);
        }
        if (u_out) store_chunk<T, V>(u_out + off, u);
        store_chunk<T, V>(g_out + off, g);
    }
}

// dg = dg * gelu'(u) in place, u = f + bias (bias optional); with dbias_part, strip blockIdx.y's
// column sums of the new dg.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads) gelu_backward_kernel(T *__restrict__ dg, const T *__restrict__ f,
                                                                 const T *__restrict__ bias,
                                                                 float *__restrict__ dbias_part, int64_t rows,
                                                                 int cols) {
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (c >= cols) return;
    float acc[V] = {}, b[V] = {};
    if (bias) load_chunk<T, V>(bias + c, b);
#pragma unroll 4
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        const int64_t off = r * cols + c;
        float d[V], x[V];
        load_chunk<T, V>(dg + off, d);
        load_chunk<T, V>(f + off, x);
#pragma unroll
        for (int i = 0; i < V; ++i) {
            if (bias) x[i] = round_to<T>(x[i] + b[i]);
            d[i] = round_to<T>(d[i] * gelu_grad(x[i]));
            acc[i] += d[i];
        }
        store_chunk<T, V>(dg + off, d);
    }
    if (dbias_part) {
        float *out = dbias_part + (int64_t)blockIdx.y * cols + c;
#pragma unroll
        for (int i = 0; i < V; ++i) out[i] = acc[i];
    }
}

// Strips of rows so that about two waves of threads cover the tensor.
unsigned strips_for(int64_t rows, unsigned col_blocks) {
    const int64_t want = (int64_t)sm_count() * 4096 / ((int64_t)col_blocks * kThreads);
    int64_t s = want < 1 ? 1 : want;
    if (s > rows) s = rows;
    if (s > 65535) s = 65535;
    return (unsigned)(s < 1 ? 1 : s);
}

template <typename T> bool vectorisable(int64_t cols, std::initializer_list<const void *> ptrs) {
    if (cols % vec_width<T>() != 0) return false;
    for (const void *p : ptrs)
        if (!aligned(p, 16)) return false;
    return true;
}
} // namespace

extern "C" int dsc_tf_bias_gelu(const void *f, const void *bias, void *u_out, void *g_out, int64_t rows, int64_t cols,
                                int dtype, int device, cudaStream_t stream) {
    if (!f || !g_out || rows < 0 || cols < 1 || cols > 0x7fffffffLL / 2) return DSC_CUDA_EARG;
    if (rows == 0) return 0;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        constexpr int V = vec_width<E>();
        const bool vec = vectorisable<E>(cols, {f, bias, u_out, g_out});
        const int64_t chunks = vec ? cols / V : cols;
        const unsigned gx = (unsigned)((chunks + kThreads - 1) / kThreads);
        const dim3 grid(gx, strips_for(rows, gx));
        const E *fe = static_cast<const E *>(f), *be = static_cast<const E *>(bias);
        E *ue = static_cast<E *>(u_out), *ge = static_cast<E *>(g_out);
        if (vec)
            bias_gelu_kernel<E, V><<<grid, kThreads, 0, stream>>>(fe, be, ue, ge, rows, (int)cols);
        else
            bias_gelu_kernel<E, 1><<<grid, kThreads, 0, stream>>>(fe, be, ue, ge, rows, (int)cols);
        return launch_error();
    });
}

extern "C" int dsc_tf_gelu_backward(void *dg, const void *f, const void *bias, float *dbias_part, int64_t rows,
                                    int64_t cols, int64_t parts, int dtype, int device, cudaStream_t stream) {
    if (!dg || !f || rows < 0 || cols < 1 || cols > 0x7fffffffLL / 2 || (dbias_part && (parts < 1 || parts > 65535)))
        return DSC_CUDA_EARG;
    if (rows == 0 && !dbias_part) return 0;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        constexpr int V = vec_width<E>();
        const bool vec = vectorisable<E>(cols, {dg, f, bias});
        const int64_t chunks = vec ? cols / V : cols;
        const unsigned gx = (unsigned)((chunks + kThreads - 1) / kThreads);
        // With partial sums every strip writes its row of dbias_part (zeros when it has no rows).
        const dim3 grid(gx, dbias_part ? (unsigned)parts : strips_for(rows, gx));
        E *de = static_cast<E *>(dg);
        const E *fe = static_cast<const E *>(f), *be = static_cast<const E *>(bias);
        if (vec)
            gelu_backward_kernel<E, V><<<grid, kThreads, 0, stream>>>(de, fe, be, dbias_part, rows, (int)cols);
        else
            gelu_backward_kernel<E, 1><<<grid, kThreads, 0, stream>>>(de, fe, be, dbias_part, rows, (int)cols);
        return launch_error();
    });
}
