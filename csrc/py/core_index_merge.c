/* Python face of the data analyzer's merge (csrc/core/index_merge.c). The sorted merge travels as a
 * capsule between the two calls, so Python picks the output dtypes and document boundaries from its sizes.
 *
 * _C.index_merge_sort(values, ids) -> merge          values, ids: lists of (bin_path, dtype_code, count), one per
 *                                                    map file, in worker/thread order
 * _C.index_merge_info(merge) -> (samples, unique, min, max)
 * _C.index_merge_write(merge, sample_to_metric, index_to_sample, index_to_metric, percentile_merged,
 *                      value_code, id_code, sample_docs, value_docs, merge_step)   prefixes: str or None (skip)
 * Bad input raises ValueError (or OSError for file errors) with the core's message. */
#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include "dsc/index_merge.h"

static const char CAPSULE_NAME[] = "deepspeed_c.index_merge";

static void merge_capsule_free(PyObject *capsule) {
    dsc_imerge *m = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    if (m) dsc_imerge_free(m);
    else PyErr_Clear();
}

static dsc_imerge *merge_arg(PyObject *obj) {
    if (!PyCapsule_IsValid(obj, CAPSULE_NAME)) {
        PyErr_SetString(PyExc_TypeError, "merge must be made by index_merge_sort()");
        return NULL;
    }
    return PyCapsule_GetPointer(obj, CAPSULE_NAME);
}

static PyObject *raise_core(int rc, const char *err) {
    if (rc == DSC_IMERGE_ENOMEM) return PyErr_NoMemory();
    PyErr_SetString(rc == DSC_IMERGE_EIO ? PyExc_OSError : PyExc_ValueError, err[0] ? err : "index merge error");
    return NULL;
}

/* A list of (path, code, count); the paths' encoded bytes are kept alive in *keep (a list). */
static int inputs_arg(PyObject *seq, const char *name, dsc_imerge_input **out, Py_ssize_t *len, PyObject *keep) {
    *out = NULL;
    if (!PyList_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list of (path, dtype_code, count)", name);
        return -1;
    }
    const Py_ssize_t n = PyList_Size(seq);
    dsc_imerge_input *in = PyMem_Calloc((size_t)(n ? n : 1), sizeof *in);
    if (!in) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GetItem(seq, i); /* borrowed */
        PyObject *path = NULL;
        long long code = 0, count = 0;
        if (!PyTuple_Check(item) || PyTuple_Size(item) != 3 || !PyUnicode_Check(PyTuple_GetItem(item, 0))) {
            PyErr_Format(PyExc_TypeError, "%s[%zd] must be a (str path, int dtype_code, int count) tuple", name, i);
            goto fail;
        }
        code = PyLong_AsLongLong(PyTuple_GetItem(item, 1));
        count = PyLong_AsLongLong(PyTuple_GetItem(item, 2));
        if (PyErr_Occurred()) goto fail;
        path = PyUnicode_EncodeFSDefault(PyTuple_GetItem(item, 0));
        if (!path) goto fail;
        if (PyList_Append(keep, path) < 0) {
            Py_DECREF(path);
            goto fail;
        }
        Py_DECREF(path); /* the list holds it */
        in[i].path = PyBytes_AsString(path);
        in[i].code = (int)code;
        in[i].count = (int64_t)count;
        if (!in[i].path) goto fail;
    }
    *out = in;
    *len = n;
    return 0;
fail:
    PyMem_Free(in);
    return -1;
}

static PyObject *index_merge_sort(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "index_merge_sort() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *keep = PyList_New(0);
    if (!keep) return NULL;
    dsc_imerge_input *values = NULL, *ids = NULL;
    Py_ssize_t nv = 0, ni = 0;
    PyObject *result = NULL;
    if (inputs_arg(args[0], "values", &values, &nv, keep) < 0 || inputs_arg(args[1], "ids", &ids, &ni, keep) < 0)
        goto done;
    if (nv != ni) {
        PyErr_Format(PyExc_ValueError, "values has %zd map files but ids has %zd", nv, ni);
        goto done;
    }
    dsc_imerge *m = NULL;
    char err[512] = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_imerge_sort(values, ids, (int64_t)nv, &m, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (rc) {
        raise_core(rc, err);
        goto done;
    }
    result = PyCapsule_New(m, CAPSULE_NAME, merge_capsule_free);
    if (!result) dsc_imerge_free(m);
done:
    PyMem_Free(values);
    PyMem_Free(ids);
    Py_DECREF(keep);
    return result;
}

static PyObject *index_merge_info(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1) {
        PyErr_Format(PyExc_TypeError, "index_merge_info() takes 1 argument (%zd given)", nargs);
        return NULL;
    }
    dsc_imerge *m = merge_arg(args[0]);
    if (!m) return NULL;
    int64_t n, u, lo, hi;
    dsc_imerge_info(m, &n, &u, &lo, &hi);
    return Py_BuildValue("(LLLL)", (long long)n, (long long)u, (long long)lo, (long long)hi);
}

