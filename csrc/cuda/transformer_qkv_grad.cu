// The attention's input gradients stacked for the QKV GEMMs: out[r, w * cols + c] = in_w[r, c] for
// dq, dk, dv (w = 0, 1, 2), with the column sums of out (the QKV bias gradient) built on the way, so
// the stack and the bias reduction read the gradients once (torch: a cat kernel, then a reduction
// over the stacked tensor).
//
// Layout as the GELU backward's: a thread owns one chunk of V columns of out (16 bytes when cols and
// the pointers allow it, else V = 1; a chunk never straddles two inputs since cols % V == 0) and walks
// a strip of rows, four rows' loads issued before their stores; each of `parts` strips writes its
// float32 column sums to its row of `part`, which dsc_tf_sum_parts adds. The CPU reference is
// deepspeed_c/ops/transformer/fused_reference.py (stack_qkv_grad).
#include <type_traits>

#include "transformer_vec.cuh"
#include "dsc/transformer_cuda.h"

namespace {
using namespace dsc_tf;

constexpr int kStackThreads = 128;
constexpr int kRowsInFlight = 4;

template <typename T, int V>
__global__ void __launch_bounds__(kStackThreads) stack_qkv_grad_kernel(
    const T *__restrict__ dq, const T *__restrict__ dk, const T *__restrict__ dv, T *__restrict__ out,
    float *__restrict__ part, int64_t rows, int cols) {
    const int64_t oc = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * V;  // column of out
    if (oc >= 3LL * cols) return;
    const int w = (int)(oc / cols), c = (int)(oc - (int64_t)w * cols);
    const T *src = (w == 0 ? dq : w == 1 ? dk : dv) + c;
    float acc[V] = {};
    for (int64_t r0 = blockIdx.y; r0 < rows; r0 += (int64_t)gridDim.y * kRowsInFlight) {
        Chunk<T, V> in[kRowsInFlight];
#pragma unroll
        for (int k = 0; k < kRowsInFlight; ++k) {
            const int64_t r = r0 + (int64_t)k * gridDim.y;
            if (r < rows) in[k] = *reinterpret_cast<const Chunk<T, V> *>(src + r * cols);
        }
#pragma unroll
        for (int k = 0; k < kRowsInFlight; ++k) {
            const int64_t r = r0 + (int64_t)k * gridDim.y;
            if (r >= rows) break;
            *reinterpret_cast<Chunk<T, V> *>(out + r * 3 * cols + oc) = in[k];
#pragma unroll
            for (int i = 0; i < V; ++i) acc[i] += load(&in[k].e[i]);
        }
    }
    float *dst = part + (int64_t)blockIdx.y * 3 * cols + oc;
#pragma unroll
    for (int i = 0; i < V; ++i) dst[i] = acc[i];
}
} // namespace

extern "C" int dsc_tf_stack_qkv_grad(const void *dq, const void *dk, const void *dv, void *out, float *part,
                                     int64_t rows, int64_t cols, int64_t parts, int dtype, int device,
                                     cudaStream_t stream) {
    if (!dq || !dk || !dv || !out || !part || rows < 0 || cols < 1 || cols > 0x7fffffffLL / 3 || parts < 1 ||
        parts > 65535)
        return DSC_CUDA_EARG;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        constexpr int V = vec_width<E>();
        const E *a = static_cast<const E *>(dq), *b = static_cast<const E *>(dk), *c = static_cast<const E *>(dv);
        E *o = static_cast<E *>(out);
        const bool vec = cols % V == 0 && aligned(dq, 16) && aligned(dk, 16) && aligned(dv, 16) && aligned(out, 16);
        const int64_t chunks = 3 * cols / (vec ? V : 1);
        const dim3 grid((unsigned)((chunks + kStackThreads - 1) / kStackThreads), (unsigned)parts);
        if (vec)
            stack_qkv_grad_kernel<E, V><<<grid, kStackThreads, 0, stream>>>(a, b, c, o, part, rows, (int)cols);
        else
            stack_qkv_grad_kernel<E, 1><<<grid, kStackThreads, 0, stream>>>(a, b, c, o, part, rows, (int)cols);
        return launch_error();
    });
}
