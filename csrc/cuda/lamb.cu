/* Multi-tensor LAMB with DeepSpeed's FusedLamb arithmetic (see dsc/cuda_lamb.h), with no
 * per-tensor launches: three kernels per call whatever the number of tensors.
 *   1. moments: update m and v, and add each chunk's sums of p^2 and u^2 into its tensor's two
 *      double slots of the scratch (one atomic each per block);
 *   2. ratios: one thread per tensor turns the sums into the clamped trust ratio;
 *   3. apply: recompute u from p and the new m, v (cheaper than storing u: no param-sized
 *      buffer) and write p -= step_size * ratio * u, plus the optional low-precision copy. */
#include <cmath>

#include "dsc/cuda_lamb.h"
#include "multi_tensor_apply.cuh"

namespace {
using namespace dsc_mt;

struct LambArgs {
    float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, inv_grad_scale, step_size, max_coeff, min_coeff;
    int eps_inside_sqrt;
};

__device__ __forceinline__ float lamb_update(float m, float v, float p, const LambArgs &a) {
    const float denom = a.eps_inside_sqrt ? sqrtf(v + a.eps) : sqrtf(v) + a.eps;
    return m / denom + a.weight_decay * p;
}

template <typename GT, typename PT>
__global__ void __launch_bounds__(kBlock) lamb_moments(const __grid_constant__ Meta<5> m, const LambArgs a, double *acc) {
    const Where w = locate(m);
    const GT *g = slot<const GT>(m, 0, w);
    const PT *p = slot<const PT>(m, 1, w);
    float *em = slot<float>(m, 2, w);
    float *ev = slot<float>(m, 3, w);
    const bool vec = vec_aligned<GT>(g) && vec_aligned<PT>(p) && vec_aligned<float>(em) && vec_aligned<float>(ev);
    double sums[2] = {0.0, 0.0}; // ||p||^2, ||u||^2
    for_each_elem(w.n, vec, [&](auto wc, auto uc, int i, int stride) {
        constexpr int W = decltype(wc)::value, U = decltype(uc)::value;
        float rg[U][W], rp[U][W], rm[U][W], rv[U][W];
        load_u<U, W>(g, i, stride, rg);
        load_u<U, W>(p, i, stride, rp);
        load_u<U, W>(em, i, stride, rm);
        load_u<U, W>(ev, i, stride, rv);
        float sp = 0.f, su = 0.f;
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int k = 0; k < W; k++) {
                const float gk = rg[u][k] * a.inv_grad_scale;
                rm[u][k] = fmaf(a.beta1, rm[u][k], a.one_minus_beta1 * gk);
                rv[u][k] = fmaf(a.beta2, rv[u][k], a.one_minus_beta2 * gk * gk);
                const float upd = lamb_update(rm[u][k], rv[u][k], rp[u][k], a);
                sp = fmaf(rp[u][k], rp[u][k], sp);
                su = fmaf(upd, upd, su);
            }
        }
        store_u<U, W>(em, i, stride, rm);
        store_u<U, W>(ev, i, stride, rv);
        sums[0] += static_cast<double>(sp);
        sums[1] += static_cast<double>(su);
    });
    block_sum<2>(sums);
    if (threadIdx.x == 0) {
        const int t = m.tensor[w.seg];
        atomicAdd(&acc[2 * t], sums[0]);
        atomicAdd(&acc[2 * t + 1], sums[1]);
    }
}

__global__ void lamb_ratios(const double *acc, int64_t n, float max_coeff, float min_coeff, float *coeff) {
    const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const float wn = static_cast<float>(sqrt(acc[2 * t])), un = static_cast<float>(sqrt(acc[2 * t + 1]));
    float c = 1.f;
    if (wn != 0.f && un != 0.f) {
        c = wn / un;
        if (c > max_coeff) c = max_coeff;
        if (c < min_coeff) c = min_coeff;
    }
    coeff[t] = c;
}

template <typename PT, typename OT>
__global__ void __launch_bounds__(kBlock) lamb_apply(const __grid_constant__ Meta<5> m, const LambArgs a, const float *coeff) {
    const Where w = locate(m);
    PT *p = slot<PT>(m, 1, w);
    const float *em = slot<const float>(m, 2, w);
    const float *ev = slot<const float>(m, 3, w);
    constexpr bool kOut = !std::is_same_v<OT, NoOut>;
    using OutT = std::conditional_t<kOut, OT, float>;
    OutT *o = kOut ? slot<OutT>(m, 4, w) : nullptr;
    const bool vec = vec_aligned<PT>(p) && vec_aligned<float>(em) && vec_aligned<float>(ev) &&
                     (!kOut || vec_aligned<OutT>(o));
    const float scale = a.step_size * coeff[m.tensor[w.seg]];
    for_each_elem(w.n, vec, [&](auto wc, auto uc, int i, int stride) {
        constexpr int W = decltype(wc)::value, U = decltype(uc)::value;
        float rp[U][W], rm[U][W], rv[U][W];
        load_u<U, W>(p, i, stride, rp);
        load_u<U, W>(em, i, stride, rm);
        load_u<U, W>(ev, i, stride, rv);
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int k = 0; k < W; k++) rp[u][k] = fmaf(-scale, lamb_update(rm[u][k], rv[u][k], rp[u][k], a), rp[u][k]);
        }
        store_u<U, W>(p, i, stride, rp);
        if constexpr (kOut) store_u<U, W>(o, i, stride, rp);
    });
}
} // namespace

