/* Python face of the 1-bit compression core (dsc/onebit.h). Built twice: for host tensors over
 * csrc/cpu/onebit.c (op `onebit`, one build per SIMD level), and with DSC_ONEBIT_ON_CUDA for device
 * tensors over the launchers of csrc/cuda/onebit.cu (op `onebit_cuda`, on torch's current stream).
 * The shim (deepspeed_c/runtime/comm/sign_codec.py) allocates every output. Every argument is
 * validated here (dtype, device, contiguity, sizes); on the host the segment table is checked
 * against the buffers too, on a GPU it lives on the device and the shim checks it when building it.
 *
 *   compensate(y, err|None, segs, sumsq_out, max_len)
 *   pack(y, err|None, bits_out, segs, scales, max_len)
 *   unpack(bits, out, segs, scales, accumulate, max_len)                                     */
#include "dsc/tensor_view.h" /* Python.h first */
#include "dsc/onebit.h"
#include "dsc/module.h"

#ifdef DSC_ONEBIT_ON_CUDA
#include "dsc/onebit_cuda.h"
#define DEV DSC_DEV_CUDA
#else
#define DEV DSC_DEV_CPU
#endif

#define SPEC(var, name, dtypes, flags) static const dsc_arg_spec var = {name, dtypes, DEV, DSC_CONTIGUOUS | (flags)}

SPEC(Y, "y", DSC_F32, 0);
SPEC(ERR, "err", DSC_F32, DSC_ALLOW_NONE);
SPEC(SEGS, "segs", DSC_I64, 0);
SPEC(SUMSQ, "sumsq_out", DSC_F64, 0);
SPEC(BITS_OUT, "bits_out", DSC_U8, 0);
SPEC(BITS, "bits", DSC_U8, 0);
SPEC(SCALES, "scales", DSC_F32, 0);
SPEC(OUT, "out", DSC_F32, 0);

static PyObject *core_error(int rc, const char *fname) {
#ifdef DSC_ONEBIT_ON_CUDA
    if (rc > 0)
        return PyErr_Format(PyExc_RuntimeError, "%s: CUDA error %d (%s)", fname, rc, dsc_onebit_cuda_strerror(rc));
#endif
    return PyErr_Format(PyExc_ValueError, "%s: invalid segment table (a negative size or an offset not a multiple "
                        "of 8)", fname);
}

/* segs must be [nseg, 3]; on the host every row must fit the buffers it addresses */
static int check_segs(const dsc_view *segs, int64_t max_len, int64_t elems, const char *elems_name, int64_t bytes,
                      const char *bytes_name, int64_t nscales, const char *scales_name) {
    if (segs->ndim != 2 || segs->shape[1] != 3) {
        PyErr_Format(PyExc_ValueError,
                     "argument 'segs' must be [segments, 3] (offset, length, scale index), got %d dims", segs->ndim);
        return -1;
    }
    if (max_len < 0) {
        PyErr_Format(PyExc_ValueError, "argument 'max_len' must be >= 0, got %lld", (long long)max_len);
        return -1;
    }
#ifdef DSC_ONEBIT_ON_CUDA
    (void)elems, (void)elems_name, (void)bytes, (void)bytes_name, (void)nscales, (void)scales_name;
    return 0;
#else
    const int64_t *t = (const int64_t *)segs->data;
    for (int64_t s = 0; s < segs->shape[0]; s++) {
        const int64_t off = t[3 * s], len = t[3 * s + 1], idx = t[3 * s + 2];
        const char *why = NULL;
        if (off < 0 || len < 0) why = "a negative offset or length";
        else if (off % 8) why = "an offset that is not a multiple of 8";
        else if (len > max_len) why = "a length above max_len";
        else if (off > elems - len) why = elems_name;
        else if (bytes >= 0 && (off + len + 7) / 8 > bytes) why = bytes_name;
        else if (idx < 0 || idx >= nscales) why = scales_name;
        if (why) {
            PyErr_Format(PyExc_ValueError, "segment %lld (offset %lld, length %lld, scale index %lld) is invalid: %s",
                         (long long)s, (long long)off, (long long)len, (long long)idx, why);
            return -1;
        }
    }
    return 0;
#endif
}

#ifdef DSC_ONEBIT_ON_CUDA
#define DSC_DEVICE_ENTER dsc_onebit_cuda_enter
#define DSC_DEVICE_LEAVE dsc_onebit_cuda_leave
#define MAXLEN(m) m,
#else
#define MAXLEN(m)
#endif
#define DSC_DEVICE_FAIL core_error
#include "dsc/binding_device.h"

static int same_numel(const dsc_view *a, const char *an, const dsc_view *b, const char *bn) {
    if (b->is_none) return 0;
    return dsc_check_same_numel(an, a, bn, b);
}

