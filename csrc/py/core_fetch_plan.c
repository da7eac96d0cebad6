/* Python face of the ZeRO-3 fetch planner (csrc/core/fetch_plan.c).
 *
 * _C.fetch_plan(steps, numels, persistent, prefetch_bucket_size, max_live_parameters,
 *               max_reuse_distance[, min_prefetch_batch]) -> (fetch, release, live_after_fetch,
 *               live_after_release, cap, peak)
 *
 *   fetch[i]    list of groups (lists of unit ids); group 0 is step i's own missing units
 *   release[i]  unit ids to release after step i
 * The plan is built with the GIL released, then replayed by dsc_fetch_plan_simulate as a
 * self-check (a failure there is a planner bug: RuntimeError). */
#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include "dsc/fetch_plan.h"

static int int64_arg(PyObject *obj, const char *name, int64_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, got %R", name, (PyObject *)Py_TYPE(obj));
        return -1;
    }
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be >= 0, got %lld", name, v);
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

/* Borrowed item k of a list or tuple (the caller checked which). */
static PyObject *item_of(PyObject *seq, Py_ssize_t k) {
    return PyList_Check(seq) ? PyList_GetItem(seq, k) : PyTuple_GetItem(seq, k);
}

static Py_ssize_t list_or_tuple_len(PyObject *seq) {
    return PyList_Check(seq) ? PyList_Size(seq) : PyTuple_Check(seq) ? PyTuple_Size(seq) : -1;
}

static int item_int64(PyObject *item, int64_t *out, const char *name, Py_ssize_t i, Py_ssize_t j) {
    if (!PyLong_Check(item)) {
        if (j < 0) PyErr_Format(PyExc_TypeError, "%s[%zd] must be an int, got %R", name, i, (PyObject *)Py_TYPE(item));
        else PyErr_Format(PyExc_TypeError, "%s[%zd][%zd] must be an int, got %R", name, i, j, (PyObject *)Py_TYPE(item));
        return -1;
    }
    long long v = PyLong_AsLongLong(item);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)v;
    return 0;
}

/* steps as CSR (PyMem arrays). */
static int parse_steps(PyObject *steps, int64_t **start_out, int64_t **units_out, Py_ssize_t *n_out) {
    Py_ssize_t n = list_or_tuple_len(steps);
    if (n < 0) {
        PyErr_Format(PyExc_TypeError, "steps must be a list of lists of unit ids, got %R", (PyObject *)Py_TYPE(steps));
        return -1;
    }
    int64_t *start = PyMem_Malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (!start) {
        PyErr_NoMemory();
        return -1;
    }
    start[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *step = item_of(steps, i);
        Py_ssize_t m = list_or_tuple_len(step);
        if (m < 0) {
            PyErr_Format(PyExc_TypeError, "steps[%zd] must be a list of unit ids, got %R", i, (PyObject *)Py_TYPE(step));
            PyMem_Free(start);
            return -1;
        }
        start[i + 1] = start[i] + m;
    }
    int64_t *units = PyMem_Malloc(sizeof(int64_t) * (size_t)(start[n] > 0 ? start[n] : 1));
    if (!units) {
        PyMem_Free(start);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *step = item_of(steps, i);
        for (Py_ssize_t j = 0; j < (Py_ssize_t)(start[i + 1] - start[i]); j++) {
            if (item_int64(item_of(step, j), &units[start[i] + j], "steps", i, j) < 0) {
                PyMem_Free(start);
                PyMem_Free(units);
                return -1;
            }
        }
    }
    *start_out = start;
    *units_out = units;
    *n_out = n;
    return 0;
}

static PyObject *id_list(const int64_t *v, int64_t n) {
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (!list) return NULL;
    for (int64_t k = 0; k < n; k++) {
        PyObject *x = PyLong_FromLongLong((long long)v[k]);
        if (!x) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SetItem(list, (Py_ssize_t)k, x);
    }
    return list;
}

static PyObject *plan_to_tuple(const dsc_fetch_plan *p, int64_t peak) {
    int64_t S = dsc_fetch_plan_num_steps(p);
    PyObject *fetch = PyList_New((Py_ssize_t)S), *release = PyList_New((Py_ssize_t)S);
    PyObject *lf = PyList_New((Py_ssize_t)S), *lr = PyList_New((Py_ssize_t)S), *cap = PyList_New((Py_ssize_t)S);
    if (!fetch || !release || !lf || !lr || !cap) goto fail;
    for (int64_t i = 0; i < S; i++) {
        int64_t ng = dsc_fetch_plan_num_groups(p, i), n = 0;
        PyObject *groups = PyList_New((Py_ssize_t)ng);
        if (!groups) goto fail;
        PyList_SetItem(fetch, (Py_ssize_t)i, groups);
        for (int64_t g = 0; g < ng; g++) {
            const int64_t *units = dsc_fetch_plan_group(p, i, g, &n);
            PyObject *gl = id_list(units, n);
            if (!gl) goto fail;
            PyList_SetItem(groups, (Py_ssize_t)g, gl);
        }
        const int64_t *rel = dsc_fetch_plan_release(p, i, &n);
        PyObject *rl = id_list(rel, n);
        if (!rl) goto fail;
        PyList_SetItem(release, (Py_ssize_t)i, rl);
        PyObject *a = PyLong_FromLongLong((long long)dsc_fetch_plan_live_after_fetch(p, i));
        if (!a) goto fail;
        PyList_SetItem(lf, (Py_ssize_t)i, a);
        PyObject *b = PyLong_FromLongLong((long long)dsc_fetch_plan_live_after_release(p, i));
        if (!b) goto fail;
        PyList_SetItem(lr, (Py_ssize_t)i, b);
        PyObject *c = PyLong_FromLongLong((long long)dsc_fetch_plan_step_cap(p, i));
        if (!c) goto fail;
        PyList_SetItem(cap, (Py_ssize_t)i, c);
    }
    return Py_BuildValue("(NNNNNL)", fetch, release, lf, lr, cap, (long long)peak);
fail:
    Py_XDECREF(fetch);
    Py_XDECREF(release);
    Py_XDECREF(lf);
    Py_XDECREF(lr);
    Py_XDECREF(cap);
    return NULL;
}

