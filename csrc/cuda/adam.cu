/* Multi-tensor Adam/AdamW (DeepSpeed's FusedAdam): one launch per dtype group. */
#include <cmath>

#include "adam_update.cuh"
#include "dsc/cuda_adam.h"

extern "C" int dsc_cuda_adam(const dsc_mt_tensor *tensors, int64_t n, const dsc_adam_params *hp, int device,
                             cudaStream_t stream) {
    if (hp == nullptr || hp->step < 1 || hp->grad_scale == 0.f) return DSC_CUDA_EARG;
    dsc_adam::AdamArgs a{};
    a.lr = hp->lr;
    a.beta1 = static_cast<float>(hp->beta1);
    a.beta2 = static_cast<float>(hp->beta2);
    a.one_minus_beta1 = static_cast<float>(1.0 - hp->beta1);
    a.one_minus_beta2 = static_cast<float>(1.0 - hp->beta2);
    a.eps = hp->eps;
    a.weight_decay = hp->weight_decay;
    a.adam_w_mode = hp->adam_w_mode;
    a.inv_grad_scale = 1.f / hp->grad_scale;
    a.inv_bc1 = 1.f;
    a.inv_sqrt_bc2 = 1.f;
    if (hp->bias_correction) { // in double: 1 - 0.999 loses a fifth of its digits in fp32
        const double t = static_cast<double>(hp->step);
        a.inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(hp->beta1, t)));
        a.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(hp->beta2, t)));
    }
    return dsc_adam::run_adam<false>(tensors, n, a, device, stream);
}
