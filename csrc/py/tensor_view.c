/* Borrowed tensor views through DLPack, validated against a per-argument spec.
 *
 * Route order (ARCHITECTURE.md): the C exchange API published on the tensor's type (torch >=
 * 2.10, ~70 ns a tensor, no Python-level call), then __dlpack__(max_version=(1, 0)), then the
 * legacy __dlpack__(). The fallbacks consume the capsule at once: the view keeps only the data
 * pointer and copied shape/strides, so the caller's tensor is what keeps the memory alive. */
#include "dsc/tensor_view.h"

#include <string.h>

#include "dsc/dlpack_abi.h"

static PyObject *g_tensor_type;    /* torch.Tensor */
static PyObject *g_parameter_type; /* torch.nn.Parameter */

/* One-entry-per-type cache of the exchange table (None looked up -> NULL stored). */
#define EXCHANGE_CACHE 8
static struct {
    PyObject *type;
    const DLPackExchangeAPI *api;
} g_exchange_cache[EXCHANGE_CACHE];
static int g_exchange_cache_len;

static int ensure_torch_types(void) {
    if (g_tensor_type) return 0;
    PyObject *torch = PyImport_ImportModule("torch");
    if (!torch) return -1;
    PyObject *tensor = PyObject_GetAttrString(torch, "Tensor");
    PyObject *nn = tensor ? PyObject_GetAttrString(torch, "nn") : NULL;
    PyObject *param = nn ? PyObject_GetAttrString(nn, "Parameter") : NULL;
    Py_DECREF(torch);
    Py_XDECREF(nn);
    if (!tensor || !param) {
        Py_XDECREF(tensor);
        Py_XDECREF(param);
        return -1;
    }
    g_tensor_type = tensor; /* kept for the process lifetime */
    g_parameter_type = param;
    return 0;
}

const char *dsc_dtype_name(uint32_t dtype) {
    switch (dtype) {
    case DSC_F32: return "float32";
    case DSC_F16: return "float16";
    case DSC_BF16: return "bfloat16";
    case DSC_F64: return "float64";
    case DSC_I32: return "int32";
    case DSC_I64: return "int64";
    case DSC_U8: return "uint8";
    case DSC_I8: return "int8";
    case DSC_BOOL: return "bool";
    case DSC_I16: return "int16";
    default: return "unknown";
    }
}

static const char *device_name(int device) {
    switch (device) {
    case DSC_DEV_CPU: return "cpu";
    case DSC_DEV_CUDA: return "cuda";
    default: return "any";
    }
}

/* "float32 or bfloat16" for an allowed-dtype mask. */
static void describe_dtypes(uint32_t mask, char *buf, size_t cap) {
    buf[0] = '\0';
    if (mask == DSC_ANY_DTYPE) {
        snprintf(buf, cap, "any dtype");
        return;
    }
    int first = 1;
    for (uint32_t bit = 1; bit && bit <= DSC_I16; bit <<= 1) {
        if (!(mask & bit)) continue;
        size_t used = strlen(buf);
        snprintf(buf + used, cap - used, "%s%s", first ? "" : " or ", dsc_dtype_name(bit));
        first = 0;
    }
}

static int dtype_from_dl(DLDataType t, uint32_t *dtype, int32_t *itemsize) {
    if (t.lanes != 1) return -1;
    uint32_t d = 0;
    switch (t.code) {
    case DSC_DL_FLOAT: d = t.bits == 32 ? DSC_F32 : t.bits == 16 ? DSC_F16 : t.bits == 64 ? DSC_F64 : 0; break;
    case DSC_DL_BFLOAT: d = t.bits == 16 ? DSC_BF16 : 0; break;
    case DSC_DL_INT:
        d = t.bits == 32 ? DSC_I32 : t.bits == 64 ? DSC_I64 : t.bits == 8 ? DSC_I8 : t.bits == 16 ? DSC_I16 : 0;
        break;
    case DSC_DL_UINT: d = t.bits == 8 ? DSC_U8 : 0; break;
    case DSC_DL_BOOL: d = t.bits == 8 ? DSC_BOOL : 0; break;
    default: break;
    }
    if (!d) return -1;
    *dtype = d;
    *itemsize = t.bits / 8;
    return 0;
}

