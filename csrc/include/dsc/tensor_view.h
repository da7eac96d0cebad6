/* The tensor boundary: borrowed views of torch tensors taken through DLPack, and a declarative
 * per-argument spec that validates them before any kernel runs.
 *
 * A view borrows: it is valid only while the Python object it came from is alive (the caller's
 * argument tuple keeps it so). C never allocates tensors; outputs are passed in by the shim.
 *
 * Typical binding (METH_FASTCALL):
 *     static const dsc_arg_spec P = {"params", DSC_F32 | DSC_BF16, DSC_DEV_CPU, DSC_CONTIGUOUS};
 *     dsc_view_list params;
 *     if (dsc_view_list_from_object(args[0], &P, &params) < 0) return NULL;
 *     ...
 *     dsc_view_list_release(&params);
 */
#ifndef DSC_TENSOR_VIEW_H
#define DSC_TENSOR_VIEW_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h> /* first: it sets feature-test macros the C library headers read */
#include <stdint.h>

#define DSC_MAX_DIMS 16

/* dtypes as bit flags so a spec can allow several */
typedef enum {
    DSC_F32 = 1u << 0,
    DSC_F16 = 1u << 1,
    DSC_BF16 = 1u << 2,
    DSC_F64 = 1u << 3,
    DSC_I32 = 1u << 4,
    DSC_I64 = 1u << 5,
    DSC_U8 = 1u << 6,
    DSC_I8 = 1u << 7,
    DSC_BOOL = 1u << 8,
    DSC_I16 = 1u << 9,
} dsc_dtype;
#define DSC_FLOATS (DSC_F32 | DSC_F16 | DSC_BF16 | DSC_F64)
#define DSC_ANY_DTYPE 0xFFFFFFFFu

typedef enum {
    DSC_DEV_ANY = 0,
    DSC_DEV_CPU = 1,
    DSC_DEV_CUDA = 2,
} dsc_device_kind;

/* spec flags */
enum {
    DSC_CONTIGUOUS = 1u << 0,  /* row-major compact strides required */
    DSC_ALLOW_NONE = 1u << 1,  /* None is accepted (view.data == NULL, view.is_none = 1) */
    DSC_ALIGNED16 = 1u << 2,   /* data pointer 16-byte aligned */
};

typedef struct {
    const char *name;   /* argument name used in every error message */
    uint32_t dtypes;    /* OR of dsc_dtype; DSC_ANY_DTYPE for any */
    int device;         /* dsc_device_kind */
    uint32_t flags;     /* DSC_CONTIGUOUS | DSC_ALLOW_NONE | ... */
} dsc_arg_spec;

typedef struct {
    void *data;          /* first element (storage offset applied) */
    uint32_t dtype;      /* one dsc_dtype flag */
    int32_t itemsize;    /* bytes per element */
    int32_t device;      /* dsc_device_kind */
    int32_t device_id;   /* CUDA ordinal, 0 on CPU */
    int32_t ndim;
    int32_t is_none;
    int32_t contiguous;
    int64_t numel;
    int64_t shape[DSC_MAX_DIMS];
    int64_t strides[DSC_MAX_DIMS]; /* in elements */
} dsc_view;

typedef struct {
    dsc_view *items;
    Py_ssize_t len;
} dsc_view_list;

/* Which DLPack route produced views (tests force each to prove the fallbacks). */
typedef enum {
    DSC_ROUTE_AUTO = 0,
    DSC_ROUTE_EXCHANGE = 1,   /* type(t).__dlpack_c_exchange_api__ (torch >= 2.10) */
    DSC_ROUTE_VERSIONED = 2,  /* t.__dlpack__(max_version=(1, 0)) */
    DSC_ROUTE_LEGACY = 3,     /* t.__dlpack__() */
} dsc_route;

/* 0 on success; -1 with a Python TypeError/ValueError naming spec->name. */
int dsc_view_from_object(PyObject *obj, const dsc_arg_spec *spec, dsc_view *out);
int dsc_view_from_object_route(PyObject *obj, const dsc_arg_spec *spec, dsc_route route,
                               dsc_view *out);

/* A list or tuple of tensors; every item checked against spec and against the first item's
 * device ("same device across the list"). The items array is PyMem-allocated: release it. */
int dsc_view_list_from_object(PyObject *seq, const dsc_arg_spec *spec, dsc_view_list *out);
void dsc_view_list_release(dsc_view_list *list);

/* Agreement checks between arguments; each raises ValueError naming both arguments. */
int dsc_check_same_len(const char *a_name, Py_ssize_t a, const char *b_name, Py_ssize_t b);
int dsc_check_same_numel(const char *a_name, const dsc_view *a, const char *b_name,
                         const dsc_view *b);
int dsc_check_same_device(const char *a_name, const dsc_view *a, const char *b_name,
                          const dsc_view *b);
/* Raises ValueError when the byte ranges of out and in overlap (an output aliasing an input). */
int dsc_check_no_alias(const char *out_name, const dsc_view *out, const char *in_name,
                       const dsc_view *in);
/* Per-element agreement between two lists: same length, same numel item by item. */
int dsc_check_lists_match(const char *a_name, const dsc_view_list *a, const char *b_name,
                          const dsc_view_list *b);

/* torch's current CUDA stream for a device (exchange API when available, else
 * torch._C._cuda_getCurrentRawStream); NULL with an exception set on failure.
 * Returns (void*)0 legitimately for the legacy default stream: check PyErr_Occurred(). */
void *dsc_current_cuda_stream(int device_id);

const char *dsc_dtype_name(uint32_t dtype);
/* Parse a float argument (Python int or float); -1 with TypeError naming it on failure. */
int dsc_arg_double(PyObject *obj, const char *name, double *out);
int dsc_arg_int64(PyObject *obj, const char *name, int64_t *out);
/* Argument-count check for METH_FASTCALL functions. */
int dsc_check_nargs(const char *fname, Py_ssize_t nargs, Py_ssize_t expected);

#endif