extern "C" int dsc_cuda_lamb(const dsc_mt_tensor *tensors, int64_t n, const dsc_lamb_params *hp, float *coeff_out,
                             double *scratch, int device, cudaStream_t stream) {
    if (hp == nullptr || hp->step < 1 || hp->grad_scale == 0.f || (n > 0 && (coeff_out == nullptr || scratch == nullptr)))
        return DSC_CUDA_EARG;
    std::vector<Group> groups;
    int rc = group_by_dtype(tensors, n, 5, groups);
    if (rc != 0) return rc;
    for (const Group &gr : groups) {
        if (!gr.present[0] || !gr.present[1] || !gr.present[2] || !gr.present[3]) return DSC_CUDA_EARG;
        if (gr.dtype[2] != DSC_CUDA_F32 || gr.dtype[3] != DSC_CUDA_F32) return DSC_CUDA_EDTYPE;
        if (gr.present[4] && (gr.dtype[1] != DSC_CUDA_F32 || gr.dtype[4] == DSC_CUDA_F32)) return DSC_CUDA_EDTYPE;
    }
    if (n == 0) return DSC_CUDA_OK;
    LambArgs a{};
    a.beta1 = static_cast<float>(hp->beta1);
    a.beta2 = static_cast<float>(hp->beta2);
    a.one_minus_beta1 = static_cast<float>(1.0 - hp->beta1);
    a.one_minus_beta2 = static_cast<float>(1.0 - hp->beta2);
    a.eps = hp->eps;
    a.weight_decay = hp->weight_decay;
    a.inv_grad_scale = 1.f / hp->grad_scale;
    a.max_coeff = hp->max_coeff;
    a.min_coeff = hp->min_coeff;
    a.eps_inside_sqrt = hp->eps_inside_sqrt;
    a.step_size = hp->lr;
    if (hp->bias_correction) {
        const double t = static_cast<double>(hp->step);
        const double bc1 = 1.0 - std::pow(hp->beta1, t);
        const double bc2 = 1.0 - std::pow(hp->beta2, t);
        a.step_size = static_cast<float>(hp->lr * std::sqrt(bc2) / bc1);
    }
    DeviceGuard guard(device);
    if ((rc = guard.error()) != 0) return rc;
    rc = static_cast<int>(cudaMemsetAsync(scratch, 0, sizeof(double) * 2 * static_cast<size_t>(n), stream));
    if (rc != 0) return rc;
    for (const Group &gr : groups) {
        rc = with_type(gr.dtype[0], [&](auto gtag) {
            return with_type(gr.dtype[1], [&](auto ptag) {
                using GT = typename decltype(gtag)::type;
                using PT = typename decltype(ptag)::type;
                return plan_launches<5>(tensors, gr.idx, [&](const Meta<5> &m, int nblocks) {
                    lamb_moments<GT, PT><<<nblocks, kBlock, 0, stream>>>(m, a, scratch);
                    return last_launch_error();
                });
            });
        });
        if (rc != 0) return rc;
    }
    lamb_ratios<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(scratch, n, a.max_coeff, a.min_coeff,
                                                                         coeff_out);
    if ((rc = last_launch_error()) != 0) return rc;
    for (const Group &gr : groups) {
        rc = with_type(gr.dtype[1], [&](auto ptag) {
            return with_out_type(gr.present[4], gr.dtype[4], [&](auto otag) {
                using PT = typename decltype(ptag)::type;
                using OT = typename decltype(otag)::type;
                if constexpr (!std::is_same_v<OT, NoOut> && !std::is_same_v<PT, float>) {
                    return static_cast<int>(DSC_CUDA_EDTYPE);
                } else {
                    return plan_launches<5>(tensors, gr.idx, [&](const Meta<5> &m, int nblocks) {
                        lamb_apply<PT, OT><<<nblocks, kBlock, 0, stream>>>(m, a, coeff_out);
                        return last_launch_error();
                    });
                }
            });
        });
        if (rc != 0) return rc;
    }
    return DSC_CUDA_OK;
}
