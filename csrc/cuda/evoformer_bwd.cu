// Evoformer attention backward: delta = rowsum(dO * O), dQ by query rows, dK/dV and the bias
// gradients by key rows; probabilities recomputed from the forward's log-sum-exp.
#include "evoformer_common.cuh"

namespace dsc_evo {
// delta[bnh, i] = sum_d dO[i, d] * O[i, d]: one thread per row, rows in O's memory order.
template <typename T>
__global__ void evo_delta_kernel(const T *__restrict__ d_o, const T *__restrict__ o, float *__restrict__ delta,
                                 int64_t rows, int L, int H, int D) {
    for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < rows; r += (int64_t)gridDim.x * blockDim.x) {
        const T *a = d_o + r * D, *b = o + r * D;
        float s = 0.f;
        for (int d = 0; d < D; d++) s = fmaf(load(a + d), load(b + d), s);
        const int h = (int)(r % H);
        const int64_t tok = r / H, i = tok % L, bn = tok / L;
        delta[(bn * H + h) * L + i] = s;
    }
}

// dQ: one thread per query row, keys streamed as in the forward.
template <typename T, int DP>
__global__ void __launch_bounds__(kRowsPerBlock)
    evo_dq_kernel(const T *__restrict__ d_o, const T *__restrict__ q, const T *__restrict__ k,
                  const T *__restrict__ v, const float *__restrict__ lse, const float *__restrict__ delta,
                  const T *__restrict__ bias1, const T *__restrict__ bias2, T *__restrict__ dq, int N, int L, int H,
                  int D, float scale) {
#if !DSC_EVO_SIMT_BODY
    __trap();
#else
    __shared__ KeyTiles<DP> t;
    const Geometry g(N, L, H, D);
    const Slice s(g);
    const T *b1 = bias1 ? bias1 + s.b1_off : nullptr;
    const T *b2 = bias2 ? bias2 + s.b2_off : nullptr;
    const int q0 = blockIdx.y * kRowsPerBlock, i = q0 + threadIdx.x;
    const bool live = i < L;
    float qr[DP], dor[DP], acc[DP];
    load_row<T, DP>(qr, q + s.base, g, i, scale);
    load_row<T, DP>(dor, d_o + s.base, g, i, 1.f);
#pragma unroll
    for (int d = 0; d < DP; d++) acc[d] = 0.f;
    const float li = live ? lse[s.lse_row + i] : INFINITY, di = live ? delta[s.lse_row + i] : 0.f;
    for (int k0 = 0; k0 < L; k0 += kKeyTile) {
        __syncthreads();
        load_key_tiles<T, DP>(t, k + s.base, v + s.base, b1, b2, g, q0, k0);
        __syncthreads();
        if (!live) continue;
#pragma unroll 4
        for (int c = 0; c < kKeyTile; c++) {
            const float sc = dot<DP>(qr, t.k[c]) + t.mask[c] + (b2 ? t.pair[threadIdx.x][c] : 0.f);
            const float p = __expf(sc - li);
            const float ds = p * (dot<DP>(dor, t.v[c]) - di);
#pragma unroll
            for (int d = 0; d < DP; d++) acc[d] = fmaf(ds, t.k[c][d], acc[d]);
        }
    }
    if (!live) return;
    T *row = dq + s.base + (int64_t)i * g.HD;
#pragma unroll
    for (int d = 0; d < DP; d++)
        if (d < D) store(row + d, acc[d] * scale);
#endif
}

