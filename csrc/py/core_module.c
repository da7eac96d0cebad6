/* deepspeed_c._C: the always-present core module. Each core's bindings live in their own
 * csrc/py/core_<thing>.c and export a NULL-terminated method table registered below. */
#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

extern PyMethodDef dsc_view_methods[];
extern PyMethodDef dsc_cpu_features_methods[];
extern PyMethodDef dsc_bucket_methods[];
extern PyMethodDef dsc_partition_methods[];
extern PyMethodDef dsc_fetch_plan_methods[];
extern PyMethodDef dsc_pipe_schedule_methods[];
extern PyMethodDef dsc_identity_methods[];
extern PyMethodDef dsc_index_merge_methods[];
extern PyMethodDef dsc_host_memory_methods[];

static PyMethodDef *const dsc_core_tables[] = {
    dsc_view_methods,
    dsc_cpu_features_methods,
    dsc_bucket_methods,
    dsc_partition_methods,
    dsc_fetch_plan_methods,
    dsc_pipe_schedule_methods,
    dsc_identity_methods,
    dsc_index_merge_methods,
    dsc_host_memory_methods,
    NULL,
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    "deepspeed_c._C",
    "deepspeed_c's core C module: the tensor boundary and the pure-C cores.",
    -1,
    NULL,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__C(void) {
    PyObject *m = PyModule_Create(&core_module);
    if (!m) return NULL;
    for (int i = 0; dsc_core_tables[i]; i++) {
        if (PyModule_AddFunctions(m, dsc_core_tables[i]) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
