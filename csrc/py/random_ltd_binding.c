/* Python face of random-LTD's token moves (dsc/random_ltd.h). Built twice: for host tensors over the
 * reference csrc/cpu/random_ltd.c (op `random_ltd`), and with DSC_RLTD_ON_CUDA for device tensors over
 * csrc/cuda/random_ltd.cu (op `random_ltd_cuda`, on torch's current stream). The shim
 * (deepspeed_c/ops/random_ltd/token_ops.py) allocates every output; each argument is validated here.
 *
 *   gather(hidden, idx, batch_first, out)
 *   scatter(hidden|None, part|None, idx, batch_first, accumulate, inv|None, out)   inv: int32 [batch * seq],
 *                                                                                    needed on CUDA
 *   mask_gather(mask, idx, out)                                                                          */
#include "dsc/tensor_view.h" /* Python.h first */
#include "dsc/module.h"
#include "dsc/random_ltd.h"

#ifdef DSC_RLTD_ON_CUDA
#include "dsc/random_ltd_cuda.h"
#define DEV DSC_DEV_CUDA
#else
#define DEV DSC_DEV_CPU
#endif

#define SPEC(var, name, dtypes, flags) static const dsc_arg_spec var = {name, dtypes, DEV, DSC_CONTIGUOUS | (flags)}

SPEC(HIDDEN, "hidden", DSC_FLOATS, 0);
SPEC(HIDDEN_OPT, "hidden", DSC_FLOATS, DSC_ALLOW_NONE);
SPEC(PART_OPT, "part", DSC_FLOATS, DSC_ALLOW_NONE);
SPEC(IDX, "idx", DSC_I32, 0);
SPEC(INV, "inv", DSC_I32, DSC_ALLOW_NONE);
SPEC(OUT, "out", DSC_FLOATS, 0);
SPEC(MASK, "mask", DSC_ANY_DTYPE, 0);
SPEC(MASK_OUT, "out", DSC_ANY_DTYPE, 0);

static int rltd_dtype(uint32_t d) {
    switch (d) {
    case DSC_BF16: return DSC_RLTD_BF16;
    case DSC_F16: return DSC_RLTD_F16;
    case DSC_F64: return DSC_RLTD_F64;
    default: return DSC_RLTD_F32;
    }
}

static PyObject *core_error(int rc, const char *fname) {
    if (rc == DSC_RLTD_ENOMEM) return PyErr_NoMemory();
#ifdef DSC_RLTD_ON_CUDA
    if (rc > 0) return PyErr_Format(PyExc_RuntimeError, "%s: CUDA error %d (%s)", fname, rc, dsc_rltd_cuda_strerror(rc));
#endif
    return PyErr_Format(PyExc_ValueError,
                        "%s: an index outside [0, seq), a position kept twice in one sample, or a size out of range",
                        fname);
}

static int same(const dsc_view *a, const char *an, const dsc_view *b, const char *bn) {
    if (a->dtype != b->dtype) {
        PyErr_Format(PyExc_TypeError, "argument '%s' must have the dtype of '%s' (%s), got %s", an, bn,
                     dsc_dtype_name(b->dtype), dsc_dtype_name(a->dtype));
        return -1;
    }
    return dsc_check_same_device(an, a, bn, b);
}

static int dims3(const dsc_view *v, const char *name, int64_t d0, int64_t d1, int64_t d2) {
    if (v->ndim == 3 && v->shape[0] == d0 && v->shape[1] == d1 && v->shape[2] == d2) return 0;
    PyErr_Format(PyExc_ValueError, "argument '%s' must have shape [%lld, %lld, %lld]", name, (long long)d0,
                 (long long)d1, (long long)d2);
    return -1;
}

