// Host emulation of the few CUDA features the Evoformer mma kernels use, so that their index math,
// fragment bookkeeping and synchronisation can be checked on a machine without a GPU
// (tests/unit/test_evoformer_emulated.py compiles evoformer_{fwd,bwd}_mma.cu with g++ and
// -DDSC_EVO_EMULATE). One OS thread per CUDA thread; a block's threads run together, blocks one
// after another. Warp collectives (shuffle, ldmatrix, mma.sync) exchange through a per-warp buffer
// between two warp barriers and follow the PTX ISA's fragment layouts:
//   ldmatrix .m8n8 .x4: lanes 8i..8i+7 give the row addresses of matrix i; lane l receives row l/4,
//     elements 2(l%4) and 2(l%4)+1 (with .trans: rows 2(l%4) and 2(l%4)+1 of column l/4).
//   mma .m16n8k16 (g = l/4, t = l%4): A regs {row g, k 2t..}, {row g+8, k 2t..}, {row g, k 2t+8..},
//     {row g+8, k 2t+8..}; B regs {k 2t.., col g}, {k 2t+8.., col g}; C {row g, cols 2t, 2t+1},
//     {row g+8, cols 2t, 2t+1}. The lower-indexed element sits in the low 16 bits.
// Never part of a GPU build.
#pragma once
#ifdef DSC_EVO_EMULATE

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace dsc_emu {
struct Dim {
    unsigned x = 0, y = 0, z = 0;
};
inline thread_local Dim tid, bid;
inline Dim bdim, gdim;
inline std::unique_ptr<std::barrier<>> block_bar;
inline std::unique_ptr<std::barrier<>> warp_bar[32];
inline uint64_t xbuf[32][32][6];  // [warp][lane][slot]
inline std::mutex atomic_mu;
using std::min;

inline int warp() { return (int)tid.x / 32; }
inline int lane() { return (int)tid.x & 31; }
inline void wsync() { warp_bar[warp()]->arrive_and_wait(); }
inline void bsync() { block_bar->arrive_and_wait(); }

template <typename V> V shfl_xor(V v, int o) {
    static_assert(sizeof(V) <= 8, "shuffle of a wide type");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof v);
    xbuf[warp()][lane()][0] = bits;
    wsync();
    const uint64_t got = xbuf[warp()][lane() ^ o][0];
    wsync();
    V r;
    std::memcpy(&r, &got, sizeof r);
    return r;
}

inline void ldsm(uint32_t (&r)[4], const void *p, bool trans) {
    xbuf[warp()][lane()][0] = reinterpret_cast<uint64_t>(p);
    wsync();
    const int g = lane() >> 2, t = lane() & 3;
    for (int i = 0; i < 4; i++) {
        uint16_t e[2];
        for (int x = 0; x < 2; x++) {
            const uint16_t *row = reinterpret_cast<const uint16_t *>(xbuf[warp()][8 * i + (trans ? 2 * t + x : g)][0]);
            e[x] = trans ? row[g] : row[2 * t + x];
        }
        r[i] = (uint32_t)e[0] | ((uint32_t)e[1] << 16);
    }
    wsync();
}

inline float half_bits(uint32_t h, bool bf16) {
    if (bf16) {
        const uint32_t u = (h & 0xffffu) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    const uint16_t b = (uint16_t)(h & 0xffffu);
    __half x;
    std::memcpy(&x, &b, 2);
    return __half2float(x);
}

inline void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16) {
    uint64_t *mine = xbuf[warp()][lane()];
    for (int i = 0; i < 4; i++) mine[i] = a[i];
    mine[4] = b0, mine[5] = b1;
    wsync();
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, t = l & 3;
        const uint64_t *f = xbuf[warp()][l];
        for (int x = 0; x < 2; x++) {
            const int sh = 16 * x;
            A[g][2 * t + x] = half_bits((uint32_t)(f[0] >> sh), bf16);
            A[g + 8][2 * t + x] = half_bits((uint32_t)(f[1] >> sh), bf16);
            A[g][2 * t + 8 + x] = half_bits((uint32_t)(f[2] >> sh), bf16);
            A[g + 8][2 * t + 8 + x] = half_bits((uint32_t)(f[3] >> sh), bf16);
            B[2 * t + x][g] = half_bits((uint32_t)(f[4] >> sh), bf16);
            B[2 * t + 8 + x][g] = half_bits((uint32_t)(f[5] >> sh), bf16);
        }
    }
    wsync();
    const int g = lane() >> 2, t = lane() & 3;
    for (int e = 0; e < 4; e++) {
        const int row = g + (e >> 1) * 8, col = 2 * t + (e & 1);
        float s = 0.f;
        for (int k = 0; k < 16; k++) s += A[row][k] * B[k][col];
        c[e] += s;
    }
}

inline float atomic_add(float *p, float v) {
    std::lock_guard<std::mutex> lock(atomic_mu);
    const float old = *p;
    *p = old + v;
    return old;
}

// Runs kernel(args...) over grid x block (block.x a multiple of 32, at most 1024).
template <typename F> void launch(Dim grid, unsigned threads, F &&kernel) {
    gdim = grid;
    bdim = Dim{threads, 1, 1};
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                block_bar = std::make_unique<std::barrier<>>(threads);
                for (unsigned w = 0; w < threads / 32; w++) warp_bar[w] = std::make_unique<std::barrier<>>(32);
                std::vector<std::thread> pool;
                for (unsigned t = 0; t < threads; t++)
                    pool.emplace_back([&, t, x, y, z] {
                        tid = Dim{t, 0, 0};
                        bid = Dim{x, y, z};
                        kernel();
                    });
                for (auto &th : pool) th.join();
            }
}
} // namespace dsc_emu

using dsc_emu::min;
#undef __shared__
#define __shared__ static
#define threadIdx dsc_emu::tid
#define blockIdx dsc_emu::bid
#define blockDim dsc_emu::bdim
#define gridDim dsc_emu::gdim
#define __syncthreads() dsc_emu::bsync()
#define __shfl_xor_sync(mask, v, o) dsc_emu::shfl_xor((v), (o))
#define __trap() std::abort()
#define atomicAdd(p, v) dsc_emu::atomic_add((p), (v))
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

#endif
