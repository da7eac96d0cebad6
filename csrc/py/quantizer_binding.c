/* Python face of block-wise quantization (dsc/quantize.h). Built twice: for host tensors over
 * csrc/cpu/quantize.c (op `quantizer`), and with DSC_Q_ON_CUDA for device tensors over the launchers
 * of csrc/cuda/quantize.cu (op `quantizer_cuda`, on torch's current stream). The shim
 * (deepspeed_c/ops/quantizer/quantizer.py) allocates every output; each argument is validated here
 * (dtype, device, contiguity, size) before a kernel runs.
 *
 *   quantize(x, segments, block, bits, q_out, scales_out)
 *   dequantize(q, scales, segments, block, bits, out)
 *   dequantize_sum(q, scales, segments, block, bits, out)     out: one segment, fp32, the sum     */
#include "dsc/tensor_view.h" /* Python.h first */
#include "dsc/module.h"
#include "dsc/quantize.h"

#ifdef DSC_Q_ON_CUDA
#include "dsc/quantize_cuda.h"
#define DEV DSC_DEV_CUDA
#else
#define DEV DSC_DEV_CPU
#endif

#define SPEC(var, name, dtypes) static const dsc_arg_spec var = {name, dtypes, DEV, DSC_CONTIGUOUS}

SPEC(X, "x", DSC_F32 | DSC_BF16 | DSC_F16);
SPEC(OUT, "out", DSC_F32 | DSC_BF16 | DSC_F16);
SPEC(SUM_OUT, "out", DSC_F32);
SPEC(Q, "q", DSC_U8 | DSC_I8);
SPEC(Q_OUT, "q_out", DSC_U8 | DSC_I8);
SPEC(SCALES, "scales", DSC_F32);
SPEC(SCALES_OUT, "scales_out", DSC_F32);

static int q_dtype(uint32_t d) { return d == DSC_BF16 ? DSC_Q_BF16 : d == DSC_F16 ? DSC_Q_F16 : DSC_Q_F32; }

/* segments, block, bits read and checked; *seg from `numel` elements in `segments` segments */
static int layout(PyObject *const *args, const char *numel_name, int64_t numel, int64_t *segments, int64_t *seg,
                  int64_t *block, int64_t *bits) {
    if (dsc_arg_int64(args[0], "segments", segments) < 0 || dsc_arg_int64(args[1], "block", block) < 0 ||
        dsc_arg_int64(args[2], "bits", bits) < 0)
        return -1;
    if (*bits != 8 && *bits != 4) {
        PyErr_Format(PyExc_ValueError, "argument 'bits' must be 8 or 4, got %lld", (long long)*bits);
        return -1;
    }
    if (*block < 1 || (*bits == 4 && (*block & 1))) {
        PyErr_Format(PyExc_ValueError, "argument 'block' must be a positive%s number of elements, got %lld",
                     *bits == 4 ? " even" : "", (long long)*block);
        return -1;
    }
    if (*segments < 1 || numel % *segments != 0) {
        PyErr_Format(PyExc_ValueError, "argument 'segments' (%lld) must be >= 1 and divide the %lld elements of '%s'",
                     (long long)*segments, (long long)numel, numel_name);
        return -1;
    }
    *seg = numel / *segments;
    return 0;
}

static int want_numel(const dsc_view *v, const char *name, int64_t n) {
    if (v->numel == n) return 0;
    PyErr_Format(PyExc_ValueError, "argument '%s' must have %lld elements, got %lld", name, (long long)n,
                 (long long)v->numel);
    return -1;
}

static PyObject *core_error(int rc, const char *fname) {
#ifdef DSC_Q_ON_CUDA
    if (rc > 0) {
        PyErr_Format(PyExc_RuntimeError, "%s: CUDA error %d (%s)", fname, rc, dsc_q_cuda_strerror(rc));
        return NULL;
    }
#endif
    PyErr_Format(PyExc_ValueError, "%s: invalid sizes", fname);
    return NULL;
}

#ifdef DSC_Q_ON_CUDA
#define DSC_DEVICE_ENTER dsc_q_cuda_enter
#define DSC_DEVICE_LEAVE dsc_q_cuda_leave
#endif
#define DSC_DEVICE_FAIL core_error
#include "dsc/binding_device.h"

static int same_device(const dsc_view *a, const char *an, const dsc_view *b, const char *bn) {
    return dsc_check_same_device(an, a, bn, b);
}

