/* The cpu_adam op: adam_step(params, grads, exp_avgs, exp_avg_sqs, copies, lr, beta1, beta2, eps,
 * weight_decay, step, bias_correction, adamw_mode[, grad_scale]) updates every tensor in one pass. */
#include "dsc/cpu_optim_args.h"  /* first: it includes Python.h, which must precede the system headers */
#include "dsc/module.h"

#include <math.h>

/* The optional trailing grad_scale argument (args[at] when nargs > at; else 1.0); -1 with an exception set. */
static int parse_grad_scale(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t at, double *out) {
    *out = 1.0;
    if (nargs <= at) return 0;
    if (dsc_arg_double(args[at], "grad_scale", out) < 0) return -1;
    if (!isfinite(*out)) {
        PyErr_Format(PyExc_ValueError, "argument 'grad_scale' must be finite, got %R", args[at]);
        return -1;
    }
    return 0;
}

/* the typed entry point behind dsc_run_opt_step */
static int run_adam(dsc_opt_tensor *ts, int64_t n, const void *hp) {
    return dsc_cpu_adam_step(ts, n, (const dsc_adam_hparams *)hp);
}

static PyObject *adam_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 13 && nargs != 14)
        return PyErr_Format(PyExc_TypeError, "adam_step() takes exactly 13 arguments, or 14 with grad_scale "
                            "(%zd given)", nargs);
    dsc_adam_hparams hp;
    if (parse_grad_scale(args, nargs, 13, &hp.grad_scale) < 0) return NULL;
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

/* adam_step's hyperparameters from args[first..first+7] (lr .. adamw_mode); -1 with an exception set. */
static int parse_hparams(PyObject *const *args, dsc_adam_hparams *hp) {
    int64_t bias_correction, adamw_mode;
    if (dsc_arg_double(args[0], "lr", &hp->lr) < 0 || dsc_arg_double(args[1], "beta1", &hp->beta1) < 0 ||
        dsc_arg_double(args[2], "beta2", &hp->beta2) < 0 || dsc_arg_double(args[3], "eps", &hp->eps) < 0 ||
        dsc_arg_double(args[4], "weight_decay", &hp->weight_decay) < 0 ||
        dsc_arg_int64(args[5], "step", &hp->step) < 0 ||
        dsc_arg_int64(args[6], "bias_correction", &bias_correction) < 0 ||
        dsc_arg_int64(args[7], "adamw_mode", &adamw_mode) < 0)
        return -1;
    if (hp->step < 1) {
        PyErr_Format(PyExc_ValueError, "argument 'step' must be >= 1, got %lld", (long long)hp->step);
        return -1;
    }
    hp->bias_correction = bias_correction != 0;
    hp->adamw_mode = adamw_mode != 0;
    return 0;
}

typedef struct {
    const dsc_adam_hparams *hp;
    const dsc_opt_tensor *outs;
} into_args;

static int run_adam_into(dsc_opt_tensor *ts, int64_t n, const void *a) {
    const into_args *x = (const into_args *)a;
    return dsc_cpu_adam_step_into(ts, x->outs, n, x->hp);
}

/* adam_step_into(params, grads, exp_avgs, exp_avg_sqs, copies, out_params, out_exp_avgs, out_exp_avg_sqs,
 * lr, beta1, beta2, eps, weight_decay, step, bias_correction, adamw_mode): out-of-place; every out tensor has
 * its input's dtype and size and may not overlap another operand (except being that input itself). */
static PyObject *adam_step_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 16 && nargs != 17)
        return PyErr_Format(PyExc_TypeError, "adam_step_into() takes exactly 16 arguments, or 17 with grad_scale "
                            "(%zd given)", nargs);
    dsc_adam_hparams hp;
    if (parse_hparams(args + 8, &hp) < 0 || parse_grad_scale(args, nargs, 16, &hp.grad_scale) < 0) return NULL;
    dsc_opt_tensor *ts, *os;
    Py_ssize_t n, no;
    if (dsc_parse_opt_lists(args[0], args[1], args[2], "exp_avgs", args[3], "exp_avg_sqs", args[4], &ts, &n) < 0)
        return NULL;
    if (dsc_parse_opt_lists(args[5], args[1], args[6], "out_exp_avgs", args[7], "out_exp_avg_sqs", Py_None, &os,
                            &no) < 0) {
        PyMem_Free(ts);
        return NULL;
    }
    if (no != n) {
        PyMem_Free(ts);
        PyMem_Free(os);
        return PyErr_Format(PyExc_ValueError, "argument 'out_params' has %zd tensors, 'params' %zd", no, n);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const dsc_opt_tensor *a = &ts[i], *b = &os[i];
        if (a->param.dtype != b->param.dtype || a->state0.dtype != b->state0.dtype ||
            a->state1.dtype != b->state1.dtype) {
            PyMem_Free(ts);
            PyMem_Free(os);
            return PyErr_Format(PyExc_TypeError, "out tensors [%zd] must have the dtypes of params, exp_avgs and "
                                "exp_avg_sqs [%zd]", i, i);
        }
    }
    into_args x = {&hp, os};
    PyObject *r = dsc_run_opt_step(ts, n, run_adam_into, &x);
    PyMem_Free(os);
    return r;
}

static PyMethodDef methods[] = {
    {"adam_step_into", (PyCFunction)(void (*)(void))adam_step_into, METH_FASTCALL,
     "adam_step_into(params, grads, exp_avgs, exp_avg_sqs, copies, out_params, out_exp_avgs, out_exp_avg_sqs, lr, "
     "beta1, beta2, eps, weight_decay, step, bias_correction, adamw_mode[, grad_scale]): adam_step writing the "
     "updated params and moments into the out lists (inputs untouched unless they are the outs)."},
    {"adam_step", (PyCFunction)(void (*)(void))adam_step, METH_FASTCALL,
     "adam_step(params, grads, exp_avgs, exp_avg_sqs, copies, lr, beta1, beta2, eps, weight_decay, step, "
     "bias_correction, adamw_mode[, grad_scale]): one Adam/AdamW step over lists of CPU tensors (copies: None or "
     "a list receiving the updated params in their own dtype; grad_scale, default 1.0: every gradient is "
     "multiplied by it in fp32 inside the kernel, no scaled copy made)."},
    DSC_SIMD_METHOD,
    DSC_BUMP_STEPS_METHOD,
    DSC_NUM_THREADS_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR, "deepspeed_c CPU Adam.", -1,
                                        methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
