/* Bindings of the `utils` op: flatten(tensors, out) and unflatten(flat, tensors), host only.
 * The shim allocates `out`; every tensor must share out's dtype and be contiguous. */
#include "dsc/tensor_view.h" /* Python.h first */
#include "dsc/flatten.h"
#include "dsc/module.h"

static const dsc_arg_spec TENSORS = {"tensors", DSC_ANY_DTYPE, DSC_DEV_CPU, DSC_CONTIGUOUS};
static const dsc_arg_spec FLAT = {"flat", DSC_ANY_DTYPE, DSC_DEV_CPU, DSC_CONTIGUOUS};

/* Validate the pair and gather raw pointers and byte counts; -1 with an exception set. */
static int gather(PyObject *list_obj, PyObject *flat_obj, dsc_view_list *list, dsc_view *flat,
                  void ***ptrs, int64_t **nbytes) {
    if (dsc_view_list_from_object(list_obj, &TENSORS, list) < 0) return -1;
    if (dsc_view_from_object(flat_obj, &FLAT, flat) < 0) goto fail;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < list->len; i++) {
        if (list->items[i].dtype != flat->dtype) {
            PyErr_Format(PyExc_TypeError, "argument 'tensors[%zd]' must be %s like 'flat', got %s", i,
                         dsc_dtype_name(flat->dtype), dsc_dtype_name(list->items[i].dtype));
            goto fail;
        }
        if (dsc_check_no_alias("flat", flat, "tensors[i]", &list->items[i]) < 0) goto fail;
        total += list->items[i].numel;
    }
    if (total != flat->numel) {
        PyErr_Format(PyExc_ValueError, "argument 'flat' has %lld elements but the tensors hold %lld",
                     (long long)flat->numel, (long long)total);
        goto fail;
    }
    *ptrs = PyMem_Malloc(sizeof(void *) * (size_t)(list->len ? list->len : 1));
    *nbytes = PyMem_Malloc(sizeof(int64_t) * (size_t)(list->len ? list->len : 1));
    if (!*ptrs || !*nbytes) {
        PyMem_Free(*ptrs);
        PyMem_Free(*nbytes);
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < list->len; i++) {
        (*ptrs)[i] = list->items[i].data;
        (*nbytes)[i] = list->items[i].numel * list->items[i].itemsize;
    }
    return 0;
fail:
    dsc_view_list_release(list);
    return -1;
}

static PyObject *flatten(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("flatten", nargs, 2) < 0) return NULL;
    dsc_view_list list;
    dsc_view flat;
    void **ptrs;
    int64_t *nbytes;
    if (gather(args[0], args[1], &list, &flat, &ptrs, &nbytes) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    dsc_flatten_bytes((const void *const *)ptrs, nbytes, list.len, flat.data);
    Py_END_ALLOW_THREADS
    PyMem_Free(ptrs);
    PyMem_Free(nbytes);
    dsc_view_list_release(&list);
    Py_RETURN_NONE;
}

static PyObject *unflatten(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("unflatten", nargs, 2) < 0) return NULL;
    dsc_view_list list;
    dsc_view flat;
    void **ptrs;
    int64_t *nbytes;
    if (gather(args[1], args[0], &list, &flat, &ptrs, &nbytes) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    dsc_unflatten_bytes(flat.data, ptrs, nbytes, list.len);
    Py_END_ALLOW_THREADS
    PyMem_Free(ptrs);
    PyMem_Free(nbytes);
    dsc_view_list_release(&list);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"flatten", (PyCFunction)(void (*)(void))flatten, METH_FASTCALL,
     "flatten(tensors, out): copy the tensors back to back into the contiguous tensor out."},
    {"unflatten", (PyCFunction)(void (*)(void))unflatten, METH_FASTCALL,
     "unflatten(flat, tensors): copy consecutive slices of flat into the tensors."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR,
                                        "deepspeed_c utils op: host flatten/unflatten.", -1, methods,
                                        NULL, NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
