/* Python face of the block-sparse attention kernels (dsc/sparse_attn_cuda.h), op `sparse_attn`.
 * The shim (deepspeed_c/ops/sparse_attention/kernel.py) builds the layout's CSR/CSC tables and
 * allocates every output; each argument is checked here (CUDA, contiguous, dtype, shape, one
 * device) before a kernel runs.
 *
 *   forward(q, k, v, o, lse, row_ptr, cols, kpm|None, am|None, rpe|None, block, scale,
 *           items|None, merges|None, slots, part|None)
 *   backward(d_o, q, k, v, o, lse, delta, row_ptr, cols, col_ptr, rows, kpm|None, am|None, rpe|None,
 *            dq, dk, dv, block, scale, row_items|None, row_merges|None, row_slots,
 *            col_items|None, col_merges|None, col_slots, part|None)
 * items / merges / slots: a balanced grid (work_plan.py's WorkPlan; None: one CTA per block row in index
 * order); part: its float32 scratch (dsc/sparse_attn_cuda.h gives the size). */
#include "dsc/tensor_view.h" /* Python.h first */
#include "dsc/cuda_binding_util.h"
#include "dsc/module.h"
#include "dsc/sparse_attn_cuda.h"

#include <stdio.h>

#define ACT (DSC_F16 | DSC_BF16)

static int cuda_dtype(uint32_t d) { return d == DSC_F16 ? DSC_CUDA_F16 : DSC_CUDA_BF16; }

static int bad_shape(const char *name, const dsc_view *x, int ndim, const int64_t *shape) {
    int ok = x->ndim == ndim;
    for (int d = 0; ok && d < ndim; d++) ok = x->shape[d] == shape[d];
    if (ok) return 0;
    char want[128], got[128];
    size_t a = 0, b = 0;
    want[0] = got[0] = 0;
    for (int d = 0; d < ndim; d++) a += (size_t)snprintf(want + a, sizeof want - a, d ? ", %lld" : "%lld", (long long)shape[d]);
    for (int d = 0; d < x->ndim && d < 8; d++)
        b += (size_t)snprintf(got + b, sizeof got - b, d ? ", %lld" : "%lld", (long long)x->shape[d]);
    PyErr_Format(PyExc_ValueError, "argument '%s' must have shape [%s], got [%s]", name, want, got);
    return -1;
}

/* A contiguous CUDA tensor of `dtypes` on q's device (of q's dtype when same_dtype) and of `shape`
 * (when not NULL); None only when optional. */
static int arg(PyObject *obj, const char *name, uint32_t dtypes, uint32_t flags, const dsc_view *q, int same_dtype,
               int ndim, const int64_t *shape, dsc_view *out) {
    const dsc_arg_spec spec = {name, dtypes, DSC_DEV_CUDA, DSC_CONTIGUOUS | flags};
    if (dsc_view_from_object(obj, &spec, out) < 0) return -1;
    if (out->is_none || q == NULL) return 0;
    if (dsc_check_same_device(name, out, "q", q) < 0) return -1;
    if (same_dtype && out->dtype != q->dtype) {
        PyErr_Format(PyExc_TypeError, "argument '%s' must have the dtype of 'q' (%s), got %s", name,
                     dsc_dtype_name(q->dtype), dsc_dtype_name(out->dtype));
        return -1;
    }
    return shape ? bad_shape(name, out, ndim, shape) : 0;
}

typedef struct {
    dsc_view q;
    int64_t B, H, L, D, block, nb;
    int64_t qkv[4], rows3[3], ptr1[1], kpm2[2], am2[2];
} geom;

