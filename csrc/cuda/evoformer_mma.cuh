// Tensor-core building blocks of the Evoformer kernels in evoformer_{fwd,bwd}_mma.cu (sm_80+):
// mma.sync m16n8k16 (fp16/bf16 in, float32 accumulate) with operands fetched by ldmatrix from
// padded shared-memory tiles, and 16-byte cooperative tile loads.
//
// Every product in the forward and the backward is one of two warp-level shapes over 64-wide
// tiles, so two helpers cover them all:
//   rows_x_tile_t   C (16 x 64)  = A (16 x DP) X^T   X a [64][DP] tile: S = Q K^T, dP = dO V^T, S^T = K Q^T, ...
//   acc_p_x_tile    C (16 x DP) += P (16 x 64) Y     Y a [64][DP] tile: O += P V, dQ += dS K, dV += P^T dO, ...
// The C fragment of the first (rows g and g+8 of the warp's 16, columns 2t and 2t+1 of each 8-wide
// n-tile; g = lane / 4, t = lane % 4) is, two n-tiles at a time, exactly the A fragment of the
// second, so probabilities never leave registers. Shared rows are padded by 8 elements (16 bytes)
// so the 8 row addresses of one ldmatrix phase fall in distinct banks.
#pragma once
#include <stdint.h>

#include <cstring>
#include <initializer_list>

#include "evoformer_common.cuh"
#include "evoformer_emulate.cuh"  // empty unless DSC_EVO_EMULATE (the host check of these kernels)

