/* Python-visible probes of the tensor boundary: tests drive every validation path and every
 * DLPack route through these, and the env report reads the exchange API's version. */
#include "dsc/dlpack_abi.h"
#include "dsc/tensor_view.h"

static PyObject *view_to_dict(const dsc_view *v) {
    if (v->is_none) Py_RETURN_NONE;
    PyObject *shape = PyTuple_New(v->ndim), *strides = PyTuple_New(v->ndim);
    if (!shape || !strides) goto fail;
    for (int i = 0; i < v->ndim; i++) {
        PyObject *s = PyLong_FromLongLong(v->shape[i]);
        PyObject *st = PyLong_FromLongLong(v->strides[i]);
        if (!s || !st) {
            Py_XDECREF(s);
            Py_XDECREF(st);
            goto fail;
        }
        PyTuple_SetItem(shape, i, s);
        PyTuple_SetItem(strides, i, st);
    }
    PyObject *d = Py_BuildValue("{s:K,s:s,s:s,s:i,s:i,s:O,s:O,s:L,s:O}", "data_ptr",
                                (unsigned long long)(uintptr_t)v->data, "dtype", dsc_dtype_name(v->dtype),
                                "device", v->device == DSC_DEV_CUDA ? "cuda" : "cpu", "device_id",
                                (int)v->device_id, "itemsize", (int)v->itemsize, "shape", shape, "strides",
                                strides, "numel", (long long)v->numel, "contiguous",
                                v->contiguous ? Py_True : Py_False);
    Py_DECREF(shape);
    Py_DECREF(strides);
    return d;
fail:
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    return NULL;
}

/* Spec from Python arguments: (name: str, dtypes: int mask, device: int, flags: int). */
static int spec_from_args(PyObject *const *args, dsc_arg_spec *spec, PyObject **name_bytes) {
    PyObject *name = args[0];
    if (!PyUnicode_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "spec name must be a str");
        return -1;
    }
    *name_bytes = PyUnicode_AsUTF8String(name);
    if (!*name_bytes) return -1;
    int64_t dtypes, device, flags;
    if (dsc_arg_int64(args[1], "dtypes", &dtypes) < 0 || dsc_arg_int64(args[2], "device", &device) < 0 ||
        dsc_arg_int64(args[3], "flags", &flags) < 0) {
        Py_CLEAR(*name_bytes);
        return -1;
    }
    spec->name = PyBytes_AsString(*name_bytes);
    spec->dtypes = (uint32_t)dtypes;
    spec->device = (int)device;
    spec->flags = (uint32_t)flags;
    return 0;
}

/* view_info(obj, route=0) -> dict: the view any binding would see (no validation beyond
 * "is a tensor"). */
static PyObject *view_info(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 1 || nargs > 2) return PyErr_Format(PyExc_TypeError, "view_info(tensor, route=0)");
    int64_t route = 0;
    if (nargs == 2 && dsc_arg_int64(args[1], "route", &route) < 0) return NULL;
    if (route < DSC_ROUTE_AUTO || route > DSC_ROUTE_LEGACY)
        return PyErr_Format(PyExc_ValueError, "route must be 0..3, got %lld", (long long)route);
    dsc_arg_spec spec = {"tensor", DSC_ANY_DTYPE, DSC_DEV_ANY, 0};
    dsc_view v;
    if (dsc_view_from_object_route(args[0], &spec, (dsc_route)route, &v) < 0) return NULL;
    return view_to_dict(&v);
}

/* check_view(obj, name, dtypes, device, flags) -> dict */
static PyObject *check_view(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("check_view", nargs, 5) < 0) return NULL;
    dsc_arg_spec spec;
    PyObject *name_bytes = NULL;
    if (spec_from_args(args + 1, &spec, &name_bytes) < 0) return NULL;
    dsc_view v;
    PyObject *result = NULL;
    if (dsc_view_from_object(args[0], &spec, &v) == 0) result = view_to_dict(&v);
    Py_DECREF(name_bytes);
    return result;
}

/* check_list(seq, name, dtypes, device, flags) -> number of items */
static PyObject *check_list(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("check_list", nargs, 5) < 0) return NULL;
    dsc_arg_spec spec;
    PyObject *name_bytes = NULL;
    if (spec_from_args(args + 1, &spec, &name_bytes) < 0) return NULL;
    dsc_view_list list;
    PyObject *result = NULL;
    if (dsc_view_list_from_object(args[0], &spec, &list) == 0) {
        result = PyLong_FromSsize_t(list.len);
        dsc_view_list_release(&list);
    }
    Py_DECREF(name_bytes);
    return result;
}

