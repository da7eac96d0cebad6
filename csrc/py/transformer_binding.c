/* Python face of the transformer layer's fused kernels (dsc/transformer_cuda.h), op `transformer`.
 * The shim (deepspeed_c/ops/transformer/fused_ops.py) allocates every output; each argument is
 * checked here (CUDA, contiguous, dtype, element count, one device) before a kernel runs.
 *
 *   bias_gelu(f, bias|None, u_out|None, g_out)
 *   gelu_backward(dg, f, bias|None, dbias_part|None)     u = f + bias; dbias_part float32 [parts, cols]
 *   residual_norm(x, bias|None, res|None, keep|None, drop_scale, gamma|None, beta|None, eps,
 *                 r_out|None, y_out|None, mean_out|None, rstd_out|None)
 *   norm_backward(dy, src, gamma, beta|None, mean|None, rstd, extra|None, keep|None, drop_scale, dx,
 *                 dx_drop|None, dgamma_part, dbeta_part, dbias_part|None, invertible)
 *   sum_parts(part, out)                                    part float32 [k, parts, cols], out [k, cols]
 *   softmax(scores, mask|None, scale)              scores [B, heads, Sq, Sk], mask float32 [B, 1|Sq, Sk]
 *   softmax_backward(dp, p, scale)
 *   stack_qkv_grad(dq, dk, dv, out, part)           dq/dk/dv [rows, cols]; out [rows, 3 cols]; part f32 [parts, 3 cols]
 *   dropout_keep(keep, threshold, seed, offset)    keep uint8/bool [n]; threshold < 2^32, seed and offset < 2^64 */
#include "dsc/tensor_view.h" /* Python.h first */
#include "dsc/cuda_binding_util.h"
#include "dsc/module.h"
#include "dsc/transformer_cuda.h"

#define ACT (DSC_F32 | DSC_F16 | DSC_BF16)

static int cuda_dtype(uint32_t d) { return d == DSC_F16 ? DSC_CUDA_F16 : d == DSC_BF16 ? DSC_CUDA_BF16 : DSC_CUDA_F32; }

/* A contiguous CUDA tensor of `dtypes` (None when optional) on ref's device (and of ref's dtype when
 * same_dtype) holding `numel` elements (numel < 0: any). */
static int arg(PyObject *obj, const char *name, uint32_t dtypes, int optional, const dsc_view *ref,
               const char *ref_name, int same_dtype, int64_t numel, dsc_view *out) {
    const dsc_arg_spec spec = {name, dtypes, DSC_DEV_CUDA, DSC_CONTIGUOUS | (optional ? DSC_ALLOW_NONE : 0)};
    if (dsc_view_from_object(obj, &spec, out) < 0) return -1;
    if (out->is_none) return 0;
    if (ref != NULL) {
        if (dsc_check_same_device(name, out, ref_name, ref) < 0) return -1;
        if (same_dtype && out->dtype != ref->dtype) {
            PyErr_Format(PyExc_TypeError, "argument '%s' must have the dtype of '%s' (%s), got %s", name, ref_name,
                         dsc_dtype_name(ref->dtype), dsc_dtype_name(out->dtype));
            return -1;
        }
    }
    if (numel >= 0 && out->numel != numel) {
        PyErr_Format(PyExc_ValueError, "argument '%s' must hold %lld elements, got %lld", name, (long long)numel,
                     (long long)out->numel);
        return -1;
    }
    return 0;
}

static void *ptr(const dsc_view *v) { return v->is_none ? NULL : v->data; }

/* [..., cols] activations: rows and cols from the last dim. */
static int rows_cols(const dsc_view *v, const char *name, int64_t *rows, int64_t *cols) {
    if (v->ndim < 1 || v->shape[v->ndim - 1] < 1) {
        PyErr_Format(PyExc_ValueError, "argument '%s' must have a non-empty last dimension", name);
        return -1;
    }
    *cols = v->shape[v->ndim - 1];
    *rows = v->numel / *cols;
    return 0;
}

static int max_cols(int64_t cols, const char *fname) {
    if (cols <= DSC_TF_MAX_COLS) return 0;
    PyErr_Format(PyExc_ValueError, "%s takes rows of at most %d columns, got %lld", fname, DSC_TF_MAX_COLS,
                 (long long)cols);
    return -1;
}

