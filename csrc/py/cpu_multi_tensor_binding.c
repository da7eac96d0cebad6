/* The cpu_multi_tensor op: sumsq(tensors) -> (float, bool found_nonfinite); scale_(tensors, f). */
#include "dsc/cpu_optim_args.h"
#include "dsc/module.h"

static PyObject *sumsq(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("sumsq", nargs, 1) < 0) return NULL;
    dsc_operand *ops;
    int64_t *numels;
    Py_ssize_t n;
    if (dsc_parse_operand_list(args[0], "tensors", &ops, &numels, &n) < 0) return NULL;
    double total = 0.0;
    int bad = 0, rc = 0;
    if (n > 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = dsc_cpu_sumsq(ops, numels, n, &total, &bad);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(ops);
    PyMem_Free(numels);
    if (rc < 0) return PyErr_NoMemory();
    return Py_BuildValue("(dO)", total, bad ? Py_True : Py_False);
}

static PyObject *scale_(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("scale_", nargs, 2) < 0) return NULL;
    double factor;
    if (dsc_arg_double(args[1], "factor", &factor) < 0) return NULL;
    dsc_operand *ops;
    int64_t *numels;
    Py_ssize_t n;
    if (dsc_parse_operand_list(args[0], "tensors", &ops, &numels, &n) < 0) return NULL;
    int rc = 0;
    if (n > 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = dsc_cpu_scale(ops, numels, n, (float)factor);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(ops);
    PyMem_Free(numels);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"sumsq", (PyCFunction)(void (*)(void))sumsq, METH_FASTCALL,
     "sumsq(tensors) -> (sum of squares, found_inf_or_nan) over float32/bfloat16/float16 CPU tensors."},
    {"scale_", (PyCFunction)(void (*)(void))scale_, METH_FASTCALL, "scale_(tensors, factor): x *= factor in place."},
    DSC_SIMD_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR,
                                        "deepspeed_c CPU multi-tensor norm and scale.", -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
