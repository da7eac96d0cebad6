/* _C.partition_plan(numels, world_size, bucket_cap, align, runtime_order=None) -> dict
 *
 * Slices come back as flat tuples of 6-tuples-worth of ints (param, rank, param_start,
 * local_start, length, bucket) so the Python side can turn them into one int64 tensor. */
#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include "dsc/partition.h"
#include "dsc/tensor_view.h"

static int64_t *int_list(PyObject *seq, const char *name, Py_ssize_t *len) {
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "argument '%s' must be a list or tuple of ints, got %R", name,
                     (PyObject *)Py_TYPE(seq));
        return NULL;
    }
    Py_ssize_t n = PySequence_Size(seq);
    if (n < 0) return NULL;
    int64_t *out = PyMem_Malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    if (!out) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        if (!item) goto fail;
        int bad = !PyLong_Check(item);
        out[i] = bad ? 0 : PyLong_AsLongLong(item);
        Py_DECREF(item);
        if (bad) {
            PyErr_Format(PyExc_TypeError, "argument '%s[%zd]' must be an int", name, i);
            goto fail;
        }
        if (PyErr_Occurred()) goto fail;
    }
    *len = n;
    return out;
fail:
    PyMem_Free(out);
    return NULL;
}

static PyObject *i64_tuple(const int64_t *v, int64_t n) {
    PyObject *t = PyTuple_New((Py_ssize_t)n);
    if (!t) return NULL;
    for (int64_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (!x) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SetItem(t, (Py_ssize_t)i, x);
    }
    return t;
}

static PyObject *slice_tuple(const dsc_slice *s, int64_t n) {
    PyObject *t = PyTuple_New((Py_ssize_t)(n * 6));
    if (!t) return NULL;
    for (int64_t i = 0; i < n; i++) {
        const int64_t f[6] = {s[i].param, s[i].rank, s[i].param_start, s[i].local_start, s[i].length, s[i].bucket};
        for (int j = 0; j < 6; j++) {
            PyObject *x = PyLong_FromLongLong(f[j]);
            if (!x) {
                Py_DECREF(t);
                return NULL;
            }
            PyTuple_SetItem(t, (Py_ssize_t)(i * 6 + j), x);
        }
    }
    return t;
}

static PyObject *plan_to_dict(const dsc_partition_plan *p) {
    PyObject *vals[8] = {
        i64_tuple(p->bucket_offset, p->num_buckets), i64_tuple(p->bucket_size, p->num_buckets),
        i64_tuple(p->bucket_numel, p->num_buckets),  i64_tuple(p->param_bucket, p->num_params),
        i64_tuple(p->param_offset, p->num_params),   slice_tuple(p->runtime_slices, p->num_runtime_slices),
        i64_tuple(p->ds_param_offset, p->num_params), slice_tuple(p->ds_slices, p->num_ds_slices),
    };
    PyObject *d = NULL;
    for (int i = 0; i < 8; i++)
        if (!vals[i]) goto done;
    d = Py_BuildValue("{s:L,s:O,s:O,s:O,s:O,s:O,s:L,s:L,s:O,s:O,s:L,s:L,s:O}",
                      "world_size", (long long)p->world_size, "bucket_offset", vals[0], "bucket_size", vals[1],
                      "bucket_numel", vals[2], "param_bucket", vals[3], "param_offset", vals[4],
                      "runtime_total", (long long)p->runtime_total, "runtime_partition_size",
                      (long long)p->runtime_partition_size, "runtime_slices", vals[5], "ds_param_offset",
                      vals[6], "ds_total", (long long)p->ds_total, "ds_partition_size",
                      (long long)p->ds_partition_size, "ds_slices", vals[7]);
done:
    for (int i = 0; i < 8; i++) Py_XDECREF(vals[i]);
    return d;
}

static PyObject *partition_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 4 || nargs > 6)
        return PyErr_Format(PyExc_TypeError, "partition_plan(numels, world_size, bucket_cap, align, "
                                             "runtime_order=None, param_bucket=None)");
    int64_t world, cap, align;
    if (dsc_arg_int64(args[1], "world_size", &world) < 0 || dsc_arg_int64(args[2], "bucket_cap", &cap) < 0 ||
        dsc_arg_int64(args[3], "align", &align) < 0)
        return NULL;
    if (world < 1) return PyErr_Format(PyExc_ValueError, "world_size must be >= 1, got %lld", (long long)world);
    if (cap < 1) return PyErr_Format(PyExc_ValueError, "bucket_cap must be >= 1, got %lld", (long long)cap);
    if (align < 1) return PyErr_Format(PyExc_ValueError, "align must be >= 1, got %lld", (long long)align);
    Py_ssize_t n = 0, norder = 0;
    int64_t *numels = int_list(args[0], "numels", &n);
    if (!numels) return NULL;
    int64_t *order = NULL, *buckets = NULL;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (numels[i] < 0) {
            PyErr_Format(PyExc_ValueError, "numels[%zd] must be >= 0, got %lld", i, (long long)numels[i]);
            goto done;
        }
    }
    if (nargs >= 5 && args[4] != Py_None) {
        order = int_list(args[4], "runtime_order", &norder);
        if (!order) goto done;
        if (norder != n) {
            PyErr_Format(PyExc_ValueError, "runtime_order has %zd entries but numels has %zd", norder, n);
            goto done;
        }
    }
    if (nargs == 6 && args[5] != Py_None) {
        Py_ssize_t nb = 0;
        buckets = int_list(args[5], "param_bucket", &nb);
        if (!buckets) goto done;
        if (nb != n) {
            PyErr_Format(PyExc_ValueError, "param_bucket has %zd entries but numels has %zd", nb, n);
            goto done;
        }
    }
    dsc_partition_plan plan;
    dsc_partition_status st;
    Py_BEGIN_ALLOW_THREADS
    if (buckets)
        st = dsc_partition_plan_build_bucketed(numels, n, order, world, align, buckets, &plan);
    else
        st = dsc_partition_plan_build(numels, n, order, world, cap, align, &plan);
    Py_END_ALLOW_THREADS
    if (st == DSC_PARTITION_NO_MEMORY) {
        PyErr_NoMemory();
    } else if (st == DSC_PARTITION_BAD_ARG) {
        PyErr_SetString(PyExc_ValueError, buckets ? "runtime_order must be a permutation of range(len(numels)) and "
                                                    "param_bucket must number the buckets 0, 1, ... along it, each "
                                                    "bucket one contiguous run"
                                                  : "runtime_order must be a permutation of range(len(numels))");
    } else {
        result = plan_to_dict(&plan);
        dsc_partition_plan_free(&plan);
    }
done:
    PyMem_Free(numels);
    PyMem_Free(order);
    PyMem_Free(buckets);
    return result;
}

PyMethodDef dsc_partition_methods[] = {
    {"partition_plan", (PyCFunction)(void (*)(void))partition_plan, METH_FASTCALL,
     "partition_plan(numels, world_size, bucket_cap, align, runtime_order=None, param_bucket=None) -> dict: "
     "the ZeRO runtime (bucketed: by bucket_cap, or as param_bucket gives them) and DeepSpeed (contiguous) "
     "partition maps of one parameter group."},
    {NULL, NULL, 0, NULL},
};
