/* Shared helpers of the CUDA op bindings: see dsc/cuda_binding_util.h. */
#include "dsc/cuda_binding_util.h"

#include <string.h>

static int cuda_dtype_of(uint32_t dtype) {
    switch (dtype) {
    case DSC_F32: return DSC_CUDA_F32;
    case DSC_F16: return DSC_CUDA_F16;
    case DSC_BF16: return DSC_CUDA_BF16;
    default: return -1;
    }
}

int dsc_mt_gather(PyObject *const *objs, const dsc_mt_slot_spec *specs, int depth, dsc_mt_tensor **out,
                  int64_t *n, int *device) {
    dsc_view_list lists[DSC_MT_MAX_DEPTH];
    int have[DSC_MT_MAX_DEPTH] = {0};
    int first = -1, rc = -1;
    *out = NULL;
    *n = 0;
    *device = -1;
    if (depth < 1 || depth > DSC_MT_MAX_DEPTH) {
        PyErr_SetString(PyExc_SystemError, "dsc_mt_gather: bad depth");
        return -1;
    }
    for (int k = 0; k < depth; k++) {
        if (specs[k].optional && objs[k] == Py_None) continue;
        const dsc_arg_spec spec = {specs[k].name, specs[k].dtypes, DSC_DEV_CUDA, DSC_CONTIGUOUS};
        if (dsc_view_list_from_object(objs[k], &spec, &lists[k]) < 0) goto done;
        have[k] = 1;
        if (first < 0) {
            first = k;
        } else if (dsc_check_lists_match(specs[first].name, &lists[first], specs[k].name, &lists[k]) < 0) {
            goto done;
        }
    }
    if (first < 0) {
        PyErr_SetString(PyExc_TypeError, "at least one tensor list is required");
        goto done;
    }
    const Py_ssize_t len = lists[first].len;
    dsc_mt_tensor *table = PyMem_Malloc(sizeof(dsc_mt_tensor) * (size_t)(len > 0 ? len : 1));
    if (!table) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        dsc_mt_tensor *t = &table[i];
        memset(t, 0, sizeof(*t));
        t->numel = lists[first].items[i].numel;
        for (int k = 0; k < depth; k++) {
            if (!have[k]) continue;
            const dsc_view *v = &lists[k].items[i];
            t->ptr[k] = v->data;
            t->dtype[k] = (uint8_t)cuda_dtype_of(v->dtype);
        }
    }
    *out = table;
    *n = len;
    *device = len > 0 ? lists[first].items[0].device_id : -1;
    rc = 0;
done:
    for (int k = 0; k < depth; k++) {
        if (have[k]) dsc_view_list_release(&lists[k]);
    }
    return rc;
}

int dsc_cuda_buffer_arg(PyObject *obj, const char *name, uint32_t dtype, int64_t min_numel, int *device,
                        int allow_none, void **data) {
    *data = NULL;
    if (allow_none && obj == Py_None) return 0;
    const dsc_arg_spec spec = {name, dtype, DSC_DEV_CUDA, DSC_CONTIGUOUS};
    dsc_view v;
    if (dsc_view_from_object(obj, &spec, &v) < 0) return -1;
    if (v.numel < min_numel) {
        PyErr_Format(PyExc_ValueError, "argument '%s' must hold at least %lld elements, got %lld", name,
                     (long long)min_numel, (long long)v.numel);
        return -1;
    }
    if (*device >= 0 && v.device_id != *device) {
        PyErr_Format(PyExc_ValueError, "argument '%s' is on cuda:%d but the tensor lists are on cuda:%d", name,
                     (int)v.device_id, *device);
        return -1;
    }
    *device = v.device_id;
    *data = v.data;
    return 0;
}

int dsc_cuda_stream_arg(int device, cudaStream_t *stream) {
    void *s = dsc_current_cuda_stream(device);
    if (s == NULL && PyErr_Occurred()) return -1;
    *stream = (cudaStream_t)s;
    return 0;
}

int dsc_cuda_check(int rc, const char *fname) {
    if (rc == 0) return 0;
    PyErr_Format(PyExc_RuntimeError, "%s failed: %s (code %d)", fname, dsc_cuda_strerror(rc), rc);
    return -1;
}

int dsc_float_args(PyObject *const *args, const char *const *names, int count, double *out) {
    for (int k = 0; k < count; k++) {
        if (dsc_arg_double(args[k], names[k], &out[k]) < 0) return -1;
    }
    return 0;
}

int dsc_flag_arg(PyObject *obj, const char *name, int *out) {
    if (!PyBool_Check(obj) && !PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "argument '%s' must be a bool, got %R", name, (PyObject *)Py_TYPE(obj));
        return -1;
    }
    const int v = PyObject_IsTrue(obj);
    if (v < 0) return -1;
    *out = v;
    return 0;
}

int dsc_mt_check_master(const dsc_mt_tensor *t, int64_t n, PyObject *out_obj, int param_slot,
                        const char *param_name, const char *out_name) {
    if (out_obj == Py_None) return 0;
    for (int64_t i = 0; i < n; i++) {
        if (t[i].dtype[param_slot] != DSC_CUDA_F32) {
            PyErr_Format(PyExc_ValueError,
                         "argument '%s' is a low-precision copy of float32 '%s', but '%s[%lld]' is %s",
                         out_name, param_name, param_name, (long long)i,
                         t[i].dtype[param_slot] == DSC_CUDA_F16 ? "float16" : "bfloat16");
            return -1;
        }
    }
    return 0;
}
