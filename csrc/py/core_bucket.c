/* Python face of the bucket planner (csrc/core/bucket_plan.c). A plan travels as a capsule;
 * bucket_plan_mark() is the hot call, once per gradient with an integer index. */
#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include "dsc/bucket_plan.h"

static const char CAPSULE_NAME[] = "deepspeed_c.bucket_plan";

static void plan_capsule_free(PyObject *capsule) {
    dsc_bucket_plan *p = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    if (p) dsc_bucket_plan_free(p);
    else PyErr_Clear();
}

static dsc_bucket_plan *plan_arg(PyObject *obj) {
    if (!PyCapsule_IsValid(obj, CAPSULE_NAME)) {
        PyErr_SetString(PyExc_TypeError, "plan must be a bucket plan made by bucket_plan()");
        return NULL;
    }
    return PyCapsule_GetPointer(obj, CAPSULE_NAME);
}

static int nargs_between(const char *fname, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi) {
    if (nargs < lo || nargs > hi) {
        if (lo == hi) PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", fname, lo, nargs);
        else PyErr_Format(PyExc_TypeError, "%s() takes %zd to %zd arguments (%zd given)", fname, lo, hi, nargs);
        return -1;
    }
    return 0;
}

static int int64_arg(PyObject *obj, const char *name, int64_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int", name);
        return -1;
    }
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)v;
    return 0;
}

/* A sequence of ints as a PyMem array (NULL with *len 0 for an empty sequence is fine). */
static int int64_seq(PyObject *seq, const char *name, int64_t **out, Py_ssize_t *len) {
    *out = NULL;
    Py_ssize_t n = PySequence_Check(seq) ? PySequence_Size(seq) : -1;
    if (n < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a sequence of ints", name);
        return -1;
    }
    int64_t *a = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    if (!a) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        if (!item) {
            PyMem_Free(a);
            return -1;
        }
        if (!PyLong_Check(item)) {
            Py_DECREF(item);
            PyMem_Free(a);
            PyErr_Format(PyExc_TypeError, "%s[%zd] must be an int", name, i);
            return -1;
        }
        long long v = PyLong_AsLongLong(item);
        Py_DECREF(item);
        if (v == -1 && PyErr_Occurred()) {
            PyMem_Free(a);
            return -1;
        }
        a[i] = (int64_t)v;
    }
    *out = a;
    *len = n;
    return 0;
}

static PyObject *int64_list(const int64_t *a, int64_t n) {
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (!list) return NULL;
    for (int64_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong((long long)a[i]);
        if (!v) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SetItem(list, (Py_ssize_t)i, v);
    }
    return list;
}

/* bucket_plan(numels, cap, order=None, keys=None, align=1, first_cap=0, assignment=None) -> plan */
static PyObject *bucket_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs_between("bucket_plan", nargs, 2, 7) < 0) return NULL;
    int64_t *numels = NULL, *order = NULL, *keys = NULL, *assigned = NULL;
    Py_ssize_t n = 0, n_order = 0, n_keys = 0, n_assigned = 0;
    int64_t cap = 0, align = 1, first_cap = 0;
    PyObject *result = NULL;
    if (int64_seq(args[0], "numels", &numels, &n) < 0) goto done;
    if (int64_arg(args[1], "cap", &cap) < 0) goto done;
    if (nargs > 2 && args[2] != Py_None) {
        if (int64_seq(args[2], "order", &order, &n_order) < 0) goto done;
        if (n_order != n) {
            PyErr_Format(PyExc_ValueError, "order has %zd entries but numels has %zd", n_order, n);
            goto done;
        }
    }
    if (nargs > 3 && args[3] != Py_None) {
        if (int64_seq(args[3], "keys", &keys, &n_keys) < 0) goto done;
        if (n_keys != n) {
            PyErr_Format(PyExc_ValueError, "keys has %zd entries but numels has %zd", n_keys, n);
            goto done;
        }
    }
    if (nargs > 4 && int64_arg(args[4], "align", &align) < 0) goto done;
    if (nargs > 5 && int64_arg(args[5], "first_cap", &first_cap) < 0) goto done;
    if (nargs > 6 && args[6] != Py_None) {
        if (int64_seq(args[6], "assignment", &assigned, &n_assigned) < 0) goto done;
        if (n_assigned != n) {
            PyErr_Format(PyExc_ValueError, "assignment has %zd entries but numels has %zd", n_assigned, n);
            goto done;
        }
    }

    dsc_bucket_plan *plan = NULL;
    const char *why = "invalid argument";
    int rc = assigned ? dsc_bucket_plan_create_assigned((int64_t)n, numels, order, assigned, align, &plan, &why)
                      : dsc_bucket_plan_create((int64_t)n, numels, keys, order, cap, first_cap, align, &plan, &why);
    if (rc == DSC_BP_ENOMEM) {
        PyErr_NoMemory();
        goto done;
    }
    if (rc != DSC_BP_OK) {
        PyErr_Format(PyExc_ValueError, "bucket_plan: %s", why);
        goto done;
    }
    result = PyCapsule_New(plan, CAPSULE_NAME, plan_capsule_free);
    if (!result) dsc_bucket_plan_free(plan);