#define RUN(call, fname, dev)                                                                                        \
    do {                                                                                                             \
        cudaStream_t stream_;                                                                                        \
        if (dsc_cuda_stream_arg((dev), &stream_) < 0) return NULL;                                                   \
        int rc_;                                                                                                     \
        cudaStream_t stream = stream_;                                                                               \
        Py_BEGIN_ALLOW_THREADS rc_ = (call);                                                                          \
        Py_END_ALLOW_THREADS if (dsc_cuda_check(rc_, fname) < 0) return NULL;                                         \
        Py_RETURN_NONE;                                                                                              \
    } while (0)

static PyObject *py_bias_gelu(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("bias_gelu", nargs, 4) < 0) return NULL;
    dsc_view f, bias, u, g;
    int64_t rows, cols;
    if (arg(args[0], "f", ACT, 0, NULL, NULL, 0, -1, &f) < 0 || rows_cols(&f, "f", &rows, &cols) < 0 ||
        arg(args[1], "bias", ACT, 1, &f, "f", 1, cols, &bias) < 0 ||
        arg(args[2], "u_out", ACT, 1, &f, "f", 1, f.numel, &u) < 0 ||
        arg(args[3], "g_out", ACT, 0, &f, "f", 1, f.numel, &g) < 0)
        return NULL;
    RUN(dsc_tf_bias_gelu(f.data, ptr(&bias), ptr(&u), g.data, rows, cols, cuda_dtype(f.dtype), f.device_id, stream),
        "bias_gelu", f.device_id);
}

/* A float32 [parts, cols] partial-sum buffer with 1 <= parts <= 65535 (None when optional). */
static int part_arg(PyObject *obj, const char *name, int optional, const dsc_view *ref, const char *ref_name,
                    int64_t cols, dsc_view *out) {
    if (arg(obj, name, DSC_F32, optional, ref, ref_name, 0, -1, out) < 0) return -1;
    if (out->is_none) return 0;
    if (out->ndim != 2 || out->shape[1] != cols || out->shape[0] < 1 || out->shape[0] > 65535) {
        PyErr_Format(PyExc_ValueError, "argument '%s' must be float32 [parts, %lld] with 1 <= parts <= 65535", name,
                     (long long)cols);
        return -1;
    }
    return 0;
}

static PyObject *py_gelu_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("gelu_backward", nargs, 4) < 0) return NULL;
    dsc_view dg, f, bias, dbp;
    int64_t rows, cols;
    if (arg(args[0], "dg", ACT, 0, NULL, NULL, 0, -1, &dg) < 0 || rows_cols(&dg, "dg", &rows, &cols) < 0 ||
        arg(args[1], "f", ACT, 0, &dg, "dg", 1, dg.numel, &f) < 0 ||
        arg(args[2], "bias", ACT, 1, &dg, "dg", 1, cols, &bias) < 0 ||
        part_arg(args[3], "dbias_part", 1, &dg, "dg", cols, &dbp) < 0)
        return NULL;
    RUN(dsc_tf_gelu_backward(dg.data, f.data, ptr(&bias), (float *)ptr(&dbp), rows, cols,
                             dbp.is_none ? 1 : dbp.shape[0],
                             cuda_dtype(dg.dtype), dg.device_id, stream),
        "gelu_backward", dg.device_id);
}