namespace dsc_evo {

constexpr int kMmaWarps = 4;
constexpr int kMmaRows = 16 * kMmaWarps;  // rows a block owns (queries or keys)
constexpr int kMmaTile = 64;              // rows of the streamed tiles
static_assert(kMmaTile <= 32 * kMmaWarps, "one thread per streamed row fetches its per-row floats");
constexpr float kLog2e = 1.4426950408889634f;  // scores go through exp2: one FMUL folded into the FMA
constexpr float kLn2 = 0.6931471805599453f;

template <int DP> struct Pad {
    static constexpr int S = DP + 8;  // row stride of a [rows][DP] tile, in elements
};

#ifdef DSC_EVO_EMULATE
inline void ldsm_x4(uint32_t (&r)[4], const void *p) { dsc_emu::ldsm(r, p, false); }
inline void ldsm_x4_t(uint32_t (&r)[4], const void *p) { dsc_emu::ldsm(r, p, true); }
#else
__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The asm below exists from sm_80 on; a build that also targets older GPUs compiles traps there (the
// launchers never pick these kernels on such a device).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define DSC_EVO_SM80 1
#else
#define DSC_EVO_SM80 0
#endif

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *p) {
#if DSC_EVO_SM80
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
#else
    __trap();
#endif
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void *p) {
#if DSC_EVO_SM80
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
#else
    __trap();
#endif
}
#endif

// 16 bytes global -> shared without passing through registers (cp.async, sm_80+); zeros when !valid
// (src then only has to be some valid address). cp_commit closes a group of copies; cp_wait<N>
// waits until at most N groups are in flight. The copies become visible to the other threads after
// the __syncthreads that follows the wait.
__device__ __forceinline__ void cp16(void *dst, const void *src, bool valid) {
#if defined(DSC_EVO_EMULATE)
    if (valid)
        std::memcpy(dst, src, 16);
    else
        std::memset(dst, 0, 16);
#elif DSC_EVO_SM80
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
#else
    __trap();
#endif
}

__device__ __forceinline__ void cp_commit() {
#if !defined(DSC_EVO_EMULATE) && DSC_EVO_SM80
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int N> __device__ __forceinline__ void cp_wait() {
#if !defined(DSC_EVO_EMULATE) && DSC_EVO_SM80
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// A kernel's shared tiles: dynamic shared memory (past the 48 KiB of static), one static object per
// kernel under the host emulation. Type must be a single token (a using-alias).
#ifdef DSC_EVO_EMULATE
#define DSC_EVO_SMEM(Type, name)                                                                                       \
    static Type name##_store;                                                                                          \
    Type &name = name##_store
#else
#define DSC_EVO_SMEM(Type, name)                                                                                       \
    extern __shared__ __align__(16) unsigned char dsc_evo_smem[];                                                      \
    Type &name = *reinterpret_cast<Type *>(dsc_evo_smem)
#endif

template <typename T> struct Mma;

template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                     "{%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif defined(DSC_EVO_EMULATE)
        dsc_emu::mma(c, a, b0, b1, true);
#else
        __trap();
#endif
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
};

template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                     "{%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif defined(DSC_EVO_EMULATE)
        dsc_emu::mma(c, a, b0, b1, false);
#else
        __trap();
#endif
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
};

// The A fragments (16 x DP) of rows [r0, r0 + 16) of a padded tile, one per 16-wide k step.
template <typename T, int DP>
__device__ __forceinline__ void load_a(uint32_t (&a)[DP / 16][4], const T *tile, int r0) {
    const int lane = threadIdx.x & 31, m = lane >> 3;
#pragma unroll
    for (int kc = 0; kc < DP / 16; kc++)
        ldsm_x4(a[kc], tile + (r0 + (m & 1) * 8 + (lane & 7)) * Pad<DP>::S + kc * 16 + (m >> 1) * 8);
}

// c[n] (n-tiles of 8 columns) = A (16 x DP) X^T, X rows [0, 64) of a padded [64][DP] tile.
template <typename T, int DP>
__device__ __forceinline__ void rows_x_tile_t(float (&c)[kMmaTile / 8][4], const uint32_t (&a)[DP / 16][4],
                                              const T *x) {
    const int lane = threadIdx.x & 31, m = lane >> 3;
#pragma unroll
    for (int n = 0; n < kMmaTile / 8; n++) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.f;
#pragma unroll
    for (int kc = 0; kc < DP / 16; kc++) {
#pragma unroll
        for (int np = 0; np < kMmaTile / 16; np++) {
            uint32_t b[4];  // n-tile 2np: b[0], b[1]; n-tile 2np + 1: b[2], b[3]
            ldsm_x4(b, x + (np * 16 + (m >> 1) * 8 + (lane & 7)) * Pad<DP>::S + kc * 16 + (m & 1) * 8);
            Mma<T>::run(c[2 * np], a[kc], b[0], b[1]);
            Mma<T>::run(c[2 * np + 1], a[kc], b[2], b[3]);
        }
    }
}

// The probabilities (or any 16 x 64 C fragment set) as the A fragments of the next product.
template <typename T>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[kMmaTile / 16][4], const float (&c)[kMmaTile / 8][4]) {
#pragma unroll
    for (int kc = 0; kc < kMmaTile / 16; kc++) {
        a[kc][0] = Mma<T>::pack(c[2 * kc][0], c[2 * kc][1]);
        a[kc][1] = Mma<T>::pack(c[2 * kc][2], c[2 * kc][3]);
        a[kc][2] = Mma<T>::pack(c[2 * kc + 1][0], c[2 * kc + 1][1]);
        a[kc][3] = Mma<T>::pack(c[2 * kc + 1][2], c[2 * kc + 1][3]);
    }
}

// acc (16 x DP, n-tiles of 8) += P (16 x 64, A fragments) Y, Y a padded [64][DP] tile (row = k index).
template <typename T, int DP>
__device__ __forceinline__ void acc_p_x_tile(float (&acc)[DP / 8][4], const uint32_t (&p)[kMmaTile / 16][4],
                                             const T *y) {
    const int lane = threadIdx.x & 31, m = lane >> 3;
#pragma unroll
    for (int kc = 0; kc < kMmaTile / 16; kc++) {
#pragma unroll
        for (int np = 0; np < DP / 16; np++) {
            uint32_t b[4];  // transposed 8 x 8 blocks: keys kc*16 + {0, 8}, dims np*16 + {0, 8}
            ldsm_x4_t(b, y + (kc * 16 + (m & 1) * 8 + (lane & 7)) * Pad<DP>::S + np * 16 + (m >> 1) * 8);
            Mma<T>::run(acc[2 * np], p[kc], b[0], b[1]);
            Mma<T>::run(acc[2 * np + 1], p[kc], b[2], b[3]);
        }
    }
}