/* batch and keep from idx [batch, keep], checked against the hidden states' layout */
static int tokens(const dsc_view *ref, const char *ref_name, const dsc_view *idx, int batch_first,
                  dsc_rltd_shape *s) {
    if (ref->ndim != 3) {
        PyErr_Format(PyExc_ValueError, "argument '%s' must be 3-d ([batch, seq, hidden] or [seq, batch, hidden]), got %d dims",
                     ref_name, ref->ndim);
        return -1;
    }
    if (idx->ndim != 2) {
        PyErr_Format(PyExc_ValueError, "argument 'idx' must be [batch, keep], got %d dims", idx->ndim);
        return -1;
    }
    s->batch = batch_first ? ref->shape[0] : ref->shape[1];
    s->seq = batch_first ? ref->shape[1] : ref->shape[0];
    s->hidden = ref->shape[2];
    s->keep = idx->shape[1];
    s->batch_first = batch_first;
    s->dtype = rltd_dtype(ref->dtype);
    s->itemsize = ref->itemsize;
    if (idx->shape[0] != s->batch || s->keep > s->seq) {
        PyErr_Format(PyExc_ValueError, "argument 'idx' must be [batch=%lld, keep <= seq=%lld], got [%lld, %lld]",
                     (long long)s->batch, (long long)s->seq, (long long)idx->shape[0], (long long)idx->shape[1]);
        return -1;
    }
    return dsc_check_same_device("idx", idx, ref_name, ref);
}

static int flag(PyObject *o, const char *name, int *out) {
    int v = PyObject_IsTrue(o);
    if (v < 0) return -1;
    if (!PyBool_Check(o) && !PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "argument '%s' must be a bool", name);
        return -1;
    }
    *out = v;
    return 0;
}

#ifdef DSC_RLTD_ON_CUDA
#define DSC_DEVICE_ENTER dsc_rltd_cuda_enter
#define DSC_DEVICE_LEAVE dsc_rltd_cuda_leave
#endif
#define DSC_DEVICE_FAIL core_error
#include "dsc/binding_device.h"

static PyObject *py_gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("gather", nargs, 4) < 0) return NULL;
    dsc_view h, idx, out;
    int bf;
    dsc_rltd_shape s;
    if (dsc_view_from_object(args[0], &HIDDEN, &h) < 0 || dsc_view_from_object(args[1], &IDX, &idx) < 0 ||
        flag(args[2], "batch_first", &bf) < 0 || dsc_view_from_object(args[3], &OUT, &out) < 0)
        return NULL;
    if (tokens(&h, "hidden", &idx, bf, &s) < 0 || same(&out, "out", &h, "hidden") < 0) return NULL;
    if (dims3(&out, "out", bf ? s.batch : s.keep, bf ? s.keep : s.batch, s.hidden) < 0) return NULL;
    if (dsc_check_no_alias("out", &out, "hidden", &h) < 0) return NULL;
    STREAM_OF(h, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(dsc_rltd_gather, h.data, (const int32_t *)idx.data, &s, out.data);
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_RLTD_OK) return core_error(rc, "gather");
    Py_RETURN_NONE;
}

static PyObject *py_scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("scatter", nargs, 7) < 0) return NULL;
    dsc_view h, part, idx, inv, out;
    int bf, acc;
    dsc_rltd_shape s;
    if (dsc_view_from_object(args[0], &HIDDEN_OPT, &h) < 0 || dsc_view_from_object(args[1], &PART_OPT, &part) < 0 ||
        dsc_view_from_object(args[2], &IDX, &idx) < 0 || flag(args[3], "batch_first", &bf) < 0 ||
        flag(args[4], "accumulate", &acc) < 0 || dsc_view_from_object(args[5], &INV, &inv) < 0 ||
        dsc_view_from_object(args[6], &OUT, &out) < 0)
        return NULL;
    if (tokens(&out, "out", &idx, bf, &s) < 0) return NULL;
    if (!h.is_none && (same(&h, "hidden", &out, "out") < 0 ||
                       dims3(&h, "hidden", out.shape[0], out.shape[1], out.shape[2]) < 0 ||
                       dsc_check_no_alias("out", &out, "hidden", &h) < 0))
        return NULL;
    if (!part.is_none && (same(&part, "part", &out, "out") < 0 ||
                          dims3(&part, "part", bf ? s.batch : s.keep, bf ? s.keep : s.batch, s.hidden) < 0 ||
                          dsc_check_no_alias("out", &out, "part", &part) < 0))
        return NULL;
