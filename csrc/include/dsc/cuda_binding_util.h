/* Helpers shared by the CUDA op bindings (csrc/py/cuda_*_binding.c): parallel tensor lists to a
 * dsc_mt_tensor table, device scalars/buffers, and launcher errors to Python exceptions. */
#ifndef DSC_CUDA_BINDING_UTIL_H
#define DSC_CUDA_BINDING_UTIL_H

#include "dsc/cuda_multi_tensor.h"
#include "dsc/tensor_view.h"

/* One list argument of a multi-tensor call. */
typedef struct {
    const char *name; /* argument name, used in every error */
    uint32_t dtypes;  /* allowed dsc_dtype flags */
    int optional;     /* None accepted: the slot is absent */
} dsc_mt_slot_spec;

/* Validates `depth` parallel lists (CUDA, contiguous, allowed dtypes, equal lengths, equal numel
 * item by item, one device) and fills a PyMem-allocated table (*out, free with PyMem_Free).
 * *device is the lists' CUDA ordinal (-1 when they are empty). 0, or -1 with an exception. */
int dsc_mt_gather(PyObject *const *objs, const dsc_mt_slot_spec *specs, int depth, dsc_mt_tensor **out,
                  int64_t *n, int *device);

/* A contiguous CUDA buffer of `dtype` with at least min_numel elements; its data pointer goes
 * to *data (NULL for an allowed None). *device: the required ordinal, or -1 to take the
 * buffer's (written back). 0, or -1 with an exception naming the argument. */
int dsc_cuda_buffer_arg(PyObject *obj, const char *name, uint32_t dtype, int64_t min_numel, int *device,
                        int allow_none, void **data);

/* Float arguments args[0..count) named names[k], into out[k]; 0 or -1 with an exception. */
int dsc_float_args(PyObject *const *args, const char *const *names, int count, double *out);
/* A bool or int flag. */
int dsc_flag_arg(PyObject *obj, const char *name, int *out);

/* torch's current stream on `device`; 0, or -1 with an exception. */
int dsc_cuda_stream_arg(int device, cudaStream_t *stream);

/* When the optional out slot was given, every tensor's param slot must be float32 (the out list
 * is the low-precision copy of an fp32 master); else ValueError naming both. */
int dsc_mt_check_master(const dsc_mt_tensor *t, int64_t n, PyObject *out_obj, int param_slot,
                        const char *param_name, const char *out_name);

/* 0 for rc == 0; else RuntimeError naming the function and the CUDA error, and -1. */
int dsc_cuda_check(int rc, const char *fname);

#endif
