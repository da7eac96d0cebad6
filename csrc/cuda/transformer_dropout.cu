// Dropout keep masks of the transformer layer from a counter-based generator (Philox4x32-10), so a
// mask costs one write of its bytes: torch's bernoulli_ drew a float per element through its
// generic distribution kernel and ran at a tenth of the copy bandwidth at BERT sizes.
//
// Element e of a call is kept when word (e % 4) of philox(counter = (e / 4, offset), key = seed ^
// kKeySalt) is below `threshold` (= (1 - p) * 2^32, computed by the caller). The caller takes seed
// and offset from a torch generator and advances its offset, so torch's RNG state (saved and
// restored by activation checkpointing) replays the same masks. The salt keeps these streams
// apart from torch's own Philox streams of the same seed. The CPU reference is
// deepspeed_c/ops/transformer/philox_reference.py (same words, bit for bit).
#include "transformer_vec.cuh"
#include "dsc/transformer_cuda.h"

namespace {
using namespace dsc_tf;

constexpr int kKeepThreads = 256;
constexpr int kPerThread = 16;  // keep bytes a thread writes: four Philox blocks, one 16-byte store

struct U4 {
    uint32_t x, y, z, w;
};

__device__ __forceinline__ U4 philox4x32_10(U4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {
            k0 += DSC_PHILOX_W0;
            k1 += DSC_PHILOX_W1;
        }
        const uint32_t lo0 = DSC_PHILOX_M0 * c.x, hi0 = __umulhi(DSC_PHILOX_M0, c.x);
        const uint32_t lo1 = DSC_PHILOX_M1 * c.z, hi1 = __umulhi(DSC_PHILOX_M1, c.z);
        c = U4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    }
    return c;
}

__device__ __forceinline__ uint32_t keep_bits(U4 r, uint32_t threshold) {
    return (uint32_t)(r.x < threshold) | (uint32_t)(r.y < threshold) << 8 | (uint32_t)(r.z < threshold) << 16 |
           (uint32_t)(r.w < threshold) << 24;
}

__global__ void __launch_bounds__(kKeepThreads) dropout_keep_kernel(uint8_t *__restrict__ keep, int64_t n,
                                                                uint32_t threshold, uint64_t seed, uint64_t offset) {
    const uint32_t k0 = (uint32_t)seed ^ DSC_PHILOX_SALT0, k1 = (uint32_t)(seed >> 32) ^ DSC_PHILOX_SALT1;
    const uint32_t o0 = (uint32_t)offset, o1 = (uint32_t)(offset >> 32);
    const int64_t first = ((int64_t)blockIdx.x * kKeepThreads + threadIdx.x) * kPerThread;
    if (first >= n) return;
    uint32_t words[kPerThread / 4];
#pragma unroll
    for (int j = 0; j < kPerThread / 4; ++j) {
        const uint64_t block = (uint64_t)(first / 4 + j);
        words[j] = keep_bits(philox4x32_10(U4{(uint32_t)block, (uint32_t)(block >> 32), o0, o1}, k0, k1), threshold);
    }
    if (first + kPerThread <= n && reinterpret_cast<uintptr_t>(keep + first) % 16 == 0) {
        *reinterpret_cast<uint4 *>(keep + first) = make_uint4(words[0], words[1], words[2], words[3]);
        return;
    }
    for (int i = 0; i < kPerThread && first + i < n; ++i) keep[first + i] = (uint8_t)(words[i / 4] >> (8 * (i % 4)));
}
} // namespace

extern "C" int dsc_tf_dropout_keep(uint8_t *keep, int64_t n, uint32_t threshold, uint64_t seed, uint64_t offset,
                                   int device, cudaStream_t stream) {
    if (!keep || n < 0) return DSC_CUDA_EARG;
    if (n == 0) return 0;
    const int64_t blocks = (n + (int64_t)kKeepThreads * kPerThread - 1) / ((int64_t)kKeepThreads * kPerThread);
    if (blocks > 0x7fffffffLL) return DSC_CUDA_EARG;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    dropout_keep_kernel<<<(unsigned)blocks, kKeepThreads, 0, stream>>>(keep, n, threshold, seed, offset);
    return launch_error();
}
