// Evoformer attention forward on tensor cores with mma.sync (evoformer_mma.cuh), flash style.
// A block of 4 warps owns 64 query rows of one (b, n, h) slice, 16 per warp, whose Q fragments stay
// in registers. The block streams 64-key tiles of K, V and the pair-bias block into padded shared
// tiles with 16-byte cp.async copies, two stages deep (the next tile lands while this one is used); each warp computes its 16 x 64 scores on tensor cores, adds the biases,
// runs the online softmax in the accumulator registers (a row's 64 scores are spread over the 4
// lanes of a quad: max and sum reduce with two shuffles), and multiplies the probabilities, still in
// registers, by V into its float32 output fragments. Same contract and outputs (O, lse) as the
// CUDA-core forward (evoformer_fwd.cu).
#include "evoformer_mma.cuh"

namespace dsc_evo {

// Two stages of the streamed tiles: tile k + 1 is copied (cp.async) while tile k is multiplied.
template <typename T, int DP> struct FwdSmem {
    __align__(16) T q[kMmaRows * Pad<DP>::S];
    __align__(16) T k[2][kMmaTile * Pad<DP>::S];
    __align__(16) T v[2][kMmaTile * Pad<DP>::S];
    __align__(16) T pair[2][kMmaTile * kBiasStride];
    __align__(16) float mask[2][kMmaTile];
};

// grid: one block per 64 query rows of each (b, n, h) slice, the row blocks of a slice adjacent
// (they share its K and V through L2).
template <typename T, int DP>
__global__ void __launch_bounds__(32 * kMmaWarps, DP == 32 ? 4 : 2)
    evo_forward_mma_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                           const T *__restrict__ bias1, const T *__restrict__ bias2, T *__restrict__ o,
                           float *__restrict__ lse, int N, int L, int H, int D, float scale, bool vec, bool bvec) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap();  // mma.sync on bf16 needs sm_80; the launcher never picks this kernel below it
