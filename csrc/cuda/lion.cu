/* Multi-tensor Lion (DeepSpeed's FusedLion): one launch per dtype group; per element
 *   c = b1 m + (1 - b1) g ;  p = p (1 - lr wd) - lr sign(c) ;  m = b2 m + (1 - b2) g
 * sign(0) = 0, as in the Lion paper. */
#include "dsc/cuda_lion.h"
#include "multi_tensor_apply.cuh"

namespace {
using namespace dsc_mt;

struct LionArgs {
    float lr, beta1, beta2, one_minus_beta1, one_minus_beta2, weight_decay;
};

template <typename GT, typename PT, typename OT>
__global__ void __launch_bounds__(kBlock) lion_kernel(const __grid_constant__ Meta<4> m, const LionArgs a) {
    const Where w = locate(m);
    const GT *g = slot<const GT>(m, 0, w);
    PT *p = slot<PT>(m, 1, w);
    float *em = slot<float>(m, 2, w);
    constexpr bool kOut = !std::is_same_v<OT, NoOut>;
    using OutT = std::conditional_t<kOut, OT, float>;
    OutT *o = kOut ? slot<OutT>(m, 3, w) : nullptr;
    const bool vec = vec_aligned<GT>(g) && vec_aligned<PT>(p) && vec_aligned<float>(em) && (!kOut || vec_aligned<OutT>(o));
    const float decay = 1.f - a.lr * a.weight_decay;
    for_each_elem(w.n, vec, [&](auto wc, auto uc, int i, int stride) {
        constexpr int W = decltype(wc)::value, U = decltype(uc)::value;
        float rg[U][W], rp[U][W], rm[U][W];
        load_u<U, W>(g, i, stride, rg);
        load_u<U, W>(p, i, stride, rp);
        load_u<U, W>(em, i, stride, rm);
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int k = 0; k < W; k++) {
                const float c = fmaf(a.beta1, rm[u][k], a.one_minus_beta1 * rg[u][k]);
                const float s = c > 0.f ? 1.f : (c < 0.f ? -1.f : 0.f);
                rp[u][k] = fmaf(rp[u][k], decay, -a.lr * s);
                rm[u][k] = fmaf(a.beta2, rm[u][k], a.one_minus_beta2 * rg[u][k]);
            }
        }
        store_u<U, W>(p, i, stride, rp);
        store_u<U, W>(em, i, stride, rm);
        if constexpr (kOut) store_u<U, W>(o, i, stride, rp);
    });
}
} // namespace

extern "C" int dsc_cuda_lion(const dsc_mt_tensor *tensors, int64_t n, const dsc_lion_params *hp, int device,
                             cudaStream_t stream) {
    if (hp == nullptr) return DSC_CUDA_EARG;
    std::vector<Group> groups;
    int rc = group_by_dtype(tensors, n, 4, groups);
    if (rc != 0) return rc;
    DeviceGuard guard(device);
    if ((rc = guard.error()) != 0) return rc;
    const LionArgs a{hp->lr,
                     static_cast<float>(hp->beta1),
                     static_cast<float>(hp->beta2),
                     static_cast<float>(1.0 - hp->beta1),
                     static_cast<float>(1.0 - hp->beta2),
                     hp->weight_decay};
    for (const Group &gr : groups) {
        if (!gr.present[0] || !gr.present[1] || !gr.present[2]) return DSC_CUDA_EARG;
        if (gr.dtype[2] != DSC_CUDA_F32) return DSC_CUDA_EDTYPE;
        if (gr.present[3] && gr.dtype[1] != DSC_CUDA_F32) return DSC_CUDA_EDTYPE;
        rc = with_type(gr.dtype[0], [&](auto gtag) {
            return with_type(gr.dtype[1], [&](auto ptag) {
                return with_out_type(gr.present[3], gr.dtype[3], [&](auto otag) {
                    using GT = typename decltype(gtag)::type;
                    using PT = typename decltype(ptag)::type;
                    using OT = typename decltype(otag)::type;
                    if constexpr (!std::is_same_v<OT, NoOut> && !std::is_same_v<PT, float>) {
                        return static_cast<int>(DSC_CUDA_EDTYPE);
                    } else {
                        return plan_launches<4>(tensors, gr.idx, [&](const Meta<4> &m, int nblocks) {
                            lion_kernel<GT, PT, OT><<<nblocks, kBlock, 0, stream>>>(m, a);
                            return last_launch_error();
                        });
                    }
                });
            });
        });
        if (rc != 0) return rc;
    }
    return DSC_CUDA_OK;
}