/* Fill `out` from a DLTensor; the DLTensor may be freed right after. */
static int view_from_dltensor(const DLTensor *t, const char *name, dsc_view *out) {
    memset(out, 0, sizeof(*out));
    if (dtype_from_dl(t->dtype, &out->dtype, &out->itemsize) < 0) {
        PyErr_Format(PyExc_TypeError,
                     "argument '%s': unsupported tensor dtype (DLPack code=%d bits=%d lanes=%d); "
                     "expected a real floating, integer or bool dtype",
                     name, (int)t->dtype.code, (int)t->dtype.bits, (int)t->dtype.lanes);
        return -1;
    }
    switch (t->device.device_type) {
    case DSC_DL_CPU:
    case DSC_DL_CUDA_HOST: out->device = DSC_DEV_CPU; break;
    case DSC_DL_CUDA:
    case DSC_DL_CUDA_MANAGED: out->device = DSC_DEV_CUDA; break;
    default:
        PyErr_Format(PyExc_TypeError, "argument '%s': tensors on DLPack device type %d are not supported "
                     "(expected cpu or cuda)", name, (int)t->device.device_type);
        return -1;
    }
    out->device_id = t->device.device_id;
    if (t->ndim < 0 || t->ndim > DSC_MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "argument '%s': %d dimensions; at most %d are supported",
                     name, (int)t->ndim, DSC_MAX_DIMS);
        return -1;
    }
    out->ndim = t->ndim;
    out->data = (char *)t->data + t->byte_offset;
    int64_t numel = 1;
    for (int i = 0; i < t->ndim; i++) {
        out->shape[i] = t->shape[i];
        numel *= t->shape[i];
    }
    out->numel = numel;
    /* compact row-major strides, filled when DLPack says NULL */
    int64_t expect = 1;
    int contiguous = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        out->strides[i] = t->strides ? t->strides[i] : expect;
        if (out->shape[i] != 1 && out->strides[i] != expect) contiguous = 0;
        expect *= out->shape[i];
    }
    out->contiguous = numel == 0 ? 1 : contiguous;
    return 0;
}

static const DLPackExchangeAPI *exchange_api_for_type(PyObject *type) {
    for (int i = 0; i < g_exchange_cache_len; i++)
        if (g_exchange_cache[i].type == type) return g_exchange_cache[i].api;
    const DLPackExchangeAPI *api = NULL;
    PyObject *cap = PyObject_GetAttrString(type, "__dlpack_c_exchange_api__");
    if (!cap) {
        PyErr_Clear();
    } else {
        if (PyCapsule_IsValid(cap, "dlpack_exchange_api")) {
            const DLPackExchangeAPI *candidate = PyCapsule_GetPointer(cap, "dlpack_exchange_api");
            if (candidate && candidate->header.version.major == 1 &&
                candidate->dltensor_from_py_object_no_sync)
                api = candidate; /* the table lives for the whole process */
        }
        Py_DECREF(cap);
    }
    if (g_exchange_cache_len < EXCHANGE_CACHE) {
        Py_INCREF(type); /* types in the cache are kept alive */
        g_exchange_cache[g_exchange_cache_len].type = type;
        g_exchange_cache[g_exchange_cache_len].api = api;
        g_exchange_cache_len++;
    }
    return api;
}

static int view_via_exchange(PyObject *obj, const DLPackExchangeAPI *api, const char *name,
                             dsc_view *out) {
    DLTensor t;
    memset(&t, 0, sizeof(t));
    if (api->dltensor_from_py_object_no_sync(obj, &t) != 0) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "argument '%s': the DLPack exchange API refused the tensor", name);
        return -1;
    }
    return view_from_dltensor(&t, name, out);
}

/* __dlpack__ routes: detach (so parameters that require grad are accepted), export, copy the
 * metadata, then consume the capsule ourselves. */
