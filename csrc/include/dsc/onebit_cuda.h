/* The 1-bit compression core on CUDA: the launchers of csrc/cuda/onebit.cu. Same contract as
 * dsc/onebit.h (whose scalar build is their reference), with every pointer on one device (segs,
 * scales and sumsq too: the scales come from device norms, so nothing waits for the host) and the
 * work queued on `stream` without synchronising. max_len bounds the segments' lengths (the launch
 * geometry); a segment whose scale index or range the launcher cannot check on the host is the
 * caller's responsibility (the Python plan validates them before copying them to the device).
 * Returns 0, DSC_ONEBIT_EINVAL for bad sizes, or a cudaError_t (> 0) that dsc_onebit_cuda_strerror
 * describes. Plain C: the binding includes it with gcc. */
#ifndef DSC_ONEBIT_CUDA_H
#define DSC_ONEBIT_CUDA_H

#include <stdint.h>

#include "dsc/cuda_stream.h"

#ifdef __cplusplus
extern "C" {
#endif

int dsc_onebit_compensate_cuda(float *y, const float *err, const int64_t *segs, int64_t nseg, int64_t max_len,
                               double *sumsq, cudaStream_t stream);
int dsc_onebit_pack_cuda(const float *y, float *err, uint8_t *bits, const int64_t *segs, int64_t nseg,
                         int64_t max_len, const float *scales, cudaStream_t stream);
int dsc_onebit_unpack_cuda(const uint8_t *bits, float *out, const int64_t *segs, int64_t nseg, int64_t max_len,
                           const float *scales, int accumulate, cudaStream_t stream);
const char *dsc_onebit_cuda_strerror(int code);
/* Make `device` current (*prev gets the caller's); leave restores it. enter returns a cudaError_t. */
int dsc_onebit_cuda_enter(int device, int *prev);
void dsc_onebit_cuda_leave(int device, int prev);

#ifdef __cplusplus
}
#endif

#endif
