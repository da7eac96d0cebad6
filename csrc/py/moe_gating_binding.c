/* Python face of the MoE gating core (dsc/moe_gating.h). Built twice: for host tensors over
 * csrc/core/moe_gating.c (op `moe_gating`), and with DSC_MOE_ON_CUDA for device tensors over the
 * launchers of csrc/cuda/moe_gating.cu (op `moe_gating_cuda`, on torch's current stream).
 * The shim (deepspeed_c/moe/gating_core.py) allocates every output; each argument is validated
 * here (dtype, device, contiguity, shape) before the core runs.
 *
 *   select(primary, secondary|None, k, idx_out)
 *   counts(idx, used|None, num_experts, counts_out)
 *   plan(idx, score|None, used|None, num_experts, capacity, order, route_slot_out, slot_route_out)
 *   dispatch(x, slot_route, k, w|None, out)
 *   combine(y, route_slot, w|None, out)
 *   route_dots(g, y, route_slot, out)                                                          */
#include "dsc/tensor_view.h" /* Python.h first */
#include "dsc/moe_gating.h"
#include "dsc/module.h"

#ifdef DSC_MOE_ON_CUDA
#include "dsc/moe_gating_cuda.h"
#define DEV DSC_DEV_CUDA
#else
#define DEV DSC_DEV_CPU
#endif

#define SPEC(var, name, dtypes, flags) static const dsc_arg_spec var = {name, dtypes, DEV, DSC_CONTIGUOUS | (flags)}

SPEC(PRIMARY, "primary", DSC_F32, 0);
SPEC(SECONDARY, "secondary", DSC_F32, DSC_ALLOW_NONE);
SPEC(IDX, "idx", DSC_I64, 0);
SPEC(IDX_OUT, "idx_out", DSC_I64, 0);
SPEC(USED, "used", DSC_U8 | DSC_BOOL, DSC_ALLOW_NONE);
SPEC(COUNTS_OUT, "counts_out", DSC_I64, 0);
SPEC(SCORE, "score", DSC_F32, DSC_ALLOW_NONE);
SPEC(ROUTE_SLOT, "route_slot", DSC_I64, 0);
SPEC(SLOT_ROUTE, "slot_route", DSC_I64, 0);
SPEC(ROUTE_SLOT_OUT, "route_slot_out", DSC_I64, 0);
SPEC(SLOT_ROUTE_OUT, "slot_route_out", DSC_I64, 0);
SPEC(X, "x", DSC_F32 | DSC_BF16 | DSC_F16 | DSC_F64, 0);
SPEC(Y, "y", DSC_F32 | DSC_BF16 | DSC_F16 | DSC_F64, 0);
SPEC(G, "g", DSC_F32 | DSC_BF16 | DSC_F16 | DSC_F64, 0);
SPEC(W, "w", DSC_F32 | DSC_F64, DSC_ALLOW_NONE);
SPEC(OUT, "out", DSC_F32 | DSC_BF16 | DSC_F16 | DSC_F64, 0);
SPEC(DOTS_OUT, "out", DSC_F32 | DSC_F64, 0);

static int moe_dtype(uint32_t d) {
    switch (d) {
    case DSC_BF16: return DSC_MOE_BF16;
    case DSC_F16: return DSC_MOE_F16;
    case DSC_F64: return DSC_MOE_F64;
    default: return DSC_MOE_F32;
    }
}

static int want_shape(const dsc_view *v, const char *name, int ndim, const int64_t *shape) {
    int ok = v->ndim == ndim;
    for (int d = 0; ok && d < ndim; d++) ok = v->shape[d] == shape[d];
    if (ok) return 0;
    char want[96] = "", got[96] = "";
    size_t a = 0, b = 0;
    for (int d = 0; d < ndim && a < sizeof want - 24; d++)
        a += (size_t)snprintf(want + a, sizeof want - a, d ? ", %lld" : "%lld", (long long)shape[d]);
    for (int d = 0; d < v->ndim && b < sizeof got - 24; d++)
        b += (size_t)snprintf(got + b, sizeof got - b, d ? ", %lld" : "%lld", (long long)v->shape[d]);
    PyErr_Format(PyExc_ValueError, "argument '%s' must have shape [%s], got [%s]", name, want, got);
    return -1;
}

