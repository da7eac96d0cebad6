/* The cpu_lion op: lion_step(params, grads, exp_avgs, copies, lr, beta1, beta2, weight_decay). */
#include "dsc/cpu_optim_args.h"
#include "dsc/module.h"

/* the typed entry point behind dsc_run_opt_step */
static int run_lion(dsc_opt_tensor *ts, int64_t n, const void *hp) {
    return dsc_cpu_lion_step(ts, n, (const dsc_lion_hparams *)hp);
}

static PyObject *lion_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("lion_step", nargs, 8) < 0) return NULL;
    dsc_lion_hparams hp;
    if (dsc_arg_double(args[4], "lr", &hp.lr) < 0 || dsc_arg_double(args[5], "beta1", &hp.beta1) < 0 ||
        dsc_arg_double(args[6], "beta2", &hp.beta2) < 0 ||
        dsc_arg_double(args[7], "weight_decay", &hp.weight_decay) < 0)
        return NULL;
    dsc_opt_tensor *ts;
    Py_ssize_t n;
    if (dsc_parse_opt_lists(args[0], args[1], args[2], "exp_avgs", NULL, NULL, args[3], &ts, &n) < 0) return NULL;
    return dsc_run_opt_step(ts, n, run_lion, &hp);
}

static PyMethodDef methods[] = {
    {"lion_step", (PyCFunction)(void (*)(void))lion_step, METH_FASTCALL,
     "lion_step(params, grads, exp_avgs, copies, lr, beta1, beta2, weight_decay)"},
    DSC_SIMD_METHOD,
    DSC_BUMP_STEPS_METHOD,
    DSC_NUM_THREADS_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR, "deepspeed_c CPU Lion.", -1,
                                        methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
