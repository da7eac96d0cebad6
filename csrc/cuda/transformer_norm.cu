// Bias + dropout + residual + LayerNorm of the transformer layer, the LayerNorm backward, and the
// sum of per-block partial column sums. The CPU reference is
// deepspeed_c/ops/transformer/fused_reference.py (residual_norm, norm_backward, sum_parts).
//
// Both norm kernels hold a row in registers: a thread owns chunks of V columns (16 bytes when the
// row length and the pointers allow it, else V = 1), at most 8 / V chunks, so rows up to
// DSC_TF_MAX_COLS fit in one block of at most 1024 threads. Forward: a block per row, two-pass
// mean and variance from the registers. Backward: each of `parts` blocks walks a strided set of
// rows, writes dx (and the dropped-out dx with its column sums, the gradient of the bias before
// the dropout), and keeps its float32 column sums of dy * xhat and dy (gamma and beta gradients)
// in registers; it writes them once as its row of the partial buffers, which dsc_tf_sum_parts
// reduces (a two-stage column reduction, no atomics). With normalize_invertible the norm's input
// is never stored: xhat is recovered from the output as (y - beta) / gamma.
#include <initializer_list>
#include <type_traits>

#include "transformer_vec.cuh"
#include "dsc/transformer_cuda.h"

namespace {
using namespace dsc_tf;

template <typename T, int V>
__global__ void __launch_bounds__(1024) residual_norm_kernel(
    const T *__restrict__ x, const T *__restrict__ bias, const T *__restrict__ res, const uint8_t *__restrict__ keep,
    float drop_scale, const T *__restrict__ gamma, const T *__restrict__ beta, T *__restrict__ r_out,
    T *__restrict__ y_out, float *__restrict__ mean_out, float *__restrict__ rstd_out, int cols, float eps) {
    constexpr int M = 8 / V;  // chunks per thread at most
    __shared__ float2 scratch[32];
    const int64_t off = (int64_t)blockIdx.x * cols;
    float v[M][V];
    float sum = 0.f, unused = 0.f;
#pragma unroll
    for (int j = 0; j < M; ++j) {
        const int c = (j * (int)blockDim.x + (int)threadIdx.x) * V;
        if (c >= cols) continue;
        load_chunk<T, V>(x + off + c, v[j]);
        float t[V];
        if (bias) {
            load_chunk<T, V>(bias + c, t);
#pragma unroll
            for (int i = 0; i < V; ++i) v[j][i] += t[i];
        }
        if (keep) {
            load_keep<V>(keep + off + c, drop_scale, t);
#pragma unroll
            for (int i = 0; i < V; ++i) v[j][i] *= t[i];
        }
        if (res) {
            load_chunk<T, V>(res + off + c, t);
#pragma unroll
            for (int i = 0; i < V; ++i) v[j][i] += t[i];
        }
#pragma unroll
        for (int i = 0; i < V; ++i) {
            v[j][i] = round_to<T>(v[j][i]);
            sum += v[j][i];
        }
        if (r_out) store_chunk<T, V>(r_out + off + c, v[j]);
    }
    if (!gamma) return;
    block_sum2(sum, unused, scratch);
    const float mean = sum / cols;
    float sq = 0.f;
#pragma unroll
    for (int j = 0; j < M; ++j) {
        if ((j * (int)blockDim.x + (int)threadIdx.x) * V >= cols) continue;
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const float d = v[j][i] - mean;
            sq += d * d;
        }
    }
    block_sum2(sq, unused, scratch);
    const float rstd = rsqrtf(sq / cols + eps);
#pragma unroll
    for (int j = 0; j < M; ++j) {
        const int c = (j * (int)blockDim.x + (int)threadIdx.x) * V;
        if (c >= cols) continue;
        float gm[V], bt[V] = {}, y[V];
        load_chunk<T, V>(gamma + c, gm);
        if (beta) load_chunk<T, V>(beta + c, bt);
#pragma unroll
        for (int i = 0; i < V; ++i) y[i] = (v[j][i] - mean) * rstd * gm[i] + bt[i];
        store_chunk<T, V>(y_out + off + c, y);
    }
    if (threadIdx.x == 0) {
        mean_out[blockIdx.x] = mean;
        rstd_out[blockIdx.x] = rstd;
    }
}

