/* Binding of the fused_lamb op: multi-tensor LAMB (DeepSpeed's FusedLamb arithmetic) over
 * parallel tensor lists, three launches per call, on torch's current stream. */
#include "dsc/cuda_binding_util.h"
#include "dsc/cuda_lamb.h"
#include "dsc/module.h"

#define ANY_FLOAT (DSC_F32 | DSC_F16 | DSC_BF16)

static const dsc_mt_slot_spec SLOTS[5] = {
    {"grads", ANY_FLOAT, 0},    {"params", ANY_FLOAT, 0},  {"exp_avgs", DSC_F32, 0},
    {"exp_avg_sqs", DSC_F32, 0}, {"out_params", DSC_F16 | DSC_BF16, 1},
};

static PyObject *multi_tensor_lamb(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("multi_tensor_lamb", nargs, 18) < 0) return NULL;
    static const char *const names[] = {"lr", "beta1", "beta2", "eps"};
    static const char *const names2[] = {"weight_decay", "max_coeff", "min_coeff", "grad_scale"};
    double f[4], f2[4];
    int64_t step;
    int eps_inside, bc;
    if (dsc_float_args(args + 7, names, 4, f) < 0 || dsc_arg_int64(args[11], "step", &step) < 0 ||
        dsc_flag_arg(args[12], "eps_inside_sqrt", &eps_inside) < 0 ||
        dsc_flag_arg(args[13], "bias_correction", &bc) < 0 || dsc_float_args(args + 14, names2, 4, f2) < 0)
        return NULL;
    if (step < 1) return PyErr_Format(PyExc_ValueError, "argument 'step' must be >= 1, got %lld", (long long)step);
    if (f2[3] == 0.0) return PyErr_Format(PyExc_ValueError, "argument 'grad_scale' must be non-zero");
    dsc_mt_tensor *t;
    int64_t n;
    int dev;
    if (dsc_mt_gather(args, SLOTS, 5, &t, &n, &dev) < 0) return NULL;
    int rc = 0;
    if (dsc_mt_check_master(t, n, args[4], 1, "params", "out_params") < 0) goto fail;
    if (n > 0) {
        void *coeff, *scratch;
        if (dsc_cuda_buffer_arg(args[5], "coeff_out", DSC_F32, n, &dev, 0, &coeff) < 0 ||
            dsc_cuda_buffer_arg(args[6], "scratch", DSC_F64, 2 * n, &dev, 0, &scratch) < 0)
            goto fail;
        cudaStream_t stream;
        if (dsc_cuda_stream_arg(dev, &stream) < 0) goto fail;
        const dsc_lamb_params hp = {(float)f[0],  f[1],         f[2],         (float)f[3],
                                    (float)f2[0], (float)f2[1], (float)f2[2], eps_inside,
                                    bc,           step,         (float)f2[3]};
        rc = dsc_cuda_lamb(t, n, &hp, (float *)coeff, (double *)scratch, dev, stream);
    }
    PyMem_Free(t);
    if (dsc_cuda_check(rc, "multi_tensor_lamb") < 0) return NULL;
    Py_RETURN_NONE;
fail:
    PyMem_Free(t);
    return NULL;
}

static PyMethodDef methods[] = {
    {"multi_tensor_lamb", (PyCFunction)(void (*)(void))multi_tensor_lamb, METH_FASTCALL,
     "multi_tensor_lamb(grads, params, exp_avgs, exp_avg_sqs, out_params, coeff_out, scratch, lr, beta1,\n"
     "                  beta2, eps, step, eps_inside_sqrt, bias_correction, weight_decay, max_coeff,\n"
     "                  min_coeff, grad_scale)\n"
     "LAMB step over parallel lists of CUDA tensors, in place. coeff_out: float32[n] receives each\n"
     "tensor's trust ratio; scratch: float64[2n] workspace."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR,
                                        "deepspeed_c fused_lamb op: multi-tensor LAMB on CUDA.", -1, methods,
                                        NULL, NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