#else
    using Smem = FwdSmem<T, DP>;
    DSC_EVO_SMEM(Smem, t);
    const Geometry g(N, L, H, D);
    const int blocks = (L + kMmaRows - 1) / kMmaRows;
    const Slice sl(g, blockIdx.x / blocks);
    const T *b1 = bias1 ? bias1 + sl.b1_off : nullptr;
    const T *b2 = bias2 ? bias2 + sl.b2_off : nullptr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
    const int q0 = (blockIdx.x % blocks) * kMmaRows;
    const int wr = warp * 16;  // the warp's first row in the block
    auto issue = [&](int k0, int st) {  // tile k0 into stage st, one cp.async group
        load_tile<T, DP>(t.k[st], k + sl.base, g.HD, L, D, k0, kMmaTile, vec);
        load_tile<T, DP>(t.v[st], v + sl.base, g.HD, L, D, k0, kMmaTile, vec);
        if (b2) load_bias_tile<T>(t.pair[st], b2, L, q0, k0, bvec);
        cp_commit();
    };
    // the mask bias of tile k0's key threadIdx.x (log2 units; -inf past L): loaded into a register when
    // the tile is issued, stored after this step's products, so its latency hides behind them
    auto fetch = [&](int k0) {
        const int j = k0 + (int)threadIdx.x;
        return threadIdx.x < kMmaTile ? (j < L ? (b1 ? load(b1 + j) * kLog2e : 0.f) : -INFINITY) : 0.f;
    };
    auto put = [&](int st, float m) {
        if (threadIdx.x < kMmaTile) t.mask[st][threadIdx.x] = m;
    };
    load_tile<T, DP>(t.q, q + sl.base, g.HD, L, D, q0, kMmaRows, vec);
    cp_commit();
    issue(0, 0);
    put(0, fetch(0));
    cp_wait<1>();  // Q has landed
    __syncthreads();
    uint32_t qf[DP / 16][4];
    load_a<T, DP>(qf, t.q, wr);
    float acc[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    const float sl2 = scale * kLog2e;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows gr and gr + 8, log2 units
    for (int k0 = 0, st = 0; k0 < L; k0 += kMmaTile, st ^= 1) {
        const bool more = k0 + kMmaTile < L;
        float next_mask = 0.f;
        if (more) {
            issue(k0 + kMmaTile, st ^ 1);  // that stage was last read before the barrier ending the previous step
            next_mask = fetch(k0 + kMmaTile);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        float s[kMmaTile / 8][4];
        rows_x_tile_t<T, DP>(s, qf, t.k[st]);
        float mx[2] = {-INFINITY, -INFINITY};
        uint32_t pbr[4] = {0u, 0u, 0u, 0u};  // the bias of n-tiles n and n + 1 (n even)
#pragma unroll
        for (int n = 0; n < kMmaTile / 8; n++) {
            const int col = n * 8 + 2 * tq;
            const float2 mk = *reinterpret_cast<const float2 *>(&t.mask[st][col]);
            if (b2 && (n & 1) == 0) bias_x4<false>(pbr, t.pair[st], wr, n >> 1);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float x0 = fmaf(s[n][2 * h], sl2, mk.x), x1 = fmaf(s[n][2 * h + 1], sl2, mk.y);
                if (b2) {
                    const float2 pb = unpack2(pbr[2 * (n & 1) + h], t.pair[st]);
                    x0 = fmaf(pb.x, kLog2e, x0);
                    x1 = fmaf(pb.y, kLog2e, x1);
                }
                s[n][2 * h] = x0;
                s[n][2 * h + 1] = x1;
                mx[h] = fmaxf(mx[h], fmaxf(x0, x1));
            }
        }
        float corr[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            const float m_new = fmaxf(m[h], mx[h]);
            corr[h] = m_new == -INFINITY ? 1.f : exp2f(m[h] - m_new);
            m[h] = m_new;
        }
        float ps[2] = {0.f, 0.f};
#pragma unroll
        for (int n = 0; n < kMmaTile / 8; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int h = e >> 1;
                const float p = m[h] == -INFINITY ? 0.f : exp2f(s[n][e] - m[h]);
                s[n][e] = p;
                ps[h] += p;
            }
        }
        // each lane keeps its partial row sums; the quad's lanes share m, so they add up at the end
        l[0] = l[0] * corr[0] + ps[0];
        l[1] = l[1] * corr[1] + ps[1];
#pragma unroll
        for (int n = 0; n < DP / 8; n++) {
            acc[n][0] *= corr[0];
            acc[n][1] *= corr[0];
            acc[n][2] *= corr[1];
            acc[n][3] *= corr[1];
        }
        uint32_t pf[kMmaTile / 16][4];
        c_to_a<T>(pf, s);
        acc_p_x_tile<T, DP>(acc, pf, t.v[st]);
        if (more) put(st ^ 1, next_mask);
        __syncthreads();  // this stage is refilled by the next step's issue
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int i = q0 + wr + gr + h * 8;
        if (i >= L) continue;
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        T *orow = o + sl.base + (int64_t)i * g.HD;
#pragma unroll
        for (int n = 0; n < DP / 8; n++) {
            const int c = n * 8 + 2 * tq;
            if (vec && c < D) {
                *reinterpret_cast<uint32_t *>(orow + c) = Mma<T>::pack(acc[n][2 * h] * inv, acc[n][2 * h + 1] * inv);
            } else {
                if (c < D) store(orow + c, acc[n][2 * h] * inv);
                if (c + 1 < D) store(orow + c + 1, acc[n][2 * h + 1] * inv);
            }
        }
        if (tq == 0) lse[sl.lse_row + i] = l[h] > 0.f ? (m[h] + log2f(l[h])) * kLn2 : INFINITY;
    }
#endif
}
} // namespace dsc_evo

#ifndef DSC_EVO_EMULATE  // the host check calls the kernel itself
using namespace dsc_evo;

extern "C" int dsc_evo_forward_tc(const void *q, const void *k, const void *v, const void *bias1, const void *bias2,
                                  void *o, float *lse, int64_t B, int64_t N, int64_t L, int64_t H, int64_t D,
                                  float scale, int dtype, int device, cudaStream_t stream) {
    if (!q || !k || !v || !o || !lse || bad_shape(B, N, L, H, D)) return DSC_CUDA_EARG;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    const int64_t blocks = B * N * H * ((L + kMmaRows - 1) / kMmaRows);
    if (blocks > 0x7fffffffLL) return DSC_CUDA_EARG;
    const bool vec = vec_ok(D, {q, k, v, o}), bvec = vec_ok(L, {bias2});
    return dispatch_half(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        return dispatch_dim(D, [&](auto dp) {
            constexpr int DP = decltype(dp)::value;
            const size_t smem = sizeof(FwdSmem<E, DP>);
            const int rc = allow_smem(evo_forward_mma_kernel<E, DP>, smem, 0);
            if (rc != 0) return rc;
            evo_forward_mma_kernel<E, DP><<<(unsigned)blocks, 32 * kMmaWarps, smem, stream>>>(
                static_cast<const E *>(q), static_cast<const E *>(k), static_cast<const E *>(v),
                static_cast<const E *>(bias1), static_cast<const E *>(bias2), static_cast<E *>(o), lse, (int)N,
                (int)L, (int)H, (int)D, scale, vec, bvec);
            return launch_error();
        });
    });
}
#endif