/* check_pair(out, inp) -> None: out must not alias inp and must match its numel and device. */
static PyObject *check_pair(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("check_pair", nargs, 2) < 0) return NULL;
    static const dsc_arg_spec out_spec = {"out", DSC_ANY_DTYPE, DSC_DEV_ANY, DSC_CONTIGUOUS};
    static const dsc_arg_spec in_spec = {"inp", DSC_ANY_DTYPE, DSC_DEV_ANY, DSC_CONTIGUOUS};
    dsc_view out, in;
    if (dsc_view_from_object(args[0], &out_spec, &out) < 0) return NULL;
    if (dsc_view_from_object(args[1], &in_spec, &in) < 0) return NULL;
    if (dsc_check_same_device("out", &out, "inp", &in) < 0) return NULL;
    if (dsc_check_same_numel("out", &out, "inp", &in) < 0) return NULL;
    if (dsc_check_no_alias("out", &out, "inp", &in) < 0) return NULL;
    Py_RETURN_NONE;
}

/* check_lists(a, b) -> None: same length, numel item by item, same device. */
static PyObject *check_lists(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("check_lists", nargs, 2) < 0) return NULL;
    static const dsc_arg_spec a_spec = {"a", DSC_ANY_DTYPE, DSC_DEV_ANY, DSC_CONTIGUOUS};
    static const dsc_arg_spec b_spec = {"b", DSC_ANY_DTYPE, DSC_DEV_ANY, DSC_CONTIGUOUS};
    dsc_view_list a, b;
    if (dsc_view_list_from_object(args[0], &a_spec, &a) < 0) return NULL;
    if (dsc_view_list_from_object(args[1], &b_spec, &b) < 0) {
        dsc_view_list_release(&a);
        return NULL;
    }
    int rc = dsc_check_lists_match("a", &a, "b", &b);
    dsc_view_list_release(&a);
    dsc_view_list_release(&b);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *current_cuda_stream(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("current_cuda_stream", nargs, 1) < 0) return NULL;
    int64_t dev;
    if (dsc_arg_int64(args[0], "device", &dev) < 0) return NULL;
    void *stream = dsc_current_cuda_stream((int)dev);
    if (!stream && PyErr_Occurred()) return NULL;
    return PyLong_FromVoidPtr(stream);
}

/* exchange_api_version() -> (major, minor) or None when torch lacks the exchange API. */
static PyObject *exchange_api_version(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    (void)args;
    if (dsc_check_nargs("exchange_api_version", nargs, 0) < 0) return NULL;
    PyObject *torch = PyImport_ImportModule("torch");
    if (!torch) return NULL;
    PyObject *tensor = PyObject_GetAttrString(torch, "Tensor");
    Py_DECREF(torch);
    if (!tensor) return NULL;
    PyObject *cap = PyObject_GetAttrString(tensor, "__dlpack_c_exchange_api__");
    Py_DECREF(tensor);
    if (!cap) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *result = NULL;
    if (PyCapsule_IsValid(cap, "dlpack_exchange_api")) {
        const DLPackExchangeAPI *api = PyCapsule_GetPointer(cap, "dlpack_exchange_api");
        result = Py_BuildValue("(II)", api->header.version.major, api->header.version.minor);
    } else {
        result = Py_None;
        Py_INCREF(result);
    }
    Py_DECREF(cap);
    return result;
}

/* dtype_flags() -> {"float32": 1, ...}: the bit values of dsc_dtype, for Python-side specs. */
static PyObject *dtype_flags(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    (void)args;
    if (dsc_check_nargs("dtype_flags", nargs, 0) < 0) return NULL;
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    for (uint32_t bit = 1; bit <= DSC_I16; bit <<= 1) {
        PyObject *v = PyLong_FromUnsignedLong(bit);
        if (!v || PyDict_SetItemString(d, dsc_dtype_name(bit), v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

PyMethodDef dsc_view_methods[] = {
    {"view_info", (PyCFunction)(void (*)(void))view_info, METH_FASTCALL,
     "view_info(tensor, route=0) -> dict: the DLPack view of a tensor (route 1 exchange API, "
     "2 __dlpack__(max_version=(1, 0)), 3 legacy __dlpack__())."},
    {"check_view", (PyCFunction)(void (*)(void))check_view, METH_FASTCALL,
     "check_view(obj, name, dtypes, device, flags) -> dict: validate one argument."},
    {"check_list", (PyCFunction)(void (*)(void))check_list, METH_FASTCALL,
     "check_list(seq, name, dtypes, device, flags) -> int: validate a tensor list."},
    {"check_pair", (PyCFunction)(void (*)(void))check_pair, METH_FASTCALL,
     "check_pair(out, inp): out matches inp in numel and device and does not alias it."},
    {"check_lists", (PyCFunction)(void (*)(void))check_lists, METH_FASTCALL,
     "check_lists(a, b): two tensor lists agree in length, numel and device."},
    {"current_cuda_stream", (PyCFunction)(void (*)(void))current_cuda_stream, METH_FASTCALL,
     "current_cuda_stream(device) -> int: torch's current CUDA stream handle."},
    {"exchange_api_version", (PyCFunction)(void (*)(void))exchange_api_version, METH_FASTCALL,
     "exchange_api_version() -> (major, minor) | None"},
    {"dtype_flags", (PyCFunction)(void (*)(void))dtype_flags, METH_FASTCALL,
     "dtype_flags() -> dict of dtype name to spec bit."},
    {NULL, NULL, 0, NULL},
};