static PyObject *py_residual_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("residual_norm", nargs, 12) < 0) return NULL;
    dsc_view x, bias, res, keep, gamma, beta, r, y, mean, rstd;
    double drop_scale, eps;
    int64_t rows, cols;
    if (arg(args[0], "x", ACT, 0, NULL, NULL, 0, -1, &x) < 0 || rows_cols(&x, "x", &rows, &cols) < 0 ||
        max_cols(cols, "residual_norm") < 0 || arg(args[1], "bias", ACT, 1, &x, "x", 1, cols, &bias) < 0 ||
        arg(args[2], "res", ACT, 1, &x, "x", 1, x.numel, &res) < 0 ||
        arg(args[3], "keep", DSC_U8 | DSC_BOOL, 1, &x, "x", 0, x.numel, &keep) < 0 ||
        dsc_arg_double(args[4], "drop_scale", &drop_scale) < 0 ||
        arg(args[5], "gamma", ACT, 1, &x, "x", 1, cols, &gamma) < 0 ||
        arg(args[6], "beta", ACT, 1, &x, "x", 1, cols, &beta) < 0 || dsc_arg_double(args[7], "eps", &eps) < 0 ||
        arg(args[8], "r_out", ACT, 1, &x, "x", 1, x.numel, &r) < 0 ||
        arg(args[9], "y_out", ACT, 1, &x, "x", 1, x.numel, &y) < 0 ||
        arg(args[10], "mean_out", DSC_F32, 1, &x, "x", 0, rows, &mean) < 0 ||
        arg(args[11], "rstd_out", DSC_F32, 1, &x, "x", 0, rows, &rstd) < 0)
        return NULL;
    if (!gamma.is_none && (y.is_none || mean.is_none || rstd.is_none))
        return PyErr_Format(PyExc_ValueError, "residual_norm with 'gamma' needs 'y_out', 'mean_out' and 'rstd_out'");
    if (gamma.is_none && r.is_none)
        return PyErr_Format(PyExc_ValueError, "residual_norm without 'gamma' needs 'r_out'");
    RUN(dsc_tf_residual_norm(x.data, ptr(&bias), ptr(&res), (const uint8_t *)ptr(&keep), (float)drop_scale, ptr(&gamma),
                             ptr(&beta), ptr(&r), ptr(&y), (float *)ptr(&mean), (float *)ptr(&rstd), rows, cols,
                             (float)eps, cuda_dtype(x.dtype), x.device_id, stream),
        "residual_norm", x.device_id);
}

static PyObject *py_norm_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("norm_backward", nargs, 15) < 0) return NULL;
    dsc_view dy, src, gamma, beta, mean, rstd, extra, keep, dx, dxd, dgp, dbp, dbias;
    double drop_scale;
    int64_t rows, cols;
    int invertible;
    if (arg(args[0], "dy", ACT, 0, NULL, NULL, 0, -1, &dy) < 0 || rows_cols(&dy, "dy", &rows, &cols) < 0 ||
        max_cols(cols, "norm_backward") < 0 || arg(args[1], "src", ACT, 0, &dy, "dy", 1, dy.numel, &src) < 0 ||
        arg(args[2], "gamma", ACT, 0, &dy, "dy", 1, cols, &gamma) < 0 ||
        arg(args[3], "beta", ACT, 1, &dy, "dy", 1, cols, &beta) < 0 ||
        arg(args[4], "mean", DSC_F32, 1, &dy, "dy", 0, rows, &mean) < 0 ||
        arg(args[5], "rstd", DSC_F32, 0, &dy, "dy", 0, rows, &rstd) < 0 ||
        arg(args[6], "extra", ACT, 1, &dy, "dy", 1, dy.numel, &extra) < 0 ||
        arg(args[7], "keep", DSC_U8 | DSC_BOOL, 1, &dy, "dy", 0, dy.numel, &keep) < 0 ||
        dsc_arg_double(args[8], "drop_scale", &drop_scale) < 0 ||
        arg(args[9], "dx", ACT, 0, &dy, "dy", 1, dy.numel, &dx) < 0 ||
        arg(args[10], "dx_drop", ACT, 1, &dy, "dy", 1, dy.numel, &dxd) < 0 ||
        part_arg(args[11], "dgamma_part", 0, &dy, "dy", cols, &dgp) < 0 ||
        arg(args[12], "dbeta_part", DSC_F32, 0, &dy, "dy", 0, dgp.numel, &dbp) < 0 ||
        arg(args[13], "dbias_part", DSC_F32, 1, &dy, "dy", 0, dgp.numel, &dbias) < 0 ||
        dsc_flag_arg(args[14], "invertible", &invertible) < 0)
        return NULL;
    if (!invertible && mean.is_none)
        return PyErr_Format(PyExc_ValueError, "norm_backward from the norm's input needs 'mean'");
    if (!dxd.is_none && keep.is_none)
        return PyErr_Format(PyExc_ValueError, "norm_backward's 'dx_drop' needs 'keep' (the dropout mask)");
    RUN(dsc_tf_norm_backward(dy.data, src.data, gamma.data, ptr(&beta), (const float *)ptr(&mean),
                             (const float *)rstd.data, ptr(&extra), (const uint8_t *)ptr(&keep), (float)drop_scale,
                             dx.data, ptr(&dxd), (float *)dgp.data, (float *)dbp.data, (float *)ptr(&dbias), rows,
                             cols, dgp.shape[0], invertible, cuda_dtype(dy.dtype), dy.device_id, stream),
        "norm_backward", dy.device_id);
}

