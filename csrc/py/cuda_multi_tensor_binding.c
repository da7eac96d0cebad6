/* Binding of the multi_tensor_ops op: the engine's utility kernels over CUDA tensor lists on
 * torch's current stream (L2 norm with inf/nan flag, scale, casting copy, flatten/unflatten)
 * and the fused AdamW epilogue. Outputs and workspaces are allocated by the Python shim. */
#include "dsc/cuda_adam.h"
#include "dsc/cuda_binding_util.h"
#include "dsc/module.h"

#define ANY_FLOAT (DSC_F32 | DSC_F16 | DSC_BF16)

static PyObject *finish(dsc_mt_tensor *t, int rc, const char *fname) {
    PyMem_Free(t);
    if (dsc_cuda_check(rc, fname) < 0) return NULL;
    Py_RETURN_NONE;
}

/* l2norm(tensors, scratch, norm_out, per_tensor_out, found_inf_out) */
static PyObject *l2norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("l2norm", nargs, 5) < 0) return NULL;
    static const dsc_mt_slot_spec slots[1] = {{"tensors", ANY_FLOAT, 0}};
    dsc_mt_tensor *t;
    int64_t n;
    int dev;
    if (dsc_mt_gather(args, slots, 1, &t, &n, &dev) < 0) return NULL;
    void *scratch, *norm, *per, *inf;
    cudaStream_t stream;
    if (dsc_cuda_buffer_arg(args[1], "scratch", DSC_F64, n + 2, &dev, 0, &scratch) < 0 ||
        dsc_cuda_buffer_arg(args[2], "norm_out", DSC_F32, 1, &dev, 0, &norm) < 0 ||
        dsc_cuda_buffer_arg(args[3], "per_tensor_out", DSC_F32, n, &dev, 1, &per) < 0 ||
        dsc_cuda_buffer_arg(args[4], "found_inf_out", DSC_F32, 1, &dev, 1, &inf) < 0 ||
        dsc_cuda_stream_arg(dev, &stream) < 0) {
        PyMem_Free(t);
        return NULL;
    }
    const int rc = dsc_cuda_l2norm(t, n, (double *)scratch, (float *)norm, (float *)per, (float *)inf, dev, stream);
    return finish(t, rc, "l2norm");
}

/* scale(src, dst, scale, scale_dev, found_inf) */
static PyObject *scale(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("scale", nargs, 5) < 0) return NULL;
    static const dsc_mt_slot_spec slots[2] = {{"src", ANY_FLOAT, 0}, {"dst", ANY_FLOAT, 0}};
    double s;
    if (dsc_arg_double(args[2], "scale", &s) < 0) return NULL;
    dsc_mt_tensor *t;
    int64_t n;
    int dev;
    if (dsc_mt_gather(args, slots, 2, &t, &n, &dev) < 0) return NULL;
    if (n == 0) return finish(t, 0, "scale");
    void *sdev, *inf;
    cudaStream_t stream;
    if (dsc_cuda_buffer_arg(args[3], "scale_dev", DSC_F32, 1, &dev, 1, &sdev) < 0 ||
        dsc_cuda_buffer_arg(args[4], "found_inf", DSC_F32, 1, &dev, 1, &inf) < 0 ||
        dsc_cuda_stream_arg(dev, &stream) < 0) {
        PyMem_Free(t);
        return NULL;
    }
    const int rc = dsc_cuda_scale(t, n, (float)s, (const float *)sdev, (float *)inf, dev, stream);
    return finish(t, rc, "scale");
}

/* copy(src, dst) */
static PyObject *copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("copy", nargs, 2) < 0) return NULL;
    static const dsc_mt_slot_spec slots[2] = {{"src", ANY_FLOAT, 0}, {"dst", ANY_FLOAT, 0}};
    dsc_mt_tensor *t;
    int64_t n;
    int dev;
    if (dsc_mt_gather(args, slots, 2, &t, &n, &dev) < 0) return NULL;
    if (n == 0) return finish(t, 0, "copy");
    cudaStream_t stream;
    if (dsc_cuda_stream_arg(dev, &stream) < 0) {
        PyMem_Free(t);
        return NULL;
    }
    return finish(t, dsc_cuda_copy(t, n, dev, stream), "copy");
}

