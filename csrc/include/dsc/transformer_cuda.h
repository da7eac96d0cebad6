/* The fused pieces of DeepSpeedTransformerLayer's training kernel (csrc/cuda/transformer_*.cu);
 * the GEMMs between them run in cuBLAS through torch.
 *
 * Every launcher runs on `stream` without synchronising and returns 0, a cudaError_t (> 0) or a
 * DSC_CUDA_E* code (< 0). Activations, weights and gradients share one dtype (`dtype`); math runs
 * in float32; per-row statistics (mean, rstd) and the partial column sums are float32. Tensors are
 * contiguous row-major [rows, cols]. Plain C: the binding (gcc) includes this header. */
#ifndef DSC_TRANSFORMER_CUDA_H
#define DSC_TRANSFORMER_CUDA_H

#include "dsc/cuda_multi_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The widest row the norm and softmax kernels take (the norm kernels keep a row in registers,
 * the softmax in shared memory as float32). */
#define DSC_TF_MAX_COLS 8192

/* u = f + bias (rounded to dtype; written to u_out when given, which may alias f),
 * g = gelu(u) (exact, erf) to g_out. bias NULL: no bias (the gelu recompute of gelu_checkpoint). */
int dsc_tf_bias_gelu(const void *f, const void *bias, void *u_out, void *g_out, int64_t rows, int64_t cols, int dtype,
                     int device, cudaStream_t stream);

/* In place on dg [rows, cols]: dg = dg * gelu'(u), u = f + bias rounded to dtype (bias optional: u = f),
 * as dsc_tf_bias_gelu forms it. With dbias_part (float32 [parts, cols], 1 <= parts <= 65535), each
 * of `parts` strips of rows writes its column sums of the new dg there (the FFN input bias's
 * gradient once dsc_tf_sum_parts adds them); parts is unused without it. */
int dsc_tf_gelu_backward(void *dg, const void *f, const void *bias, float *dbias_part, int64_t rows, int64_t cols,
                         int64_t parts, int dtype, int device, cudaStream_t stream);

/* r = (x + bias) * (keep ? drop_scale : 0) + res, rounded to dtype (bias, keep [rows, cols] uint8 and
 * res optional); r_out (optional) receives r. With gamma: y = (r - mean) * rstd * gamma + beta
 * (beta optional) to y_out, mean and rstd (float32 [rows]) to mean_out, rstd_out. */
int dsc_tf_residual_norm(const void *x, const void *bias, const void *res, const uint8_t *keep, float drop_scale,
                         const void *gamma, const void *beta, void *r_out, void *y_out, float *mean_out,
                         float *rstd_out, int64_t rows, int64_t cols, float eps, int dtype, int device,
                         cudaStream_t stream);

/* LayerNorm backward: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) + extra, g = dy * gamma.
 * xhat comes from the norm's input (`src` = r, with mean and rstd) or, invertible != 0, from its
 * output (`src` = y: xhat = (y - beta) / gamma; mean unused). extra (optional) is added (a residual
 * branch's gradient). With keep (uint8 [rows, cols]), dx_drop (optional, needs keep) receives
 * dx * (keep ? drop_scale : 0): the gradient through the dropout in front of the residual add.
 * Each of the `parts` blocks sums dy * xhat and dy over its rows into dgamma_part and dbeta_part
 * (float32 [parts, cols]) and, with dbias_part, the dropped dx (dx without keep) into it (the
 * gradient of the bias before the dropout); dsc_tf_sum_parts adds the parts. */
int dsc_tf_norm_backward(const void *dy, const void *src, const void *gamma, const void *beta, const float *mean,
                         const float *rstd, const void *extra, const uint8_t *keep, float drop_scale, void *dx,
                         void *dx_drop, float *dgamma_part, float *dbeta_part, float *dbias_part, int64_t rows,
                         int64_t cols, int64_t parts, int invertible, int dtype, int device, cudaStream_t stream);

/* out[i, c] = sum over p of part[i, p, c] (part float32 [k, parts, cols], out [k, cols] in dtype):
 * the second stage of the column sums above. */
int dsc_tf_sum_parts(const float *part, void *out, int64_t k, int64_t parts, int64_t cols, int dtype, int device,
                     cudaStream_t stream);

/* In place on scores [B, heads, Sq, Sk]: p = softmax(scale * s + mask) along Sk; mask (optional)
 * float32 [B, mask_rows, Sk] with mask_rows 1 (one row for every query) or Sq. A row with no
 * finite score becomes zeros. */
int dsc_tf_softmax(void *scores, const float *mask, int64_t B, int64_t heads, int64_t Sq, int64_t Sk,
                   int64_t mask_rows, float scale, int dtype, int device, cudaStream_t stream);

/* out [rows, 3 * cols] = [dq | dk | dv] row by row (each [rows, cols]), and each of `parts` strips of rows
 * (1 <= parts <= 65535) writes its float32 column sums of out to its row of part [parts, 3 * cols]
 * (the QKV bias gradient once dsc_tf_sum_parts adds them). */
int dsc_tf_stack_qkv_grad(const void *dq, const void *dk, const void *dv, void *out, float *part, int64_t rows,
                          int64_t cols, int64_t parts, int dtype, int device, cudaStream_t stream);

/* Philox4x32-10's constants, and the salt xor-ed into the key of the dropout streams (see
 * dsc_tf_dropout_keep); deepspeed_c/ops/transformer/philox_reference.py repeats them. */
#define DSC_PHILOX_M0 0xD2511F53u
#define DSC_PHILOX_M1 0xCD9E8D57u
#define DSC_PHILOX_W0 0x9E3779B9u
#define DSC_PHILOX_W1 0xBB67AE85u
#define DSC_PHILOX_SALT0 0x5DEECE66u
#define DSC_PHILOX_SALT1 0x2545F491u

/* keep[e] = 1 when word e % 4 of Philox4x32-10(counter (e / 4 as 64 bits, offset as 64 bits), key
 * seed ^ salt) is below threshold, else 0, for e < n (uint8 [n]): a dropout keep mask with keep
 * probability threshold / 2^32. */
int dsc_tf_dropout_keep(uint8_t *keep, int64_t n, uint32_t threshold, uint64_t seed, uint64_t offset, int device,
                        cudaStream_t stream);

/* In place on dp [rows, cols]: ds = scale * p * (dp - sum_j p_j dp_j). */
int dsc_tf_softmax_backward(void *dp, const void *p, int64_t rows, int64_t cols, float scale, int dtype, int device,
                            cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
