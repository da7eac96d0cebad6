/* Python face of the pipeline schedule core (csrc/core/pipe_schedule.c, pipe_partition.c).
 *
 * _C.pipe_schedule(kind, micro_batches, stages, stage_id, virtual_stages)
 *     -> (steps, num_buffers); steps is a list (one per step) of lists of
 *        (opcode, buffer_id, micro_batch, chunk) tuples
 * _C.pipe_simulate(kind, micro_batches, stages, virtual_stages) -> (makespan, bubble_fraction)
 * _C.pipe_partition_uniform(num_items, num_parts) -> list of num_parts + 1 boundaries
 * _C.pipe_partition_balanced(weights, num_parts) -> list of num_parts + 1 boundaries
 * Bad arguments raise ValueError/TypeError with the core's message. */
#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include "dsc/pipe_schedule.h"

static int ll_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *fn, long long *out) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", fn, want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        if (!PyLong_Check(args[i])) {
            PyErr_Format(PyExc_TypeError, "%s: argument %zd must be an int, got %R", fn, i,
                         (PyObject *)Py_TYPE(args[i]));
            return -1;
        }
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static PyObject *raise_core(int rc, const char *err) {
    if (rc == DSC_PS_ENOMEM) return PyErr_NoMemory();
    PyErr_SetString(rc == DSC_PS_EINVAL ? PyExc_ValueError : PyExc_RuntimeError, err[0] ? err : "pipeline schedule error");
    return NULL;
}

static PyObject *steps_to_list(const dsc_pipe_plan *plan) {
    PyObject *steps = PyList_New((Py_ssize_t)plan->num_steps);
    if (!steps) return NULL;
    for (int64_t t = 0; t < plan->num_steps; t++) {
        int64_t a = plan->step_start[t], b = plan->step_start[t + 1];
        PyObject *step = PyList_New((Py_ssize_t)(b - a));
        if (!step) goto fail;
        PyList_SetItem(steps, (Py_ssize_t)t, step); /* steals */
        for (int64_t i = a; i < b; i++) {
            const dsc_pipe_instr *in = &plan->instrs[i];
            PyObject *tup = Py_BuildValue("(iiii)", in->op, in->buffer_id, in->micro_batch, in->chunk);
            if (!tup) goto fail;
            PyList_SetItem(step, (Py_ssize_t)(i - a), tup);
        }
    }
    return steps;
fail:
    Py_DECREF(steps);
    return NULL;
}

static PyObject *pipe_schedule(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long v[5];
    if (ll_args(args, nargs, 5, "pipe_schedule", v) < 0) return NULL;
    dsc_pipe_plan plan;
    char err[256] = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_pipe_plan_build((int)v[0], v[1], v[2], v[3], v[4], &plan, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (rc) return raise_core(rc, err);
    PyObject *steps = steps_to_list(&plan);
    long long nbuf = (long long)plan.num_buffers;
    dsc_pipe_plan_free(&plan);
    if (!steps) return NULL;
    return Py_BuildValue("(NL)", steps, nbuf);
}

static PyObject *pipe_simulate(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long v[4];
    if (ll_args(args, nargs, 4, "pipe_simulate", v) < 0) return NULL;
    double span = 0, bubble = 0;
    char err[256] = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_pipe_simulate((int)v[0], v[1], v[2], v[3], &span, &bubble, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (rc) return raise_core(rc, err);
    return Py_BuildValue("(dd)", span, bubble);
}

static PyObject *parts_list(const int64_t *parts, long long m) {
    PyObject *out = PyList_New((Py_ssize_t)(m + 1));
    if (!out) return NULL;
    for (long long p = 0; p <= m; p++) {
        PyObject *x = PyLong_FromLongLong((long long)parts[p]);
        if (!x) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SetItem(out, (Py_ssize_t)p, x);
    }
    return out;
}

static PyObject *pipe_partition_uniform(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long v[2];
    if (ll_args(args, nargs, 2, "pipe_partition_uniform", v) < 0) return NULL;
    if (v[0] < 0 || v[1] < 1 || v[1] > (1LL << 30)) {
        PyErr_Format(PyExc_ValueError, "partition_uniform needs num_items >= 0 and num_parts >= 1, got %lld, %lld",
                     v[0], v[1]);
        return NULL;
    }
    int64_t *parts = PyMem_Malloc(sizeof(int64_t) * (size_t)(v[1] + 1));
    if (!parts) return PyErr_NoMemory();
    dsc_pipe_partition_uniform(v[0], v[1], parts);
    PyObject *out = parts_list(parts, v[1]);
    PyMem_Free(parts);
    return out;
}

static PyObject *pipe_partition_balanced(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "pipe_partition_balanced takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *seq = args[0];
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "weights must be a list or tuple of numbers, got %R", (PyObject *)Py_TYPE(seq));
        return NULL;
    }
    long long m = PyLong_Check(args[1]) ? PyLong_AsLongLong(args[1]) : -1;
    if (m < 1 || m > (1LL << 30)) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "num_parts must be an int >= 1, got %R", args[1]);
        return NULL;
    }
    Py_ssize_t n = PySequence_Size(seq);
    if (n < 0) return NULL;
    double *w = PyMem_Malloc(sizeof(double) * (size_t)(n ? n : 1));
    int64_t *parts = PyMem_Malloc(sizeof(int64_t) * (size_t)(m + 1));
    PyObject *out = NULL;
    if (!w || !parts) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_Check(seq) ? PyList_GetItem(seq, i) : PyTuple_GetItem(seq, i); /* borrowed */
        if (!item) goto done;
        w[i] = PyFloat_AsDouble(item);
        if (w[i] == -1.0 && PyErr_Occurred()) goto done;
    }
    char err[256] = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_pipe_partition_balanced(w, (int64_t)n, (int64_t)m, parts, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (rc) {
        raise_core(rc, err);
        goto done;
    }
    out = parts_list(parts, m);
done:
    PyMem_Free(w);
    PyMem_Free(parts);
    return out;
}

PyMethodDef dsc_pipe_schedule_methods[] = {
    {"pipe_schedule", (PyCFunction)(void (*)(void))pipe_schedule, METH_FASTCALL,
     "pipe_schedule(kind, micro_batches, stages, stage_id, virtual_stages) -> (steps, num_buffers)"},
    {"pipe_simulate", (PyCFunction)(void (*)(void))pipe_simulate, METH_FASTCALL,
     "pipe_simulate(kind, micro_batches, stages, virtual_stages) -> (makespan, bubble_fraction)"},
    {"pipe_partition_uniform", (PyCFunction)(void (*)(void))pipe_partition_uniform, METH_FASTCALL,
     "pipe_partition_uniform(num_items, num_parts) -> boundaries"},
    {"pipe_partition_balanced", (PyCFunction)(void (*)(void))pipe_partition_balanced, METH_FASTCALL,
     "pipe_partition_balanced(weights, num_parts) -> boundaries"},
    {NULL, NULL, 0, NULL},
};
