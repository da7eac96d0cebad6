/* CPU ISA detection for the op builder: what the running CPU (and OS) can execute, so the
 * builder compiles the widest path that will run. */
#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

static PyObject *cpu_features(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    (void)args;
    if (nargs != 0) return PyErr_Format(PyExc_TypeError, "cpu_features() takes no arguments");
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return Py_BuildValue("{s:O,s:O,s:O,s:O,s:O,s:O,s:O}",
                         "avx2", __builtin_cpu_supports("avx2") ? Py_True : Py_False,
                         "fma", __builtin_cpu_supports("fma") ? Py_True : Py_False,
                         "f16c", __builtin_cpu_supports("f16c") ? Py_True : Py_False,
                         "avx512f", __builtin_cpu_supports("avx512f") ? Py_True : Py_False,
                         "avx512bw", __builtin_cpu_supports("avx512bw") ? Py_True : Py_False,
                         "avx512vl", __builtin_cpu_supports("avx512vl") ? Py_True : Py_False,
                         "avx512bf16", __builtin_cpu_supports("avx512bf16") ? Py_True : Py_False);
#else
    return PyDict_New();
#endif
}

PyMethodDef dsc_cpu_features_methods[] = {
    {"cpu_features", (PyCFunction)(void (*)(void))cpu_features, METH_FASTCALL,
     "cpu_features() -> dict of ISA extension name to bool for the running CPU."},
    {NULL, NULL, 0, NULL},
};
