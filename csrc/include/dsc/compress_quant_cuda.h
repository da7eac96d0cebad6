/* The CUDA launchers of csrc/cuda/compress_quant.cu: the contract of dsc/compress_quant.h (csrc/cpu/
 * compress_quant.c is their reference, bit for bit) on device pointers of one device, queued on `stream`.
 * Returns 0, DSC_CQ_EINVAL, or a cudaError_t (> 0) that dsc_cq_cuda_strerror describes. Plain C. */
#ifndef DSC_COMPRESS_QUANT_CUDA_H
#define DSC_COMPRESS_QUANT_CUDA_H

#include <stdint.h>

#include "dsc/cuda_stream.h"

#ifdef __cplusplus
extern "C" {
#endif

int dsc_cq_fake_quant_cuda(const void *x, void *out, int dtype, int64_t groups, int64_t n, int bits, int asym,
                           const float *lo, const float *hi, int recip, uint64_t seed, cudaStream_t stream);
int dsc_cq_ternary_cuda(const void *x, void *out, int dtype, int64_t groups, int64_t n, const float *thres,
                        const float *alpha, cudaStream_t stream);
int dsc_cq_binary_cuda(const void *x, void *out, int dtype, int64_t groups, int64_t n, const float *m,
                       cudaStream_t stream);
const char *dsc_cq_cuda_strerror(int code);
int dsc_cq_cuda_enter(int device, int *prev);
void dsc_cq_cuda_leave(int device, int prev);

#ifdef __cplusplus
}
#endif

#endif
