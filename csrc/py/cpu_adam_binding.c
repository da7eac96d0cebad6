/* The cpu_adam op: adam_step(params, grads, exp_avgs, exp_avg_sqs, copies, lr, beta1, beta2, eps,
 * weight_decay, step, bias_correction, adamw_mode) updates every tensor in one pass. */
#include "dsc/cpu_optim_args.h"
#include "dsc/module.h"

/* the typed entry point behind dsc_run_opt_step */
static int run_adam(dsc_opt_tensor *ts, int64_t n, const void *hp) {
    return dsc_cpu_adam_step(ts, n, (const dsc_adam_hparams *)hp);
}

static PyObject *adam_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("adam_step", nargs, 13) < 0) return NULL;
    dsc_adam_hparams hp;
    int64_t bias_correction, adamw_mode;
    if (dsc_arg_double(args[5], "lr", &hp.lr) < 0 || dsc_arg_double(args[6], "beta1", &hp.beta1) < 0 ||
        dsc_arg_double(args[7], "beta2", &hp.beta2) < 0 || dsc_arg_double(args[8], "eps", &hp.eps) < 0 ||
        dsc_arg_double(args[9], "weight_decay", &hp.weight_decay) < 0 ||
        dsc_arg_int64(args[10], "step", &hp.step) < 0 ||
        dsc_arg_int64(args[11], "bias_correction", &bias_correction) < 0 ||
        dsc_arg_int64(args[12], "adamw_mode", &adamw_mode) < 0)
        return NULL;
    if (hp.step < 1) return PyErr_Format(PyExc_ValueError, "argument 'step' must be >= 1, got %lld", (long long)hp.step);
    hp.bias_correction = bias_correction != 0;
    hp.adamw_mode = adamw_mode != 0;
    dsc_opt_tensor *ts;
    Py_ssize_t n;
    if (dsc_parse_opt_lists(args[0], args[1], args[2], "exp_avgs", args[3], "exp_avg_sqs", args[4], &ts, &n) < 0)
        return NULL;
    return dsc_run_opt_step(ts, n, run_adam, &hp);
}

static PyMethodDef methods[] = {
    {"adam_step", (PyCFunction)(void (*)(void))adam_step, METH_FASTCALL,
     "adam_step(params, grads, exp_avgs, exp_avg_sqs, copies, lr, beta1, beta2, eps, weight_decay, step, "
     "bias_correction, adamw_mode): one Adam/AdamW step over lists of CPU tensors (copies: None or a list "
     "receiving the updated params in their own dtype)."},
    DSC_SIMD_METHOD,
    DSC_BUMP_STEPS_METHOD,
    DSC_NUM_THREADS_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR, "deepspeed_c CPU Adam.", -1,
                                        methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
