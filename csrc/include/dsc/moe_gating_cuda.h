/* The MoE gating core on CUDA: the launchers of csrc/cuda/moe_gating.cu. Same contract as
 * dsc/moe_gating.h (which is their reference), with every pointer on one device and the work
 * queued on `stream` without synchronising. Differences, because a launcher cannot see device
 * data without a sync: an expert id outside [0, E) is not reported but its route is dropped
 * (route_slot -1) and not counted. Returns 0, DSC_MOE_EINVAL for bad sizes, or a cudaError_t
 * (> 0) that dsc_moe_cuda_strerror describes. Plain C: the binding includes it with gcc. */
#ifndef DSC_MOE_GATING_CUDA_H
#define DSC_MOE_GATING_CUDA_H

#include <stdint.h>

#include "dsc/cuda_stream.h"

#ifdef __cplusplus
extern "C" {
#endif

int dsc_moe_select_cuda(const float *primary, const float *secondary, int64_t S, int64_t E, int64_t k,
                        int64_t *idx, cudaStream_t stream);
int dsc_moe_counts_cuda(const int64_t *idx, const uint8_t *used, int64_t S, int64_t k, int64_t E, int64_t *counts,
                        cudaStream_t stream);
int dsc_moe_plan_cuda(const int64_t *idx, const float *score, const uint8_t *used, int64_t S, int64_t k, int64_t E,
                      int64_t capacity, int order, int64_t *route_slot, int64_t *slot_route, cudaStream_t stream);
int dsc_moe_dispatch_cuda(const void *x, int dtype, int64_t S, int64_t M, const int64_t *slot_route, int64_t nslots,
                          int64_t k, const void *w, void *out, cudaStream_t stream);
int dsc_moe_combine_cuda(const void *y, int dtype, int64_t nslots, int64_t M, const int64_t *route_slot, int64_t S,
                         int64_t k, const void *w, void *out, cudaStream_t stream);
int dsc_moe_route_dots_cuda(const void *g, const void *y, int dtype, int64_t S, int64_t M, int64_t nslots,
                            const int64_t *route_slot, int64_t k, void *out, cudaStream_t stream);
const char *dsc_moe_cuda_strerror(int code);
/* Make `device` current (*prev gets the caller's); leave restores it. enter returns a cudaError_t. */
int dsc_moe_cuda_enter(int device, int *prev);
void dsc_moe_cuda_leave(int device, int prev);

#ifdef __cplusplus
}
#endif

#endif