done:
    PyMem_Free(numels);
    PyMem_Free(order);
    PyMem_Free(keys);
    PyMem_Free(assigned);
    return result;
}

/* bucket_plan_layout(plan) -> (bucket_of, offset_of, bucket_numels, bucket_keys, members) */
static PyObject *bucket_plan_layout(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs_between("bucket_plan_layout", nargs, 1, 1) < 0) return NULL;
    dsc_bucket_plan *p = plan_arg(args[0]);
    if (!p) return NULL;
    int64_t n = dsc_bucket_plan_num_params(p), nb = dsc_bucket_plan_num_buckets(p);
    PyObject *bucket_of = PyList_New((Py_ssize_t)n), *offset_of = PyList_New((Py_ssize_t)n);
    PyObject *numels = PyList_New((Py_ssize_t)nb), *keys = PyList_New((Py_ssize_t)nb);
    PyObject *members = PyList_New((Py_ssize_t)nb);
    if (!bucket_of || !offset_of || !numels || !keys || !members) goto fail;
    for (int64_t i = 0; i < n; i++) {
        PyObject *b = PyLong_FromLongLong((long long)dsc_bucket_plan_bucket_of(p, i));
        if (!b) goto fail;
        PyList_SetItem(bucket_of, (Py_ssize_t)i, b);
        PyObject *o = PyLong_FromLongLong((long long)dsc_bucket_plan_offset_of(p, i));
        if (!o) goto fail;
        PyList_SetItem(offset_of, (Py_ssize_t)i, o);
    }
    for (int64_t b = 0; b < nb; b++) {
        PyObject *v = PyLong_FromLongLong((long long)dsc_bucket_plan_bucket_numel(p, b));
        if (!v) goto fail;
        PyList_SetItem(numels, (Py_ssize_t)b, v);
        PyObject *k = PyLong_FromLongLong((long long)dsc_bucket_plan_bucket_key(p, b));
        if (!k) goto fail;
        PyList_SetItem(keys, (Py_ssize_t)b, k);
        int64_t count = 0;
        const int64_t *m = dsc_bucket_plan_members(p, b, &count);
        PyObject *ml = int64_list(m, count);
        if (!ml) goto fail;
        PyList_SetItem(members, (Py_ssize_t)b, ml);
    }
    return Py_BuildValue("(NNNNN)", bucket_of, offset_of, numels, keys, members);
fail:
    Py_XDECREF(bucket_of);
    Py_XDECREF(offset_of);
    Py_XDECREF(numels);
    Py_XDECREF(keys);
    Py_XDECREF(members);
    return NULL;
}

static PyObject *bucket_plan_reset(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs_between("bucket_plan_reset", nargs, 1, 1) < 0) return NULL;
    dsc_bucket_plan *p = plan_arg(args[0]);
    if (!p) return NULL;
    dsc_bucket_plan_reset(p);
    Py_RETURN_NONE;
}

