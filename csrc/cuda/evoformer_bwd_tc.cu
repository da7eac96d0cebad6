// Evoformer attention backward on tensor cores (WMMA 16x16x16,
// fp16/bf16 operands, float32 accumulate). A block of 4 warps owns 64 key rows (16 per warp),
// streaming 32-row query tiles (Q, dO, lse, delta) through shared memory. Per tile each warp
// computes S^T = K_w Q^T and dP^T = V_w dO^T on WMMA, two lanes per key row turn them into
// P^T = exp(scale S^T + biases - lse) and dS^T = P^T (dP^T - delta) (float32, then rounded to the
// input dtype as MMA operands), add dS into the bias gradients with atomics, and the warp
// accumulates dV_w += P^T dO and dK_w += dS^T Q in register fragments for the whole key row.
// dQ has its own kernel by query rows (evo_dq_tc_kernel: the forward's layout, S and dP on WMMA,
// dQ_w += dS K accumulated in fragments), so no gradient needs atomics but the biases'.
#include <mma.h>

#include "evoformer_common.cuh"

namespace dsc_evo {
namespace wmma = nvcuda::wmma;

constexpr int kBtWarps = 4;
constexpr int kBtKeys = 16 * kBtWarps;  // key rows per block
constexpr int kBtRows = 32;             // query rows per tile

template <typename T, int DP> struct BwdTiles {
    __align__(32) T k[kBtKeys][DP];
    __align__(32) T v[kBtKeys][DP];
    __align__(32) T q[kBtRows][DP];
    __align__(32) T d_o[kBtRows][DP];
    __align__(32) float scratch[kBtWarps][2][16][kBtRows];  // S^T and dP^T; at the end dK_w / dV_w rows
    __align__(32) T p[kBtWarps][16][kBtRows];
    __align__(32) T ds[kBtWarps][16][kBtRows];
    float lse[kBtRows], delta[kBtRows];
};

template <typename T, int DP>
__device__ __forceinline__ void copy_tile(T (*tile)[DP], const T *__restrict__ src, const Geometry &g, int r0,
                                          int rows) {
    for (int e = threadIdx.x; e < rows * DP; e += blockDim.x) {
        const int r = e / DP, d = e % DP, i = r0 + r;
        tile[r][d] = (i < g.L && d < g.D) ? src[i * g.HD + d] : T(0.f);
    }
}

template <typename T, int DP>
__global__ void __launch_bounds__(32 * kBtWarps)
    evo_dkv_tc_kernel(const T *__restrict__ d_o, const T *__restrict__ q, const T *__restrict__ k,
                      const T *__restrict__ v, const float *__restrict__ lse, const float *__restrict__ delta,
                      const T *__restrict__ bias1, const T *__restrict__ bias2, T *__restrict__ dk,
                      T *__restrict__ dv, float *__restrict__ dbias1, float *__restrict__ dbias2, int N, int L, int H,
                      int D, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap();  // bf16 WMMA needs sm_80; the launcher never picks this kernel below it
#else
    extern __shared__ __align__(32) unsigned char smem_raw[];
    BwdTiles<T, DP> &t = *reinterpret_cast<BwdTiles<T, DP> *>(smem_raw);
    const Geometry g(N, L, H, D);
    const Slice sl(g);
    const T *b2 = bias2 ? bias2 + sl.b2_off : nullptr;
    float *db2 = dbias2 ? dbias2 + sl.b2_off : nullptr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = lane >> 1, half = lane & 1;  // this lane's key row of the warp's 16, its half of the queries
    const int j0 = blockIdx.y * kBtKeys, j = j0 + warp * 16 + r;
    const bool live = j < L;
    const float bj = live ? (bias1 ? load(bias1 + sl.b1_off + j) : 0.f) : 0.f;
    copy_tile<T, DP>(t.k, k + sl.base, g, j0, kBtKeys);
    copy_tile<T, DP>(t.v, v + sl.base, g, j0, kBtKeys);
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> dk_acc[DP / 16], dv_acc[DP / 16];
#pragma unroll
    for (int n = 0; n < DP / 16; n++) {
        wmma::fill_fragment(dk_acc[n], 0.f);
        wmma::fill_fragment(dv_acc[n], 0.f);
    }
    float db1 = 0.f;
    for (int i0 = 0; i0 < L; i0 += kBtRows) {
        __syncthreads();  // the previous query tile is no longer read
        copy_tile<T, DP>(t.q, q + sl.base, g, i0, kBtRows);
        copy_tile<T, DP>(t.d_o, d_o + sl.base, g, i0, kBtRows);
        for (int c = threadIdx.x; c < kBtRows; c += blockDim.x) {
            const int i = i0 + c;
            t.lse[c] = i < L ? lse[sl.lse_row + i] : INFINITY;  // +inf: p = 0 past L
            t.delta[c] = i < L ? delta[sl.lse_row + i] : 0.f;
        }
        __syncthreads();
        // S^T (16 x 32) = K_w Q^T and dP^T (16 x 32) = V_w dO^T
#pragma unroll
        for (int n = 0; n < kBtRows / 16; n++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> s_acc, p_acc;
            wmma::fill_fragment(s_acc, 0.f);
            wmma::fill_fragment(p_acc, 0.f);
#pragma unroll
            for (int kk = 0; kk < DP / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
                wmma::load_matrix_sync(a, &t.k[warp * 16][kk * 16], DP);
                wmma::load_matrix_sync(b, &t.q[n * 16][kk * 16], DP);
                wmma::mma_sync(s_acc, a, b, s_acc);
                wmma::load_matrix_sync(a, &t.v[warp * 16][kk * 16], DP);
                wmma::load_matrix_sync(b, &t.d_o[n * 16][kk * 16], DP);
                wmma::mma_sync(p_acc, a, b, p_acc);
            }
            wmma::store_matrix_sync(&t.scratch[warp][0][0][n * 16], s_acc, kBtRows, wmma::mem_row_major);
            wmma::store_matrix_sync(&t.scratch[warp][1][0][n * 16], p_acc, kBtRows, wmma::mem_row_major);
        }
        __syncwarp();
        constexpr int kHalf = kBtRows / 2;
#pragma unroll 4
        for (int c = half * kHalf; c < (half + 1) * kHalf; c++) {
            const int i = i0 + c;
            float p = 0.f, ds = 0.f;
            if (live && i < L) {
                float s = t.scratch[warp][0][r][c] * scale + bj;
                if (b2) s += load(b2 + (int64_t)i * L + j);
                p = __expf(s - t.lse[c]);
                ds = p * (t.scratch[warp][1][r][c] - t.delta[c]);
                if (db2) atomicAdd(db2 + (int64_t)i * L + j, ds);
            }
            db1 += ds;
            T pt, dst;
            store(&pt, p);
            store(&dst, ds);
            t.p[warp][r][c] = pt;
            t.ds[warp][r][c] = dst;
        }
        __syncwarp();
        // dV_w += P^T dO, dK_w += dS^T Q  (16 x 32 times 32 x DP)
#pragma unroll
        for (int n = 0; n < DP / 16; n++) {
#pragma unroll
            for (int kk = 0; kk < kBtRows / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
                wmma::load_matrix_sync(a, &t.p[warp][0][kk * 16], kBtRows);
                wmma::load_matrix_sync(b, &t.d_o[kk * 16][n * 16], DP);
                wmma::mma_sync(dv_acc[n], a, b, dv_acc[n]);
                wmma::load_matrix_sync(a, &t.ds[warp][0][kk * 16], kBtRows);
                wmma::load_matrix_sync(b, &t.q[kk * 16][n * 16], DP);
                wmma::mma_sync(dk_acc[n], a, b, dk_acc[n]);
            }
        }
    }
    db1 += __shfl_xor_sync(0xffffffffu, db1, 1);
    if (dbias1 && live && half == 0) atomicAdd(dbias1 + sl.b1_off + j, db1);
    // the warp's rows of dK (times scale: S used scale * q) and dV, through its scratch ([16][DP] floats)
    float *out = &t.scratch[warp][0][0][0];
    for (int which = 0; which < 2; which++) {
        __syncwarp();
#pragma unroll
        for (int n = 0; n < DP / 16; n++)
            wmma::store_matrix_sync(out + n * 16, which == 0 ? dk_acc[n] : dv_acc[n], DP, wmma::mem_row_major);
        __syncwarp();
        if (live) {
            T *row = (which == 0 ? dk : dv) + sl.base + (int64_t)j * g.HD;
            const float mul = which == 0 ? scale : 1.f;
            for (int c = half * (DP / 2); c < (half + 1) * (DP / 2); c++)
                if (c < D) store(row + c, out[r * DP + c] * mul);
        }
    }
#endif
}


template <typename T, int DP> struct DqTiles {
    __align__(32) T q[kBtKeys][DP];  // 64 query rows, 16 per warp
    __align__(32) T d_o[kBtKeys][DP];
    __align__(32) T k[kBtRows][DP];  // 32-key tiles
    __align__(32) T v[kBtRows][DP];
    __align__(32) float scratch[kBtWarps][2][16][kBtRows];  // S and dP; at the end dQ_w rows
    __align__(32) T ds[kBtWarps][16][kBtRows];
};

template <typename T, int DP>
__global__ void __launch_bounds__(32 * kBtWarps)
    evo_dq_tc_kernel(const T *__restrict__ d_o, const T *__restrict__ q, const T *__restrict__ k,
                     const T *__restrict__ v, const float *__restrict__ lse, const float *__restrict__ delta,
                     const T *__restrict__ bias1, const T *__restrict__ bias2, T *__restrict__ dq, int N, int L, int H,
                     int D, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap();
#else
    extern __shared__ __align__(32) unsigned char smem_raw[];
    DqTiles<T, DP> &t = *reinterpret_cast<DqTiles<T, DP> *>(smem_raw);
    const Geometry g(N, L, H, D);
    const Slice sl(g);
    const T *b1 = bias1 ? bias1 + sl.b1_off : nullptr;
    const T *b2 = bias2 ? bias2 + sl.b2_off : nullptr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = lane >> 1, half = lane & 1;  // this lane's query row of the warp's 16, its half of the keys
    const int q0 = blockIdx.y * kBtKeys, i = q0 + warp * 16 + r;
    const bool live = i < L;
    const float li = live ? lse[sl.lse_row + i] : INFINITY, di = live ? delta[sl.lse_row + i] : 0.f;
    copy_tile<T, DP>(t.q, q + sl.base, g, q0, kBtKeys);
    copy_tile<T, DP>(t.d_o, d_o + sl.base, g, q0, kBtKeys);
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> dq_acc[DP / 16];
#pragma unroll
    for (int n = 0; n < DP / 16; n++) wmma::fill_fragment(dq_acc[n], 0.f);
    for (int k0 = 0; k0 < L; k0 += kBtRows) {
        __syncthreads();
        copy_tile<T, DP>(t.k, k + sl.base, g, k0, kBtRows);
        copy_tile<T, DP>(t.v, v + sl.base, g, k0, kBtRows);
        __syncthreads();
        // S (16 x 32) = Q_w K^T and dP (16 x 32) = dO_w V^T
#pragma unroll
        for (int n = 0; n < kBtRows / 16; n++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> s_acc, p_acc;
            wmma::fill_fragment(s_acc, 0.f);
            wmma::fill_fragment(p_acc, 0.f);
#pragma unroll
            for (int kk = 0; kk < DP / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
                wmma::load_matrix_sync(a, &t.q[warp * 16][kk * 16], DP);
                wmma::load_matrix_sync(b, &t.k[n * 16][kk * 16], DP);
                wmma::mma_sync(s_acc, a, b, s_acc);
                wmma::load_matrix_sync(a, &t.d_o[warp * 16][kk * 16], DP);
                wmma::load_matrix_sync(b, &t.v[n * 16][kk * 16], DP);
                wmma::mma_sync(p_acc, a, b, p_acc);
            }
            wmma::store_matrix_sync(&t.scratch[warp][0][0][n * 16], s_acc, kBtRows, wmma::mem_row_major);
            wmma::store_matrix_sync(&t.scratch[warp][1][0][n * 16], p_acc, kBtRows, wmma::mem_row_major);
        }
        __syncwarp();
        constexpr int kHalf = kBtRows / 2;
#pragma unroll 4
        for (int c = half * kHalf; c < (half + 1) * kHalf; c++) {
            const int j = k0 + c;
            float ds = 0.f;
            if (live && j < L) {
                float s = t.scratch[warp][0][r][c] * scale;
                if (b1) s += load(b1 + j);
                if (b2) s += load(b2 + (int64_t)i * L + j);
                ds = __expf(s - li) * (t.scratch[warp][1][r][c] - di);
            }
            T dst;
            store(&dst, ds);
            t.ds[warp][r][c] = dst;
        }
        __syncwarp();
        // dQ_w += dS (16 x 32) K (32 x DP)
#pragma unroll
        for (int n = 0; n < DP / 16; n++) {
#pragma unroll
            for (int kk = 0; kk < kBtRows / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
                wmma::load_matrix_sync(a, &t.ds[warp][0][kk * 16], kBtRows);
                wmma::load_matrix_sync(b, &t.k[kk * 16][n * 16], DP);
                wmma::mma_sync(dq_acc[n], a, b, dq_acc[n]);
            }
        }
    }
    float *out = &t.scratch[warp][0][0][0];
    __syncwarp();
#pragma unroll
    for (int n = 0; n < DP / 16; n++) wmma::store_matrix_sync(out + n * 16, dq_acc[n], DP, wmma::mem_row_major);
    __syncwarp();
    if (!live) return;
    T *row = dq + sl.base + (int64_t)i * g.HD;
    for (int c = half * (DP / 2); c < (half + 1) * (DP / 2); c++)
        if (c < D) store(row + c, out[r * DP + c] * scale);
#endif
}

template <typename T, int DP>
int launch_dkv_tc_typed(const T *d_o, const T *q, const T *k, const T *v, const float *lse, const float *delta,
                        const T *b1, const T *b2, T *dk, T *dv, float *db1, float *db2, int64_t B, int64_t N,
                        int64_t L, int64_t H, int64_t D, float scale, cudaStream_t stream) {
    const size_t smem = sizeof(BwdTiles<T, DP>);
    const int rc = allow_smem(evo_dkv_tc_kernel<T, DP>, smem, 0);
    if (rc != 0) return rc;
    const dim3 grid((unsigned)(B * N * H), (unsigned)((L + kBtKeys - 1) / kBtKeys));
    evo_dkv_tc_kernel<T, DP><<<grid, 32 * kBtWarps, smem, stream>>>(d_o, q, k, v, lse, delta, b1, b2, dk, dv, db1,
                                                                      db2, (int)N, (int)L, (int)H, (int)D, scale);
    return launch_error();
}

template <typename T, int DP>
int launch_dq_tc_typed(const T *d_o, const T *q, const T *k, const T *v, const float *lse, const float *delta,
                       const T *b1, const T *b2, T *dq, int64_t B, int64_t N, int64_t L, int64_t H, int64_t D,
                       float scale, cudaStream_t stream) {
    const size_t smem = sizeof(DqTiles<T, DP>);
    const int rc = allow_smem(evo_dq_tc_kernel<T, DP>, smem, 0);
    if (rc != 0) return rc;
    const dim3 grid((unsigned)(B * N * H), (unsigned)((L + kBtKeys - 1) / kBtKeys));
    evo_dq_tc_kernel<T, DP><<<grid, 32 * kBtWarps, smem, stream>>>(d_o, q, k, v, lse, delta, b1, b2, dq, (int)N,
                                                                     (int)L, (int)H, (int)D, scale);
    return launch_error();
}

int launch_bwd_tc(const void *d_o, const void *q, const void *k, const void *v, const float *lse, const float *delta,
                  const void *bias1, const void *bias2, void *dq, void *dk, void *dv, float *dbias1, float *dbias2,
                  int64_t B, int64_t N, int64_t L, int64_t H, int64_t D, float scale, int dtype, cudaStream_t stream) {
    return dispatch_half(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        return dispatch_dim(D, [&](auto dp) {
            constexpr int DP = decltype(dp)::value;
            const E *gO = static_cast<const E *>(d_o), *Q = static_cast<const E *>(q), *K = static_cast<const E *>(k),
                    *V = static_cast<const E *>(v), *b1 = static_cast<const E *>(bias1),
                    *b2 = static_cast<const E *>(bias2);
            const int rc = launch_dq_tc_typed<E, DP>(gO, Q, K, V, lse, delta, b1, b2, static_cast<E *>(dq), B, N, L,
                                                     H, D, scale, stream);
            if (rc != 0) return rc;
            return launch_dkv_tc_typed<E, DP>(gO, Q, K, V, lse, delta, b1, b2, static_cast<E *>(dk),
                                              static_cast<E *>(dv), dbias1, dbias2, B, N, L, H, D, scale, stream);
        });
    });
}
} // namespace dsc_evo