/* Validates (tensors, flat) for flatten/unflatten; returns the table or NULL with an exception. */
static dsc_mt_tensor *flat_pair(PyObject *list_obj, PyObject *flat_obj, int64_t *n, int *dev, dsc_view *flat) {
    static const dsc_mt_slot_spec slots[1] = {{"tensors", ANY_FLOAT, 0}};
    dsc_mt_tensor *t;
    if (dsc_mt_gather(&list_obj, slots, 1, &t, n, dev) < 0) return NULL;
    static const dsc_arg_spec flat_spec = {"flat", ANY_FLOAT, DSC_DEV_CUDA, DSC_CONTIGUOUS};
    if (dsc_view_from_object(flat_obj, &flat_spec, flat) < 0) goto fail;
    int64_t total = 0;
    for (int64_t i = 0; i < *n; i++) {
        total += t[i].numel;
        const int item = t[i].dtype[0] == DSC_CUDA_F32 ? 4 : 2;
        const uintptr_t a0 = (uintptr_t)t[i].ptr[0], a1 = a0 + (uintptr_t)(t[i].numel * item);
        const uintptr_t f0 = (uintptr_t)flat->data, f1 = f0 + (uintptr_t)(flat->numel * flat->itemsize);
        if (t[i].numel > 0 && flat->numel > 0 && a0 < f1 && f0 < a1) {
            PyErr_Format(PyExc_ValueError, "argument 'tensors[%lld]' overlaps 'flat' in memory", (long long)i);
            goto fail;
        }
    }
    if (total != flat->numel) {
        PyErr_Format(PyExc_ValueError, "argument 'flat' has %lld elements but the tensors hold %lld",
                     (long long)flat->numel, (long long)total);
        goto fail;
    }
    if (*n > 0 && flat->device_id != *dev) {
        PyErr_Format(PyExc_ValueError, "argument 'flat' is on cuda:%d but 'tensors' are on cuda:%d",
                     (int)flat->device_id, *dev);
        goto fail;
    }
    *dev = flat->device_id;
    return t;
fail:
    PyMem_Free(t);
    return NULL;
}

static int flat_dtype(const dsc_view *v) {
    return v->dtype == DSC_F32 ? DSC_CUDA_F32 : v->dtype == DSC_F16 ? DSC_CUDA_F16 : DSC_CUDA_BF16;
}

/* flatten(tensors, flat) */
static PyObject *flatten(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("flatten", nargs, 2) < 0) return NULL;
    int64_t n;
    int dev;
    dsc_view flat;
    dsc_mt_tensor *t = flat_pair(args[0], args[1], &n, &dev, &flat);
    if (!t) return NULL;
    if (n == 0) return finish(t, 0, "flatten");
    cudaStream_t stream;
    if (dsc_cuda_stream_arg(dev, &stream) < 0) {
        PyMem_Free(t);
        return NULL;
    }
    return finish(t, dsc_cuda_flatten(t, n, flat.data, flat_dtype(&flat), dev, stream), "flatten");
}

/* unflatten(flat, tensors) */
static PyObject *unflatten(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("unflatten", nargs, 2) < 0) return NULL;
    int64_t n;
    int dev;
    dsc_view flat;
    dsc_mt_tensor *t = flat_pair(args[1], args[0], &n, &dev, &flat);
    if (!t) return NULL;
    if (n == 0) return finish(t, 0, "unflatten");
    cudaStream_t stream;
    if (dsc_cuda_stream_arg(dev, &stream) < 0) {
        PyMem_Free(t);
        return NULL;
    }
    return finish(t, dsc_cuda_unflatten(flat.data, flat_dtype(&flat), t, n, dev, stream), "unflatten");
}

/* adam_epilogue(grads, params, exp_avgs, exp_avg_sqs, out_params, grad_norm, found_inf, step,
 *               lr, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, loss_scale,
 *               max_grad_norm) */
