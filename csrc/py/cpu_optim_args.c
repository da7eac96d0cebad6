#include "dsc/cpu_optim_args.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define FLOAT_DTYPES (DSC_F32 | DSC_BF16 | DSC_F16)

static int32_t cpu_dtype(uint32_t dsc) {
    return dsc == DSC_F32 ? DSC_CPU_F32 : dsc == DSC_BF16 ? DSC_CPU_BF16 : DSC_CPU_F16;
}

static int parse_list(PyObject *obj, const char *name, int allow_none_list, dsc_view_list *out) {
    out->items = NULL;
    out->len = -1;
    if (obj == NULL || (allow_none_list && obj == Py_None)) return 0;
    dsc_arg_spec spec = {name, FLOAT_DTYPES, DSC_DEV_CPU, DSC_CONTIGUOUS};
    return dsc_view_list_from_object(obj, &spec, out);
}

/* states may be fp32, the parameter's own dtype, or bf16 beside an fp32 master */
static int check_state_dtype(const dsc_view *p, const dsc_view *s, const char *name, Py_ssize_t i) {
    if (s->dtype == DSC_F32 || s->dtype == p->dtype || (p->dtype == DSC_F32 && s->dtype == DSC_BF16)) return 0;
    PyErr_Format(PyExc_TypeError,
                 "argument '%s[%zd]' is %s but its parameter is %s; optimizer states must be float32, the "
                 "parameter's dtype, or bfloat16 beside a float32 master", name, i, dsc_dtype_name(s->dtype),
                 dsc_dtype_name(p->dtype));
    return -1;
}

static int check_item(const dsc_view_list *ps, const dsc_view_list *other, const char *name, Py_ssize_t i) {
    if (other->len < 0) return 0;
    const dsc_view *p = &ps->items[i], *o = &other->items[i];
    if (o->numel != p->numel) {
        PyErr_Format(PyExc_ValueError, "'%s[%zd]' has %lld elements but 'params[%zd]' has %lld", name, i,
                     (long long)o->numel, i, (long long)p->numel);
        return -1;
    }
    return dsc_check_no_alias(name, o, "params[i]", p);
}

int dsc_parse_opt_lists(PyObject *params, PyObject *grads, PyObject *s0, const char *s0_name, PyObject *s1,
                        const char *s1_name, PyObject *copies, dsc_opt_tensor **out, Py_ssize_t *n) {
    dsc_view_list lp, lg, l0, l1, lc;
    lp.items = lg.items = l0.items = l1.items = lc.items = NULL;
    int rc = -1;
    *out = NULL;
    if (parse_list(params, "params", 0, &lp) < 0 || parse_list(grads, "grads", 0, &lg) < 0 ||
        parse_list(s0, s0_name, 0, &l0) < 0 || parse_list(s1, s1_name, 0, &l1) < 0 ||
        parse_list(copies, "copies", 1, &lc) < 0)
        goto done;
    if (dsc_check_same_len("params", lp.len, "grads", lg.len) < 0 ||
        dsc_check_same_len("params", lp.len, s0_name, l0.len) < 0 ||
        (l1.len >= 0 && dsc_check_same_len("params", lp.len, s1_name, l1.len) < 0) ||
        (lc.len >= 0 && dsc_check_same_len("params", lp.len, "copies", lc.len) < 0))
        goto done;
    *out = PyMem_Malloc(sizeof(dsc_opt_tensor) * (size_t)(lp.len > 0 ? lp.len : 1));
    if (!*out) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < lp.len; i++) {
        if (check_item(&lp, &lg, "grads", i) < 0 || check_item(&lp, &l0, s0_name, i) < 0 ||
            check_item(&lp, &l1, s1_name, i) < 0 || check_item(&lp, &lc, "copies", i) < 0 ||
            check_state_dtype(&lp.items[i], &l0.items[i], s0_name, i) < 0 ||
            (l1.len >= 0 && check_state_dtype(&lp.items[i], &l1.items[i], s1_name, i) < 0))
            goto done;
        if (l1.len >= 0 && l1.items[i].dtype != l0.items[i].dtype) {
            PyErr_Format(PyExc_TypeError, "'%s[%zd]' is %s but '%s[%zd]' is %s; both states need one dtype",
                         s0_name, i, dsc_dtype_name(l0.items[i].dtype), s1_name, i,
                         dsc_dtype_name(l1.items[i].dtype));
            goto done;
        }
        if (l1.len >= 0 && dsc_check_no_alias(s1_name, &l1.items[i], s0_name, &l0.items[i]) < 0) goto done;
        dsc_opt_tensor *t = &(*out)[i];
        t->numel = lp.items[i].numel;
        t->param = (dsc_operand){lp.items[i].data, cpu_dtype(lp.items[i].dtype)};
        t->grad = (dsc_operand){lg.items[i].data, cpu_dtype(lg.items[i].dtype)};
        t->state0 = (dsc_operand){l0.items[i].data, cpu_dtype(l0.items[i].dtype)};
        t->state1 = l1.len >= 0 ? (dsc_operand){l1.items[i].data, cpu_dtype(l1.items[i].dtype)}
                                : (dsc_operand){NULL, DSC_CPU_F32};
        t->copy = lc.len >= 0 ? (dsc_operand){lc.items[i].data, cpu_dtype(lc.items[i].dtype)}
                              : (dsc_operand){NULL, DSC_CPU_F32};
    }
    *n = lp.len;
    rc = 0;
