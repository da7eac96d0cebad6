/* Multi-tensor CUDA kernels: the shared tensor table, error codes, and the utility launchers
 * (L2 norm with inf/nan detection, scale, casting copy, flatten/unflatten).
 *
 * A multi-tensor call takes n tensors, each with up to DSC_MT_MAX_DEPTH "slots" (gradient,
 * parameter, moments, ...). Slot k of tensor i is tensors[i].ptr[k], a contiguous device buffer
 * of tensors[i].numel elements of dtype tensors[i].dtype[k]. Launchers group the tensors by
 * their dtype tuple and issue one launch per group (more only when a group outgrows one
 * launch's metadata), on `stream`, without synchronising. They return 0, a cudaError_t (> 0),
 * or a DSC_CUDA_E* code (< 0); dsc_cuda_strerror describes either.
 *
 * Plain C: bindings compiled with gcc include this header; the kernels are CUDA C++. */
#ifndef DSC_CUDA_MULTI_TENSOR_H
#define DSC_CUDA_MULTI_TENSOR_H

#include <stdint.h>

#include "dsc/cuda_stream.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DSC_MT_MAX_DEPTH 5

typedef enum {
    DSC_CUDA_F32 = 0,
    DSC_CUDA_F16 = 1,
    DSC_CUDA_BF16 = 2,
} dsc_cuda_dtype;

typedef struct {
    void *ptr[DSC_MT_MAX_DEPTH];     /* slot k: device pointer, NULL where an optional slot is absent */
    int64_t numel;                   /* elements in every present slot */
    uint8_t dtype[DSC_MT_MAX_DEPTH]; /* slot k: dsc_cuda_dtype */
} dsc_mt_tensor;

enum {
    DSC_CUDA_OK = 0,
    DSC_CUDA_EDTYPE = -1, /* a dtype (combination) no kernel is instantiated for */
    DSC_CUDA_EARG = -2,   /* an argument out of range (negative numel, missing pointer, ...) */
};

/* Text for a launcher's return code (cudaGetErrorString for CUDA errors). */
const char *dsc_cuda_strerror(int code);

/* Tensors per launch for a given number of slots (how many fit in one kernel's metadata). */
int dsc_mt_tensors_per_launch(int depth);
/* Elements one thread block handles (the chunk). */
int dsc_mt_chunk_elems(void);

/* L2 norms in one read of the data. Slot 0: the input (f32/f16/bf16).
 * scratch: n + 2 device doubles, any contents (zeroed here).
 * norm_out: 1 float, sqrt of the sum of squares of every element of every tensor.
 * per_tensor_out: n floats (or NULL), tensor i's norm (0 for an empty tensor).
 * found_inf_out: 1 float (or NULL), 1.0 when any element is inf or nan, else 0.0. */
int dsc_cuda_l2norm(const dsc_mt_tensor *tensors, int64_t n, double *scratch, float *norm_out,
                    float *per_tensor_out, float *found_inf_out, int device, cudaStream_t stream);

/* dst = src * scale (slot 0 src, slot 1 dst; any f32/f16/bf16 pair; dst may equal src).
 * scale_dev: 1 device float multiplied into scale, or NULL. found_inf: 1 device float or NULL;
 * set to 1.0 when any src element is inf or nan and never cleared (torch's unscale contract). */
int dsc_cuda_scale(const dsc_mt_tensor *tensors, int64_t n, float scale, const float *scale_dev,
                   float *found_inf, int device, cudaStream_t stream);

/* dst = src with dtype conversion (slot 0 src, slot 1 dst). */
int dsc_cuda_copy(const dsc_mt_tensor *tensors, int64_t n, int device, cudaStream_t stream);

/* Copy tensors (slot 0) back to back into flat (flat_dtype; conversion allowed). */
int dsc_cuda_flatten(const dsc_mt_tensor *tensors, int64_t n, void *flat, int flat_dtype, int device,
                     cudaStream_t stream);
/* Copy consecutive slices of flat into the tensors (slot 0). */
int dsc_cuda_unflatten(const void *flat, int flat_dtype, const dsc_mt_tensor *tensors, int64_t n,
                       int device, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
