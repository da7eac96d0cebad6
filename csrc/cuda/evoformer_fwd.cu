// Evoformer attention forward: online softmax over key tiles, one thread per query row.
#include "evoformer_common.cuh"

namespace dsc_evo {
template <typename T, int DP>
__global__ void __launch_bounds__(kRowsPerBlock)
    evo_forward_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                       const T *__restrict__ bias1, const T *__restrict__ bias2, T *__restrict__ o,
                       float *__restrict__ lse, int N, int L, int H, int D, float scale) {
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
    float qr[DP], acc[DP];
    load_row<T, DP>(qr, q + s.base, g, i, scale);
#pragma unroll
    for (int d = 0; d < DP; d++) acc[d] = 0.f;
    float m = -INFINITY, l = 0.f;
    for (int k0 = 0; k0 < L; k0 += kKeyTile) {
        __syncthreads();  // the previous tile is no longer read
        load_key_tiles<T, DP>(t, k + s.base, v + s.base, b1, b2, g, q0, k0);
        __syncthreads();
        if (!live) continue;
        for (int c0 = 0; c0 < kKeyTile; c0 += kChunk) {
            float sc[kChunk];
            float mx = m;
#pragma unroll
            for (int c = 0; c < kChunk; c++) {
                sc[c] = dot<DP>(qr, t.k[c0 + c]) + t.mask[c0 + c] + (b2 ? t.pair[threadIdx.x][c0 + c] : 0.f);
                mx = fmaxf(mx, sc[c]);
            }
            if (mx == -INFINITY) continue;  // nothing visible yet in this row
            const float corr = __expf(m - mx);
            m = mx;
            float p[kChunk], ps = 0.f;
#pragma unroll
            for (int c = 0; c < kChunk; c++) {
                p[c] = __expf(sc[c] - mx);
                ps += p[c];
            }
            l = l * corr + ps;
#pragma unroll
            for (int d = 0; d < DP; d++) {
                float a = acc[d] * corr;
#pragma unroll
                for (int c = 0; c < kChunk; c++) a = fmaf(p[c], t.v[c0 + c][d], a);
                acc[d] = a;
            }
        }
    }
    if (!live) return;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    T *orow = o + s.base + (int64_t)i * g.HD;
#pragma unroll
    for (int d = 0; d < DP; d++)
        if (d < D) store(orow + d, acc[d] * inv);
    lse[s.lse_row + i] = l > 0.f ? m + logf(l) : INFINITY;
#endif
}

} // namespace dsc_evo

using namespace dsc_evo;

extern "C" int dsc_evo_forward(const void *q, const void *k, const void *v, const void *bias1, const void *bias2,
                               void *o, float *lse, int64_t B, int64_t N, int64_t L, int64_t H, int64_t D,
                               float scale, int dtype, int device, cudaStream_t stream) {
    if (!q || !k || !v || !o || !lse || bad_shape(B, N, L, H, D)) return DSC_CUDA_EARG;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    if (simt_unavailable()) return DSC_CUDA_EARG;
    const dim3 grid((unsigned)(B * N * H), (unsigned)((L + kRowsPerBlock - 1) / kRowsPerBlock));
    return dispatch_half(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        return dispatch_dim(D, [&](auto dp) {
            evo_forward_kernel<E, decltype(dp)::value><<<grid, kRowsPerBlock, 0, stream>>>(
                static_cast<const E *>(q), static_cast<const E *>(k), static_cast<const E *>(v),
                static_cast<const E *>(bias1), static_cast<const E *>(bias2), static_cast<E *>(o), lse, (int)N,
                (int)L, (int)H, (int)D, scale);
            return launch_error();
        });
    });
}