// The vectorised form runs at most 512 threads (rows up to 4096 columns): at 1024 the 64 registers
// a thread may hold would spill its column sums.
template <int V> constexpr int norm_backward_threads() { return V == 1 ? 1024 : 512; }

// G rows at once a block (threadIdx.y picks the row; 2 when two rows' threads fit the cap): twice the
// loads in flight per SM for the same number of partial-sum rows (measured on an H200 at 8192 x 1024
// bf16: 44.8 us against 50.6 with one row, while more blocks of one row were slower, their partials
// outweighing the gain). The G row groups' column sums are added in shared memory before the block
// writes its partial row.
template <typename T, int V, int G>
__global__ void __launch_bounds__(norm_backward_threads<V>()) norm_backward_kernel(
    const T *__restrict__ dy, const T *__restrict__ src, const T *__restrict__ gamma, const T *__restrict__ beta,
    const float *__restrict__ mean, const float *__restrict__ rstd, const T *__restrict__ extra,
    const uint8_t *__restrict__ keep, float drop_scale, T *__restrict__ dx, T *__restrict__ dx_drop,
    float *__restrict__ dgamma_part, float *__restrict__ dbeta_part, float *__restrict__ dbias_part, int64_t rows,
    int cols, int invertible) {
    constexpr int M = 8 / V;
    __shared__ float2 scratch[G][32];
    extern __shared__ float combine[];  // (G - 1) * cols floats
    // Only the sums live across rows; gamma and beta are re-read per row (L1 hits), which keeps
    // the registers under the 64 a thread of a 1024-thread block may hold.
    float acc_g[M][V], acc_b[M][V], acc_d[M][V];
#pragma unroll
    for (int j = 0; j < M; ++j)
#pragma unroll
        for (int i = 0; i < V; ++i) acc_g[j][i] = acc_b[j][i] = acc_d[j][i] = 0.f;
    // The loop runs the same trips in every row group (the reduction's barriers are block-wide); a
    // group past the last row computes nothing.
    for (int64_t first = (int64_t)blockIdx.x * G; first < rows; first += (int64_t)gridDim.x * G) {
        const int64_t row = first + threadIdx.y;
        const bool active = row < rows;
        const int64_t off = row * cols;
        const float rs = active ? rstd[row] : 0.f, mu = (active && !invertible) ? mean[row] : 0.f;
        float xh[M][V], g[M][V];
        // The second pass's inputs are fetched with the first's, before the barrier, kept packed.
        Chunk<T, V> ex[M];
        KeepChunk<V> kp[M];
        float s1 = 0.f, s2 = 0.f;
#pragma unroll
        for (int j = 0; j < M; ++j) {
            const int c = (j * (int)blockDim.x + (int)threadIdx.x) * V;
            if (!active || c >= cols) continue;
            if (extra) ex[j] = *reinterpret_cast<const Chunk<T, V> *>(extra + off + c);
            if (keep) kp[j] = *reinterpret_cast<const KeepChunk<V> *>(keep + off + c);
            float d[V], s[V], gm[V], bt[V] = {};
            load_chunk<T, V>(dy + off + c, d);
            load_chunk<T, V>(src + off + c, s);
            load_chunk<T, V>(gamma + c, gm);
            if (invertible && beta) load_chunk<T, V>(beta + c, bt);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                xh[j][i] = invertible ? (s[i] - bt[i]) / gm[i] : (s[i] - mu) * rs;
                g[j][i] = d[i] * gm[i];
                acc_g[j][i] += d[i] * xh[j][i];
                acc_b[j][i] += d[i];
                s1 += g[j][i];
                s2 += g[j][i] * xh[j][i];
            }
        }
        block_sum2(s1, s2, scratch[threadIdx.y]);
        const float m1 = s1 / cols, m2 = s2 / cols;
#pragma unroll
        for (int j = 0; j < M; ++j) {
            const int c = (j * (int)blockDim.x + (int)threadIdx.x) * V;
            if (!active || c >= cols) continue;
            float o[V];
#pragma unroll
            for (int i = 0; i < V; ++i) o[i] = rs * (g[j][i] - m1 - xh[j][i] * m2);
            if (extra) {
#pragma unroll
                for (int i = 0; i < V; ++i) o[i] += load(&ex[j].e[i]);
            }
#pragma unroll
            for (int i = 0; i < V; ++i) o[i] = round_to<T>(o[i]);
            store_chunk<T, V>(dx + off + c, o);
            if (keep) {
#pragma unroll
                for (int i = 0; i < V; ++i) o[i] = round_to<T>(o[i] * (kp[j].e[i] ? drop_scale : 0.f));
                if (dx_drop) store_chunk<T, V>(dx_drop + off + c, o);
            }
#pragma unroll
            for (int i = 0; i < V; ++i) acc_d[j][i] += o[i];
        }
    }
    const int64_t prow = (int64_t)blockIdx.x * cols;
    float(*const accs[3])[V] = {acc_g, acc_b, acc_d};
    float *const outs[3] = {dgamma_part, dbeta_part, dbias_part};
