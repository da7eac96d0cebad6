// Shared pieces of the Evoformer attention kernels (evoformer_fwd.cu, evoformer_bwd.cu). DS4Sci Evoformer attention, flash style: scores live only in registers and shared-memory tiles,
// the softmax runs online (running max and sum per query row), and the backward recomputes the
// probabilities from the saved log-sum-exp. One thread owns one query row (forward, dQ) or one key
// row (dK, dV, bias gradients); the other side streams through shared memory as float32 tiles
// that every thread of the block reads by broadcast. Head dims are padded with zeros to 32 or 64 so
// each thread's rows stay in registers. Only fp16 and bf16 are instantiated (float32 inputs take
// the torch path): each instantiation costs build time on every machine.
//
// The pair bias's gradient sums over the N rows of the stack: the dK/dV kernel, whose warps hold
// consecutive keys of one query row, adds its dS row into the float32 [B, H, L, L] gradient with
// coalesced atomics. The mask bias's gradient (summed over heads and queries) is one atomic per
// key and head.
#pragma once
#include <type_traits>

#include "inference_common.cuh"
#include "dsc/evoformer_cuda.h"

// The CUDA-core kernels serve GPUs without bf16 tensor cores (before sm_80). In a build for sm_80 or
// newer their device code is left out (the tensor-core kernels run there): it would be half of the
// op's compile time for nothing. Their launchers refuse such a device (simt_unavailable) instead.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define DSC_EVO_SIMT_BODY 0
#else
#define DSC_EVO_SIMT_BODY 1
#endif

namespace dsc_evo {
using namespace dsc_inf;

// The current device runs the tensor-core kernels, so the CUDA-core ones are not built for it.
inline bool simt_unavailable() {
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
    return major >= 8;
}

constexpr int kRowsPerBlock = 128;  // forward and dQ: query rows per block (one per thread)
constexpr int kKeyTile = 32;        // forward and dQ: keys per shared-memory tile
constexpr int kChunk = 8;           // keys folded into the running softmax at once
constexpr int kKeysPerBlock = 64;   // dK/dV: key rows per block (one per thread)
constexpr int kQueryTile = 32;      // dK/dV: query rows per shared-memory tile

struct Geometry {
    int N, L, H, D;
    int64_t HD;  // elements between consecutive tokens of one (b, n) row
    __device__ Geometry(int n, int l, int h, int d) : N(n), L(l), H(h), D(d), HD((int64_t)h * d) {}
};

// Rows [r0, r0 + rows) of one (b, n, h) slice of a [B, N, L, H, D] tensor into tile[rows][DP] as
// float32 times `mul`, zeros past L and past D.
template <typename T, int DP>
__device__ __forceinline__ void load_rows(float (*tile)[DP], const T *__restrict__ src, const Geometry &g, int r0,
                                          int rows, float mul) {
    for (int e = threadIdx.x; e < rows * DP; e += blockDim.x) {
        const int r = e / DP, d = e % DP, i = r0 + r;
        tile[r][d] = (i < g.L && d < g.D) ? load(src + i * g.HD + d) * mul : 0.f;
    }
}

// One row of a [.., L, H, D] slice into registers (times `mul`), zeros when out of range.
template <typename T, int DP>
__device__ __forceinline__ void load_row(float (&row)[DP], const T *__restrict__ src, const Geometry &g, int i,
                                         float mul) {
#pragma unroll
    for (int d = 0; d < DP; d++) row[d] = (i < g.L && d < g.D) ? load(src + i * g.HD + d) * mul : 0.f;
}

template <int DP> __device__ __forceinline__ float dot(const float (&a)[DP], const float *b) {
    float s = 0.f;
#pragma unroll
    for (int d = 0; d < DP; d++) s = fmaf(a[d], b[d], s);
    return s;
}

// Shared tiles of the query-row kernels: keys, values, mask bias, pair bias.
template <int DP> struct KeyTiles {
    float k[kKeyTile][DP];
    float v[kKeyTile][DP];
    float mask[kKeyTile];
    float pair[kRowsPerBlock][kKeyTile + 1];  // +1: rows read across threads without bank conflicts
};

template <typename T, int DP>
__device__ __forceinline__ void load_key_tiles(KeyTiles<DP> &t, const T *k, const T *v, const T *b1, const T *b2,
                                               const Geometry &g, int q0, int k0) {
    load_rows<T, DP>(t.k, k, g, k0, kKeyTile, 1.f);
    load_rows<T, DP>(t.v, v, g, k0, kKeyTile, 1.f);
    for (int c = threadIdx.x; c < kKeyTile; c += blockDim.x) {
        const int j = k0 + c;
        t.mask[c] = j < g.L ? (b1 ? load(b1 + j) : 0.f) : -INFINITY;
    }
    if (b2) {
        for (int e = threadIdx.x; e < kRowsPerBlock * kKeyTile; e += blockDim.x) {
            const int r = e / kKeyTile, c = e % kKeyTile, i = q0 + r, j = k0 + c;
            t.pair[r][c] = (i < g.L && j < g.L) ? load(b2 + (int64_t)i * g.L + j) : 0.f;
        }
    }
}

// Pointers of one (b, n, h) slice: the [L, H, D] base at head h, the mask bias row, the pair bias
// [L, L] plane.
struct Slice {
    int64_t bnh, base, lse_row;
    int64_t b1_off, b2_off;
    __device__ Slice(const Geometry &g) : Slice(g, blockIdx.x) {}
    __device__ Slice(const Geometry &g, int64_t index) {
        bnh = index;
        const int h = (int)(bnh % g.H);
        const int64_t bn = bnh / g.H, b = bn / g.N;
        base = bn * g.L * g.HD + (int64_t)h * g.D;
        lse_row = bnh * g.L;
        b1_off = bn * g.L;
        b2_off = (b * g.H + h) * g.L * g.L;
    }
};

// Calls f with a tag of the padded head dim (32 or 64).
template <typename F> int dispatch_dim(int64_t D, F &&f) {
    if (D <= 32) return f(std::integral_constant<int, 32>{});
    return f(std::integral_constant<int, 64>{});
}

// Calls f with a null pointer of the element type (fp16 or bf16), or returns EDTYPE.
template <typename F> int dispatch_half(int dtype, F &&f) {
    if (dtype == DSC_CUDA_F16) return f(static_cast<__half *>(nullptr));
    if (dtype == DSC_CUDA_BF16) return f(static_cast<__nv_bfloat16 *>(nullptr));
    return DSC_CUDA_EDTYPE;
}

// dQ, dK, dV and the bias gradients on mma.sync tensor-core tiles (evoformer_bwd_mma.cu); fp16/bf16, sm_80+; delta
// ready.
int launch_bwd_mma(const void *d_o, const void *q, const void *k, const void *v, const void *o, const float *lse,
                   float *delta, const void *bias1, const void *bias2, void *dq, void *dk, void *dv, float *dbias1,
                   float *dbias2, int64_t B, int64_t N, int64_t L, int64_t H, int64_t D, float scale, int dtype,
                   cudaStream_t stream);

inline bool bad_shape(int64_t B, int64_t N, int64_t L, int64_t H, int64_t D) {
    return B < 1 || N < 1 || L < 1 || H < 1 || D < 1 || D > DSC_EVO_MAX_HEAD_DIM || L > 0x7fffffffLL ||
           B * N * H > 0x7fffffffLL || (L + kRowsPerBlock - 1) / kRowsPerBlock > 65535;
}
} // namespace dsc_evo
