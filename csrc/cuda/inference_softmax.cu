// The softmax of prefill attention: attention over a multi-token prompt runs as two batched GEMMs
// (scores = q k^T, out = p v, cuBLAS through torch, on tensor cores) around this kernel, which
// scales the scores, applies the causal limit and the padding mask, and normalises each row in
// place (float32 math; a row with no visible key becomes zeros). One block per score row.
#include "inference_common.cuh"

namespace {
using namespace dsc_inf;

template <typename T>
__global__ void masked_softmax_kernel(T *__restrict__ scores, int L, int T_, int rows_per_batch,
                                      const int32_t *__restrict__ past_ptr, const int32_t *__restrict__ key_mask,
                                      int64_t mask_stride, float scale) {
    extern __shared__ float row_s[];  // [L]
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const int t = (int)(row % T_);
    const int b = (int)(row / rows_per_batch);
    const int limit = *past_ptr + t;  // last visible key
    const int32_t *mask = key_mask ? key_mask + (int64_t)b * mask_stride : nullptr;
    T *p = scores + row * L;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < L; j += blockDim.x) {
        const bool ok = j <= limit && (mask == nullptr || mask[j] != 0);
        const float v = ok ? load(p + j) * scale : -INFINITY;
        row_s[j] = v;
        mx = fmaxf(mx, v);
    }
    // block max through the sum helper's pattern
    {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
        mx = warp_max(mx);
        __syncthreads();
        if (lane == 0) scratch[warp] = mx;
        __syncthreads();
        mx = warp_max(lane < nwarps ? scratch[lane] : -INFINITY);
    }
    float sum = 0.f;
    for (int j = threadIdx.x; j < L; j += blockDim.x) {
        const float e = mx == -INFINITY ? 0.f : __expf(row_s[j] - mx);
        row_s[j] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int j = threadIdx.x; j < L; j += blockDim.x) store(p + j, row_s[j] * inv);
}
} // namespace

extern "C" int dsc_inf_masked_softmax(void *scores, int64_t rows, int64_t L, int64_t T, int64_t rows_per_batch,
                                      const int32_t *past, const int32_t *key_mask, int64_t mask_stride, float scale,
                                      int dtype, int device, cudaStream_t stream) {
    if (!scores || !past || rows < 0 || L < 1 || T < 1 || rows_per_batch < T || rows_per_batch % T != 0 ||
        L > DSC_INF_MAX_NORM_COLS || rows > 0x7fffffffLL || (key_mask && mask_stride < L))
        return DSC_CUDA_EARG;
    if (rows == 0) return 0;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    int threads = 32;
    while (threads < 1024 && threads * 4 < L) threads *= 2;
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        const int rc = allow_smem(masked_softmax_kernel<E>, sizeof(float) * (size_t)L, 32 * sizeof(float));
        if (rc != 0) return rc;
        masked_softmax_kernel<E><<<(unsigned)rows, threads, sizeof(float) * (size_t)L, stream>>>(
            static_cast<E *>(scores), (int)L, (int)T, (int)rows_per_batch, past, key_mask, mask_stride, scale);
        return launch_error();
    });
}