static PyObject *fetch_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 && nargs != 7)
        return PyErr_Format(PyExc_TypeError, "fetch_plan(steps, numels, persistent, prefetch_bucket_size, "
                                             "max_live_parameters, max_reuse_distance[, min_prefetch_batch]) takes 6 "
                                             "or 7 arguments (%zd given)",
                            nargs);
    int64_t bucket, max_live, max_reuse, min_batch = 0;
    if (int64_arg(args[3], "prefetch_bucket_size", &bucket) < 0 ||
        int64_arg(args[4], "max_live_parameters", &max_live) < 0 ||
        int64_arg(args[5], "max_reuse_distance", &max_reuse) < 0 ||
        (nargs == 7 && int64_arg(args[6], "min_prefetch_batch", &min_batch) < 0))
        return NULL;
    Py_ssize_t U = list_or_tuple_len(args[1]);
    if (U < 0)
        return PyErr_Format(PyExc_TypeError, "numels must be a list of ints, got %R", (PyObject *)Py_TYPE(args[1]));
    if (args[2] != Py_None) {
        Py_ssize_t np = list_or_tuple_len(args[2]);
        if (np < 0)
            return PyErr_Format(PyExc_TypeError, "persistent must be a list of bools or None, got %R",
                                (PyObject *)Py_TYPE(args[2]));
        if (np != U)
            return PyErr_Format(PyExc_ValueError, "persistent has %zd entries but numels has %zd", np, U);
    }
    int64_t *numels = PyMem_Malloc(sizeof(int64_t) * (size_t)(U > 0 ? U : 1));
    unsigned char *pers = PyMem_Malloc((size_t)(U > 0 ? U : 1));
    int64_t *start = NULL, *units = NULL;
    PyObject *result = NULL;
    if (!numels || !pers) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t u = 0; u < U; u++) {
        if (item_int64(item_of(args[1], u), &numels[u], "numels", u, -1) < 0) goto done;
        if (numels[u] < 0) {
            PyErr_Format(PyExc_ValueError, "numels[%zd] must be >= 0, got %lld", u, (long long)numels[u]);
            goto done;
        }
        int t = args[2] == Py_None ? 0 : PyObject_IsTrue(item_of(args[2], u));
        if (t < 0) goto done;
        pers[u] = (unsigned char)t;
    }
    Py_ssize_t S = 0;
    if (parse_steps(args[0], &start, &units, &S) < 0) goto done;

    dsc_fetch_plan *plan = NULL;
    char err[256] = {0};
    int rc;
    int64_t peak = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_fetch_plan_build_batched((int64_t)S, start, units, (int64_t)U, numels, pers, bucket, max_live, max_reuse,
                                      min_batch, &plan, err, sizeof err);
    if (rc == DSC_FP_OK) rc = dsc_fetch_plan_simulate(plan, start, units, numels, pers, &peak, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (rc == DSC_FP_ENOMEM) PyErr_NoMemory();
    else if (rc == DSC_FP_EPLAN)
        PyErr_Format(PyExc_RuntimeError, "fetch_plan: the planner made a plan that breaks its contract (%s); "
                                         "please report this with the trace", err);
    else if (rc != DSC_FP_OK) PyErr_Format(PyExc_ValueError, "fetch_plan: %s", err);
    else result = plan_to_tuple(plan, peak);
    dsc_fetch_plan_free(plan);
done:
    PyMem_Free(numels);
    PyMem_Free(pers);
    PyMem_Free(start);
    PyMem_Free(units);
    return result;
}

PyMethodDef dsc_fetch_plan_methods[] = {
    {"fetch_plan", (PyCFunction)(void (*)(void))fetch_plan, METH_FASTCALL,
     "fetch_plan(steps, numels, persistent, prefetch_bucket_size, max_live_parameters, max_reuse_distance"
     "[, min_prefetch_batch]) -> "
     "(fetch, release, live_after_fetch, live_after_release, cap, peak): the ZeRO-3 gather/release plan of a "
     "recorded trace (see csrc/include/dsc/fetch_plan.h)."},
    {NULL, NULL, 0, NULL},
};