// Rows [r0, r0 + rows) of one (b, n, h) slice ([L, H, D] at `src`, row stride HD) into a padded
// tile, zeros past L and past D. vec: D % 8 == 0 and 16-byte aligned rows, so 8 elements move per
// cp.async (complete after cp_commit / cp_wait); otherwise element by element through registers.
template <typename T, int DP>
__device__ __forceinline__ void load_tile(T *tile, const T *__restrict__ src, int64_t HD, int L, int D, int r0,
                                          int rows, bool vec) {
    constexpr int C = DP / 8;  // 16-byte chunks per row
    for (int e = threadIdx.x; e < rows * C; e += blockDim.x) {
        const int r = e / C, c = (e % C) * 8, i = r0 + r;
        T *dst = tile + r * Pad<DP>::S + c;
        if (vec) {
            const bool ok = i < L && c < D;
            cp16(dst, ok ? src + (int64_t)i * HD + c : src, ok);
        } else {
#pragma unroll
            for (int x = 0; x < 8; x++)
                dst[x] = (i < L && c + x < D) ? src[(int64_t)i * HD + c + x] : T(0.f);
        }
    }
}

// The pair-bias block [r0, r0 + 64) x [c0, c0 + 64) of an [L, L] plane into a [64][72] tile
// (zeros outside); cp.async when rows are 16-byte aligned (L % 8 == 0), as load_tile.
template <typename T>
__device__ __forceinline__ void load_bias_tile(T *tile, const T *__restrict__ plane, int L, int r0, int c0,
                                               bool vec) {
    constexpr int S = kMmaTile + 8, C = kMmaTile / 8;
    for (int e = threadIdx.x; e < kMmaTile * C; e += blockDim.x) {
        const int r = e / C, c = (e % C) * 8, i = r0 + r, j = c0 + c;
        T *dst = tile + r * S + c;
        if (vec) {
            const bool ok = i < L && j < L;  // L % 8 == 0: then all 8 are
            cp16(dst, ok ? plane + (int64_t)i * L + j : plane, ok);
        } else {
#pragma unroll
            for (int x = 0; x < 8; x++) dst[x] = (i < L && j + x < L) ? plane[(int64_t)i * L + j + x] : T(0.f);
        }
    }
}

constexpr int kBiasStride = kMmaTile + 8;

// A packed pair of fp16/bf16 values (low half: the lower column) as floats.
__device__ __forceinline__ float2 unpack2(uint32_t v, const __nv_bfloat16 *) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&v));
}
__device__ __forceinline__ float2 unpack2(uint32_t v, const __half *) {
    return __half22float2(*reinterpret_cast<const __half2 *>(&v));
}

// The pair-bias values under a warp's C fragments of n-tiles 2np and 2np + 1 (16 fragment rows from
// r0), with one ldmatrix: x[2 * nn + h] holds n-tile 2np + nn, fragment row gr + 8h, columns 2t and
// 2t + 1. Trans false: the [64][72] bias tile's rows are the fragment rows (S = Q K^T, tile [query][key]);
// true: its columns are (S^T = K Q^T of the dK/dV kernel, tile still [query][key]).
template <bool Trans, typename T>
__device__ __forceinline__ void bias_x4(uint32_t (&x)[4], const T *tile, int r0, int np) {
    const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
    if (Trans)
        ldsm_x4_t(x, tile + (np * 16 + (m >> 1) * 8 + r) * kBiasStride + r0 + (m & 1) * 8);
    else
        ldsm_x4(x, tile + (r0 + (m & 1) * 8 + r) * kBiasStride + np * 16 + (m >> 1) * 8);
}

// Every pointer is 16-byte aligned and D % 8 == 0: rows of D elements start 16-byte aligned too.
inline bool vec_ok(int64_t D, std::initializer_list<const void *> ptrs) {
    if (D % 8 != 0) return false;
    for (const void *p : ptrs)
        if (p && (reinterpret_cast<uintptr_t>(p) & 15) != 0) return false;
    return true;
}

} // namespace dsc_evo
