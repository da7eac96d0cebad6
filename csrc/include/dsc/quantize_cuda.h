/* Block-wise quantization on CUDA: the launchers of csrc/cuda/quantize.cu. Same contract as
 * dsc/quantize.h (csrc/cpu/quantize.c is their reference: same codes, same scales), every pointer on
 * one device, the work queued on `stream` without synchronising. Returns 0, DSC_Q_EINVAL for bad
 * sizes, or a cudaError_t (> 0) that dsc_q_cuda_strerror describes. Plain C: the binding includes it
 * with gcc. */
#ifndef DSC_QUANTIZE_CUDA_H
#define DSC_QUANTIZE_CUDA_H

#include <stdint.h>

#include "dsc/cuda_stream.h"

#ifdef __cplusplus
extern "C" {
#endif

int dsc_quantize_cuda(const void *x, int dtype, int64_t segments, int64_t seg, int64_t block, int bits, uint8_t *q,
                      float *scales, cudaStream_t stream);
int dsc_dequantize_cuda(const uint8_t *q, const float *scales, int64_t segments, int64_t seg, int64_t block, int bits,
                        void *out, int dtype, cudaStream_t stream);
int dsc_dequantize_sum_cuda(const uint8_t *q, const float *scales, int64_t segments, int64_t seg, int64_t block,
                            int bits, float *out, cudaStream_t stream);
const char *dsc_q_cuda_strerror(int code);
/* Make `device` current (*prev gets the caller's); leave restores it. enter returns a cudaError_t. */
int dsc_q_cuda_enter(int device, int *prev);
void dsc_q_cuda_leave(int device, int prev);

#ifdef __cplusplus
}
#endif

#endif
