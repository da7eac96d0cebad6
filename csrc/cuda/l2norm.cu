/* Multi-tensor L2 norm, global and per tensor, with an inf/nan flag, in one read of the data.
 *
 * Each block squares and sums its chunk in double, then adds
 * the chunk's sum with one double atomic to its tensor's slot and to the global slot of the
 * scratch; a chunk holding an inf or nan raises the flag slot. A last tiny kernel takes the
 * square roots. Float64 accumulation keeps the result within a few fp32 ulps of the exact norm
 * and the atomic order effects far below fp32 resolution. The flag is per element, so a finite
 * value whose square overflows fp32 is not mistaken for an inf. */
#include "multi_tensor_apply.cuh"

namespace {
using namespace dsc_mt;

template <typename T>
__global__ void __launch_bounds__(kBlock)
l2norm_kernel(const __grid_constant__ Meta<1> m, double *acc, int64_t n, int per_tensor) {
    const Where w = locate(m);
    const T *x = slot<const T>(m, 0, w);
    double sum[1] = {0.0};
    bool bad = false;
    for_each_elem(w.n, vec_aligned<T>(x), [&](auto wc, auto uc, int i, int stride) {
        constexpr int W = decltype(wc)::value, U = decltype(uc)::value;
        float r[U][W];
        load_u<U, W>(x, i, stride, r);
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int k = 0; k < W; k++) {
                const double d = r[u][k]; // squared in double: a finite 1e20 must not become inf
                sum[0] = fma(d, d, sum[0]);
                bad |= !isfinite(r[u][k]);
            }
        }
    });
    bad = __syncthreads_or(bad);
    block_sum<1>(sum);
    if (threadIdx.x == 0) {
        atomicAdd(&acc[n], sum[0]);
        if (per_tensor) atomicAdd(&acc[m.tensor[w.seg]], sum[0]);
        if (bad) acc[n + 1] = 1.0; // every writer stores the same value
    }
}

__global__ void l2norm_finish(const double *acc, int64_t n, float *norm_out, float *per_tensor_out,
                              float *found_inf_out) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (per_tensor_out != nullptr && i < n) per_tensor_out[i] = static_cast<float>(sqrt(acc[i]));
    if (i == 0) {
        *norm_out = static_cast<float>(sqrt(acc[n]));
        if (found_inf_out != nullptr) *found_inf_out = acc[n + 1] != 0.0 ? 1.f : 0.f;
    }
}
} // namespace

extern "C" int dsc_cuda_l2norm(const dsc_mt_tensor *tensors, int64_t n, double *scratch, float *norm_out,
                               float *per_tensor_out, float *found_inf_out, int device, cudaStream_t stream) {
    if (scratch == nullptr || norm_out == nullptr) return DSC_CUDA_EARG;
    std::vector<Group> groups;
    int rc = group_by_dtype(tensors, n, 1, groups);
    if (rc != 0) return rc;
    DeviceGuard guard(device);
    if ((rc = guard.error()) != 0) return rc;
    rc = static_cast<int>(cudaMemsetAsync(scratch, 0, sizeof(double) * static_cast<size_t>(n + 2), stream));
    if (rc != 0) return rc;
    const int per_tensor = per_tensor_out != nullptr;
    for (const Group &g : groups) {
        rc = with_type(g.dtype[0], [&](auto tag) {
            using T = typename decltype(tag)::type;
            return plan_launches<1>(tensors, g.idx, [&](const Meta<1> &m, int nblocks) {
                l2norm_kernel<T><<<nblocks, kBlock, 0, stream>>>(m, scratch, n, per_tensor);
                return last_launch_error();
            });
        });
        if (rc != 0) return rc;
    }
    const int64_t threads = 256, cover = n > 0 ? n : 1;
    l2norm_finish<<<static_cast<unsigned>((cover + threads - 1) / threads), threads, 0, stream>>>(
        scratch, n, norm_out, per_tensor_out, found_inf_out);
    return last_launch_error();
}