static int q_arg(PyObject *obj, PyObject *block_obj, geom *g) {
    if (arg(obj, "q", ACT, DSC_ALIGNED16, NULL, 0, 0, NULL, &g->q) < 0) return -1;
    if (g->q.ndim != 4) {
        PyErr_Format(PyExc_ValueError, "argument 'q' must be [batch, heads, seq, head_dim] (4 dims), got %d dims",
                     g->q.ndim);
        return -1;
    }
    if (dsc_arg_int64(block_obj, "block", &g->block) < 0) return -1;
    g->B = g->q.shape[0], g->H = g->q.shape[1], g->L = g->q.shape[2], g->D = g->q.shape[3];
    if (g->block != 16 && g->block != 32 && g->block != 64 && g->block != 128) {
        PyErr_Format(PyExc_ValueError, "argument 'block' must be 16, 32, 64 or 128 for the CUDA kernels, got %lld",
                     (long long)g->block);
        return -1;
    }
    if (g->L % g->block != 0) {
        PyErr_Format(PyExc_ValueError, "sequence length %lld is not a multiple of the block %lld: pad the inputs "
                     "with SparseAttentionUtils.pad_to_block_size", (long long)g->L, (long long)g->block);
        return -1;
    }
    if (g->D % 8 != 0 || g->D > DSC_SA_MAX_HEAD_DIM || g->D < 8) {
        PyErr_Format(PyExc_ValueError, "argument 'q': head dim must be a multiple of 8 up to %d for the CUDA "
                     "kernels, got %lld", DSC_SA_MAX_HEAD_DIM, (long long)g->D);
        return -1;
    }
    g->nb = g->L / g->block;
    const int64_t qkv[4] = {g->B, g->H, g->L, g->D};
    for (int d = 0; d < 4; d++) g->qkv[d] = qkv[d];
    g->rows3[0] = g->B, g->rows3[1] = g->H, g->rows3[2] = g->L;
    g->ptr1[0] = g->H * g->nb + 1;
    g->kpm2[0] = g->B, g->kpm2[1] = g->L;
    g->am2[0] = g->L, g->am2[1] = g->L;
    return 0;
}

/* rpe float32 [Br, Hr, L, L] with Br in {1, B}, Hr in {1, H}: its batch and head strides (0 when broadcast). */
static int rpe_arg(PyObject *obj, const geom *g, dsc_view *rpe, int64_t *sb, int64_t *sh) {
    *sb = *sh = 0;
    if (arg(obj, "rpe", DSC_F32, DSC_ALLOW_NONE, &g->q, 0, 0, NULL, rpe) < 0) return -1;
    if (rpe->is_none) return 0;
    if (rpe->ndim != 4 || (rpe->shape[0] != 1 && rpe->shape[0] != g->B) ||
        (rpe->shape[1] != 1 && rpe->shape[1] != g->H) || rpe->shape[2] != g->L || rpe->shape[3] != g->L) {
        PyErr_Format(PyExc_ValueError, "argument 'rpe' must be [1 or %lld, 1 or %lld, %lld, %lld]", (long long)g->B,
                     (long long)g->H, (long long)g->L, (long long)g->L);
        return -1;
    }
    *sh = rpe->shape[1] == 1 ? 0 : g->L * g->L;
    *sb = rpe->shape[0] == 1 ? 0 : rpe->shape[1] * g->L * g->L;
    return 0;
}

static const void *opt(const dsc_view *v) { return v->is_none ? NULL : v->data; }

/* A WorkPlan's tables: items int32 [n >= 1, 4], merges int32 [m, 4] or None (no split row; 16-byte
 * aligned rows), slots >= 0.
 * *has = 0 when items is None (the index-order grid). */
static int plan_arg(PyObject *items_obj, PyObject *merges_obj, PyObject *slots_obj, const char *names[3],
                    const geom *g, dsc_sa_plan *plan, int *has) {
    dsc_view items, merges;
    *has = 0;
    if (arg(items_obj, names[0], DSC_I32, DSC_ALIGNED16 | DSC_ALLOW_NONE, &g->q, 0, 0, NULL, &items) < 0) return -1;
    if (items.is_none) return 0;
    if (items.ndim != 2 || items.shape[1] != 4 || items.shape[0] < 1) {
        PyErr_Format(PyExc_ValueError, "argument '%s' must be [n >= 1, 4] (a WorkPlan's items)", names[0]);
        return -1;
    }
    if (arg(merges_obj, names[1], DSC_I32, DSC_ALIGNED16 | DSC_ALLOW_NONE, &g->q, 0, 0, NULL, &merges) < 0) return -1;
    if (!merges.is_none && (merges.ndim != 2 || merges.shape[1] != 4)) {
        PyErr_Format(PyExc_ValueError, "argument '%s' must be [n, 4] (a WorkPlan's merges)", names[1]);
        return -1;
    }
    int64_t slots;
    if (dsc_arg_int64(slots_obj, names[2], &slots) < 0) return -1;
    const int64_t n_merges = merges.is_none ? 0 : merges.shape[0];
    if (slots < 0 || (n_merges > 0 && slots < 2)) {
        PyErr_Format(PyExc_ValueError, "argument '%s' must be >= 2 when there are merges, >= 0 always, got %lld",
                     names[2], (long long)slots);
        return -1;
    }
    plan->items = (const int *)items.data, plan->merges = n_merges ? (const int *)merges.data : NULL;
    plan->n_items = items.shape[0], plan->n_merges = n_merges, plan->slots = slots;
    *has = 1;
    return 0;
}