static int view_via_dunder(PyObject *obj, int versioned, const char *name, dsc_view *out) {
    PyObject *detached = PyObject_CallMethod(obj, "detach", NULL);
    if (!detached) return -1;
    PyObject *method = PyObject_GetAttrString(detached, "__dlpack__");
    PyObject *capsule = NULL;
    if (method) {
        PyObject *args = PyTuple_New(0);
        PyObject *kwargs = versioned ? Py_BuildValue("{s:(ii)}", "max_version", 1, 0) : NULL;
        if (args && (!versioned || kwargs)) capsule = PyObject_Call(method, args, kwargs);
        Py_XDECREF(args);
        Py_XDECREF(kwargs);
        Py_DECREF(method);
    }
    int rc = -1;
    if (!capsule) goto done;
    if (versioned && PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        DLManagedTensorVersioned *mt = PyCapsule_GetPointer(capsule, "dltensor_versioned");
        rc = view_from_dltensor(&mt->dl_tensor, name, out);
        PyCapsule_SetName(capsule, "used_dltensor_versioned");
        if (mt->deleter) mt->deleter(mt);
    } else if (!versioned && PyCapsule_IsValid(capsule, "dltensor")) {
        DLManagedTensor *mt = PyCapsule_GetPointer(capsule, "dltensor");
        rc = view_from_dltensor(&mt->dl_tensor, name, out);
        PyCapsule_SetName(capsule, "used_dltensor");
        if (mt->deleter) mt->deleter(mt);
    } else {
        PyErr_Format(PyExc_TypeError, "argument '%s': __dlpack__ returned an unexpected object", name);
    }
done:
    Py_XDECREF(capsule);
    Py_DECREF(detached);
    return rc;
}

static int check_is_tensor(PyObject *obj, const char *name) {
    if (ensure_torch_types() < 0) return -1;
    PyObject *type = (PyObject *)Py_TYPE(obj);
    if (type == g_tensor_type || type == g_parameter_type) return 0;
    int is_param = PyObject_IsSubclass(type, g_parameter_type);
    if (is_param < 0) return -1;
    if (is_param) return 0;
    int is_tensor = PyObject_IsInstance(obj, g_tensor_type);
    if (is_tensor < 0) return -1;
    if (is_tensor) {
        PyErr_Format(PyExc_TypeError,
                     "argument '%s' must be a plain torch.Tensor or nn.Parameter, got the tensor "
                     "subclass %R; pass a plain tensor (e.g. .to_local() or .detach())", name, type);
    } else {
        PyErr_Format(PyExc_TypeError, "argument '%s' must be a torch.Tensor, got %R", name, type);
    }
    return -1;
}

static int validate(const dsc_view *v, const dsc_arg_spec *spec, const char *name) {
    if (!(spec->dtypes & v->dtype)) {
        char want[160];
        describe_dtypes(spec->dtypes, want, sizeof(want));
        PyErr_Format(PyExc_TypeError, "argument '%s' must be %s, got %s", name, want,
                     dsc_dtype_name(v->dtype));
        return -1;
    }
    if (spec->device != DSC_DEV_ANY && spec->device != v->device) {
        PyErr_Format(PyExc_ValueError, "argument '%s' must be on the %s device, got a %s tensor", name,
                     device_name(spec->device), device_name(v->device));
        return -1;
    }
    if ((spec->flags & DSC_CONTIGUOUS) && !v->contiguous) {
        PyErr_Format(PyExc_ValueError, "argument '%s' must be contiguous, got strides that are not "
                     "row-major compact; call .contiguous() first", name);
        return -1;
    }
    if ((spec->flags & DSC_ALIGNED16) && ((uintptr_t)v->data & 15u)) {
        PyErr_Format(PyExc_ValueError, "argument '%s' must be 16-byte aligned", name);
        return -1;
    }
    return 0;
}

