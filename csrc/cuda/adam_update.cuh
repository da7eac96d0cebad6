/* The Adam/AdamW kernel shared by the plain multi-tensor Adam (adam.cu) and the fused
 * optimizer epilogue (epilogue.cu). Per element, in fp32 registers:
 *   g = grad / scale                    (scale: the host's grad_scale, or loss scale x clip)
 *   g += wd * p                         (L2 mode only)
 *   m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
 *   u = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)
 *   u += wd * p                         (AdamW mode only: decoupled decay)
 *   p -= lr u ;  out = cast(p)          (out: optional fp16/bf16 copy of an fp32 master p)
 * which is DeepSpeed's FusedAdam arithmetic; AdamW mode equals torch.optim.AdamW's
 * p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps). */
#ifndef DSC_ADAM_UPDATE_CUH
#define DSC_ADAM_UPDATE_CUH

#include "multi_tensor_apply.cuh"

namespace dsc_adam {
using namespace dsc_mt;

struct AdamArgs {
    float lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
    float inv_bc1;        // 1 / (1 - beta1^t), or 1 without bias correction
    float inv_sqrt_bc2;   // 1 / sqrt(1 - beta2^t), or 1
    float inv_grad_scale; // plain Adam: 1 / grad_scale
    int adam_w_mode;
    // epilogue only: the scale, the skip and the step come from the device
    const float *grad_norm;
    const float *found_inf;
    const float *step;
    float loss_scale, max_grad_norm;
    double beta1_d, beta2_d; // bias corrections in double, as the host path computes them
    int bias_correction;
};

// Epilogue: decides on the device whether this step is taken. Every block and the step
// counter kernel evaluate the same expression on the same inputs.
__device__ __forceinline__ bool epilogue_skips(const float *grad_norm, const float *found_inf) {
    return !isfinite(*grad_norm) || (found_inf != nullptr && *found_inf != 0.f);
}

template <typename GT, typename PT, typename OT, bool EPI>
__global__ void __launch_bounds__(kBlock) adam_kernel(const __grid_constant__ Meta<5> m, const AdamArgs a) {
    float inv_scale = a.inv_grad_scale, inv_bc1 = a.inv_bc1, inv_sqrt_bc2 = a.inv_sqrt_bc2;
    if constexpr (EPI) {
        if (epilogue_skips(a.grad_norm, a.found_inf)) return; // nothing is written on a skipped step
        const float unscaled_norm = *a.grad_norm / a.loss_scale;
        inv_scale = 1.f / a.loss_scale;
        if (a.max_grad_norm > 0.f) { // DeepSpeed's clip: divide by (norm + 1e-6) / max when > 1
            const float clip = (unscaled_norm + 1e-6f) / a.max_grad_norm;
            if (clip > 1.f) inv_scale = 1.f / (a.loss_scale * clip);
        }
        if (a.bias_correction) {
            const double t = static_cast<double>(*a.step) + 1.0;
            inv_bc1 = static_cast<float>(1.0 / (1.0 - pow(a.beta1_d, t)));
            inv_sqrt_bc2 = static_cast<float>(1.0 / sqrt(1.0 - pow(a.beta2_d, t)));
        }
    }
    const Where w = locate(m);
    const GT *g = slot<const GT>(m, 0, w);
    PT *p = slot<PT>(m, 1, w);
    float *em = slot<float>(m, 2, w);
    float *ev = slot<float>(m, 3, w);
    constexpr bool kOut = !std::is_same_v<OT, NoOut>;
    using OutT = std::conditional_t<kOut, OT, float>;
    OutT *o = kOut ? slot<OutT>(m, 4, w) : nullptr;
    const bool vec = vec_aligned<GT>(g) && vec_aligned<PT>(p) && vec_aligned<float>(em) &&
                     vec_aligned<float>(ev) && (!kOut || vec_aligned<OutT>(o));
    const float b1 = a.beta1, b2 = a.beta2, ob1 = a.one_minus_beta1, ob2 = a.one_minus_beta2;
    const float lr = a.lr, wd = a.weight_decay, eps = a.eps;
    const bool w_mode = a.adam_w_mode != 0;
    for_each_elem(w.n, vec, [&](auto wc, auto uc, int i, int stride) {
        constexpr int W = decltype(wc)::value, U = decltype(uc)::value;
        float rg[U][W], rp[U][W], rm[U][W], rv[U][W];
        load_u<U, W>(g, i, stride, rg);
        load_u<U, W>(p, i, stride, rp);
        load_u<U, W>(em, i, stride, rm);
        load_u<U, W>(ev, i, stride, rv);
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int k = 0; k < W; k++) {
                float gk = rg[u][k] * inv_scale;
                if (!w_mode) gk = fmaf(wd, rp[u][k], gk);
                rm[u][k] = fmaf(b1, rm[u][k], ob1 * gk);
                rv[u][k] = fmaf(b2, rv[u][k], ob2 * gk * gk);
                const float denom = fmaf(sqrtf(rv[u][k]), inv_sqrt_bc2, eps);
                float upd = (rm[u][k] * inv_bc1) / denom;
                if (w_mode) upd = fmaf(wd, rp[u][k], upd);
                rp[u][k] = fmaf(-lr, upd, rp[u][k]);
            }
        }
        store_u<U, W>(p, i, stride, rp);
        store_u<U, W>(em, i, stride, rm);
        store_u<U, W>(ev, i, stride, rv);
        if constexpr (kOut) store_u<U, W>(o, i, stride, rp);
    });
}

// Launches the kernel over every dtype group of the table.
template <bool EPI>
int run_adam(const dsc_mt_tensor *tensors, int64_t n, const AdamArgs &a, int device, cudaStream_t stream) {
    std::vector<Group> groups;
    int rc = group_by_dtype(tensors, n, 5, groups);
    if (rc != 0) return rc;
    DeviceGuard guard(device);
    if ((rc = guard.error()) != 0) return rc;
    for (const Group &gr : groups) {
        if (!gr.present[0] || !gr.present[1] || !gr.present[2] || !gr.present[3]) return DSC_CUDA_EARG;
        if (gr.dtype[2] != DSC_CUDA_F32 || gr.dtype[3] != DSC_CUDA_F32) return DSC_CUDA_EDTYPE;
        if (gr.present[4] && gr.dtype[1] != DSC_CUDA_F32) return DSC_CUDA_EDTYPE; // out copy needs an fp32 master
        rc = with_type(gr.dtype[0], [&](auto gtag) {
            return with_type(gr.dtype[1], [&](auto ptag) {
                return with_out_type(gr.present[4], gr.dtype[4], [&](auto otag) {
                    using GT = typename decltype(gtag)::type;
                    using PT = typename decltype(ptag)::type;
                    using OT = typename decltype(otag)::type;
                    if constexpr (!std::is_same_v<OT, NoOut> && !std::is_same_v<PT, float>) {
                        return static_cast<int>(DSC_CUDA_EDTYPE);
                    } else {
                        return plan_launches<5>(tensors, gr.idx, [&](const Meta<5> &m, int nblocks) {
                            adam_kernel<GT, PT, OT, EPI><<<nblocks, kBlock, 0, stream>>>(m, a);
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

} // namespace dsc_adam

#endif