#pragma unroll
    for (int a = 0; a < 3; ++a) {
        if (!outs[a]) continue;
        if (G > 1) {
            __syncthreads();  // the previous sum's reads of `combine` are done
            if (threadIdx.y > 0) {
#pragma unroll
                for (int j = 0; j < M; ++j) {
                    const int c = (j * (int)blockDim.x + (int)threadIdx.x) * V;
                    if (c >= cols) continue;
#pragma unroll
                    for (int i = 0; i < V; ++i) combine[(threadIdx.y - 1) * cols + c + i] = accs[a][j][i];
                }
            }
            __syncthreads();
            if (threadIdx.y > 0) continue;
        }
#pragma unroll
        for (int j = 0; j < M; ++j) {
            const int c = (j * (int)blockDim.x + (int)threadIdx.x) * V;
            if (c >= cols) continue;
#pragma unroll
            for (int i = 0; i < V; ++i) {
                float t = accs[a][j][i];
#pragma unroll
                for (int y = 1; y < G; ++y) t += combine[(y - 1) * cols + c + i];
                outs[a][prow + c + i] = t;
            }
        }
    }
}

// out[k, c] = sum over p of part[k, p, c]: 32 columns a block, 16 rows of partials summed at once.
template <typename T>
__global__ void __launch_bounds__(512) sum_parts_kernel(const float *__restrict__ part, T *__restrict__ out,
                                                        int64_t parts, int64_t cols) {
    __shared__ float s[16][33];
    const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x;
    const float *base = part + (int64_t)blockIdx.y * parts * cols;
    float acc = 0.f;
    if (c < cols)
        for (int64_t p = threadIdx.y; p < parts; p += 16) acc += base[p * cols + c];
    s[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y != 0 || c >= cols) return;
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) total += s[i][threadIdx.x];
    store(out + (int64_t)blockIdx.y * cols + c, total);
}

// Threads for a row of `chunks` chunks: one chunk each up to `cap` threads, then several.
unsigned threads_for(int64_t chunks, int cap = 1024) { return (unsigned)round_up32(chunks < cap ? chunks : cap); }

