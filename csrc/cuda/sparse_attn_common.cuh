// Shared pieces of the block-sparse attention kernels (sparse_attn_fwd.cu, sparse_attn_bwd.cu).
// Tensor-core math is mma.sync m16n8k16 (fp16/bf16 in, float32 accumulate, sm_80+). A block of
// BLK / 16 warps owns one layout block (BLK query rows in the forward and dQ kernels, BLK key rows
// in the dK/dV kernel), 16 rows per warp, and walks the layout's nonzero blocks of that row (or
// column) in chunks of C keys (or queries) staged in shared memory. The accumulator fragment of
// one product is, register for register, the A fragment of the next (the flash-attention trick),
// so probabilities never leave registers. Operands that must be read transposed are stored
// transposed when staged ([DP][C + 8] tiles); every tile row is padded by 8 elements so the
// fragment loads of a warp touch 32 distinct banks.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "device_guard.cuh"
#include "dsc/sparse_attn_cuda.h"

namespace dsc_sa {

// Keys (forward, dQ) or queries (dK/dV) staged per chunk: 64, or 32 with 128-wide heads so the
// fragments stay in registers.
template <int BLK, int DP> __host__ __device__ constexpr int chunk() { return BLK < (DP > 64 ? 32 : 64) ? BLK : (DP > 64 ? 32 : 64); }

template <typename T> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t *>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t *>(&h);
}

// c += a (16 x 16, row) * b (16 x 8, col).
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (std::is_same_v<T, __half>) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
#else
    __trap();  // the launchers refuse devices below compute capability 8.0
#endif
}

template <typename T> __device__ __forceinline__ uint32_t ld32(const T *p) { return *reinterpret_cast<const uint32_t *>(p); }

// A fragment (16 x 16, rows r0.., cols k0..) of a row-major tile with `pitch` elements per row.
template <typename T>
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const T *tile, int pitch, int r0, int k0, int lane) {
    const int g = lane >> 2, t = lane & 3;
    a[0] = ld32(tile + (r0 + g) * pitch + k0 + 2 * t);
    a[1] = ld32(tile + (r0 + g + 8) * pitch + k0 + 2 * t);
    a[2] = ld32(tile + (r0 + g) * pitch + k0 + 8 + 2 * t);
    a[3] = ld32(tile + (r0 + g + 8) * pitch + k0 + 8 + 2 * t);
}

// The same straight from a [rows, D] global slice; columns at or past D read as zeros.
template <typename T>
__device__ __forceinline__ void frag_a_global(uint32_t (&a)[4], const T *src, int D, int r0, int k0, int lane) {
    const int g = lane >> 2, t = lane & 3, c0 = k0 + 2 * t, c1 = c0 + 8;
    const T *p0 = src + (int64_t)(r0 + g) * D, *p1 = src + (int64_t)(r0 + g + 8) * D;
    a[0] = c0 < D ? ld32(p0 + c0) : 0u;
    a[1] = c0 < D ? ld32(p1 + c0) : 0u;
    a[2] = c1 < D ? ld32(p0 + c1) : 0u;
    a[3] = c1 < D ? ld32(p1 + c1) : 0u;
}

// B fragment (16 x 8: k0.. by n0..) of a tile holding element (k, n) at tile[n * pitch + k].
template <typename T>
__device__ __forceinline__ void frag_b(uint32_t &b0, uint32_t &b1, const T *tile, int pitch, int n0, int k0,
                                       int lane) {
    const int g = lane >> 2, t = lane & 3;
    b0 = ld32(tile + (n0 + g) * pitch + k0 + 2 * t);
    b1 = ld32(tile + (n0 + g) * pitch + k0 + 8 + 2 * t);
}

