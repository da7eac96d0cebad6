/* Multi-tensor Lion: c = beta1 * m + (1 - beta1) * g; p = p * (1 - lr * wd) - lr * sign(c);
 * m = beta2 * m + (1 - beta2) * g.
 * Slots: 0 grad, 1 param (updated in place), 2 exp_avg (f32), 3 optional out copy (f16/bf16,
 * only with an f32 param). */
#ifndef DSC_CUDA_LION_H
#define DSC_CUDA_LION_H

#include "dsc/cuda_multi_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    float lr;
    double beta1; /* double: 1 - 0.999 keeps its digits (in fp32 it is off by 1.3e-5) */
    double beta2;
    float weight_decay;
} dsc_lion_params;

int dsc_cuda_lion(const dsc_mt_tensor *tensors, int64_t n, const dsc_lion_params *hp, int device,
                  cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
