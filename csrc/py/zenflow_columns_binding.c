/* The zenflow_columns op: count(segments, idx) -> int, gather(part, segments, idx, out) and
 * scatter(part, segments, idx, vals), host float32 (see dsc/columns.h for the segment table). Every
 * segment and index is checked before any element moves: errors name the argument and the row. */
#include "dsc/tensor_view.h" /* Python.h first */
#include "dsc/columns.h"
#include "dsc/cpu_optim_args.h"
#include "dsc/module.h"

static const dsc_arg_spec PART = {"part", DSC_F32, DSC_DEV_CPU, DSC_CONTIGUOUS};
static const dsc_arg_spec SEGS = {"segments", DSC_I64, DSC_DEV_CPU, DSC_CONTIGUOUS};
static const dsc_arg_spec IDX = {"idx", DSC_I32, DSC_DEV_CPU, DSC_CONTIGUOUS};
static const dsc_arg_spec OUT = {"out", DSC_F32, DSC_DEV_CPU, DSC_CONTIGUOUS};
static const dsc_arg_spec VALS = {"vals", DSC_F32, DSC_DEV_CPU, DSC_CONTIGUOUS};

typedef struct {
    dsc_view segs, idx;
    int64_t nseg;
    int64_t *vals_start; /* PyMem */
    int64_t total;
} table;

/* Validates the segment table against the index list and (when part_numel >= 0) the partition. */
static int parse_table(PyObject *segs_obj, PyObject *idx_obj, int64_t part_numel, table *t) {
    t->vals_start = NULL;
    if (dsc_view_from_object(segs_obj, &SEGS, &t->segs) < 0) return -1;
    if (dsc_view_from_object(idx_obj, &IDX, &t->idx) < 0) return -1;
    if (t->segs.ndim != 2 || t->segs.shape[1] != DSC_COL_SEGMENT_FIELDS) {
        PyErr_Format(PyExc_ValueError, "argument 'segments' must have shape [n, %d] (part_start, len, param_off, "
                     "cols, idx_start, idx_count)", DSC_COL_SEGMENT_FIELDS);
        return -1;
    }
    t->nseg = t->segs.shape[0];
    const dsc_col_segment *s = (const dsc_col_segment *)t->segs.data;
    const int32_t *ix = (const int32_t *)t->idx.data;
    t->vals_start = PyMem_Malloc(sizeof(int64_t) * (size_t)(t->nseg ? t->nseg : 1));
    if (!t->vals_start) {
        PyErr_NoMemory();
        return -1;
    }
    int64_t total = 0;
    for (int64_t i = 0; i < t->nseg; i++) {
        const dsc_col_segment *g = &s[i];
        if (g->part_start < 0 || g->len < 0 || g->param_off < 0 || g->cols < 1 || g->idx_start < 0 ||
            g->idx_count < 0 || g->idx_start + g->idx_count > t->idx.numel ||
            (part_numel >= 0 && g->part_start + g->len > part_numel)) {
            PyErr_Format(PyExc_ValueError, "argument 'segments' row %lld is out of range (part_start=%lld len=%lld "
                         "param_off=%lld cols=%lld idx_start=%lld idx_count=%lld; part has %lld elements, idx %lld)",
                         (long long)i, (long long)g->part_start, (long long)g->len, (long long)g->param_off,
                         (long long)g->cols, (long long)g->idx_start, (long long)g->idx_count, (long long)part_numel,
                         (long long)t->idx.numel);
            goto fail;
        }
        for (int64_t j = 0; j < g->idx_count; j++) {
            int32_t c = ix[g->idx_start + j];
            if (c < 0 || c >= g->cols || (j > 0 && c <= ix[g->idx_start + j - 1])) {
                PyErr_Format(PyExc_ValueError, "argument 'idx': segment %lld's column indices must be ascending, "
                             "distinct and in [0, %lld); entry %lld is %d", (long long)i, (long long)g->cols,
                             (long long)j, (int)c);
                goto fail;
            }
        }
        t->vals_start[i] = total;
        total += dsc_columns_count(g, ix);
    }
    t->total = total;
    return 0;
fail:
    PyMem_Free(t->vals_start);
    t->vals_start = NULL;
    return -1;
}

static PyObject *count(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("count", nargs, 2) < 0) return NULL;
    table t;
    if (parse_table(args[0], args[1], -1, &t) < 0) return NULL;
    PyMem_Free(t.vals_start);
    return PyLong_FromLongLong((long long)t.total);
}

static int move_args(const char *fname, PyObject *const *args, Py_ssize_t nargs, const dsc_arg_spec *vspec,
                     dsc_view *part, dsc_view *vals, table *t) {
    if (dsc_check_nargs(fname, nargs, 4) < 0) return -1;
    if (dsc_view_from_object(args[0], &PART, part) < 0) return -1;
    if (dsc_view_from_object(args[3], vspec, vals) < 0) return -1;
    if (parse_table(args[1], args[2], part->numel, t) < 0) return -1;
    if (vals->numel != t->total) {
        PyErr_Format(PyExc_ValueError, "argument '%s' has %lld elements; the segments select %lld", vspec->name,
                     (long long)vals->numel, (long long)t->total);
        PyMem_Free(t->vals_start);
        return -1;
    }
    if (dsc_check_no_alias(vspec->name, vals, "part", part) < 0) {
        PyMem_Free(t->vals_start);
        return -1;
    }
    return 0;
}

static PyObject *gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    dsc_view part, out;
    table t;
    if (move_args("gather", args, nargs, &OUT, &part, &out, &t) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    dsc_columns_gather((const float *)part.data, (const dsc_col_segment *)t.segs.data, t.nseg,
                       (const int32_t *)t.idx.data, t.vals_start, (float *)out.data);
    Py_END_ALLOW_THREADS
    PyMem_Free(t.vals_start);
    Py_RETURN_NONE;
}

static PyObject *scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    dsc_view part, vals;
    table t;
    if (move_args("scatter", args, nargs, &VALS, &part, &vals, &t) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    dsc_columns_scatter((float *)part.data, (const dsc_col_segment *)t.segs.data, t.nseg,
                        (const int32_t *)t.idx.data, t.vals_start, (const float *)vals.data);
    Py_END_ALLOW_THREADS
    PyMem_Free(t.vals_start);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"count", (PyCFunction)(void (*)(void))count, METH_FASTCALL,
     "count(segments, idx) -> int: the selected elements of every segment."},
    {"gather", (PyCFunction)(void (*)(void))gather, METH_FASTCALL,
     "gather(part, segments, idx, out): out = the selected elements of part, segment by segment."},
    {"scatter", (PyCFunction)(void (*)(void))scatter, METH_FASTCALL,
     "scatter(part, segments, idx, vals): the selected elements of part = vals."},
    DSC_SIMD_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR,
                                        "deepspeed_c ZenFlow column gather/scatter on the host.", -1, methods, NULL,
                                        NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