static int same_dtype(const dsc_view *a, const char *an, const dsc_view *b, const char *bn) {
    if (a->dtype == b->dtype) return 0;
    PyErr_Format(PyExc_TypeError, "argument '%s' must have the dtype of '%s' (%s), got %s", an, bn,
                 dsc_dtype_name(b->dtype), dsc_dtype_name(a->dtype));
    return -1;
}

/* w's dtype follows the moved rows: float64 rows take float64 weights, all others float32 */
static int weight_dtype(const dsc_view *w, const dsc_view *rows, const char *rows_name) {
    if (w->is_none) return 0;
    uint32_t want = rows->dtype == DSC_F64 ? DSC_F64 : DSC_F32;
    if (w->dtype == want) return 0;
    PyErr_Format(PyExc_TypeError, "argument 'w' must be %s for %s '%s', got %s", dsc_dtype_name(want),
                 dsc_dtype_name(rows->dtype), rows_name, dsc_dtype_name(w->dtype));
    return -1;
}

static PyObject *core_error(int rc, const char *fname) {
    if (rc == DSC_MOE_ENOMEM) return PyErr_NoMemory();
#ifdef DSC_MOE_ON_CUDA
    if (rc > 0) {
        PyErr_Format(PyExc_RuntimeError, "%s: CUDA error %d (%s)", fname, rc, dsc_moe_cuda_strerror(rc));
        return NULL;
    }
#endif
    PyErr_Format(PyExc_ValueError,
                 "%s: invalid routing (an expert id outside [0, num_experts), a slot outside the buffer, or "
                 "a size out of range)", fname);
    return NULL;
}

#ifdef DSC_MOE_ON_CUDA
#define DSC_DEVICE_ENTER dsc_moe_cuda_enter
#define DSC_DEVICE_LEAVE dsc_moe_cuda_leave
#endif
#define DSC_DEVICE_FAIL core_error
#include "dsc/binding_device.h"

static PyObject *py_select(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("select", nargs, 4) < 0) return NULL;
    dsc_view p, q, idx;
    int64_t k;
    if (dsc_view_from_object(args[0], &PRIMARY, &p) < 0 || dsc_view_from_object(args[1], &SECONDARY, &q) < 0 ||
        dsc_arg_int64(args[2], "k", &k) < 0 || dsc_view_from_object(args[3], &IDX_OUT, &idx) < 0)
        return NULL;
    if (p.ndim != 2) return PyErr_Format(PyExc_ValueError, "argument 'primary' must be [tokens, experts], got %d dims", p.ndim);
    const int64_t S = p.shape[0], E = p.shape[1];
    if (k < 1 || k > E) return PyErr_Format(PyExc_ValueError, "argument 'k' must be in [1, %lld], got %lld", (long long)E, (long long)k);
    if (!q.is_none && want_shape(&q, "secondary", 2, p.shape) < 0) return NULL;
    const int64_t ishape[2] = {S, k};
    if (want_shape(&idx, "idx_out", 2, ishape) < 0) return NULL;
    STREAM_OF(p, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(dsc_moe_select, p.data, q.is_none ? NULL : q.data, S, E, k, idx.data);
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_MOE_OK) return core_error(rc, "select");
    Py_RETURN_NONE;
}

static PyObject *py_counts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("counts", nargs, 4) < 0) return NULL;
    dsc_view idx, used, counts;
    int64_t E;
    if (dsc_view_from_object(args[0], &IDX, &idx) < 0 || dsc_view_from_object(args[1], &USED, &used) < 0 ||
        dsc_arg_int64(args[2], "num_experts", &E) < 0 || dsc_view_from_object(args[3], &COUNTS_OUT, &counts) < 0)
        return NULL;
    if (idx.ndim != 2) return PyErr_Format(PyExc_ValueError, "argument 'idx' must be [tokens, k], got %d dims", idx.ndim);
    if (E < 1) return PyErr_Format(PyExc_ValueError, "argument 'num_experts' must be >= 1, got %lld", (long long)E);
    const int64_t S = idx.shape[0], k = idx.shape[1];
    if (k < 1) return PyErr_Format(PyExc_ValueError, "argument 'idx' needs at least one route per token");
    if (!used.is_none && want_shape(&used, "used", 1, &S) < 0) return NULL;
    if (want_shape(&counts, "counts_out", 1, &E) < 0) return NULL;
    STREAM_OF(idx, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(dsc_moe_counts, idx.data, used.is_none ? NULL : used.data, S, k, E, counts.data);
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_MOE_OK) return core_error(rc, "counts");
    Py_RETURN_NONE;
}

