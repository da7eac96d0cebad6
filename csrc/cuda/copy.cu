/* Multi-tensor scale and casting copy (fp32 <-> fp16/bf16), and flatten/unflatten between a
 * tensor list and one contiguous buffer, all on one kernel: dst = src * scale, with an optional
 * inf/nan flag on src (the loss-scale unscale of torch's GradScaler, done for a whole list). */
#include "multi_tensor_apply.cuh"

namespace {
using namespace dsc_mt;

struct ScaleArgs {
    float scale;
    const float *scale_dev; // multiplied in when not NULL
    float *found_inf;       // set to 1 on an inf/nan source element when not NULL
};

template <typename S, typename D, bool SCALE>
__global__ void __launch_bounds__(kBlock) scale_kernel(const __grid_constant__ Meta<2> m, const ScaleArgs a) {
    const Where w = locate(m);
    const S *src = slot<const S>(m, 0, w);
    D *dst = slot<D>(m, 1, w);
    float s = a.scale;
    if (SCALE && a.scale_dev != nullptr) s *= *a.scale_dev;
    bool bad = false;
    for_each_elem(w.n, vec_aligned<S>(src) && vec_aligned<D>(dst), [&](auto wc, auto uc, int i, int stride) {
        constexpr int W = decltype(wc)::value, U = decltype(uc)::value;
        float r[U][W];
        load_u<U, W>(src, i, stride, r);
        if constexpr (SCALE) {
#pragma unroll
            for (int u = 0; u < U; u++) {
#pragma unroll
                for (int k = 0; k < W; k++) {
                    bad |= !isfinite(r[u][k]);
                    r[u][k] *= s;
                }
            }
        }
        store_u<U, W>(dst, i, stride, r);
    });
    if (SCALE && a.found_inf != nullptr) {
        bad = __syncthreads_or(bad);
        if (bad && threadIdx.x == 0) *a.found_inf = 1.f;
    }
}

template <bool SCALE>
int run_scale(const dsc_mt_tensor *tensors, int64_t n, const ScaleArgs &a, int device, cudaStream_t stream) {
    std::vector<Group> groups;
    int rc = group_by_dtype(tensors, n, 2, groups);
    if (rc != 0) return rc;
    DeviceGuard guard(device);
    if ((rc = guard.error()) != 0) return rc;
    for (const Group &g : groups) {
        if (!g.present[0] || !g.present[1]) return DSC_CUDA_EARG;
        rc = with_type(g.dtype[0], [&](auto stag) {
            return with_type(g.dtype[1], [&](auto dtag) {
                using S = typename decltype(stag)::type;
                using D = typename decltype(dtag)::type;
                return plan_launches<2>(tensors, g.idx, [&](const Meta<2> &m, int nblocks) {
                    scale_kernel<S, D, SCALE><<<nblocks, kBlock, 0, stream>>>(m, a);
                    return last_launch_error();
                });
            });
        });
        if (rc != 0) return rc;
    }
    return DSC_CUDA_OK;
}

// Slot 0 of `tensors` paired with consecutive slices of `flat` (slot 1 = flat slice when
// to_flat, else the two are swapped).
int run_flat(const dsc_mt_tensor *tensors, int64_t n, void *flat, int flat_dtype, bool to_flat, int device,
             cudaStream_t stream) {
    if (n < 0 || (n > 0 && tensors == nullptr) || !valid_dtype(flat_dtype)) return DSC_CUDA_EARG;
    std::vector<dsc_mt_tensor> pairs(static_cast<size_t>(n));
    int64_t offset = 0;
    for (int64_t i = 0; i < n; i++) {
        dsc_mt_tensor p{};
        p.numel = tensors[i].numel;
        void *slice = static_cast<char *>(flat) + offset * itemsize(flat_dtype);
        p.ptr[to_flat ? 0 : 1] = tensors[i].ptr[0];
        p.dtype[to_flat ? 0 : 1] = tensors[i].dtype[0];
        p.ptr[to_flat ? 1 : 0] = slice;
        p.dtype[to_flat ? 1 : 0] = static_cast<uint8_t>(flat_dtype);
        pairs[static_cast<size_t>(i)] = p;
        offset += tensors[i].numel;
    }
    if (offset > 0 && flat == nullptr) return DSC_CUDA_EARG;
    const ScaleArgs a{1.f, nullptr, nullptr};
    return run_scale<false>(pairs.data(), n, a, device, stream);
}
} // namespace

extern "C" int dsc_cuda_scale(const dsc_mt_tensor *tensors, int64_t n, float scale, const float *scale_dev,
                              float *found_inf, int device, cudaStream_t stream) {
    const ScaleArgs a{scale, scale_dev, found_inf};
    return run_scale<true>(tensors, n, a, device, stream);
}

extern "C" int dsc_cuda_copy(const dsc_mt_tensor *tensors, int64_t n, int device, cudaStream_t stream) {
    const ScaleArgs a{1.f, nullptr, nullptr};
    return run_scale<false>(tensors, n, a, device, stream);
}

extern "C" int dsc_cuda_flatten(const dsc_mt_tensor *tensors, int64_t n, void *flat, int flat_dtype, int device,
                                cudaStream_t stream) {
    return run_flat(tensors, n, flat, flat_dtype, true, device, stream);
}

extern "C" int dsc_cuda_unflatten(const void *flat, int flat_dtype, const dsc_mt_tensor *tensors, int64_t n,
                                  int device, cudaStream_t stream) {
    // The flat buffer is only read on this path; the shared pairing helper takes it non-const.
    return run_flat(tensors, n, const_cast<void *>(flat), flat_dtype, false, device, stream);
}
