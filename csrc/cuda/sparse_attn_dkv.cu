// Block-sparse attention backward, dK and dV: per layout block column, over the query block rows
// that attend to it (the layout's transpose), dV = P^T dO, dK = scale * dS^T Q (see sparse_attn.cu).
#include "sparse_attn_common.cuh"

namespace dsc_sa {

template <typename T, int BLK, int DP>
__global__ void __launch_bounds__(BLK * 2)
    sa_dkv_kernel(const T *__restrict__ d_o, const T *__restrict__ q, const T *__restrict__ k,
                  const T *__restrict__ v, const float *__restrict__ lse, const float *__restrict__ delta,
                  const int *__restrict__ col_ptr, const int *__restrict__ rows, const float *kpm, const float *am,
                  const float *rpe, int64_t rpe_sb, int64_t rpe_sh, T *__restrict__ dk, T *__restrict__ dv, int H,
                  int L, int D, float scale) {
    constexpr int C = chunk<BLK, DP>();
    __shared__ __align__(16) T sq[C][DP + 8];
    __shared__ __align__(16) T sqt[DP][C + 8];
    __shared__ __align__(16) T sd[C][DP + 8];
    __shared__ __align__(16) T sdt[DP][C + 8];
    __shared__ float slse[C], sdl[C];
    const int cb = blockIdx.x, bh = blockIdx.y, h = bh % H, b = bh / H, nb = L / BLK;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int64_t base = (int64_t)bh * L * D;
    const int r0 = cb * BLK + warp * 16, j0 = r0 + g;
    const Bias bias(kpm, am, rpe, rpe_sb, rpe_sh, b, h, L);

    uint32_t kf[DP / 16][4], vf[DP / 16][4];
#pragma unroll
    for (int kk = 0; kk < DP / 16; kk++) {
        frag_a_global(kf[kk], k + base, D, r0, kk * 16, lane);
        frag_a_global(vf[kk], v + base, D, r0, kk * 16, lane);
    }
    float gk[DP / 8][4], gv[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; n++)
        gk[n][0] = gk[n][1] = gk[n][2] = gk[n][3] = gv[n][0] = gv[n][1] = gv[n][2] = gv[n][3] = 0.f;

    const int lo = col_ptr[h * nb + cb], hi = col_ptr[h * nb + cb + 1];
    for (int e = lo; e < hi; e++) {
        const int rb = rows[e];
        for (int c0 = 0; c0 < BLK; c0 += C) {
            const int i0 = rb * BLK + c0;
            __syncthreads();
            stage_rows<T, C, DP>(sq, q + base + (int64_t)i0 * D, D);
            stage_cols<T, C, DP>(sqt, q + base + (int64_t)i0 * D, D);
            stage_rows<T, C, DP>(sd, d_o + base + (int64_t)i0 * D, D);
            stage_cols<T, C, DP>(sdt, d_o + base + (int64_t)i0 * D, D);
            for (int c = threadIdx.x; c < C; c += blockDim.x) {
                slse[c] = lse[(int64_t)bh * L + i0 + c];
                sdl[c] = delta[(int64_t)bh * L + i0 + c];
            }
            __syncthreads();
            // S^T (keys x queries) = K Q^T and dP^T = V dO^T
            float s[C / 8][4], dp[C / 8][4];
#pragma unroll
            for (int n = 0; n < C / 8; n++)
                s[n][0] = s[n][1] = s[n][2] = s[n][3] = dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < DP / 16; kk++) {
#pragma unroll
                for (int n = 0; n < C / 8; n++) {
                    uint32_t b0, b1;
                    frag_b(b0, b1, &sq[0][0], DP + 8, n * 8, kk * 16, lane);
                    mma<T>(s[n], kf[kk], b0, b1);
                    frag_b(b0, b1, &sd[0][0], DP + 8, n * 8, kk * 16, lane);
                    mma<T>(dp[n], vf[kk], b0, b1);
                }
            }
            probabilities<C / 8, true>(s, bias, scale, j0, i0, t, nullptr, slse);
            // dV += P^T dO
#pragma unroll
            for (int kk = 0; kk < C / 16; kk++) {
                uint32_t a[4];
                acc_to_a<T>(a, s, kk);
#pragma unroll
                for (int n = 0; n < DP / 8; n++) {
                    uint32_t b0, b1;
                    frag_b(b0, b1, &sdt[0][0], C + 8, n * 8, kk * 16, lane);
                    mma<T>(gv[n], a, b0, b1);
                }
            }
            // dS^T = P^T (dP^T - delta_query); dK += dS^T Q
#pragma unroll
            for (int n = 0; n < C / 8; n++) {
                const int c = n * 8 + 2 * t;
                s[n][0] *= dp[n][0] - sdl[c], s[n][1] *= dp[n][1] - sdl[c + 1];
                s[n][2] *= dp[n][2] - sdl[c], s[n][3] *= dp[n][3] - sdl[c + 1];
            }
#pragma unroll
            for (int kk = 0; kk < C / 16; kk++) {
                uint32_t a[4];
                acc_to_a<T>(a, s, kk);
#pragma unroll
                for (int n = 0; n < DP / 8; n++) {
                    uint32_t b0, b1;
                    frag_b(b0, b1, &sqt[0][0], C + 8, n * 8, kk * 16, lane);
                    mma<T>(gk[n], a, b0, b1);
                }
            }
        }
    }
    T *k0 = dk + base + (int64_t)j0 * D, *k1 = k0 + 8 * (int64_t)D;
    T *v0 = dv + base + (int64_t)j0 * D, *v1 = v0 + 8 * (int64_t)D;
#pragma unroll
    for (int n = 0; n < DP / 8; n++) {
        const int d = n * 8 + 2 * t;
        if (d < D) {
            *reinterpret_cast<uint32_t *>(k0 + d) = pack2<T>(gk[n][0] * scale, gk[n][1] * scale);
            *reinterpret_cast<uint32_t *>(k1 + d) = pack2<T>(gk[n][2] * scale, gk[n][3] * scale);
            *reinterpret_cast<uint32_t *>(v0 + d) = pack2<T>(gv[n][0], gv[n][1]);
            *reinterpret_cast<uint32_t *>(v1 + d) = pack2<T>(gv[n][2], gv[n][3]);
        }
    }
}

int launch_dkv_v1(const BackwardArgs &a) {
    const dim3 grid((unsigned)(a.L / a.block), (unsigned)(a.B * a.H));
    return dispatch(a.dtype, a.block, a.D, [&](auto *tag, auto blk, auto dp) {
        using E = std::remove_pointer_t<decltype(tag)>;
        constexpr int BLK = decltype(blk)::value, DP = decltype(dp)::value;
        sa_dkv_kernel<E, BLK, DP><<<grid, BLK * 2, 0, a.stream>>>(
            static_cast<const E *>(a.d_o), static_cast<const E *>(a.q), static_cast<const E *>(a.k),
            static_cast<const E *>(a.v), a.lse, a.delta, a.col_ptr, a.rows, a.kpm, a.am, a.rpe, a.rpe_sb, a.rpe_sh,
            static_cast<E *>(a.dk), static_cast<E *>(a.dv), (int)a.H, (int)a.L, (int)a.D, a.scale);
        return launch_error();
    });
}
} // namespace dsc_sa
