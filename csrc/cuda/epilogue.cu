/* The fused optimizer epilogue: given the global gradient norm (device) and the loss scale,
 * one pass over the tensors unscales, clips, skips on inf/nan, applies AdamW and writes the
 * fp16/bf16 model copy. Per parameter it reads grad (2 B) and master, m, v (12 B) and writes
 * master, m, v and the copy (14 B): 28 bytes, against ~58 for torch's separate unscale,
 * inf check, clip, fused AdamW and cast. The skip decision and the step count stay on the
 * device, so the host never waits. */
#include "adam_update.cuh"
#include "dsc/cuda_adam.h"

namespace {
__global__ void epilogue_count_step(const float *grad_norm, const float *found_inf, float *step) {
    if (!dsc_adam::epilogue_skips(grad_norm, found_inf)) *step += 1.f;
}
} // namespace

extern "C" int dsc_cuda_adam_epilogue(const dsc_mt_tensor *tensors, int64_t n, const dsc_epilogue_params *hp,
                                      const float *grad_norm, const float *found_inf, float *step, int device,
                                      cudaStream_t stream) {
    if (hp == nullptr || grad_norm == nullptr || step == nullptr || !(hp->loss_scale > 0.f)) return DSC_CUDA_EARG;
    dsc_adam::AdamArgs a{};
    a.lr = hp->adam.lr;
    a.beta1 = static_cast<float>(hp->adam.beta1);
    a.beta2 = static_cast<float>(hp->adam.beta2);
    a.one_minus_beta1 = static_cast<float>(1.0 - hp->adam.beta1);
    a.one_minus_beta2 = static_cast<float>(1.0 - hp->adam.beta2);
    a.eps = hp->adam.eps;
    a.weight_decay = hp->adam.weight_decay;
    a.adam_w_mode = hp->adam.adam_w_mode;
    a.inv_bc1 = 1.f;
    a.inv_sqrt_bc2 = 1.f;
    a.inv_grad_scale = 1.f;
    a.grad_norm = grad_norm;
    a.found_inf = found_inf;
    a.step = step;
    a.loss_scale = hp->loss_scale;
    a.max_grad_norm = hp->max_grad_norm;
    a.beta1_d = hp->adam.beta1;
    a.beta2_d = hp->adam.beta2;
    a.bias_correction = hp->adam.bias_correction;
    int rc = dsc_adam::run_adam<true>(tensors, n, a, device, stream);
    if (rc != 0) return rc;
    dsc_mt::DeviceGuard guard(device);
    if ((rc = guard.error()) != 0) return rc;
    epilogue_count_step<<<1, 1, 0, stream>>>(grad_norm, found_inf, step);
    return dsc_mt::last_launch_error();
}