// The 16 x 16 A fragment k-chunk kk of a 16 x C accumulator (two adjacent n-tiles), in T.
template <typename T, int NT>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&s)[NT][4], int kk) {
    a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
    a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
    a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// Rows [0, R) of a [*, D] global slice into tile[R][DP + 8] (zeros past D), 16 bytes at a time.
template <typename T, int R, int DP>
__device__ __forceinline__ void stage_rows(T (*tile)[DP + 8], const T *__restrict__ src, int D) {
    constexpr int V = DP / 8;
    for (int e = threadIdx.x; e < R * V; e += blockDim.x) {
        const int r = e / V, c = (e % V) * 8;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (c < D) val = *reinterpret_cast<const uint4 *>(src + (int64_t)r * D + c);
        *reinterpret_cast<uint4 *>(&tile[r][c]) = val;
    }
}

// The same slice transposed: tile[d][r] = src[r][d].
template <typename T, int R, int DP>
__device__ __forceinline__ void stage_cols(T (*tile)[R + 8], const T *__restrict__ src, int D) {
    constexpr int V = DP / 8;
    for (int e = threadIdx.x; e < R * V; e += blockDim.x) {
        const int r = e % R, c = (e / R) * 8;  // consecutive threads: consecutive rows, one column group
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (c < D) val = *reinterpret_cast<const uint4 *>(src + (int64_t)r * D + c);
        const T *x = reinterpret_cast<const T *>(&val);
#pragma unroll
        for (int u = 0; u < 8; u++) tile[c + u][r] = x[u];
    }
}

// The additive biases of one (b, h) slice: score(i, j) += kpm[j] + am[i, j] + rpe[i, j].
struct Bias {
    const float *kpm, *am, *rpe;
    int L;
    __device__ Bias(const float *kpm_all, const float *am_all, const float *rpe_all, int64_t rpe_sb, int64_t rpe_sh,
                    int b, int h, int L_)
        : kpm(kpm_all ? kpm_all + (int64_t)b * L_ : nullptr), am(am_all),
          rpe(rpe_all ? rpe_all + b * rpe_sb + h * rpe_sh : nullptr), L(L_) {}
    __device__ __forceinline__ bool any() const { return kpm || am || rpe; }
    __device__ __forceinline__ float at(int i, int j) const {
        float x = 0.f;
        if (kpm) x += kpm[j];
        if (am) x += am[(int64_t)i * L + j];
        if (rpe) x += rpe[(int64_t)i * L + j];
        return x;
    }
};

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Probabilities of one 16 x C score fragment (rows ri0, ri0 + 8 of the accumulator's row side)
// in place: exp(scale * s + bias - lse). `transposed`: accumulator rows are keys, columns queries.
template <int NT, bool transposed>
__device__ __forceinline__ void probabilities(float (&s)[NT][4], const Bias &bias, float scale, int row0, int col0,
                                              int t, const float *lse_rows, const float *lse_cols) {
#pragma unroll
    for (int n = 0; n < NT; n++) {
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int rr = (u >> 1) * 8, cc = n * 8 + 2 * t + (u & 1);
            const int r = row0 + rr, c = col0 + cc;
            float x = s[n][u] * scale;
            if (bias.any()) x += transposed ? bias.at(c, r) : bias.at(r, c);
            const float m = transposed ? lse_cols[cc] : lse_rows[u >> 1];
            s[n][u] = m == INFINITY ? 0.f : __expf(x - m);
        }
    }
}

// Calls f(T tag, BLK tag, DP tag) for the instantiated combinations, or returns an error code.
template <typename F> int dispatch(int dtype, int block, int64_t D, F &&f) {
    auto by_dim = [&](auto tag, auto blk) {
        if (D <= 64) return f(tag, blk, std::integral_constant<int, 64>{});
        return f(tag, blk, std::integral_constant<int, 128>{});
    };
    auto by_block = [&](auto tag) {
        switch (block) {
        case 16: return by_dim(tag, std::integral_constant<int, 16>{});
        case 32: return by_dim(tag, std::integral_constant<int, 32>{});
        case 64: return by_dim(tag, std::integral_constant<int, 64>{});
        case 128: return by_dim(tag, std::integral_constant<int, 128>{});
        default: return (int)DSC_CUDA_EARG;
        }
    };
    if (dtype == DSC_CUDA_F16) return by_block(static_cast<__half *>(nullptr));
    if (dtype == DSC_CUDA_BF16) return by_block(static_cast<__nv_bfloat16 *>(nullptr));
    return DSC_CUDA_EDTYPE;
}

inline bool bad_shape(int64_t B, int64_t H, int64_t L, int64_t D, int block) {
    return B < 1 || H < 1 || L < 1 || D < 8 || D % 8 != 0 || D > DSC_SA_MAX_HEAD_DIM || L % block != 0 ||
           B * H > 65535 || L * D > 0x7fffffffLL || L / block > 0x7fffffffLL;
}

// Tensor cores with bf16 need compute capability 8.0.
inline int check_arch(int device) {
    int major = 0;
    const cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (e != cudaSuccess) return (int)e;
    return major >= 8 ? 0 : (int)DSC_CUDA_EARG;
}

inline int launch_error() { return static_cast<int>(cudaGetLastError()); }

// Each pass lives in its own file so the build compiles them in parallel; arguments as the C
// launchers' (sparse_attn.cu), delta already filled for the gradient passes.
struct BackwardArgs {
    const void *d_o, *q, *k, *v;
    const float *lse, *delta;
    const int *row_ptr, *cols, *col_ptr, *rows;
    const float *kpm, *am, *rpe;
    int64_t rpe_sb, rpe_sh;
    void *dq, *dk, *dv;
    int64_t B, H, L, D;
    int block;
    float scale;
    int dtype;
    const dsc_sa_plan *row_plan, *col_plan;  // NULL: the index-order grid (sparse_attn_plan.cuh)
    float *part;
    cudaStream_t stream;
};
struct ForwardArgs {
    const void *q, *k, *v;
    void *o;
    float *lse;
    const int *row_ptr, *cols;
    const float *kpm, *am, *rpe;
    int64_t rpe_sb, rpe_sh;
    int64_t B, H, L, D;
    int block;
    float scale;
    int dtype;
    const dsc_sa_plan *plan;
    float *part;
    cudaStream_t stream;
};
// The forward's epilogue, shared by both forms: rows i0 / i1 of O normalised by their softmax sums (summed
// over the quad here), and their log-sum-exp (+inf for a row with no visible key, whose O is zero).
template <typename T, int DP>
__device__ __forceinline__ void store_forward_rows(const float (&acc)[DP / 8][4], float m0, float m1, float l0, float l1,
                                                   T *o0, T *o1, float *lse_row, int i0, int i1, int D, int t) {
    l0 = quad_sum(l0), l1 = quad_sum(l1);
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
#pragma unroll
    for (int n = 0; n < DP / 8; n++) {
        const int d = n * 8 + 2 * t;
        if (d < D) {
            *reinterpret_cast<uint32_t *>(o0 + d) = pack2<T>(acc[n][0] * inv0, acc[n][1] * inv0);
            *reinterpret_cast<uint32_t *>(o1 + d) = pack2<T>(acc[n][2] * inv1, acc[n][3] * inv1);
        }
    }
    if (t == 0) {
        lse_row[i0] = l0 > 0.f ? m0 + logf(l0) : INFINITY;
        lse_row[i1] = l1 > 0.f ? m1 + logf(l1) : INFINITY;
    }
}

// One file per pass (sparse_attn_{fwd,dq,dkv}.cu), built in parallel.
int launch_forward(const ForwardArgs &a);
int launch_dq(const BackwardArgs &a);
int launch_dkv(const BackwardArgs &a);
} // namespace dsc_sa
