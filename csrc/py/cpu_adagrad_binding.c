/* The cpu_adagrad op: adagrad_step(params, grads, sums, copies, lr, eps, weight_decay). */
#include "dsc/cpu_optim_args.h"
#include "dsc/module.h"

/* the typed entry point behind dsc_run_opt_step */
static int run_adagrad(dsc_opt_tensor *ts, int64_t n, const void *hp) {
    return dsc_cpu_adagrad_step(ts, n, (const dsc_adagrad_hparams *)hp);
}

static PyObject *adagrad_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("adagrad_step", nargs, 7) < 0) return NULL;
    dsc_adagrad_hparams hp;
    if (dsc_arg_double(args[4], "lr", &hp.lr) < 0 || dsc_arg_double(args[5], "eps", &hp.eps) < 0 ||
        dsc_arg_double(args[6], "weight_decay", &hp.weight_decay) < 0)
        return NULL;
    dsc_opt_tensor *ts;
    Py_ssize_t n;
    if (dsc_parse_opt_lists(args[0], args[1], args[2], "sums", NULL, NULL, args[3], &ts, &n) < 0) return NULL;
    return dsc_run_opt_step(ts, n, run_adagrad, &hp);
}

static PyMethodDef methods[] = {
    {"adagrad_step", (PyCFunction)(void (*)(void))adagrad_step, METH_FASTCALL,
     "adagrad_step(params, grads, sums, copies, lr, eps, weight_decay)"},
    DSC_SIMD_METHOD,
    DSC_BUMP_STEPS_METHOD,
    DSC_NUM_THREADS_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR, "deepspeed_c CPU Adagrad.", -1,
                                        methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
