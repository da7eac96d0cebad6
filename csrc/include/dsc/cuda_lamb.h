/* Multi-tensor LAMB with DeepSpeed's FusedLamb arithmetic: per tensor, the update
 * u = m / denom + weight_decay * p and the trust ratio clamp(||p|| / ||u||, min_coeff, max_coeff)
 * (1 when either norm is 0), then p -= step_size * ratio * u with
 * step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t) (lr without bias correction).
 * Three launches per dtype group whatever the tensor count: moments + norms, ratios, apply.
 *
 * Slots: 0 grad, 1 param (updated in place), 2 exp_avg (f32), 3 exp_avg_sq (f32),
 * 4 optional out copy (f16/bf16, only with an f32 param). */
#ifndef DSC_CUDA_LAMB_H
#define DSC_CUDA_LAMB_H

#include "dsc/cuda_multi_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    float lr;
    double beta1; /* double: 1 - 0.999 keeps its digits (in fp32 it is off by 1.3e-5) */
    double beta2;
    float eps;
    float weight_decay;
    float max_coeff;
    float min_coeff;
    int eps_inside_sqrt; /* 1: denom = sqrt(v + eps); 0: denom = sqrt(v) + eps */
    int bias_correction;
    int64_t step;        /* this step's number, >= 1 */
    float grad_scale;    /* gradients are divided by this first */
} dsc_lamb_params;

/* coeff_out: n device floats, tensor i's trust ratio. scratch: 2 * n device doubles. */
int dsc_cuda_lamb(const dsc_mt_tensor *tensors, int64_t n, const dsc_lamb_params *hp, float *coeff_out,
                  double *scratch, int device, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