static int prefix_arg(PyObject *obj, const char *name, PyObject *keep, const char **out) {
    *out = NULL;
    if (obj == Py_None) return 0;
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a str path prefix or None", name);
        return -1;
    }
    PyObject *b = PyUnicode_EncodeFSDefault(obj);
    if (!b) return -1;
    if (PyList_Append(keep, b) < 0) {
        Py_DECREF(b);
        return -1;
    }
    Py_DECREF(b);
    *out = PyBytes_AsString(b);
    return *out ? 0 : -1;
}

static int docs_arg(PyObject *seq, const char *name, int64_t **out, int64_t *len) {
    *out = NULL;
    if (!PyList_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list of ints", name);
        return -1;
    }
    const Py_ssize_t n = PyList_Size(seq);
    int64_t *a = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (!a) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        a[i] = (int64_t)PyLong_AsLongLong(PyList_GetItem(seq, i));
        if (a[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(a);
            return -1;
        }
    }
    *out = a;
    *len = (int64_t)n;
    return 0;
}

static PyObject *index_merge_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_Format(PyExc_TypeError, "index_merge_write() takes 10 arguments (%zd given)", nargs);
        return NULL;
    }
    dsc_imerge *m = merge_arg(args[0]);
    if (!m) return NULL;
    PyObject *keep = PyList_New(0);
    if (!keep) return NULL;
    dsc_imerge_outputs o;
    memset(&o, 0, sizeof o);
    int64_t *sdocs = NULL, *vdocs = NULL;
    PyObject *result = NULL;
    if (prefix_arg(args[1], "sample_to_metric", keep, &o.sample_to_metric) < 0 ||
        prefix_arg(args[2], "index_to_sample", keep, &o.index_to_sample) < 0 ||
        prefix_arg(args[3], "index_to_metric", keep, &o.index_to_metric) < 0 ||
        prefix_arg(args[4], "percentile_merged", keep, &o.percentile_merged) < 0)
        goto done;
    o.value_code = (int)PyLong_AsLong(args[5]);
    o.id_code = (int)PyLong_AsLong(args[6]);
    o.merge_step = (int64_t)PyLong_AsLongLong(args[9]);
    if (PyErr_Occurred()) goto done;
    if (docs_arg(args[7], "sample_docs", &sdocs, &o.n_sample_docs) < 0 ||
        docs_arg(args[8], "value_docs", &vdocs, &o.n_value_docs) < 0)
        goto done;
    o.sample_docs = sdocs;
    o.value_docs = vdocs;
    char err[512] = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_imerge_write(m, &o, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (rc) {
        raise_core(rc, err);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(sdocs);
    PyMem_Free(vdocs);
    Py_DECREF(keep);
    return result;
}

#define FASTCALL(fn) (PyCFunction)(void (*)(void))fn, METH_FASTCALL

PyMethodDef dsc_index_merge_methods[] = {
    {"index_merge_sort", FASTCALL(index_merge_sort),
     "index_merge_sort(values, ids) -> merge: map the analyzer's per-worker files (lists of (bin_path, dtype_code, "
     "count)) and sort the samples by value, stably."},
    {"index_merge_info", FASTCALL(index_merge_info), "index_merge_info(merge) -> (samples, unique, min, max)"},
    {"index_merge_write", FASTCALL(index_merge_write),
     "index_merge_write(merge, sample_to_metric, index_to_sample, index_to_metric, percentile_merged, value_code, "
     "id_code, sample_docs, value_docs, merge_step): write the index file pairs (prefixes; None skips one)."},
    {NULL, NULL, 0, NULL},
};