static PyObject *py_sum_parts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("sum_parts", nargs, 2) < 0) return NULL;
    dsc_view part, out;
    if (arg(args[0], "part", DSC_F32, 0, NULL, NULL, 0, -1, &part) < 0) return NULL;
    if (part.ndim != 3 || part.numel < 1 || part.shape[0] > 65535)
        return PyErr_Format(PyExc_ValueError, "argument 'part' must be a non-empty float32 [k, parts, cols], "
                            "k <= 65535");
    const int64_t k = part.shape[0], parts = part.shape[1], cols = part.shape[2];
    if (arg(args[1], "out", ACT, 0, &part, "part", 0, k * cols, &out) < 0) return NULL;
    RUN(dsc_tf_sum_parts((const float *)part.data, out.data, k, parts, cols, cuda_dtype(out.dtype), out.device_id,
                         stream),
        "sum_parts", out.device_id);
}

static PyObject *py_softmax(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("softmax", nargs, 3) < 0) return NULL;
    dsc_view s, mask;
    double scale;
    if (arg(args[0], "scores", ACT, 0, NULL, NULL, 0, -1, &s) < 0) return NULL;
    if (s.ndim != 4)
        return PyErr_Format(PyExc_ValueError, "argument 'scores' must be [B, heads, Sq, Sk], got %d dims", s.ndim);
    const int64_t B = s.shape[0], heads = s.shape[1], Sq = s.shape[2], Sk = s.shape[3];
    if (max_cols(Sk, "softmax") < 0 || arg(args[1], "mask", DSC_F32, 1, &s, "scores", 0, -1, &mask) < 0 ||
        dsc_arg_double(args[2], "scale", &scale) < 0)
        return NULL;
    int64_t mask_rows = 1;
    if (!mask.is_none) {
        if (mask.ndim != 3 || mask.shape[0] != B || (mask.shape[1] != 1 && mask.shape[1] != Sq) || mask.shape[2] != Sk)
            return PyErr_Format(PyExc_ValueError, "argument 'mask' must be float32 [%lld, 1 or %lld, %lld]",
                                (long long)B, (long long)Sq, (long long)Sk);
        mask_rows = mask.shape[1];
    }
    RUN(dsc_tf_softmax(s.data, (const float *)ptr(&mask), B, heads, Sq, Sk, mask_rows, (float)scale, cuda_dtype(s.dtype),
                       s.device_id, stream),
        "softmax", s.device_id);
}

static PyObject *py_softmax_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("softmax_backward", nargs, 3) < 0) return NULL;
    dsc_view dp, p;
    double scale;
    int64_t rows, cols;
    if (arg(args[0], "dp", ACT, 0, NULL, NULL, 0, -1, &dp) < 0 || rows_cols(&dp, "dp", &rows, &cols) < 0 ||
        arg(args[1], "p", ACT, 0, &dp, "dp", 1, dp.numel, &p) < 0 || dsc_arg_double(args[2], "scale", &scale) < 0)
        return NULL;
    RUN(dsc_tf_softmax_backward(dp.data, p.data, rows, cols, (float)scale, cuda_dtype(dp.dtype), dp.device_id, stream),
        "softmax_backward", dp.device_id);
}