static PyObject *py_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("plan", nargs, 8) < 0) return NULL;
    dsc_view idx, score, used, rs, sr;
    int64_t E, C, order;
    if (dsc_view_from_object(args[0], &IDX, &idx) < 0 || dsc_view_from_object(args[1], &SCORE, &score) < 0 ||
        dsc_view_from_object(args[2], &USED, &used) < 0 || dsc_arg_int64(args[3], "num_experts", &E) < 0 ||
        dsc_arg_int64(args[4], "capacity", &C) < 0 || dsc_arg_int64(args[5], "order", &order) < 0 ||
        dsc_view_from_object(args[6], &ROUTE_SLOT_OUT, &rs) < 0 || dsc_view_from_object(args[7], &SLOT_ROUTE_OUT, &sr) < 0)
        return NULL;
    if (idx.ndim != 2) return PyErr_Format(PyExc_ValueError, "argument 'idx' must be [tokens, k], got %d dims", idx.ndim);
    if (E < 1) return PyErr_Format(PyExc_ValueError, "argument 'num_experts' must be >= 1, got %lld", (long long)E);
    if (C < 0) return PyErr_Format(PyExc_ValueError, "argument 'capacity' must be >= 0, got %lld", (long long)C);
    if (order != DSC_MOE_TOKEN_MAJOR && order != DSC_MOE_ROUTE_MAJOR)
        return PyErr_Format(PyExc_ValueError, "argument 'order' must be 0 (token-major) or 1 (route-major), got %lld", (long long)order);
    const int64_t S = idx.shape[0], k = idx.shape[1], nslots = E * C;
    if (!score.is_none && want_shape(&score, "score", 2, idx.shape) < 0) return NULL;
    if (!used.is_none && want_shape(&used, "used", 1, &S) < 0) return NULL;
    if (want_shape(&rs, "route_slot_out", 2, idx.shape) < 0 || want_shape(&sr, "slot_route_out", 1, &nslots) < 0) return NULL;
    STREAM_OF(idx, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(dsc_moe_plan, idx.data, score.is_none ? NULL : score.data, used.is_none ? NULL : used.data, S, k, E, C,
              (int)order, rs.data, sr.data);
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_MOE_OK) return core_error(rc, "plan");
    Py_RETURN_NONE;
}

static PyObject *py_dispatch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("dispatch", nargs, 5) < 0) return NULL;
    dsc_view x, sr, w, out;
    int64_t k;
    if (dsc_view_from_object(args[0], &X, &x) < 0 || dsc_view_from_object(args[1], &SLOT_ROUTE, &sr) < 0 ||
        dsc_arg_int64(args[2], "k", &k) < 0 || dsc_view_from_object(args[3], &W, &w) < 0 ||
        dsc_view_from_object(args[4], &OUT, &out) < 0)
        return NULL;
    if (x.ndim != 2) return PyErr_Format(PyExc_ValueError, "argument 'x' must be [tokens, hidden], got %d dims", x.ndim);
    if (sr.ndim != 1) return PyErr_Format(PyExc_ValueError, "argument 'slot_route' must be 1-d, got %d dims", sr.ndim);
    if (k < 1) return PyErr_Format(PyExc_ValueError, "argument 'k' must be >= 1, got %lld", (long long)k);
    const int64_t S = x.shape[0], M = x.shape[1], nslots = sr.shape[0], wshape = S * k;
    const int64_t oshape[2] = {nslots, M};
    if (want_shape(&out, "out", 2, oshape) < 0 || same_dtype(&out, "out", &x, "x") < 0) return NULL;
    if (!w.is_none && (want_shape(&w, "w", 1, &wshape) < 0 || weight_dtype(&w, &x, "x") < 0)) return NULL;
    if (dsc_check_no_alias("out", &out, "x", &x) < 0) return NULL;
    STREAM_OF(x, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(dsc_moe_dispatch, x.data, moe_dtype(x.dtype), S, M, sr.data, nslots, k, w.is_none ? NULL : w.data, out.data);
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_MOE_OK) return core_error(rc, "dispatch");
    Py_RETURN_NONE;
}