template <typename T> bool vectorisable(int64_t cols, const uint8_t *keep, std::initializer_list<const void *> ptrs) {
    constexpr int V = vec_width<T>();
    if (cols % V != 0 || !aligned(keep, V)) return false;
    for (const void *p : ptrs)
        if (!aligned(p, 16)) return false;
    return true;
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
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        constexpr int V = vec_width<E>();
        const E *xe = static_cast<const E *>(x), *be = static_cast<const E *>(bias), *re = static_cast<const E *>(res);
        const E *ge = static_cast<const E *>(gamma), *bte = static_cast<const E *>(beta);
        E *ro = static_cast<E *>(r_out), *yo = static_cast<E *>(y_out);
        if (vectorisable<E>(cols, keep, {x, bias, res, gamma, beta, r_out, y_out}))
            residual_norm_kernel<E, V><<<(unsigned)rows, threads_for(cols / V), 0, stream>>>(
                xe, be, re, keep, drop_scale, ge, bte, ro, yo, mean_out, rstd_out, (int)cols, eps);
        else
            residual_norm_kernel<E, 1><<<(unsigned)rows, threads_for(cols), 0, stream>>>(
                xe, be, re, keep, drop_scale, ge, bte, ro, yo, mean_out, rstd_out, (int)cols, eps);
        return launch_error();
    });
}

extern "C" int dsc_tf_norm_backward(const void *dy, const void *src, const void *gamma, const void *beta,
                                    const float *mean, const float *rstd, const void *extra, const uint8_t *keep,
                                    float drop_scale, void *dx, void *dx_drop, float *dgamma_part, float *dbeta_part,
                                    float *dbias_part, int64_t rows, int64_t cols, int64_t parts, int invertible,
                                    int dtype, int device, cudaStream_t stream) {
    if (!dy || !src || !gamma || !rstd || !dx || !dgamma_part || !dbeta_part || (!invertible && !mean) ||
        (dx_drop && !keep) || rows < 0 || cols < 1 || cols > DSC_TF_MAX_COLS || parts < 1 || parts > 65535)
        return DSC_CUDA_EARG;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        constexpr int V = vec_width<E>();
        const E *dye = static_cast<const E *>(dy), *se = static_cast<const E *>(src);
        const E *ge = static_cast<const E *>(gamma), *be = static_cast<const E *>(beta);
        const E *ee = static_cast<const E *>(extra);
        E *dxe = static_cast<E *>(dx), *dde = static_cast<E *>(dx_drop);
        constexpr int cap = norm_backward_threads<V>();
        if (cols <= (int64_t)cap * 8 && vectorisable<E>(cols, keep, {dy, src, gamma, beta, extra, dx, dx_drop})) {
            const unsigned threads = threads_for(cols / V, cap);
            if (2 * threads <= (unsigned)cap)
                norm_backward_kernel<E, V, 2><<<(unsigned)parts, dim3(threads, 2), cols * sizeof(float), stream>>>(
                    dye, se, ge, be, mean, rstd, ee, keep, drop_scale, dxe, dde, dgamma_part, dbeta_part, dbias_part,
                    rows, (int)cols, invertible);
            else
                norm_backward_kernel<E, V, 1><<<(unsigned)parts, threads, 0, stream>>>(
                    dye, se, ge, be, mean, rstd, ee, keep, drop_scale, dxe, dde, dgamma_part, dbeta_part, dbias_part,
                    rows, (int)cols, invertible);
        } else {
            norm_backward_kernel<E, 1, 1><<<(unsigned)parts, threads_for(cols), 0, stream>>>(
                dye, se, ge, be, mean, rstd, ee, keep, drop_scale, dxe, dde, dgamma_part, dbeta_part, dbias_part, rows,
                (int)cols, invertible);
        }
        return launch_error();
    });
}

extern "C" int dsc_tf_sum_parts(const float *part, void *out, int64_t k, int64_t parts, int64_t cols, int dtype,
                                int device, cudaStream_t stream) {
    if (!part || !out || k < 1 || k > 65535 || parts < 1 || cols < 1) return DSC_CUDA_EARG;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        const dim3 grid((unsigned)((cols + 31) / 32), (unsigned)k), block(32, 16);
        sum_parts_kernel<E><<<grid, block, 0, stream>>>(part, static_cast<E *>(out), parts, cols);
        return launch_error();
    });
}
