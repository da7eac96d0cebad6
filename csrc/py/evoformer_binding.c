/* Python face of the Evoformer attention kernels (dsc/evoformer_cuda.h), op `evoformer_attn`.
 * The shim (deepspeed_c/ops/deepspeed4science/evoformer_attn.py) allocates every output; each
 * argument is checked here (CUDA, contiguous, dtype, shape, one device) before a kernel runs.
 *
 *   forward(q, k, v, bias1|None, bias2|None, o, lse, scale)       CUDA cores
 *   forward_tc(q, k, v, bias1|None, bias2|None, o, lse, scale)    tensor cores, mma.sync tiles (sm_80+)
 *   backward(d_o, q, k, v, o, lse, bias1|None, bias2|None, delta, dq, dk, dv, dbias1|None, dbias2|None, scale, tc)
 *            tc: the gradients on tensor cores (sm_80+), else on CUDA cores (before sm_80) */
#include "dsc/tensor_view.h" /* Python.h first */
#include "dsc/cuda_binding_util.h"
#include "dsc/evoformer_cuda.h"
#include "dsc/module.h"

#include <stdio.h>

#define ACT (DSC_F16 | DSC_BF16) /* float32 takes the torch path */

static int cuda_dtype(uint32_t d) { return d == DSC_F16 ? DSC_CUDA_F16 : d == DSC_BF16 ? DSC_CUDA_BF16 : DSC_CUDA_F32; }

static void format_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t a = 0;
    buf[0] = 0;
    for (int d = 0; d < ndim && a + 24 < cap; d++)
        a += (size_t)snprintf(buf + a, cap - a, d ? ", %lld" : "%lld", (long long)shape[d]);
}

/* A contiguous CUDA tensor of `dtypes` and exactly `shape` (ndim 5 or 4), on ref's device and, when
 * same_dtype, of ref's dtype. None only when optional. */
static int arg(PyObject *obj, const char *name, uint32_t dtypes, int optional, const dsc_view *ref, int same_dtype,
               int ndim, const int64_t *shape, dsc_view *out) {
    const dsc_arg_spec spec = {name, dtypes, DSC_DEV_CUDA, DSC_CONTIGUOUS | (optional ? DSC_ALLOW_NONE : 0)};
    if (dsc_view_from_object(obj, &spec, out) < 0) return -1;
    if (out->is_none) return 0;
    if (ref != NULL) {
        if (dsc_check_same_device(name, out, "q", ref) < 0) return -1;
        if (same_dtype && out->dtype != ref->dtype) {
            PyErr_Format(PyExc_TypeError, "argument '%s' must have the dtype of 'q' (%s), got %s", name,
                         dsc_dtype_name(ref->dtype), dsc_dtype_name(out->dtype));
            return -1;
        }
    }
    if (shape == NULL) return 0;
    int ok = out->ndim == ndim;
    for (int d = 0; ok && d < ndim; d++) ok = out->shape[d] == shape[d];
    if (ok) return 0;
    char want[160], got[160];
    format_shape(want, sizeof want, ndim, shape);
    format_shape(got, sizeof got, out->ndim, out->shape);
    PyErr_Format(PyExc_ValueError, "argument '%s' must have shape [%s], got [%s]", name, want, got);
    return -1;
}

/* q [B, N, L, H, D]: fills the shapes every other argument must have. */
typedef struct {
    int64_t B, N, L, H, D;
    int64_t qkv[5], bias1[5], bias2[5], rows[4];
} shapes;

static int q_arg(PyObject *obj, dsc_view *q, shapes *s) {
    if (arg(obj, "q", ACT, 0, NULL, 0, 0, NULL, q) < 0) return -1;
    if (q->ndim != 5) {
        PyErr_Format(PyExc_ValueError, "argument 'q' must be [B, N, L, H, D] (5 dims), got %d dims", q->ndim);
        return -1;
    }
    s->B = q->shape[0], s->N = q->shape[1], s->L = q->shape[2], s->H = q->shape[3], s->D = q->shape[4];
    if (s->D > DSC_EVO_MAX_HEAD_DIM) {
        PyErr_Format(PyExc_ValueError, "evoformer attention takes head dims up to %d, got %lld", DSC_EVO_MAX_HEAD_DIM,
                     (long long)s->D);
        return -1;
    }
    const int64_t qkv[5] = {s->B, s->N, s->L, s->H, s->D}, b1[5] = {s->B, s->N, 1, 1, s->L},
                  b2[5] = {s->B, 1, s->H, s->L, s->L}, rows[4] = {s->B, s->N, s->H, s->L};
    for (int d = 0; d < 5; d++) s->qkv[d] = qkv[d], s->bias1[d] = b1[d], s->bias2[d] = b2[d];
    for (int d = 0; d < 4; d++) s->rows[d] = rows[d];
    return 0;
}

typedef int (*forward_fn)(const void *, const void *, const void *, const void *, const void *, void *, float *,
                          int64_t, int64_t, int64_t, int64_t, int64_t, float, int, int, cudaStream_t);

