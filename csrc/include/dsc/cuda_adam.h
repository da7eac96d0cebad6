/* Multi-tensor Adam/AdamW, and the fused optimizer epilogue (unscale + clip + skip-on-inf/nan +
 * AdamW + low-precision write-back in one pass). See cuda_multi_tensor.h for the tensor table.
 *
 * Slots: 0 grad (f32/f16/bf16), 1 param (f32/f16/bf16, updated in place), 2 exp_avg (f32),
 * 3 exp_avg_sq (f32), 4 optional out copy (f16/bf16, only with an f32 param: the model's copy
 * of an f32 master weight, written from the updated value in the same pass). */
#ifndef DSC_CUDA_ADAM_H
#define DSC_CUDA_ADAM_H

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
    int adam_w_mode;     /* 1: decoupled decay (AdamW); 0: decay added to the gradient (L2) */
    int bias_correction; /* 1: divide the moments by 1 - beta^step */
    int64_t step;        /* this step's number, >= 1 (ignored by the epilogue: it reads the device) */
    float grad_scale;    /* gradients are divided by this first (1 for none) */
} dsc_adam_params;

int dsc_cuda_adam(const dsc_mt_tensor *tensors, int64_t n, const dsc_adam_params *hp, int device,
                  cudaStream_t stream);

typedef struct {
    dsc_adam_params adam; /* adam.grad_scale is ignored: the loss scale and the clip decide it */
    float loss_scale;     /* gradients carry this factor; divided out */
    float max_grad_norm;  /* clip to this global norm of the unscaled gradients; <= 0: no clip */
} dsc_epilogue_params;

/* grad_norm: 1 device float, the global L2 norm of the gradients as they are (still scaled).
 * found_inf: 1 device float or NULL; non-zero skips the step, as does a non-finite grad_norm.
 * step: 1 device float, the number of steps taken so far; the update uses step + 1 and the
 * counter is incremented on the device only when the step is not skipped. A skipped step
 * writes nothing. No host synchronisation anywhere. */
int dsc_cuda_adam_epilogue(const dsc_mt_tensor *tensors, int64_t n, const dsc_epilogue_params *hp,
                           const float *grad_norm, const float *found_inf, float *step, int device,
                           cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