/* bucket_plan_mark(plan, param) -> frontier: buckets [0, frontier) are ready */
static PyObject *bucket_plan_mark(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "bucket_plan_mark() takes 2 arguments (%zd given)", nargs);
    dsc_bucket_plan *p = plan_arg(args[0]);
    if (!p) return NULL;
    long long i = PyLong_AsLongLong(args[1]);
    if (i == -1 && PyErr_Occurred()) return NULL;
    int64_t f = dsc_bucket_plan_mark(p, (int64_t)i);
    if (f == DSC_BP_ERANGE)
        return PyErr_Format(PyExc_IndexError, "param index %lld out of range for a plan of %lld params", i,
                            (long long)dsc_bucket_plan_num_params(p));
    if (f == DSC_BP_ETWICE)
        return PyErr_Format(PyExc_RuntimeError,
                            "param %lld was marked ready twice in one reduction round "
                            "(a gradient produced twice in one backward?)", i);
    return PyLong_FromLongLong((long long)f);
}

static PyObject *bucket_plan_mark_all(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs_between("bucket_plan_mark_all", nargs, 1, 1) < 0) return NULL;
    dsc_bucket_plan *p = plan_arg(args[0]);
    if (!p) return NULL;
    return PyLong_FromLongLong((long long)dsc_bucket_plan_mark_all(p));
}

static PyObject *bucket_plan_frontier(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs_between("bucket_plan_frontier", nargs, 1, 1) < 0) return NULL;
    dsc_bucket_plan *p = plan_arg(args[0]);
    if (!p) return NULL;
    return PyLong_FromLongLong((long long)dsc_bucket_plan_frontier(p));
}

typedef int64_t (*index_query)(const dsc_bucket_plan *, int64_t *, int64_t);

static PyObject *index_list(PyObject *const *args, Py_ssize_t nargs, const char *fname, index_query q) {
    if (nargs_between(fname, nargs, 1, 1) < 0) return NULL;
    dsc_bucket_plan *p = plan_arg(args[0]);
    if (!p) return NULL;
    int64_t n = dsc_bucket_plan_num_params(p);
    int64_t *buf = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    if (!buf) return PyErr_NoMemory();
    int64_t count = q(p, buf, n);
    PyObject *list = int64_list(buf, count);
    PyMem_Free(buf);
    return list;
}

static PyObject *bucket_plan_pending(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return index_list(args, nargs, "bucket_plan_pending", dsc_bucket_plan_pending);
}

static PyObject *bucket_plan_arrival(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return index_list(args, nargs, "bucket_plan_arrival", dsc_bucket_plan_arrival);
}

#define FASTCALL(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL

PyMethodDef dsc_bucket_methods[] = {
    {"bucket_plan", FASTCALL(bucket_plan),
     "bucket_plan(numels, cap, order=None, keys=None, align=1, first_cap=0, assignment=None) -> plan\n"
     "Plan gradient buckets: params in arrival order `order` (None: reverse registration),\n"
     "a bucket closes once over `cap` elements (bucket 0: `first_cap`, 0 = cap), params with\n"
     "different `keys` never share a bucket; or, with `assignment`, each param's bucket as given."},
    {"bucket_plan_layout", FASTCALL(bucket_plan_layout),
     "bucket_plan_layout(plan) -> (bucket_of, offset_of, bucket_numels, bucket_keys, members)"},
    {"bucket_plan_reset", FASTCALL(bucket_plan_reset), "bucket_plan_reset(plan): start a reduction round."},
    {"bucket_plan_mark", FASTCALL(bucket_plan_mark),
     "bucket_plan_mark(plan, param) -> frontier; buckets below the frontier are ready."},
    {"bucket_plan_mark_all", FASTCALL(bucket_plan_mark_all),
     "bucket_plan_mark_all(plan) -> frontier; marks every pending param ready."},
    {"bucket_plan_frontier", FASTCALL(bucket_plan_frontier), "bucket_plan_frontier(plan) -> frontier"},
    {"bucket_plan_pending", FASTCALL(bucket_plan_pending),
     "bucket_plan_pending(plan) -> params not yet marked this round, in planned order."},
    {"bucket_plan_arrival", FASTCALL(bucket_plan_arrival),
     "bucket_plan_arrival(plan) -> params marked this round, in the order they were marked."},
    {NULL, NULL, 0, NULL},
};