static PyObject *forward_with(PyObject *const *args, Py_ssize_t nargs, const char *fname, forward_fn fn) {
    if (dsc_check_nargs(fname, nargs, 8) < 0) return NULL;
    dsc_view q, k, v, b1, b2, o, lse;
    shapes s;
    double scale;
    if (q_arg(args[0], &q, &s) < 0 || arg(args[1], "k", ACT, 0, &q, 1, 5, s.qkv, &k) < 0 ||
        arg(args[2], "v", ACT, 0, &q, 1, 5, s.qkv, &v) < 0 || arg(args[3], "bias1", ACT, 1, &q, 1, 5, s.bias1, &b1) < 0 ||
        arg(args[4], "bias2", ACT, 1, &q, 1, 5, s.bias2, &b2) < 0 || arg(args[5], "o", ACT, 0, &q, 1, 5, s.qkv, &o) < 0 ||
        arg(args[6], "lse", DSC_F32, 0, &q, 0, 4, s.rows, &lse) < 0 || dsc_arg_double(args[7], "scale", &scale) < 0)
        return NULL;
    cudaStream_t stream;
    if (dsc_cuda_stream_arg(q.device_id, &stream) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fn(q.data, k.data, v.data, b1.is_none ? NULL : b1.data, b2.is_none ? NULL : b2.data, o.data,
            (float *)lse.data, s.B, s.N, s.L, s.H, s.D, (float)scale, cuda_dtype(q.dtype), q.device_id, stream);
    Py_END_ALLOW_THREADS
    if (dsc_cuda_check(rc, fname) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return forward_with(args, nargs, "forward", dsc_evo_forward);
}

static PyObject *py_forward_tc(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return forward_with(args, nargs, "forward_tc", dsc_evo_forward_tc);
}

static PyObject *py_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("backward", nargs, 16) < 0) return NULL;
    dsc_view go, q, k, v, o, lse, b1, b2, delta, dq, dk, dv, db1, db2;
    shapes s;
    double scale;
    int tc;
    if (q_arg(args[1], &q, &s) < 0 || arg(args[0], "d_o", ACT, 0, &q, 1, 5, s.qkv, &go) < 0 ||
        arg(args[2], "k", ACT, 0, &q, 1, 5, s.qkv, &k) < 0 || arg(args[3], "v", ACT, 0, &q, 1, 5, s.qkv, &v) < 0 ||
        arg(args[4], "o", ACT, 0, &q, 1, 5, s.qkv, &o) < 0 || arg(args[5], "lse", DSC_F32, 0, &q, 0, 4, s.rows, &lse) < 0 ||
        arg(args[6], "bias1", ACT, 1, &q, 1, 5, s.bias1, &b1) < 0 ||
        arg(args[7], "bias2", ACT, 1, &q, 1, 5, s.bias2, &b2) < 0 ||
        arg(args[8], "delta", DSC_F32, 0, &q, 0, 4, s.rows, &delta) < 0 ||
        arg(args[9], "dq", ACT, 0, &q, 1, 5, s.qkv, &dq) < 0 || arg(args[10], "dk", ACT, 0, &q, 1, 5, s.qkv, &dk) < 0 ||
        arg(args[11], "dv", ACT, 0, &q, 1, 5, s.qkv, &dv) < 0 ||
        arg(args[12], "dbias1", DSC_F32, 1, &q, 0, 5, s.bias1, &db1) < 0 ||
        arg(args[13], "dbias2", DSC_F32, 1, &q, 0, 5, s.bias2, &db2) < 0 || dsc_arg_double(args[14], "scale", &scale) < 0 ||
        dsc_flag_arg(args[15], "tc", &tc) < 0)
        return NULL;
    if ((!db1.is_none && b1.is_none) || (!db2.is_none && b2.is_none))
        return PyErr_Format(PyExc_ValueError, "a bias gradient ('dbias1'/'dbias2') was given without its bias");
    cudaStream_t stream;
    if (dsc_cuda_stream_arg(q.device_id, &stream) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_evo_backward(go.data, q.data, k.data, v.data, o.data, (const float *)lse.data, b1.is_none ? NULL : b1.data,
                          b2.is_none ? NULL : b2.data, (float *)delta.data, dq.data, dk.data, dv.data,
                          db1.is_none ? NULL : (float *)db1.data, db2.is_none ? NULL : (float *)db2.data, s.B, s.N, s.L,
                          s.H, s.D, (float)scale, tc, cuda_dtype(q.dtype), q.device_id, stream);
    Py_END_ALLOW_THREADS
    if (dsc_cuda_check(rc, "evoformer backward") < 0) return NULL;
    Py_RETURN_NONE;
}

#define METHOD(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}

static PyMethodDef methods[] = {
    METHOD("forward", py_forward, "forward(q, k, v, bias1, bias2, o, lse, scale): flash-style Evoformer attention."),
    METHOD("forward_tc", py_forward_tc, "forward_tc(q, k, v, bias1, bias2, o, lse, scale): the same on tensor cores."),
    METHOD("backward", py_backward,
           "backward(d_o, q, k, v, o, lse, bias1, bias2, delta, dq, dk, dv, dbias1, dbias2, scale, tc): its gradients."),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR,
                                        "deepspeed_c DS4Sci Evoformer attention kernels.", -1, methods, NULL, NULL,
                                        NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