// dK, dV and the bias gradients: one thread per key row, query rows streamed through shared memory.
template <typename T, int DP>
__global__ void __launch_bounds__(kKeysPerBlock)
    evo_dkv_kernel(const T *__restrict__ d_o, const T *__restrict__ q, const T *__restrict__ k,
                   const T *__restrict__ v, const float *__restrict__ lse, const float *__restrict__ delta,
                   const T *__restrict__ bias1, const T *__restrict__ bias2, T *__restrict__ dk, T *__restrict__ dv,
                   float *__restrict__ dbias1, float *__restrict__ dbias2, int N, int L, int H, int D, float scale) {
#if !DSC_EVO_SIMT_BODY
    __trap();
#else
    __shared__ float qs[kQueryTile][DP], dos[kQueryTile][DP], pair[kQueryTile][kKeysPerBlock + 1];
    __shared__ float ls[kQueryTile], dls[kQueryTile];
    const Geometry g(N, L, H, D);
    const Slice s(g);
    const T *b2 = bias2 ? bias2 + s.b2_off : nullptr;
    float *db2 = dbias2 ? dbias2 + s.b2_off : nullptr;
    const int j0 = blockIdx.y * kKeysPerBlock, j = j0 + threadIdx.x;
    const bool live = j < L;
    float kr[DP], vr[DP], dkr[DP], dvr[DP];
    load_row<T, DP>(kr, k + s.base, g, j, 1.f);
    load_row<T, DP>(vr, v + s.base, g, j, 1.f);
#pragma unroll
    for (int d = 0; d < DP; d++) dkr[d] = dvr[d] = 0.f;
    const float bj = live ? (bias1 ? load(bias1 + s.b1_off + j) : 0.f) : -INFINITY;
    float db1 = 0.f;
    for (int i0 = 0; i0 < L; i0 += kQueryTile) {
        __syncthreads();
        load_rows<T, DP>(qs, q + s.base, g, i0, kQueryTile, scale);
        load_rows<T, DP>(dos, d_o + s.base, g, i0, kQueryTile, 1.f);
        for (int r = threadIdx.x; r < kQueryTile; r += blockDim.x) {
            const int i = i0 + r;
            ls[r] = i < L ? lse[s.lse_row + i] : INFINITY;  // +inf: p = 0 for rows past L
            dls[r] = i < L ? delta[s.lse_row + i] : 0.f;
        }
        if (b2) {
            for (int e = threadIdx.x; e < kQueryTile * kKeysPerBlock; e += blockDim.x) {
                const int r = e / kKeysPerBlock, c = e % kKeysPerBlock, i = i0 + r, jj = j0 + c;
                pair[r][c] = (i < L && jj < L) ? load(b2 + (int64_t)i * L + jj) : 0.f;
            }
        }
        __syncthreads();
        if (!live) continue;
        const int rows = min(kQueryTile, L - i0);
        for (int r = 0; r < rows; r++) {
            const float sc = dot<DP>(kr, qs[r]) + bj + (b2 ? pair[r][threadIdx.x] : 0.f);
            const float p = __expf(sc - ls[r]);
            const float ds = p * (dot<DP>(vr, dos[r]) - dls[r]);
#pragma unroll
            for (int d = 0; d < DP; d++) {
                dvr[d] = fmaf(p, dos[r][d], dvr[d]);
                dkr[d] = fmaf(ds, qs[r][d], dkr[d]);  // qs holds scale * q
            }
            db1 += ds;
            if (db2) atomicAdd(db2 + (int64_t)(i0 + r) * L + j, ds);
        }
    }
    if (!live) return;
    T *krow = dk + s.base + (int64_t)j * g.HD, *vrow = dv + s.base + (int64_t)j * g.HD;
#pragma unroll
    for (int d = 0; d < DP; d++) {
        if (d < D) {
            store(krow + d, dkr[d]);
            store(vrow + d, dvr[d]);
        }
    }
    if (dbias1) atomicAdd(dbias1 + s.b1_off + j, db1);
#endif
}

} // namespace dsc_evo

using namespace dsc_evo;

extern "C" int dsc_evo_backward(const void *d_o, const void *q, const void *k, const void *v, const void *o,
                                const float *lse, const void *bias1, const void *bias2, float *delta, void *dq,
                                void *dk, void *dv, float *dbias1, float *dbias2, int64_t B, int64_t N, int64_t L,
                                int64_t H, int64_t D, float scale, int tc, int dtype, int device,
                                cudaStream_t stream) {
    if (!d_o || !q || !k || !v || !o || !lse || !delta || !dq || !dk || !dv || bad_shape(B, N, L, H, D) ||
        (dbias1 && !bias1) || (dbias2 && !bias2))
        return DSC_CUDA_EARG;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    if (tc == 0 && simt_unavailable()) return DSC_CUDA_EARG;
    if (tc)  // delta is computed by the tensor-core dQ kernel
        return launch_bwd_mma(d_o, q, k, v, o, lse, delta, bias1, bias2, dq, dk, dv, dbias1, dbias2, B, N, L, H, D,
                              scale, dtype, stream);
    const int64_t rows = B * N * L * H;
    const dim3 qgrid((unsigned)(B * N * H), (unsigned)((L + kRowsPerBlock - 1) / kRowsPerBlock));
    const dim3 kgrid((unsigned)(B * N * H), (unsigned)((L + kKeysPerBlock - 1) / kKeysPerBlock));
    return dispatch_half(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        const E *gO = static_cast<const E *>(d_o), *Q = static_cast<const E *>(q), *K = static_cast<const E *>(k),
                *V = static_cast<const E *>(v), *b1 = static_cast<const E *>(bias1),
                *b2 = static_cast<const E *>(bias2);
        evo_delta_kernel<E><<<grid_for(rows, 256), 256, 0, stream>>>(gO, static_cast<const E *>(o), delta, rows,
                                                                      (int)L, (int)H, (int)D);
        int rc = launch_error();
        if (rc != 0) return rc;
        return dispatch_dim(D, [&](auto dp) {
            constexpr int DP = decltype(dp)::value;
            evo_dq_kernel<E, DP><<<qgrid, kRowsPerBlock, 0, stream>>>(gO, Q, K, V, lse, delta, b1, b2,
                                                                      static_cast<E *>(dq), (int)N, (int)L, (int)H,
                                                                      (int)D, scale);
            const int rc2 = launch_error();
            if (rc2 != 0) return rc2;
            evo_dkv_kernel<E, DP><<<kgrid, kKeysPerBlock, 0, stream>>>(
                gO, Q, K, V, lse, delta, b1, b2, static_cast<E *>(dk), static_cast<E *>(dv), dbias1, dbias2, (int)N,
                (int)L, (int)H, (int)D, scale);
            return launch_error();
        });
    });
}