static PyObject *py_combine(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("combine", nargs, 4) < 0) return NULL;
    dsc_view y, rs, w, out;
    if (dsc_view_from_object(args[0], &Y, &y) < 0 || dsc_view_from_object(args[1], &ROUTE_SLOT, &rs) < 0 ||
        dsc_view_from_object(args[2], &W, &w) < 0 || dsc_view_from_object(args[3], &OUT, &out) < 0)
        return NULL;
    if (y.ndim != 2) return PyErr_Format(PyExc_ValueError, "argument 'y' must be [slots, hidden], got %d dims", y.ndim);
    if (rs.ndim != 2) return PyErr_Format(PyExc_ValueError, "argument 'route_slot' must be [tokens, k], got %d dims", rs.ndim);
    const int64_t nslots = y.shape[0], M = y.shape[1], S = rs.shape[0], k = rs.shape[1];
    if (k < 1) return PyErr_Format(PyExc_ValueError, "argument 'route_slot' needs at least one route per token");
    const int64_t oshape[2] = {S, M};
    if (want_shape(&out, "out", 2, oshape) < 0 || same_dtype(&out, "out", &y, "y") < 0) return NULL;
    if (!w.is_none && (want_shape(&w, "w", 2, rs.shape) < 0 || weight_dtype(&w, &y, "y") < 0)) return NULL;
    if (dsc_check_no_alias("out", &out, "y", &y) < 0) return NULL;
    STREAM_OF(y, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(dsc_moe_combine, y.data, moe_dtype(y.dtype), nslots, M, rs.data, S, k, w.is_none ? NULL : w.data, out.data);
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_MOE_OK) return core_error(rc, "combine");
    Py_RETURN_NONE;
}

static PyObject *py_route_dots(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("route_dots", nargs, 4) < 0) return NULL;
    dsc_view g, y, rs, out;
    if (dsc_view_from_object(args[0], &G, &g) < 0 || dsc_view_from_object(args[1], &Y, &y) < 0 ||
        dsc_view_from_object(args[2], &ROUTE_SLOT, &rs) < 0 || dsc_view_from_object(args[3], &DOTS_OUT, &out) < 0)
        return NULL;
    if (g.ndim != 2 || y.ndim != 2 || rs.ndim != 2)
        return PyErr_Format(PyExc_ValueError, "route_dots takes g [tokens, hidden], y [slots, hidden], route_slot [tokens, k]");
    if (same_dtype(&y, "y", &g, "g") < 0) return NULL;
    const int64_t S = g.shape[0], M = g.shape[1], nslots = y.shape[0];
    if (y.shape[1] != M) return PyErr_Format(PyExc_ValueError, "argument 'y' must have %lld columns like 'g', got %lld", (long long)M, (long long)y.shape[1]);
    if (rs.shape[0] != S) return PyErr_Format(PyExc_ValueError, "argument 'route_slot' must have %lld rows like 'g', got %lld", (long long)S, (long long)rs.shape[0]);
    if (want_shape(&out, "out", 2, rs.shape) < 0 || weight_dtype(&out, &g, "g") < 0) return NULL;
    STREAM_OF(g, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(dsc_moe_route_dots, g.data, y.data, moe_dtype(g.dtype), S, M, nslots, rs.data, rs.shape[1], out.data);
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_MOE_OK) return core_error(rc, "route_dots");
    Py_RETURN_NONE;
}

#define METHOD(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}

static PyMethodDef methods[] = {
    METHOD("select", py_select, "select(primary, secondary, k, idx_out): top-k experts per token."),
    METHOD("counts", py_counts, "counts(idx, used, num_experts, counts_out): routes per expert (exp_counts)."),
    METHOD("plan", py_plan, "plan(idx, score, used, num_experts, capacity, order, route_slot_out, slot_route_out)."),
    METHOD("dispatch", py_dispatch, "dispatch(x, slot_route, k, w, out): tokens into expert slots."),
    METHOD("combine", py_combine, "combine(y, route_slot, w, out): weighted sum of each token's slots."),
    METHOD("route_dots", py_route_dots, "route_dots(g, y, route_slot, out): <g[token], y[slot]> per route."),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR,
                                        "deepspeed_c MoE gating core (selection, capacity plan, dispatch, combine).",
                                        -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