static PyObject *py_quantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("quantize", nargs, 6) < 0) return NULL;
    dsc_view x, q, sc;
    int64_t segments, seg, block, bits;
    if (dsc_view_from_object(args[0], &X, &x) < 0 ||
        layout(args + 1, "x", x.numel, &segments, &seg, &block, &bits) < 0 ||
        dsc_view_from_object(args[4], &Q_OUT, &q) < 0 || dsc_view_from_object(args[5], &SCALES_OUT, &sc) < 0)
        return NULL;
    if (want_numel(&q, "q_out", segments * dsc_q_segment_bytes(seg, (int)bits)) < 0 ||
        want_numel(&sc, "scales_out", segments * dsc_q_blocks_per_segment(seg, block)) < 0 ||
        same_device(&q, "q_out", &x, "x") < 0 || same_device(&sc, "scales_out", &x, "x") < 0)
        return NULL;
    if (x.numel == 0) Py_RETURN_NONE;
    STREAM_OF(x, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(dsc_quantize, x.data, q_dtype(x.dtype), segments, seg, block, (int)bits, (uint8_t *)q.data,
              (float *)sc.data);
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_Q_OK) return core_error(rc, "quantize");
    Py_RETURN_NONE;
}

/* q and scales checked against the layout of `segments` segments of `seg` elements */
static int check_codes(const dsc_view *q, const dsc_view *sc, const dsc_view *out, int64_t segments, int64_t seg,
                       int64_t block, int64_t bits) {
    if (want_numel(q, "q", segments * dsc_q_segment_bytes(seg, (int)bits)) < 0 ||
        want_numel(sc, "scales", segments * dsc_q_blocks_per_segment(seg, block)) < 0 ||
        same_device(q, "q", out, "out") < 0 || same_device(sc, "scales", out, "out") < 0)
        return -1;
    return 0;
}

static PyObject *py_dequantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("dequantize", nargs, 6) < 0) return NULL;
    dsc_view q, sc, out;
    int64_t segments, seg, block, bits;
    if (dsc_view_from_object(args[0], &Q, &q) < 0 || dsc_view_from_object(args[1], &SCALES, &sc) < 0 ||
        dsc_view_from_object(args[5], &OUT, &out) < 0 ||
        layout(args + 2, "out", out.numel, &segments, &seg, &block, &bits) < 0 ||
        check_codes(&q, &sc, &out, segments, seg, block, bits) < 0)
        return NULL;
    if (out.numel == 0) Py_RETURN_NONE;
    STREAM_OF(out, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(dsc_dequantize, (const uint8_t *)q.data, (const float *)sc.data, segments, seg, block, (int)bits,
              out.data, q_dtype(out.dtype));
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_Q_OK) return core_error(rc, "dequantize");
    Py_RETURN_NONE;
}

static PyObject *py_dequantize_sum(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("dequantize_sum", nargs, 6) < 0) return NULL;
    dsc_view q, sc, out;
    int64_t segments, seg, block, bits;
    if (dsc_view_from_object(args[0], &Q, &q) < 0 || dsc_view_from_object(args[1], &SCALES, &sc) < 0 ||
        dsc_view_from_object(args[5], &SUM_OUT, &out) < 0 || dsc_arg_int64(args[2], "segments", &segments) < 0)
        return NULL;
    if (segments < 1)
        return PyErr_Format(PyExc_ValueError, "argument 'segments' must be >= 1, got %lld", (long long)segments);
    /* out is one segment: the layout is segments x out.numel */
    if (layout(args + 2, "out", out.numel * segments, &segments, &seg, &block, &bits) < 0 ||
        check_codes(&q, &sc, &out, segments, seg, block, bits) < 0)
        return NULL;
    if (out.numel == 0) Py_RETURN_NONE;
    STREAM_OF(out, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(dsc_dequantize_sum, (const uint8_t *)q.data, (const float *)sc.data, segments, seg, block, (int)bits,
              (float *)out.data);
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_Q_OK) return core_error(rc, "dequantize_sum");
    Py_RETURN_NONE;
}

#define METHOD(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}

static PyMethodDef methods[] = {
    METHOD("quantize", py_quantize, "quantize(x, segments, block, bits, q_out, scales_out): codes and block scales."),
    METHOD("dequantize", py_dequantize, "dequantize(q, scales, segments, block, bits, out): values back."),
    METHOD("dequantize_sum", py_dequantize_sum,
           "dequantize_sum(q, scales, segments, block, bits, out): the segments dequantized and summed (fp32)."),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR,
                                        "deepspeed_c block-wise int8/int4 quantization (ZeRO++).", -1, methods, NULL,
                                        NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
