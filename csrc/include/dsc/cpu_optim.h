/* CPU optimizer cores: Adam/AdamW, Adagrad, Lion, and the multi-tensor L2 norm and scale the
 * engine uses for clipping and fp16 unscale. Pure C11 + OpenMP; the SIMD width comes from the
 * build (DSC_SIMD_AVX512 / DSC_SIMD_AVX2 / DSC_SIMD_SCALAR, see dsc/cpu_simd.h).
 *
 * Every step kernel takes a list of tensors, each operand with its own storage dtype, reads
 * each element once and writes it once (one pass over memory): low-precision operands are
 * widened to fp32 in registers, updated, and narrowed back with round-to-nearest-even. The
 * optional `copy` operand receives the updated parameter in its own (low) precision in the
 * same pass: the ZeRO-Offload "step and write the bf16/fp16 copy" hot path. The three SIMD
 * builds produce identical bits. */
#ifndef DSC_CPU_OPTIM_H
#define DSC_CPU_OPTIM_H

#include <stdint.h>

typedef enum { DSC_CPU_F32 = 0, DSC_CPU_BF16 = 1, DSC_CPU_F16 = 2 } dsc_cpu_dtype;

/* One operand of one tensor: data == NULL means absent (e.g. no copy). */
typedef struct {
    void *data;
    int32_t dtype; /* dsc_cpu_dtype */
} dsc_operand;

/* One tensor's operands; all hold `numel` elements. */
typedef struct {
    int64_t numel;
    dsc_operand param;    /* read and written */
    dsc_operand grad;     /* read */
    dsc_operand state0;   /* Adam exp_avg, Adagrad sum, Lion exp_avg; read and written */
    dsc_operand state1;   /* Adam exp_avg_sq; unused otherwise */
    dsc_operand copy;     /* optional low-precision copy of the updated param; written */
} dsc_opt_tensor;

typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
    int64_t step;         /* 1-based step count after this update */
    int bias_correction;
    int adamw_mode;       /* 1: decoupled weight decay; 0: L2 added to the gradient */
    double grad_scale;    /* the gradient is multiplied by (float)grad_scale first (loss-scale and clip factor,
                           * the mean over accumulated steps): no scaled copy of it is made; 1.0: none */
} dsc_adam_hparams;

typedef struct {
    double lr, eps, weight_decay;
} dsc_adagrad_hparams;

typedef struct {
    double lr, beta1, beta2, weight_decay;
} dsc_lion_hparams;

int dsc_cpu_adam_step(dsc_opt_tensor *tensors, int64_t n, const dsc_adam_hparams *hp);
/* The same step reading tensors[i]'s param and states and writing the updated ones to outs[i]'s (other
 * buffers of the same dtypes and sizes, or the same ones); copies are tensors[i]'s. */
int dsc_cpu_adam_step_into(dsc_opt_tensor *tensors, const dsc_opt_tensor *outs, int64_t n,
                           const dsc_adam_hparams *hp);
int dsc_cpu_adagrad_step(dsc_opt_tensor *tensors, int64_t n, const dsc_adagrad_hparams *hp);
int dsc_cpu_lion_step(dsc_opt_tensor *tensors, int64_t n, const dsc_lion_hparams *hp);

/* Sum of squares of every element of every tensor (accumulated in double) and whether any
 * element is inf or nan. */
int dsc_cpu_sumsq(const dsc_operand *tensors, const int64_t *numels, int64_t n, double *sumsq,
                   int *found_nonfinite);
/* x *= factor, in place, for every tensor. Each returns 0, or -1 when out of memory. */
int dsc_cpu_scale(const dsc_operand *tensors, const int64_t *numels, int64_t n, float factor);

/* Which SIMD path this build runs: "avx512", "avx2" or "scalar". */
const char *dsc_cpu_simd_name(void);

#endif
