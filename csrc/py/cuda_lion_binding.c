/* Binding of the fused_lion op (DeepSpeed's `multi_tensor_lion`): Lion over parallel tensor
 * lists in one launch per dtype group, on torch's current stream. */
#include "dsc/cuda_binding_util.h"
#include "dsc/cuda_lion.h"
#include "dsc/module.h"

#define ANY_FLOAT (DSC_F32 | DSC_F16 | DSC_BF16)

static const dsc_mt_slot_spec SLOTS[4] = {
    {"grads", ANY_FLOAT, 0},
    {"params", ANY_FLOAT, 0},
    {"exp_avgs", DSC_F32, 0},
    {"out_params", DSC_F16 | DSC_BF16, 1},
};

static PyObject *multi_tensor_lion(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("multi_tensor_lion", nargs, 8) < 0) return NULL;
    static const char *const names[] = {"lr", "beta1", "beta2", "weight_decay"};
    double f[4];
    if (dsc_float_args(args + 4, names, 4, f) < 0) return NULL;
    dsc_mt_tensor *t;
    int64_t n;
    int dev;
    if (dsc_mt_gather(args, SLOTS, 4, &t, &n, &dev) < 0) return NULL;
    int rc = 0;
    if (dsc_mt_check_master(t, n, args[3], 1, "params", "out_params") < 0) goto fail;
    if (n > 0) {
        cudaStream_t stream;
        if (dsc_cuda_stream_arg(dev, &stream) < 0) goto fail;
        const dsc_lion_params hp = {(float)f[0], f[1], f[2], (float)f[3]};
        rc = dsc_cuda_lion(t, n, &hp, dev, stream);
    }
    PyMem_Free(t);
    if (dsc_cuda_check(rc, "multi_tensor_lion") < 0) return NULL;
    Py_RETURN_NONE;
fail:
    PyMem_Free(t);
    return NULL;
}

static PyMethodDef methods[] = {
    {"multi_tensor_lion", (PyCFunction)(void (*)(void))multi_tensor_lion, METH_FASTCALL,
     "multi_tensor_lion(grads, params, exp_avgs, out_params, lr, beta1, beta2, weight_decay)\n"
     "Lion step over parallel lists of CUDA tensors, in place, on torch's current stream."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR,
                                        "deepspeed_c fused_lion op: multi-tensor Lion on CUDA.", -1, methods,
                                        NULL, NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
