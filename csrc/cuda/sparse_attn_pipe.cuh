// The pipelined form of the block-sparse attention kernels (sparse_attn_{fwd,dq,dkv}.cu): chunks are
// staged with cp.async into two shared-memory stages, the next chunk's copy in flight while the
// current one is multiplied, and every B operand is read with ldmatrix from row-major tiles
// (.trans where the product needs the tile transposed), so nothing is ever stored transposed.
#pragma once
#include "sparse_attn_common.cuh"

namespace dsc_sa {

__device__ __forceinline__ unsigned smem_addr(const void *p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, zero-filled when !valid (src must still be a mapped address).
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void *dst, const void *src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Rows [0, R) of a [*, D] global slice into tile[R][DP + 8] (zeros past D), asynchronously.
template <typename T, int R, int DP>
__device__ __forceinline__ void stage_rows_async(T (*tile)[DP + 8], const T *__restrict__ src, int D) {
    constexpr int V = DP / 8;
    for (int e = threadIdx.x; e < R * V; e += blockDim.x) {
        const int r = e / V, c = (e % V) * 8;
        const bool valid = c < D;
        cp_async16(&tile[r][c], src + (valid ? (int64_t)r * D + c : 0), valid);
    }
}

// B fragments of two adjacent n-tiles (n0, n0 + 8) at k-chunk k0 from a tile holding (k, n) at
// tile[n][k]: {b0, b1} of n-tile n0 in r[0], r[1], of n0 + 8 in r[2], r[3].
template <typename T>
__device__ __forceinline__ void ldsm_b_nk(uint32_t (&r)[4], const T *tile, int pitch, int n0, int k0, int lane) {
    const int m = lane >> 3, row = lane & 7;
    const T *p = tile + (n0 + (m >> 1) * 8 + row) * pitch + k0 + (m & 1) * 8;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// The same from a tile holding (k, n) at tile[k][n] (row-major in k), read transposed.
template <typename T>
__device__ __forceinline__ void ldsm_b_kn(uint32_t (&r)[4], const T *tile, int pitch, int n0, int k0, int lane) {
    const int m = lane >> 3, row = lane & 7;
    const T *p = tile + (k0 + (m & 1) * 8 + row) * pitch + n0 + (m >> 1) * 8;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// acc[n] += a * B for every n-tile of an N-wide product, B fragments by ldmatrix (NT even).
template <typename T, int NT, bool KN>
__device__ __forceinline__ void mma_row(float (&acc)[NT][4], const uint32_t (&a)[4], const T *tile, int pitch, int k0,
                                        int lane) {
#pragma unroll
    for (int n = 0; n < NT; n += 2) {
        uint32_t b[4];
        if constexpr (KN)
            ldsm_b_kn(b, tile, pitch, n * 8, k0, lane);
        else
            ldsm_b_nk(b, tile, pitch, n * 8, k0, lane);
        mma<T>(acc[n], a, b[0], b[1]);
        mma<T>(acc[n + 1], a, b[2], b[3]);
    }
}

// The layout walk of one block row (or column) as a flat sequence of chunks: chunk x is key (or
// query) rows [blocks[lo + x / per] * BLK + (x % per) * C, + C).
template <int BLK, int C> struct ChunkWalk {
    static constexpr int per = BLK / C;
    const int *blocks;
    int lo, total;
    __device__ ChunkWalk(const int *b, int lo_, int hi_) : blocks(b), lo(lo_), total((hi_ - lo_) * per) {}
    __device__ __forceinline__ int first_row(int x) const { return blocks[lo + x / per] * BLK + (x % per) * C; }
};
} // namespace dsc_sa