static int view_named(PyObject *obj, const dsc_arg_spec *spec, dsc_route route, const char *name,
                      dsc_view *out) {
    if (obj == Py_None) {
        if (spec->flags & DSC_ALLOW_NONE) {
            memset(out, 0, sizeof(*out));
            out->is_none = 1;
            return 0;
        }
        PyErr_Format(PyExc_TypeError, "argument '%s' must be a torch.Tensor, got None", name);
        return -1;
    }
    if (check_is_tensor(obj, name) < 0) return -1;
    int rc;
    if (route == DSC_ROUTE_AUTO || route == DSC_ROUTE_EXCHANGE) {
        const DLPackExchangeAPI *api = exchange_api_for_type((PyObject *)Py_TYPE(obj));
        if (api) {
            rc = view_via_exchange(obj, api, name, out);
        } else if (route == DSC_ROUTE_EXCHANGE) {
            PyErr_Format(PyExc_RuntimeError, "argument '%s': this torch has no DLPack C exchange API "
                         "(needs torch >= 2.10)", name);
            return -1;
        } else {
            rc = view_via_dunder(obj, 1, name, out);
            if (rc < 0 && PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear(); /* torch < 2.9: no max_version keyword */
                rc = view_via_dunder(obj, 0, name, out);
            }
        }
    } else {
        rc = view_via_dunder(obj, route == DSC_ROUTE_VERSIONED, name, out);
    }
    if (rc < 0) return -1;
    return validate(out, spec, name);
}

int dsc_view_from_object_route(PyObject *obj, const dsc_arg_spec *spec, dsc_route route,
                               dsc_view *out) {
    return view_named(obj, spec, route, spec->name, out);
}

int dsc_view_from_object(PyObject *obj, const dsc_arg_spec *spec, dsc_view *out) {
    return view_named(obj, spec, DSC_ROUTE_AUTO, spec->name, out);
}

int dsc_view_list_from_object(PyObject *seq, const dsc_arg_spec *spec, dsc_view_list *out) {
    out->items = NULL;
    out->len = 0;
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "argument '%s' must be a list or tuple of tensors, got %R",
                     spec->name, (PyObject *)Py_TYPE(seq));
        return -1;
    }
    Py_ssize_t n = PySequence_Size(seq);
    if (n < 0) return -1;
    dsc_view *items = PyMem_Malloc(sizeof(dsc_view) * (size_t)(n > 0 ? n : 1));
    if (!items) {
        PyErr_NoMemory();
        return -1;
    }
    char name[128];
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(seq, i); /* new ref; the sequence keeps it alive */
        if (!item) goto fail;
        int rc = view_named(item, spec, DSC_ROUTE_AUTO, spec->name, &items[i]);
        if (rc < 0) {
            /* the item's indexed name is formatted only on failure (hot path: lists of
             * thousands of tensors); re-run to raise with it */
            PyErr_Clear();
            snprintf(name, sizeof(name), "%s[%zd]", spec->name, i);
            rc = view_named(item, spec, DSC_ROUTE_AUTO, name, &items[i]);
            if (rc == 0) { /* cannot happen for a deterministic check; fail safe anyway */
                PyErr_Format(PyExc_RuntimeError, "argument '%s': inconsistent validation", name);
                rc = -1;
            }
        }
        Py_DECREF(item);
        if (rc < 0) goto fail;
        if (i > 0 && !items[i].is_none && !items[0].is_none &&
            (items[i].device != items[0].device || items[i].device_id != items[0].device_id)) {
            PyErr_Format(PyExc_ValueError,
                         "argument '%s': all tensors must be on one device; item 0 is on %s:%d, "
                         "item %zd is on %s:%d", spec->name, device_name(items[0].device),
                         (int)items[0].device_id, i, device_name(items[i].device), (int)items[i].device_id);
            goto fail;
        }
    }
    out->items = items;
    out->len = n;
    return 0;
fail:
    PyMem_Free(items);
    return -1;
}

void dsc_view_list_release(dsc_view_list *list) {
    PyMem_Free(list->items);
    list->items = NULL;
    list->len = 0;
}

int dsc_check_same_len(const char *a_name, Py_ssize_t a, const char *b_name, Py_ssize_t b) {
    if (a == b) return 0;
    PyErr_Format(PyExc_ValueError, "arguments '%s' and '%s' must have the same length, got %zd and %zd",
                 a_name, b_name, a, b);
    return -1;
}