static PyObject *py_compensate(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("compensate", nargs, 5) < 0) return NULL;
    dsc_view y, err, segs, sumsq;
    int64_t max_len;
    if (dsc_view_from_object(args[0], &Y, &y) < 0 || dsc_view_from_object(args[1], &ERR, &err) < 0 ||
        dsc_view_from_object(args[2], &SEGS, &segs) < 0 || dsc_view_from_object(args[3], &SUMSQ, &sumsq) < 0 ||
        dsc_arg_int64(args[4], "max_len", &max_len) < 0)
        return NULL;
    if (same_numel(&y, "y", &err, "err") < 0 || (!err.is_none && dsc_check_same_device("err", &err, "y", &y) < 0) ||
        dsc_check_same_device("sumsq_out", &sumsq, "y", &y) < 0 || dsc_check_same_device("segs", &segs, "y", &y) < 0)
        return NULL;
    if (check_segs(&segs, max_len, y.numel, "it runs past the end of 'y'", -1, "", sumsq.numel,
                   "its scale index is outside 'sumsq_out'") < 0)
        return NULL;
    STREAM_OF(y, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(dsc_onebit_compensate, y.data, err.is_none ? NULL : err.data, segs.data, segs.shape[0],
              MAXLEN(max_len) sumsq.data);
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_ONEBIT_OK) return core_error(rc, "compensate");
    Py_RETURN_NONE;
}

static PyObject *py_pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("pack", nargs, 6) < 0) return NULL;
    dsc_view y, err, bits, segs, scales;
    int64_t max_len;
    if (dsc_view_from_object(args[0], &Y, &y) < 0 || dsc_view_from_object(args[1], &ERR, &err) < 0 ||
        dsc_view_from_object(args[2], &BITS_OUT, &bits) < 0 || dsc_view_from_object(args[3], &SEGS, &segs) < 0 ||
        dsc_view_from_object(args[4], &SCALES, &scales) < 0 || dsc_arg_int64(args[5], "max_len", &max_len) < 0)
        return NULL;
    if (same_numel(&y, "y", &err, "err") < 0 || (!err.is_none && dsc_check_same_device("err", &err, "y", &y) < 0) ||
        dsc_check_same_device("bits_out", &bits, "y", &y) < 0 || dsc_check_same_device("segs", &segs, "y", &y) < 0 ||
        dsc_check_same_device("scales", &scales, "y", &y) < 0)
        return NULL;
    if (check_segs(&segs, max_len, y.numel, "it runs past the end of 'y'", bits.numel,
                   "its bits run past the end of 'bits_out'", scales.numel, "its scale index is outside 'scales'") < 0)
        return NULL;
    STREAM_OF(y, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(dsc_onebit_pack, y.data, err.is_none ? NULL : err.data, bits.data, segs.data, segs.shape[0],
              MAXLEN(max_len) scales.data);
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_ONEBIT_OK) return core_error(rc, "pack");
    Py_RETURN_NONE;
}

static PyObject *py_unpack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("unpack", nargs, 6) < 0) return NULL;
    dsc_view bits, out, segs, scales;
    int64_t accumulate, max_len;
    if (dsc_view_from_object(args[0], &BITS, &bits) < 0 || dsc_view_from_object(args[1], &OUT, &out) < 0 ||
        dsc_view_from_object(args[2], &SEGS, &segs) < 0 || dsc_view_from_object(args[3], &SCALES, &scales) < 0)
        return NULL;
    accumulate = PyObject_IsTrue(args[4]);
    if (accumulate < 0 || dsc_arg_int64(args[5], "max_len", &max_len) < 0) return NULL;
    if (dsc_check_same_device("out", &out, "bits", &bits) < 0 ||
        dsc_check_same_device("segs", &segs, "bits", &bits) < 0 ||
        dsc_check_same_device("scales", &scales, "bits", &bits) < 0)
        return NULL;
    if (check_segs(&segs, max_len, out.numel, "it runs past the end of 'out'", bits.numel,
                   "its bits run past the end of 'bits'", scales.numel, "its scale index is outside 'scales'") < 0)
        return NULL;
    STREAM_OF(out, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(dsc_onebit_unpack, bits.data, out.data, segs.data, segs.shape[0], MAXLEN(max_len) scales.data,
              (int)accumulate);
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_ONEBIT_OK) return core_error(rc, "unpack");
    Py_RETURN_NONE;
}

#define METHOD(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}

static PyMethodDef methods[] = {
    METHOD("compensate", py_compensate,
           "compensate(y, err, segs, sumsq_out, max_len): y += err, sumsq_out[idx] += sum of y^2 per segment."),
    METHOD("pack", py_pack,
           "pack(y, err, bits_out, segs, scales, max_len): sign bits of y; err = y - scale * sign (err not None)."),
    METHOD("unpack", py_unpack,
           "unpack(bits, out, segs, scales, accumulate, max_len): out (+)= scale * sign from the bits."),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR,
                                        "deepspeed_c 1-bit compression core (sign pack/unpack with error feedback).",
                                        -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
