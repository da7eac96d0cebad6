/* Binding of the fused_adam op (DeepSpeed's `multi_tensor_adam`): Adam/AdamW over parallel
 * tensor lists in one launch per dtype group, on torch's current stream. */
#include "dsc/cuda_adam.h"
#include "dsc/cuda_binding_util.h"
#include "dsc/module.h"

#define ANY_FLOAT (DSC_F32 | DSC_F16 | DSC_BF16)

static const dsc_mt_slot_spec SLOTS[5] = {
    {"grads", ANY_FLOAT, 0},    {"params", ANY_FLOAT, 0},  {"exp_avgs", DSC_F32, 0},
    {"exp_avg_sqs", DSC_F32, 0}, {"out_params", DSC_F16 | DSC_BF16, 1},
};

static PyObject *multi_tensor_adam(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("multi_tensor_adam", nargs, 14) < 0) return NULL;
    static const char *const names[] = {"lr", "beta1", "beta2", "eps"};
    double f[4], wd, gs;
    int64_t step;
    int w_mode, bc;
    if (dsc_float_args(args + 5, names, 4, f) < 0 || dsc_arg_int64(args[9], "step", &step) < 0 ||
        dsc_flag_arg(args[10], "adam_w_mode", &w_mode) < 0 || dsc_flag_arg(args[11], "bias_correction", &bc) < 0 ||
        dsc_arg_double(args[12], "weight_decay", &wd) < 0 || dsc_arg_double(args[13], "grad_scale", &gs) < 0)
        return NULL;
    if (step < 1) return PyErr_Format(PyExc_ValueError, "argument 'step' must be >= 1, got %lld", (long long)step);
    if (gs == 0.0) return PyErr_Format(PyExc_ValueError, "argument 'grad_scale' must be non-zero");
    dsc_mt_tensor *t;
    int64_t n;
    int dev;
    if (dsc_mt_gather(args, SLOTS, 5, &t, &n, &dev) < 0) return NULL;
    int rc = 0;
    if (dsc_mt_check_master(t, n, args[4], 1, "params", "out_params") < 0) goto fail;
    if (n > 0) {
        cudaStream_t stream;
        if (dsc_cuda_stream_arg(dev, &stream) < 0) goto fail;
        const dsc_adam_params hp = {(float)f[0], f[1], f[2], (float)f[3], (float)wd,
                                    w_mode, bc, step, (float)gs};
        rc = dsc_cuda_adam(t, n, &hp, dev, stream);
    }
    PyMem_Free(t);
    if (dsc_cuda_check(rc, "multi_tensor_adam") < 0) return NULL;
    Py_RETURN_NONE;
fail:
    PyMem_Free(t);
    return NULL;
}

static PyMethodDef methods[] = {
    {"multi_tensor_adam", (PyCFunction)(void (*)(void))multi_tensor_adam, METH_FASTCALL,
     "multi_tensor_adam(grads, params, exp_avgs, exp_avg_sqs, out_params, lr, beta1, beta2, eps, step,\n"
     "                  adam_w_mode, bias_correction, weight_decay, grad_scale)\n"
     "Adam/AdamW step over parallel lists of CUDA tensors, in place, on torch's current stream.\n"
     "exp_avgs/exp_avg_sqs are float32; out_params (or None) receives a float16/bfloat16 copy of\n"
     "float32 params. Gradients are divided by grad_scale first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR,
                                        "deepspeed_c fused_adam op: multi-tensor Adam/AdamW on CUDA.", -1,
                                        methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