static PyObject *adam_epilogue(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("adam_epilogue", nargs, 17) < 0) return NULL;
    static const dsc_mt_slot_spec slots[5] = {
        {"grads", ANY_FLOAT, 0},    {"params", ANY_FLOAT, 0},  {"exp_avgs", DSC_F32, 0},
        {"exp_avg_sqs", DSC_F32, 0}, {"out_params", DSC_F16 | DSC_BF16, 1},
    };
    static const char *const names[] = {"lr", "beta1", "beta2", "eps", "weight_decay"};
    static const char *const names2[] = {"loss_scale", "max_grad_norm"};
    double f[5], f2[2];
    int w_mode, bc;
    if (dsc_float_args(args + 8, names, 5, f) < 0 || dsc_flag_arg(args[13], "adam_w_mode", &w_mode) < 0 ||
        dsc_flag_arg(args[14], "bias_correction", &bc) < 0 || dsc_float_args(args + 15, names2, 2, f2) < 0)
        return NULL;
    if (!(f2[0] > 0.0)) return PyErr_Format(PyExc_ValueError, "argument 'loss_scale' must be > 0");
    dsc_mt_tensor *t;
    int64_t n;
    int dev;
    if (dsc_mt_gather(args, slots, 5, &t, &n, &dev) < 0) return NULL;
    if (dsc_mt_check_master(t, n, args[4], 1, "params", "out_params") < 0) {
        PyMem_Free(t);
        return NULL;
    }
    void *norm, *inf, *step;
    cudaStream_t stream;
    if (dsc_cuda_buffer_arg(args[5], "grad_norm", DSC_F32, 1, &dev, 0, &norm) < 0 ||
        dsc_cuda_buffer_arg(args[6], "found_inf", DSC_F32, 1, &dev, 1, &inf) < 0 ||
        dsc_cuda_buffer_arg(args[7], "step", DSC_F32, 1, &dev, 0, &step) < 0 ||
        dsc_cuda_stream_arg(dev, &stream) < 0) {
        PyMem_Free(t);
        return NULL;
    }
    const dsc_epilogue_params hp = {
        {(float)f[0], f[1], f[2], (float)f[3], (float)f[4], w_mode, bc, 1, 1.f},
        (float)f2[0],
        (float)f2[1],
    };
    const int rc = dsc_cuda_adam_epilogue(t, n, &hp, (const float *)norm, (const float *)inf, (float *)step, dev,
                                          stream);
    return finish(t, rc, "adam_epilogue");
}

static PyObject *tensors_per_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t depth;
    if (dsc_check_nargs("tensors_per_launch", nargs, 1) < 0 || dsc_arg_int64(args[0], "depth", &depth) < 0)
        return NULL;
    if (depth < 1 || depth > DSC_MT_MAX_DEPTH)
        return PyErr_Format(PyExc_ValueError, "argument 'depth' must be in 1..%d", DSC_MT_MAX_DEPTH);
    return PyLong_FromLong(dsc_mt_tensors_per_launch((int)depth));
}

static PyObject *chunk_elems(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    (void)args;
    if (dsc_check_nargs("chunk_elems", nargs, 0) < 0) return NULL;
    return PyLong_FromLong(dsc_mt_chunk_elems());
}

#define FAST(f) ((PyCFunction)(void (*)(void))(f))

static PyMethodDef methods[] = {
    {"l2norm", FAST(l2norm), METH_FASTCALL,
     "l2norm(tensors, scratch, norm_out, per_tensor_out, found_inf_out): global (and per-tensor)\n"
     "L2 norm in one read; scratch is float64[n + 2]; found_inf_out gets 1.0 on any inf/nan, else 0.0."},
    {"scale", FAST(scale), METH_FASTCALL,
     "scale(src, dst, scale, scale_dev, found_inf): dst = src * scale (* scale_dev[0]); found_inf\n"
     "(or None) is set to 1.0 when src holds an inf/nan and is never cleared."},
    {"copy", FAST(copy), METH_FASTCALL, "copy(src, dst): casting copy between two tensor lists."},
    {"flatten", FAST(flatten), METH_FASTCALL, "flatten(tensors, flat): copy the tensors back to back into flat."},
    {"unflatten", FAST(unflatten), METH_FASTCALL, "unflatten(flat, tensors): copy consecutive slices of flat out."},
    {"adam_epilogue", FAST(adam_epilogue), METH_FASTCALL,
     "adam_epilogue(grads, params, exp_avgs, exp_avg_sqs, out_params, grad_norm, found_inf, step, lr,\n"
     "              beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, loss_scale,\n"
     "              max_grad_norm)\n"
     "Unscale, clip, skip on inf/nan, AdamW and low-precision write-back in one pass; grad_norm,\n"
     "found_inf and step are device float32 scalars; step is incremented on the device."},
    {"tensors_per_launch", FAST(tensors_per_launch), METH_FASTCALL,
     "tensors_per_launch(depth): how many tensors one launch takes with `depth` lists."},
    {"chunk_elems", FAST(chunk_elems), METH_FASTCALL, "chunk_elems(): elements per thread block."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR,
                                        "deepspeed_c multi_tensor_ops: CUDA multi-tensor utility kernels.", -1,
                                        methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
