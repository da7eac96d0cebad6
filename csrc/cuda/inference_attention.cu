// Causal attention with GQA over the KV cache, for prefill (T query tokens) and one-token decode.
//
// A block serves one (batch row, kv head) and WARPS query rows of it; a row is one (token t,
// head g of the kv head's group), so the heads sharing a kv head read each K/V tile from shared
// memory once. Keys stream through shared memory 32 at a time: lane j scores key j against the
// row's query (held in shared memory), the warp keeps a running max and sum (online softmax),
// and each lane accumulates its own D/32 output dims. With `splits` > 1 the keys are divided
// among blockIdx.z; each split writes (max, sum, unnormalised output) and combine_kernel merges
// them: decode at batch 1 has too few query rows to fill the GPU otherwise.
#include "inference_common.cuh"

namespace {
using namespace dsc_inf;

constexpr int WARPS = 4;
constexpr int TILE = 32;

// VEC elements of T in one 16-byte load (the caller guarantees 16-byte alignment: the cache is
// torch-allocated and every offset is a multiple of D, itself a multiple of VEC).
template <typename T> __device__ __forceinline__ void load16(const T *p, float *out) {
    const uint4 raw = *reinterpret_cast<const uint4 *>(p);
    const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
    for (int i = 0; i < (int)(16 / sizeof(T)); i++) out[i] = load(e + i);
}

struct AttnArgs {
    const int32_t *past;
    const int32_t *key_mask;
    int64_t mask_stride;
    float *workspace;
    int splits, B, T, H, Hkv, D, S;
    float scale;
    bool vec;  // K/V rows may be read 16 bytes at a time (D a multiple of the vector, 16-byte aligned)
};

template <typename T, int DPL>
__global__ void __launch_bounds__(WARPS * 32) attention_kernel(const T *__restrict__ q, const T *__restrict__ kc,
                                                               const T *__restrict__ vc, T *__restrict__ out,
                                                               AttnArgs a) {
    extern __shared__ float smem[];
    constexpr int VEC = 16 / sizeof(T);
    const int D = a.D, DS = D | 1;  // odd row stride: lane j reading row j of the K tile hits distinct banks
    float *q_s = smem;                  // [WARPS][D]
    float *k_s = q_s + WARPS * D;       // [TILE][DS]
    float *v_s = k_s + TILE * DS;       // [TILE][D]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int G = a.H / a.Hkv;
    const int b = blockIdx.y / a.Hkv, kvh = blockIdx.y % a.Hkv;
    const int rows = a.T * G;
    const int row = blockIdx.x * WARPS + warp;
    const bool live = row < rows;
    const int t = live ? row / G : 0;
    const int h = kvh * G + (live ? row % G : 0);
    const int past = *a.past;
    int kv_len = past + a.T;
    if (kv_len > a.S) kv_len = a.S;

    // keys this block needs: up to the last live row's causal limit; then this split's share
    const int last_row = min(rows, (int)(blockIdx.x + 1) * WARPS) - 1;
    const int block_keys = min(kv_len, past + last_row / G + 1);
    const int per_split = (((a.S + a.splits - 1) / a.splits) + TILE - 1) / TILE * TILE;
    const int k_begin = blockIdx.z * per_split;
    const int k_end = min(block_keys, k_begin + per_split);

    const int64_t q_off = (((int64_t)b * a.T + t) * a.H + h) * D;
    for (int d = lane; d < D; d += 32) q_s[warp * D + d] = live ? load(q + q_off + d) * a.scale : 0.f;
    const int64_t kv_base = ((int64_t)b * a.Hkv + kvh) * a.S * D;
    const int32_t *mask = a.key_mask ? a.key_mask + (int64_t)b * a.mask_stride : nullptr;

    float m = -INFINITY, l = 0.f, acc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; i++) acc[i] = 0.f;

    for (int j0 = k_begin; j0 < k_end; j0 += TILE) {
        __syncthreads();  // the previous tile is consumed (and q_s written, first time)
        if (a.vec) {  // 16-byte loads: decode streams the whole cache, bandwidth is the cost
            const int dv = D / VEC;
            for (int e = threadIdx.x; e < TILE * dv; e += blockDim.x) {
                const int jj = e / dv, c = (e - jj * dv) * VEC, j = j0 + jj;
                float kf[VEC], vf[VEC];
                if (j < k_end) {
                    load16(kc + kv_base + (int64_t)j * D + c, kf);
                    load16(vc + kv_base + (int64_t)j * D + c, vf);
                } else {
#pragma unroll
                    for (int i = 0; i < VEC; i++) kf[i] = vf[i] = 0.f;
                }
#pragma unroll
                for (int i = 0; i < VEC; i++) {
                    k_s[jj * DS + c + i] = kf[i];
                    v_s[jj * D + c + i] = vf[i];
                }
            }
        } else {
            for (int e = threadIdx.x; e < TILE * D; e += blockDim.x) {
                const int jj = e / D, d = e - jj * D, j = j0 + jj;
                const bool in = j < k_end;
                k_s[jj * DS + d] = in ? load(kc + kv_base + (int64_t)j * D + d) : 0.f;
                v_s[jj * D + d] = in ? load(vc + kv_base + (int64_t)j * D + d) : 0.f;
            }
        }
        __syncthreads();
        if (!live) continue;
        const int j = j0 + lane;
        const bool ok = j < k_end && j <= past + t && (mask == nullptr || mask[j] != 0);
        float s = -INFINITY;
        if (ok) {
            float dot = 0.f;
            const float *qr = q_s + warp * D, *kr = k_s + lane * DS;
            for (int d = 0; d < D; d++) dot = fmaf(qr[d], kr[d], dot);
            s = dot;
        }
        const float m_new = fmaxf(m, warp_max(s));
        if (m_new == -INFINITY) continue;  // nothing visible yet
        const float p = ok ? __expf(s - m_new) : 0.f;
        const float corr = __expf(m - m_new);  // m == -inf gives 0
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[i] *= corr;
        for (int jj = 0; jj < TILE; jj++) {
            const float pj = __shfl_sync(0xffffffffu, p, jj);
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                const int d = lane + 32 * i;
                if (d < D) acc[i] = fmaf(pj, v_s[jj * D + d], acc[i]);
            }
        }
        m = m_new;
    }
    if (!live) return;
    if (a.splits == 1) {
        const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            const int d = lane + 32 * i;
            if (d < D) store(out + q_off + d, acc[i] * inv);
        }
        return;
    }
    // partials: [splits][B*T*H][D + 2] = (acc..., max, sum)
    const int64_t qrow = ((int64_t)b * a.T + t) * a.H + h;
    const int64_t nrows = (int64_t)a.B * a.T * a.H;
    float *w = a.workspace + ((int64_t)blockIdx.z * nrows + qrow) * (D + 2);