done:
    if (rc < 0) {
        PyMem_Free(*out);
        *out = NULL;
    }
    PyMem_Free(lp.items);
    PyMem_Free(lg.items);
    PyMem_Free(l0.items);
    PyMem_Free(l1.items);
    PyMem_Free(lc.items);
    return rc;
}

int dsc_parse_operand_list(PyObject *tensors, const char *name, dsc_operand **ops, int64_t **numels,
                           Py_ssize_t *n) {
    dsc_view_list l;
    if (parse_list(tensors, name, 0, &l) < 0) return -1;
    Py_ssize_t len = l.len;
    *ops = PyMem_Malloc(sizeof(dsc_operand) * (size_t)(len > 0 ? len : 1));
    *numels = PyMem_Malloc(sizeof(int64_t) * (size_t)(len > 0 ? len : 1));
    if (!*ops || !*numels) {
        PyMem_Free(*ops);
        PyMem_Free(*numels);
        dsc_view_list_release(&l);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        (*ops)[i] = (dsc_operand){l.items[i].data, cpu_dtype(l.items[i].dtype)};
        (*numels)[i] = l.items[i].numel;
    }
    *n = len;
    dsc_view_list_release(&l);
    return 0;
}

PyObject *dsc_bump_steps(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("bump_steps", nargs, 1) < 0) return NULL;
    dsc_arg_spec spec = {"steps", DSC_F32, DSC_DEV_CPU, 0};
    dsc_view_list l;
    if (dsc_view_list_from_object(args[0], &spec, &l) < 0) return NULL;
    PyObject *out = NULL;
    for (Py_ssize_t i = 0; i < l.len; i++) {
        if (l.items[i].numel != 1) {
            PyErr_Format(PyExc_ValueError, "'steps[%zd]' must hold one element (a step count), got %lld", i,
                         (long long)l.items[i].numel);
            goto done;
        }
    }
    out = PyList_New(l.len);
    if (!out) goto done;
    for (Py_ssize_t i = 0; i < l.len; i++) {
        float *step = l.items[i].data;
        *step += 1.0f;
        PyObject *count = PyLong_FromLongLong((long long)*step);
        if (!count || PyList_SetItem(out, i, count) < 0) {
            Py_CLEAR(out);
            goto done;
        }
    }
done:
    dsc_view_list_release(&l);
    return out;
}

PyObject *dsc_simd_method(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    (void)args;
    if (dsc_check_nargs("simd", nargs, 0) < 0) return NULL;
    return PyUnicode_FromString(dsc_cpu_simd_name());
}

PyObject *dsc_num_threads_method(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs > 1) return PyErr_Format(PyExc_TypeError, "num_threads() takes at most 1 argument (%zd given)", nargs);
    if (nargs == 1) {
        long n = PyLong_AsLong(args[0]);
        if (n == -1 && PyErr_Occurred()) return NULL;
        if (n < 0) return PyErr_Format(PyExc_ValueError, "argument 'n' must be >= 0, got %ld", n);
#ifdef _OPENMP
        if (n > 0) omp_set_num_threads((int)n);
#endif
    }
#ifdef _OPENMP
    return PyLong_FromLong((long)omp_get_max_threads());
#else
    return PyLong_FromLong(1L);
#endif
}

PyObject *dsc_run_opt_step(dsc_opt_tensor *ts, Py_ssize_t n, dsc_opt_step_fn step, const void *hparams) {
    int rc = 0;
    if (n > 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = step(ts, (int64_t)n, hparams);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(ts);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
