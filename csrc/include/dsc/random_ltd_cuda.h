/* random-LTD's token moves on CUDA: the launchers of csrc/cuda/random_ltd.cu, the contract of
 * dsc/random_ltd.h (their reference) with every pointer on one device and the work queued on
 * `stream` without synchronising. Differences, because a launcher cannot read device data without
 * a sync: an index outside [0, seq) is not reported; gather writes zeros for it and scatter and
 * mask_gather ignore it (mask_gather: zeros). scatter takes `inv`, int32 scratch of batch * seq
 * elements (the shim allocates it), where it builds each position's kept slot or -1.
 * Returns 0, DSC_RLTD_EINVAL for bad sizes, or a cudaError_t (> 0). Plain C for the gcc binding. */
#ifndef DSC_RANDOM_LTD_CUDA_H
#define DSC_RANDOM_LTD_CUDA_H

#include <stdint.h>

#include "dsc/cuda_stream.h"
#include "dsc/random_ltd.h"

#ifdef __cplusplus
extern "C" {
#endif

int dsc_rltd_gather_cuda(const void *hidden, const int32_t *idx, const dsc_rltd_shape *s, void *out,
                         cudaStream_t stream);
int dsc_rltd_scatter_cuda(const void *hidden, const void *part, const int32_t *idx, const dsc_rltd_shape *s,
                          int accumulate, int32_t *inv, void *out, cudaStream_t stream);
int dsc_rltd_mask_gather_cuda(const void *mask, int64_t mask_batch, int64_t heads, int64_t seq, const int32_t *idx,
                              int64_t batch, int64_t keep, int itemsize, void *out, cudaStream_t stream);
const char *dsc_rltd_cuda_strerror(int code);
int dsc_rltd_cuda_enter(int device, int *prev);
void dsc_rltd_cuda_leave(int device, int prev);

#ifdef __cplusplus
}
#endif

#endif