int dsc_check_same_numel(const char *a_name, const dsc_view *a, const char *b_name, const dsc_view *b) {
    if (a->numel == b->numel) return 0;
    PyErr_Format(PyExc_ValueError, "arguments '%s' and '%s' must have the same number of elements, "
                 "got %lld and %lld", a_name, b_name, (long long)a->numel, (long long)b->numel);
    return -1;
}

int dsc_check_same_device(const char *a_name, const dsc_view *a, const char *b_name, const dsc_view *b) {
    if (a->device == b->device && a->device_id == b->device_id) return 0;
    PyErr_Format(PyExc_ValueError, "arguments '%s' and '%s' must be on the same device, got %s:%d and %s:%d",
                 a_name, b_name, device_name(a->device), (int)a->device_id, device_name(b->device),
                 (int)b->device_id);
    return -1;
}

int dsc_check_no_alias(const char *out_name, const dsc_view *out, const char *in_name, const dsc_view *in) {
    if (out->is_none || in->is_none || out->numel == 0 || in->numel == 0) return 0;
    if (out->device != in->device || out->device_id != in->device_id) return 0;
    uintptr_t o0 = (uintptr_t)out->data, o1 = o0 + (uintptr_t)(out->numel * out->itemsize);
    uintptr_t i0 = (uintptr_t)in->data, i1 = i0 + (uintptr_t)(in->numel * in->itemsize);
    if (o0 < i1 && i0 < o1) {
        PyErr_Format(PyExc_ValueError, "output argument '%s' overlaps input argument '%s' in memory; "
                     "pass a separate output tensor", out_name, in_name);
        return -1;
    }
    return 0;
}

int dsc_check_lists_match(const char *a_name, const dsc_view_list *a, const char *b_name,
                          const dsc_view_list *b) {
    if (dsc_check_same_len(a_name, a->len, b_name, b->len) < 0) return -1;
    for (Py_ssize_t i = 0; i < a->len; i++) {
        if (a->items[i].numel != b->items[i].numel) {
            PyErr_Format(PyExc_ValueError, "'%s[%zd]' has %lld elements but '%s[%zd]' has %lld", a_name, i,
                         (long long)a->items[i].numel, b_name, i, (long long)b->items[i].numel);
            return -1;
        }
    }
    if (a->len > 0) {
        char an[128], bn[128];
        snprintf(an, sizeof(an), "%s[0]", a_name);
        snprintf(bn, sizeof(bn), "%s[0]", b_name);
        return dsc_check_same_device(an, &a->items[0], bn, &b->items[0]);
    }
    return 0;
}

void *dsc_current_cuda_stream(int device_id) {
    if (ensure_torch_types() < 0) return NULL;
    const DLPackExchangeAPI *api = exchange_api_for_type(g_tensor_type);
    if (api && api->current_work_stream) {
        void *stream = NULL;
        if (api->current_work_stream(DSC_DL_CUDA, device_id, &stream) != 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "current_work_stream failed");
            return NULL;
        }
        return stream;
    }
    /* torch < 2.10 */
    PyObject *torch_c = PyImport_ImportModule("torch._C");
    if (!torch_c) return NULL;
    PyObject *raw = PyObject_CallMethod(torch_c, "_cuda_getCurrentRawStream", "i", device_id);
    Py_DECREF(torch_c);
    if (!raw) return NULL;
    void *stream = PyLong_AsVoidPtr(raw);
    Py_DECREF(raw);
    return stream;
}

int dsc_arg_double(PyObject *obj, const char *name, double *out) {
    if (!PyFloat_Check(obj) && !PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "argument '%s' must be a float, got %R", name, (PyObject *)Py_TYPE(obj));
        return -1;
    }
    *out = PyFloat_AsDouble(obj);
    return PyErr_Occurred() ? -1 : 0;
}

int dsc_arg_int64(PyObject *obj, const char *name, int64_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "argument '%s' must be an int, got %R", name, (PyObject *)Py_TYPE(obj));
        return -1;
    }
    *out = PyLong_AsLongLong(obj);
    return PyErr_Occurred() ? -1 : 0;
}

int dsc_check_nargs(const char *fname, Py_ssize_t nargs, Py_ssize_t expected) {
    if (nargs == expected) return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)", fname, expected, nargs);
    return -1;
}