static PyObject *py_stack_qkv_grad(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("stack_qkv_grad", nargs, 5) < 0) return NULL;
    dsc_view dq, dk, dv, out, part;
    int64_t rows, cols;
    if (arg(args[0], "dq", ACT, 0, NULL, NULL, 0, -1, &dq) < 0 || rows_cols(&dq, "dq", &rows, &cols) < 0 ||
        arg(args[1], "dk", ACT, 0, &dq, "dq", 1, dq.numel, &dk) < 0 ||
        arg(args[2], "dv", ACT, 0, &dq, "dq", 1, dq.numel, &dv) < 0 ||
        arg(args[3], "out", ACT, 0, &dq, "dq", 1, 3 * dq.numel, &out) < 0 ||
        arg(args[4], "part", DSC_F32, 0, &dq, "dq", 0, -1, &part) < 0)
        return NULL;
    if (part.ndim != 2 || part.shape[1] != 3 * cols || part.shape[0] < 1 || part.shape[0] > 65535)
        return PyErr_Format(PyExc_ValueError, "argument 'part' must be float32 [parts, %lld], 1 <= parts <= 65535",
                            (long long)(3 * cols));
    RUN(dsc_tf_stack_qkv_grad(dq.data, dk.data, dv.data, out.data, (float *)part.data, rows, cols, part.shape[0],
                              cuda_dtype(dq.dtype), dq.device_id, stream),
        "stack_qkv_grad", dq.device_id);
}

/* A Python int in [0, limit] as uint64 (seeds and offsets use the whole 64 bits). */
static int arg_u64(PyObject *obj, const char *name, unsigned long long limit, uint64_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "argument '%s' must be an int", name);
        return -1;
    }
    const unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (PyErr_Occurred() || v > limit) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "argument '%s' must be an int in [0, %llu]", name, limit);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static PyObject *py_dropout_keep(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("dropout_keep", nargs, 4) < 0) return NULL;
    dsc_view keep;
    uint64_t threshold, seed, offset;
    if (arg(args[0], "keep", DSC_U8 | DSC_BOOL, 0, NULL, NULL, 0, -1, &keep) < 0 ||
        arg_u64(args[1], "threshold", 0xffffffffull, &threshold) < 0 ||
        arg_u64(args[2], "seed", ~0ull, &seed) < 0 || arg_u64(args[3], "offset", ~0ull, &offset) < 0)
        return NULL;
    RUN(dsc_tf_dropout_keep((uint8_t *)keep.data, keep.numel, (uint32_t)threshold, seed, offset, keep.device_id,
                            stream),
        "dropout_keep", keep.device_id);
}

#define METHOD(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}

static PyMethodDef methods[] = {
    METHOD("bias_gelu", py_bias_gelu, "bias_gelu(f, bias, u_out, g_out): u = f + bias, g = gelu(u)."),
    METHOD("gelu_backward", py_gelu_backward,
           "gelu_backward(dg, f, bias, dbias_part): dg *= gelu'(f + bias) in place; partial column sums of dg."),
    METHOD("residual_norm", py_residual_norm,
           "residual_norm(x, bias, res, keep, drop_scale, gamma, beta, eps, r_out, y_out, mean_out, rstd_out): "
           "bias + dropout + residual, then LayerNorm."),
    METHOD("norm_backward", py_norm_backward,
           "norm_backward(dy, src, gamma, beta, mean, rstd, extra, keep, drop_scale, dx, dx_drop, dgamma_part, "
           "dbeta_part, dbias_part, invertible)."),
    METHOD("sum_parts", py_sum_parts, "sum_parts(part, out): out[k] = part[k].sum(0) (second stage of column sums)."),
    METHOD("softmax", py_softmax, "softmax(scores, mask, scale): scaled masked softmax in place."),
    METHOD("softmax_backward", py_softmax_backward, "softmax_backward(dp, p, scale): in place."),
    METHOD("stack_qkv_grad", py_stack_qkv_grad,
           "stack_qkv_grad(dq, dk, dv, out, part): out = [dq | dk | dv] by rows, partial column sums of out."),
    METHOD("dropout_keep", py_dropout_keep,
           "dropout_keep(keep, threshold, seed, offset): Philox keep mask, keep[e] = word(e) < threshold."),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR,
                                        "deepspeed_c transformer layer training kernels.", -1, methods, NULL, NULL,
                                        NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
