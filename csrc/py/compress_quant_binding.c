/* Python face of the fused fake quantizers (dsc/compress_quant.h). Built twice: for host tensors over
 * csrc/cpu/compress_quant.c (op `compress_quant`), and with DSC_CQ_ON_CUDA for device tensors over
 * csrc/cuda/compress_quant.cu (op `compress_quant_cuda`, on torch's current stream). The Python side
 * (deepspeed_c/compression/quant_kernels.py) allocates `out`; everything is checked here first.
 *
 *   fake_quant(x, out, groups, bits, asym, lo, hi, recip, seed)   lo, hi: None or fp32 (groups)
 *   ternary(x, out, groups, thres, alpha)                           thres, alpha: fp32 (groups)
 *   binary(x, out, groups, m)                                       m: fp32 (groups)            */
#include "dsc/tensor_view.h" /* Python.h first */
#include "dsc/compress_quant.h"
#include "dsc/module.h"

#ifdef DSC_CQ_ON_CUDA
#include "dsc/compress_quant_cuda.h"
#define DEV DSC_DEV_CUDA
#else
#define DEV DSC_DEV_CPU
#endif

static const dsc_arg_spec X = {"x", DSC_F32 | DSC_BF16 | DSC_F16, DEV, DSC_CONTIGUOUS};
static const dsc_arg_spec OUT = {"out", DSC_F32 | DSC_BF16 | DSC_F16, DEV, DSC_CONTIGUOUS};

static int cq_dtype(uint32_t d) { return d == DSC_BF16 ? DSC_CQ_BF16 : d == DSC_F16 ? DSC_CQ_F16 : DSC_CQ_F32; }

/* x and out: same dtype, device and size; groups divides it; *n the group length */
static int prepare(PyObject *const *args, dsc_view *x, dsc_view *out, int64_t *groups, int64_t *n) {
    if (dsc_view_from_object(args[0], &X, x) < 0 || dsc_view_from_object(args[1], &OUT, out) < 0 ||
        dsc_arg_int64(args[2], "groups", groups) < 0 || dsc_check_same_numel("out", out, "x", x) < 0 ||
        dsc_check_same_device("out", out, "x", x) < 0)
        return -1;
    if (out->dtype != x->dtype) {
        PyErr_SetString(PyExc_ValueError, "argument 'out' must have the dtype of 'x'");
        return -1;
    }
    if (*groups < 1 || x->numel % *groups != 0) {
        PyErr_Format(PyExc_ValueError, "argument 'groups' (%lld) must be >= 1 and divide the %lld elements of 'x'",
                     (long long)*groups, (long long)x->numel);
        return -1;
    }
    *n = x->numel / *groups;
    return 0;
}

/* an fp32 per-group vector on x's device (NULL data for an allowed None) */
static int stats(PyObject *obj, const char *name, const dsc_view *x, int64_t groups, int allow_none, float **data) {
    const dsc_arg_spec spec = {name, DSC_F32, DEV, DSC_CONTIGUOUS | (allow_none ? DSC_ALLOW_NONE : 0)};
    dsc_view v;
    if (dsc_view_from_object(obj, &spec, &v) < 0) return -1;
    *data = (float *)v.data;
    if (v.is_none) return 0;
    if (v.numel != groups) {
        PyErr_Format(PyExc_ValueError, "argument '%s' must have one element per group (%lld), got %lld", name,
                     (long long)groups, (long long)v.numel);
        return -1;
    }
    return dsc_check_same_device(name, &v, "x", x);
}

static PyObject *fail(int rc, const char *fname) {
#ifdef DSC_CQ_ON_CUDA
    if (rc > 0) return PyErr_Format(PyExc_RuntimeError, "%s: CUDA error %d (%s)", fname, rc, dsc_cq_cuda_strerror(rc));
#endif
    if (rc == DSC_CQ_ENOMEM) return PyErr_NoMemory();
    return PyErr_Format(PyExc_ValueError, "%s: invalid arguments (bits must be 2..16)", fname);
}

#ifdef DSC_CQ_ON_CUDA
#define DSC_DEVICE_ENTER dsc_cq_cuda_enter
#define DSC_DEVICE_LEAVE dsc_cq_cuda_leave
#endif
#define DSC_DEVICE_FAIL fail
#include "dsc/binding_device.h"

static PyObject *py_fake_quant(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("fake_quant", nargs, 9) < 0) return NULL;
    dsc_view x, out;
    int64_t groups, n, bits, asym, recip, seed;
    float *lo, *hi;
    if (prepare(args, &x, &out, &groups, &n) < 0 || dsc_arg_int64(args[3], "bits", &bits) < 0 ||
        dsc_arg_int64(args[4], "asym", &asym) < 0 || stats(args[5], "lo", &x, groups, 1, &lo) < 0 ||
        stats(args[6], "hi", &x, groups, 1, &hi) < 0 || dsc_arg_int64(args[7], "recip", &recip) < 0 ||
        dsc_arg_int64(args[8], "seed", &seed) < 0)
        return NULL;
    if (bits < 2 || bits > 16)
        return PyErr_Format(PyExc_ValueError, "argument 'bits' must be 2..16, got %lld", (long long)bits);
    if ((lo == NULL) != (hi == NULL)) return PyErr_Format(PyExc_ValueError, "arguments 'lo' and 'hi' go together");
    if (x.numel == 0) Py_RETURN_NONE;
    STREAM_OF(x, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(dsc_cq_fake_quant, x.data, out.data, cq_dtype(x.dtype), groups, n, (int)bits, (int)(asym != 0), lo, hi,
              (int)(recip != 0), (uint64_t)seed);
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_CQ_OK) return fail(rc, "fake_quant");
    Py_RETURN_NONE;
}

static PyObject *py_ternary(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("ternary", nargs, 5) < 0) return NULL;
    dsc_view x, out;
    int64_t groups, n;
    float *thres, *alpha;
    if (prepare(args, &x, &out, &groups, &n) < 0 || stats(args[3], "thres", &x, groups, 0, &thres) < 0 ||
        stats(args[4], "alpha", &x, groups, 0, &alpha) < 0)
        return NULL;
    if (x.numel == 0) Py_RETURN_NONE;
    STREAM_OF(x, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(dsc_cq_ternary, x.data, out.data, cq_dtype(x.dtype), groups, n, thres, alpha);
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_CQ_OK) return fail(rc, "ternary");
    Py_RETURN_NONE;
}

static PyObject *py_binary(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("binary", nargs, 4) < 0) return NULL;
    dsc_view x, out;
    int64_t groups, n;
    float *m;
    if (prepare(args, &x, &out, &groups, &n) < 0 || stats(args[3], "m", &x, groups, 0, &m) < 0) return NULL;
    if (x.numel == 0) Py_RETURN_NONE;
    STREAM_OF(x, stream);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(dsc_cq_binary, x.data, out.data, cq_dtype(x.dtype), groups, n, m);
    Py_END_ALLOW_THREADS
    LEAVE_DEVICE();
    if (rc != DSC_CQ_OK) return fail(rc, "binary");
    Py_RETURN_NONE;
}

#define METHOD(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}

static PyMethodDef methods[] = {
    METHOD("fake_quant", py_fake_quant,
           "fake_quant(x, out, groups, bits, asym, lo, hi, recip, seed): x quantized and dequantized into out."),
    METHOD("ternary", py_ternary, "ternary(x, out, groups, thres, alpha): XTC ternary weights into out."),
    METHOD("binary", py_binary, "binary(x, out, groups, m): XTC binary weights into out."),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR,
                                        "deepspeed_c fused fake quantization (compression library, MoQ).", -1,
                                        methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
