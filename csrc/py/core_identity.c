/* Identity checks over Python lists, for caches kept between optimizer steps (the fused
 * optimizers' launch plans): is every object still the one recorded? A Python loop pays a
 * bytecode dispatch and an int allocation per item (id()); these compare pointers. */
#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

static int seq_len(PyObject *seq, const char *name, Py_ssize_t *n) {
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "argument '%s' must be a list or tuple, got %R", name,
                     (PyObject *)Py_TYPE(seq));
        return -1;
    }
    *n = PySequence_Size(seq);
    return *n < 0 ? -1 : 0;
}

/* borrowed item i of a list or tuple */
static PyObject *item(PyObject *seq, Py_ssize_t i) {
    return PyList_Check(seq) ? PyList_GetItem(seq, i) : PyTuple_GetItem(seq, i);
}

static PyObject *same_objects(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "same_objects(a, b) takes 2 arguments, got %zd", nargs);
    Py_ssize_t n, m;
    if (seq_len(args[0], "a", &n) < 0 || seq_len(args[1], "b", &m) < 0) return NULL;
    if (n != m) Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = item(args[0], i), *y = item(args[1], i);
        if (!x || !y) return NULL;
        if (x != y) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyObject *entries_are(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "entries_are(dicts, key, expected) takes 3 arguments, got %zd", nargs);
    Py_ssize_t n, m;
    if (seq_len(args[0], "dicts", &n) < 0 || seq_len(args[2], "expected", &m) < 0) return NULL;
    if (n != m) Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = item(args[0], i), *want = item(args[2], i);
        if (!d || !want) return NULL;
        if (!PyDict_Check(d))
            return PyErr_Format(PyExc_TypeError, "argument 'dicts[%zd]' must be a dict, got %R", i,
                                (PyObject *)Py_TYPE(d));
        PyObject *got = PyDict_GetItemWithError(d, args[1]); /* borrowed */
        if (!got && PyErr_Occurred()) return NULL;
        if (got != want) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyObject *any_none(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 1) return PyErr_Format(PyExc_TypeError, "any_none(seq) takes 1 argument, got %zd", nargs);
    Py_ssize_t n;
    if (seq_len(args[0], "seq", &n) < 0) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = item(args[0], i);
        if (!x) return NULL;
        if (x == Py_None) Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

PyMethodDef dsc_identity_methods[] = {
    {"same_objects", (PyCFunction)(void (*)(void))same_objects, METH_FASTCALL,
     "same_objects(a, b) -> bool: same length and a[i] is b[i] for every i."},
    {"entries_are", (PyCFunction)(void (*)(void))entries_are, METH_FASTCALL,
     "entries_are(dicts, key, expected) -> bool: dicts[i].get(key) is expected[i] for every i."},
    {"any_none", (PyCFunction)(void (*)(void))any_none, METH_FASTCALL,
     "any_none(seq) -> bool: some item is None."},
    {NULL, NULL, 0, NULL},
};