/* The plans' float32 scratch, at least `need` elements when need > 0. */
static int part_arg(PyObject *obj, const geom *g, int64_t need, dsc_view *part) {
    if (arg(obj, "part", DSC_F32, DSC_ALIGNED16 | DSC_ALLOW_NONE, &g->q, 0, 0, NULL, part) < 0) return -1;
    if (need > 0 && (part->is_none || part->numel < need)) {
        PyErr_Format(PyExc_ValueError, "argument 'part' must hold at least %lld float32 elements, got %lld",
                     (long long)need, (long long)(part->is_none ? 0 : part->numel));
        return -1;
    }
    return 0;
}

static PyObject *py_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("forward", nargs, 16) < 0) return NULL;
    geom g;
    dsc_view k, v, o, lse, row_ptr, cols, kpm, am, rpe;
    int64_t sb, sh;
    double scale;
    if (q_arg(args[0], args[10], &g) < 0 || arg(args[1], "k", ACT, DSC_ALIGNED16, &g.q, 1, 4, g.qkv, &k) < 0 ||
        arg(args[2], "v", ACT, DSC_ALIGNED16, &g.q, 1, 4, g.qkv, &v) < 0 ||
        arg(args[3], "o", ACT, DSC_ALIGNED16, &g.q, 1, 4, g.qkv, &o) < 0 ||
        arg(args[4], "lse", DSC_F32, 0, &g.q, 0, 3, g.rows3, &lse) < 0 ||
        arg(args[5], "row_ptr", DSC_I32, 0, &g.q, 0, 1, g.ptr1, &row_ptr) < 0 ||
        arg(args[6], "cols", DSC_I32, 0, &g.q, 0, 0, NULL, &cols) < 0 ||
        arg(args[7], "kpm", DSC_F32, DSC_ALLOW_NONE, &g.q, 0, 2, g.kpm2, &kpm) < 0 ||
        arg(args[8], "am", DSC_F32, DSC_ALLOW_NONE, &g.q, 0, 2, g.am2, &am) < 0 || rpe_arg(args[9], &g, &rpe, &sb, &sh) < 0 ||
        dsc_arg_double(args[11], "scale", &scale) < 0)
        return NULL;
    static const char *names[3] = {"items", "merges", "slots"};
    dsc_sa_plan plan;
    dsc_view part;
    int has;
    if (plan_arg(args[12], args[13], args[14], names, &g, &plan, &has) < 0 ||
        part_arg(args[15], &g, has && plan.n_merges > 0 ? g.B * plan.slots * g.block * (g.D + 1) : 0, &part) < 0)
        return NULL;
    cudaStream_t stream;
    if (dsc_cuda_stream_arg(g.q.device_id, &stream) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_sa_forward(g.q.data, k.data, v.data, o.data, (float *)lse.data, (const int *)row_ptr.data,
                        (const int *)cols.data, opt(&kpm), opt(&am), opt(&rpe), sb, sh, g.B, g.H, g.L, g.D,
                        (int)g.block, (float)scale, cuda_dtype(g.q.dtype), has ? &plan : NULL,
                        (float *)opt(&part), g.q.device_id, stream);
    Py_END_ALLOW_THREADS
    if (dsc_cuda_check(rc, "sparse attention forward") < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("backward", nargs, 26) < 0) return NULL;
    geom g;
    dsc_view go, k, v, o, lse, delta, row_ptr, cols, col_ptr, rows, kpm, am, rpe, dq, dk, dv;
    int64_t sb, sh;
    double scale;
    if (q_arg(args[1], args[17], &g) < 0 || arg(args[0], "d_o", ACT, DSC_ALIGNED16, &g.q, 1, 4, g.qkv, &go) < 0 ||
        arg(args[2], "k", ACT, DSC_ALIGNED16, &g.q, 1, 4, g.qkv, &k) < 0 ||
        arg(args[3], "v", ACT, DSC_ALIGNED16, &g.q, 1, 4, g.qkv, &v) < 0 ||
        arg(args[4], "o", ACT, DSC_ALIGNED16, &g.q, 1, 4, g.qkv, &o) < 0 ||
        arg(args[5], "lse", DSC_F32, 0, &g.q, 0, 3, g.rows3, &lse) < 0 ||
        arg(args[6], "delta", DSC_F32, 0, &g.q, 0, 3, g.rows3, &delta) < 0 ||
        arg(args[7], "row_ptr", DSC_I32, 0, &g.q, 0, 1, g.ptr1, &row_ptr) < 0 ||
        arg(args[8], "cols", DSC_I32, 0, &g.q, 0, 0, NULL, &cols) < 0 ||
        arg(args[9], "col_ptr", DSC_I32, 0, &g.q, 0, 1, g.ptr1, &col_ptr) < 0 ||
        arg(args[10], "rows", DSC_I32, 0, &g.q, 0, 0, NULL, &rows) < 0 ||
        arg(args[11], "kpm", DSC_F32, DSC_ALLOW_NONE, &g.q, 0, 2, g.kpm2, &kpm) < 0 ||
        arg(args[12], "am", DSC_F32, DSC_ALLOW_NONE, &g.q, 0, 2, g.am2, &am) < 0 ||
        rpe_arg(args[13], &g, &rpe, &sb, &sh) < 0 || arg(args[14], "dq", ACT, DSC_ALIGNED16, &g.q, 1, 4, g.qkv, &dq) < 0 ||
        arg(args[15], "dk", ACT, DSC_ALIGNED16, &g.q, 1, 4, g.qkv, &dk) < 0 ||
        arg(args[16], "dv", ACT, DSC_ALIGNED16, &g.q, 1, 4, g.qkv, &dv) < 0 ||
        dsc_arg_double(args[18], "scale", &scale) < 0)
        return NULL;
    static const char *row_names[3] = {"row_items", "row_merges", "row_slots"};
    static const char *col_names[3] = {"col_items", "col_merges", "col_slots"};
    dsc_sa_plan row_plan, col_plan;
    dsc_view part;
    int has_row, has_col;
    if (plan_arg(args[19], args[20], args[21], row_names, &g, &row_plan, &has_row) < 0 ||
        plan_arg(args[22], args[23], args[24], col_names, &g, &col_plan, &has_col) < 0)
        return NULL;
    const int64_t tile = g.B * g.block * g.D;
    const int64_t need_row = has_row && row_plan.n_merges > 0 ? row_plan.slots * tile : 0;
    const int64_t need_col = has_col && col_plan.n_merges > 0 ? 2 * col_plan.slots * tile : 0;
    if (part_arg(args[25], &g, need_row > need_col ? need_row : need_col, &part) < 0) return NULL;
    cudaStream_t stream;
    if (dsc_cuda_stream_arg(g.q.device_id, &stream) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_sa_backward(go.data, g.q.data, k.data, v.data, o.data, (const float *)lse.data, (float *)delta.data,
                         (const int *)row_ptr.data, (const int *)cols.data, (const int *)col_ptr.data,
                         (const int *)rows.data, opt(&kpm), opt(&am), opt(&rpe), sb, sh, dq.data, dk.data, dv.data,
                         g.B, g.H, g.L, g.D, (int)g.block, (float)scale, cuda_dtype(g.q.dtype),
                         has_row ? &row_plan : NULL, has_col ? &col_plan : NULL, (float *)opt(&part), g.q.device_id,
                         stream);
    Py_END_ALLOW_THREADS
    if (dsc_cuda_check(rc, "sparse attention backward") < 0) return NULL;
    Py_RETURN_NONE;
}

#define METHOD(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}

static PyMethodDef methods[] = {
    METHOD("forward", py_forward,
           "forward(q, k, v, o, lse, row_ptr, cols, kpm, am, rpe, block, scale, items, merges, slots, part): "
           "block-sparse attention."),
    METHOD("backward", py_backward,
           "backward(d_o, q, k, v, o, lse, delta, row_ptr, cols, col_ptr, rows, kpm, am, rpe, dq, dk, dv, block, "
           "scale, row_items, row_merges, row_slots, col_items, col_merges, col_slots, part): its gradients."),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR,
                                        "deepspeed_c block-sparse attention kernels.", -1, methods, NULL, NULL, NULL,
                                        NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
