// Evoformer attention forward on tensor cores (WMMA 16x16x16, fp16/bf16 in, float32 accumulate).
// A block of 4 warps owns 64 query rows (16 per warp) and streams 32-key tiles of K and V through
// shared memory. Per tile each warp computes its 16 x 32 score block with WMMA, parks it in shared
// memory, and two lanes per query row add the biases, update the row's running max and sum, write
// the probabilities back in the input dtype and rescale the row's float32 output accumulator;
// then P V (16 x D) runs on WMMA and is added into that accumulator. Same contract and outputs
// (O, lse) as evo_forward_kernel in evoformer_fwd.cu, which stays as the CUDA-core path.
#include <mma.h>

#include "evoformer_common.cuh"

namespace dsc_evo {
namespace wmma = nvcuda::wmma;

constexpr int kTcWarps = 4;
constexpr int kTcRows = 16 * kTcWarps;  // query rows per block
constexpr int kTcKeys = 32;             // keys per tile

template <typename T, int DP> struct TcTiles {
    __align__(32) T q[kTcRows][DP];
    __align__(32) T k[kTcKeys][DP];
    __align__(32) T v[kTcKeys][DP];
    __align__(32) float s[kTcWarps][16][kTcKeys];  // scores, then one 16 x 16 block of P V at a time
    __align__(32) T p[kTcWarps][16][kTcKeys];
    __align__(32) float o[kTcWarps][16][DP];
};

// Rows [r0, r0 + rows) of one slice into a T tile, zeros past L and past D.
template <typename T, int DP>
__device__ __forceinline__ void copy_rows(T (*tile)[DP], const T *__restrict__ src, const Geometry &g, int r0,
                                          int rows) {
    for (int e = threadIdx.x; e < rows * DP; e += blockDim.x) {
        const int r = e / DP, d = e % DP, i = r0 + r;
        tile[r][d] = (i < g.L && d < g.D) ? src[i * g.HD + d] : T(0.f);
    }
}

template <typename T, int DP>
__global__ void __launch_bounds__(32 * kTcWarps)
    evo_forward_tc_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                          const T *__restrict__ bias1, const T *__restrict__ bias2, T *__restrict__ o,
                          float *__restrict__ lse, int N, int L, int H, int D, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap();  // bf16 WMMA needs sm_80; the launcher never picks this kernel below it
#else
    __shared__ TcTiles<T, DP> t;
    const Geometry g(N, L, H, D);
    const Slice sl(g);
    const T *b1 = bias1 ? bias1 + sl.b1_off : nullptr;
    const T *b2 = bias2 ? bias2 + sl.b2_off : nullptr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int q0 = blockIdx.y * kTcRows;
    const int r = lane >> 1, half = lane & 1;  // this lane's row of the warp's 16 and its half of the columns
    const int i = q0 + warp * 16 + r;
    copy_rows<T, DP>(t.q, q + sl.base, g, q0, kTcRows);
    for (int c = lane; c < 16 * DP; c += 32) t.o[warp][c / DP][c % DP] = 0.f;
    float m = -INFINITY, l = 0.f;
    for (int k0 = 0; k0 < L; k0 += kTcKeys) {
        __syncthreads();  // the previous tiles are no longer read
        copy_rows<T, DP>(t.k, k + sl.base, g, k0, kTcKeys);
        copy_rows<T, DP>(t.v, v + sl.base, g, k0, kTcKeys);
        __syncthreads();
        // S (16 x 32) = Q_w (16 x DP) K^T (DP x 32)
        for (int n = 0; n < kTcKeys / 16; n++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.f);
#pragma unroll
            for (int kk = 0; kk < DP / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
                wmma::load_matrix_sync(a, &t.q[warp * 16][kk * 16], DP);
                wmma::load_matrix_sync(b, &t.k[n * 16][kk * 16], DP);
                wmma::mma_sync(acc, a, b, acc);
            }
            wmma::store_matrix_sync(&t.s[warp][0][n * 16], acc, kTcKeys, wmma::mem_row_major);
        }
        __syncwarp();
        // online softmax: lanes 2r and 2r+1 share row r, 16 keys each
        constexpr int kHalf = kTcKeys / 2;
        float sc[kHalf];
        float mx = -INFINITY;
#pragma unroll
        for (int c = 0; c < kHalf; c++) {
            const int col = half * kHalf + c, j = k0 + col;
            float s = -INFINITY;
            if (j < L && i < L) {
                s = t.s[warp][r][col] * scale;
                if (b1) s += load(b1 + j);
                if (b2) s += load(b2 + (int64_t)i * L + j);
            }
            sc[c] = s;
            mx = fmaxf(mx, s);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float m_new = fmaxf(m, mx);
        const float corr = m_new == -INFINITY ? 1.f : __expf(m - m_new);
        float ps = 0.f;
#pragma unroll
        for (int c = 0; c < kHalf; c++) {
            const float p = m_new == -INFINITY ? 0.f : __expf(sc[c] - m_new);
            ps += p;
            T pt;
            store(&pt, p);
            t.p[warp][r][half * kHalf + c] = pt;
        }
        ps += __shfl_xor_sync(0xffffffffu, ps, 1);
        l = l * corr + ps;
        m = m_new;
        for (int c = half * (DP / 2); c < (half + 1) * (DP / 2); c++) t.o[warp][r][c] *= corr;
        __syncwarp();
        // O_w += P_w (16 x 32) V (32 x DP), one 16-column block at a time through the scratch
        for (int n = 0; n < DP / 16; n++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.f);
#pragma unroll
            for (int kk = 0; kk < kTcKeys / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
                wmma::load_matrix_sync(a, &t.p[warp][0][kk * 16], kTcKeys);
                wmma::load_matrix_sync(b, &t.v[kk * 16][n * 16], DP);
                wmma::mma_sync(acc, a, b, acc);
            }
            wmma::store_matrix_sync(&t.s[warp][0][0], acc, kTcKeys, wmma::mem_row_major);
            __syncwarp();
#pragma unroll
            for (int c = half * 8; c < half * 8 + 8; c++) t.o[warp][r][n * 16 + c] += t.s[warp][r][c];
            __syncwarp();
        }
    }
    if (i >= L) return;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    T *orow = o + sl.base + (int64_t)i * g.HD;
    for (int c = half * (DP / 2); c < (half + 1) * (DP / 2); c++)
        if (c < D) store(orow + c, t.o[warp][r][c] * inv);
    if (half == 0) lse[sl.lse_row + i] = l > 0.f ? m + logf(l) : INFINITY;
#endif
}
} // namespace dsc_evo

using namespace dsc_evo;

extern "C" int dsc_evo_forward_tc(const void *q, const void *k, const void *v, const void *bias1, const void *bias2,
                                  void *o, float *lse, int64_t B, int64_t N, int64_t L, int64_t H, int64_t D,
                                  float scale, int dtype, int device, cudaStream_t stream) {
    if (!q || !k || !v || !o || !lse || bad_shape(B, N, L, H, D)) return DSC_CUDA_EARG;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    const dim3 grid((unsigned)(B * N * H), (unsigned)((L + kTcRows - 1) / kTcRows));
    return dispatch_half(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        return dispatch_dim(D, [&](auto dp) {
            evo_forward_tc_kernel<E, decltype(dp)::value><<<grid, 32 * kTcWarps, 0, stream>>>(
                static_cast<const E *>(q), static_cast<const E *>(k), static_cast<const E *>(v),
                static_cast<const E *>(bias1), static_cast<const E *>(bias2), static_cast<E *>(o), lse, (int)N,
                (int)L, (int)H, (int)D, scale);
            return launch_error();
        });
    });
}