#ifdef DSC_RLTD_ON_CUDA
    if (inv.is_none || inv.numel != s.batch * s.seq)
        return PyErr_Format(PyExc_ValueError, "argument 'inv' must be int32 scratch of batch * seq = %lld elements",
                            (long long)(s.batch * s.seq));
    if (dsc_check_same_device("inv", &inv, "out", &out) < 0) return NULL;
#endif
    STREAM_OF(out, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
#ifdef DSC_RLTD_ON_CUDA
    rc = CALL(dsc_rltd_scatter, h.is_none ? NULL : h.data, part.is_none ? NULL : part.data, (const int32_t *)idx.data,
              &s, acc, (int32_t *)inv.data, out.data);
#else
    rc = CALL(dsc_rltd_scatter, h.is_none ? NULL : h.data, part.is_none ? NULL : part.data, (const int32_t *)idx.data,
              &s, acc, out.data);
#endif
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_RLTD_OK) return core_error(rc, "scatter");
    Py_RETURN_NONE;
}

static PyObject *py_mask_gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("mask_gather", nargs, 3) < 0) return NULL;
    dsc_view m, idx, out;
    if (dsc_view_from_object(args[0], &MASK, &m) < 0 || dsc_view_from_object(args[1], &IDX, &idx) < 0 ||
        dsc_view_from_object(args[2], &MASK_OUT, &out) < 0)
        return NULL;
    if (m.ndim != 4 || m.shape[2] != m.shape[3])
        return PyErr_Format(PyExc_ValueError, "argument 'mask' must be [batch or 1, heads, seq, seq], got %d dims", m.ndim);
    if (idx.ndim != 2) return PyErr_Format(PyExc_ValueError, "argument 'idx' must be [batch, keep], got %d dims", idx.ndim);
    const int64_t batch = idx.shape[0], keep = idx.shape[1], heads = m.shape[1], seq = m.shape[2];
    if (m.shape[0] != 1 && m.shape[0] != batch)
        return PyErr_Format(PyExc_ValueError, "argument 'mask' must have batch 1 or %lld, got %lld", (long long)batch,
                            (long long)m.shape[0]);
    if (keep > seq) return PyErr_Format(PyExc_ValueError, "argument 'idx' keeps %lld of %lld tokens", (long long)keep, (long long)seq);
    if (same(&out, "out", &m, "mask") < 0 || dsc_check_same_device("idx", &idx, "mask", &m) < 0) return NULL;
    if (out.ndim != 4 || out.shape[0] != batch || out.shape[1] != heads || out.shape[2] != keep || out.shape[3] != keep)
        return PyErr_Format(PyExc_ValueError, "argument 'out' must have shape [%lld, %lld, %lld, %lld]", (long long)batch,
                            (long long)heads, (long long)keep, (long long)keep);
    STREAM_OF(m, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(dsc_rltd_mask_gather, m.data, m.shape[0], heads, seq, (const int32_t *)idx.data, batch, keep, m.itemsize,
              out.data);
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_RLTD_OK) return core_error(rc, "mask_gather");
    Py_RETURN_NONE;
}

#define METHOD(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}

static PyMethodDef methods[] = {
    METHOD("gather", py_gather, "gather(hidden, idx, batch_first, out): the kept tokens' rows."),
    METHOD("scatter", py_scatter,
           "scatter(hidden, part, idx, batch_first, accumulate, inv, out): hidden with the kept rows replaced "
           "(or added to) by part; None hidden/part read as zeros."),
    METHOD("mask_gather", py_mask_gather, "mask_gather(mask, idx, out): the kept rows and columns of the mask."),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR,
                                        "deepspeed_c random-LTD token gather/scatter and mask slicing.", -1, methods,
                                        NULL, NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