#pragma unroll
    for (int i = 0; i < DPL; i++) {
        const int d = lane + 32 * i;
        if (d < D) w[d] = acc[i];
    }
    if (lane == 0) {
        w[D] = m;
        w[D + 1] = l;
    }
}

// One warp per query row: merges the splits' (max, sum, acc) with the usual rescaling.
template <typename T>
__global__ void combine_kernel(const float *__restrict__ ws, T *__restrict__ out, int64_t nrows, int splits, int D) {
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= nrows) return;
    float m = -INFINITY;
    for (int s = 0; s < splits; s++) m = fmaxf(m, ws[((int64_t)s * nrows + row) * (D + 2) + D]);
    float l = 0.f;
    for (int s = 0; s < splits; s++) {
        const float *w = ws + ((int64_t)s * nrows + row) * (D + 2);
        if (w[D] != -INFINITY) l += w[D + 1] * __expf(w[D] - m);
    }
    const float inv = (l > 0.f && m != -INFINITY) ? 1.f / l : 0.f;
    for (int d = lane; d < D; d += 32) {
        float v = 0.f;
        for (int s = 0; s < splits; s++) {
            const float *w = ws + ((int64_t)s * nrows + row) * (D + 2);
            if (w[D] != -INFINITY) v += w[d] * __expf(w[D] - m);
        }
        store(out + row * D + d, v * inv);
    }
}

template <typename T, int DPL>
int launch(const void *q, const void *kc, const void *vc, void *out, AttnArgs a, cudaStream_t stream) {
    const int vec = 16 / sizeof(T);
    a.vec = a.D % vec == 0 && reinterpret_cast<uintptr_t>(kc) % 16 == 0 && reinterpret_cast<uintptr_t>(vc) % 16 == 0;
    const int rows = a.T * (a.H / a.Hkv);
    dim3 grid((rows + WARPS - 1) / WARPS, a.B * a.Hkv, a.splits);
    const size_t smem = sizeof(float) * ((size_t)WARPS * a.D + (size_t)TILE * (a.D | 1) + (size_t)TILE * a.D);
    auto kern = attention_kernel<T, DPL>;
    const int smem_rc = allow_smem(kern, smem, 0);
    if (smem_rc != 0) return smem_rc;
    kern<<<grid, WARPS * 32, smem, stream>>>(static_cast<const T *>(q), static_cast<const T *>(kc),
                                             static_cast<const T *>(vc), static_cast<T *>(out), a);
    int rc = launch_error();
    if (rc != 0 || a.splits == 1) return rc;
    const int64_t nrows = (int64_t)a.B * a.T * a.H;
    combine_kernel<T><<<grid_for(nrows, 4, 1LL << 30), 128, 0, stream>>>(a.workspace, static_cast<T *>(out), nrows,
                                                                          a.splits, a.D);
    return launch_error();
}
} // namespace

extern "C" int dsc_inf_attention(const void *q, const void *k_cache, const void *v_cache, const int32_t *past,
                                 const int32_t *key_mask, int64_t mask_stride, void *out, float *workspace,
                                 int64_t splits, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t S,
                                 float scale, int dtype, int device, cudaStream_t stream) {
    if (!q || !k_cache || !v_cache || !past || !out || B < 1 || T < 1 || Hkv < 1 || H < Hkv || H % Hkv != 0 ||
        D < 1 || D > DSC_INF_MAX_HEAD_DIM || S < 1 || splits < 1 || splits > 64 || (splits > 1 && !workspace) ||
        (key_mask && mask_stride < S) || B * Hkv > 65535 || T * H > (1LL << 30))
        return DSC_CUDA_EARG;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    AttnArgs a{past, key_mask, mask_stride, workspace, (int)splits, (int)B, (int)T, (int)H, (int)Hkv, (int)D, (int)S,
               scale, false};
    const int need = (int)((D + 31) / 32);
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        if (need <= 1) return launch<E, 1>(q, k_cache, v_cache, out, a, stream);
        if (need <= 2) return launch<E, 2>(q, k_cache, v_cache, out, a, stream);
        if (need <= 4) return launch<E, 4>(q, k_cache, v_cache, out, a, stream);
        return launch<E, 8>(q, k_cache, v_cache, out, a, stream);
    });
}
