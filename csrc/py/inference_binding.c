/* Python face of the fused inference kernels (dsc/inference_cuda.h), op `transformer_inference`.
 * The shim (deepspeed_c/ops/transformer/inference/kernels.py) allocates every output; each
 * argument is validated here (CUDA, contiguous, dtype, shape, one device) before a kernel runs.
 *
 *   add_norm(x, y|None, bias|None, gamma, beta|None, eps, r_out|None, n_out)
 *   qkv_rotary_cache(qkv, bias|None, cos|None, sin|None, positions|None, past, k_cache, v_cache, q_out,
 *                    n_heads, n_kv, head_dim, rot)
 *   attention(q, k_cache, v_cache, past, key_mask|None, scale, out, workspace|None, splits)
 *   masked_softmax(scores, t, rows_per_batch, past, key_mask|None, scale)
 *   bias_gelu(h, bias|None, approximate)
 *   silu_mul(gu, bias|None, out)
 *   quant_gemv(x, q, scales, out, bits, group[, variant])  weight-only int8/int4 GEMV (decode)
 *   dequantize(q, scales, out, bits, group)         the weights in the activation dtype (prefill)
 *   moe_gemv(x, idx, wts|None, w, out, combine)     expert GEMVs of MoE decode (inference_moe.cu) */
#include "dsc/tensor_view.h" /* Python.h first */
#include <cuda_runtime_api.h> /* C-compatible: cudaGetErrorString */
#include "dsc/inference_cuda.h"
#include "dsc/module.h"

#include <stdio.h>

#define ACT (DSC_F32 | DSC_F16 | DSC_BF16)

static int cuda_dtype(uint32_t d) { return d == DSC_F16 ? DSC_CUDA_F16 : d == DSC_BF16 ? DSC_CUDA_BF16 : DSC_CUDA_F32; }

/* One argument: a contiguous CUDA tensor of `dtypes` (None allowed when optional) on the
 * device of `ref` (when given) and, for activations, of ref's dtype. */
static int arg(PyObject *obj, const char *name, uint32_t dtypes, int optional, const dsc_view *ref,
               const char *ref_name, int same_dtype, dsc_view *out) {
    const dsc_arg_spec spec = {name, dtypes, DSC_DEV_CUDA, DSC_CONTIGUOUS | (optional ? DSC_ALLOW_NONE : 0)};
    if (dsc_view_from_object(obj, &spec, out) < 0) return -1;
    if (out->is_none || ref == NULL) return 0;
    if (dsc_check_same_device(name, out, ref_name, ref) < 0) return -1;
    if (same_dtype && out->dtype != ref->dtype) {
        PyErr_Format(PyExc_TypeError, "argument '%s' must have the dtype of '%s' (%s), got %s", name, ref_name,
                     dsc_dtype_name(ref->dtype), dsc_dtype_name(out->dtype));
        return -1;
    }
    return 0;
}

static int want_numel(const dsc_view *v, const char *name, int64_t n) {
    if (v->is_none || v->numel == n) return 0;
    PyErr_Format(PyExc_ValueError, "argument '%s' must hold %lld elements, got %lld", name, (long long)n,
                 (long long)v->numel);
    return -1;
}

static int want_dims(const dsc_view *v, const char *name, int ndim, const int64_t *shape) {
    int ok = v->ndim == ndim;
    for (int d = 0; ok && d < ndim; d++) ok = shape[d] < 0 || v->shape[d] == shape[d];
    if (ok) return 0;
    char want[128] = "", got[128] = "";
    size_t a = 0, b = 0;
    for (int d = 0; d < ndim && a < sizeof want - 24; d++) {
        if (shape[d] < 0) a += (size_t)snprintf(want + a, sizeof want - a, d ? ", *" : "*");
        else a += (size_t)snprintf(want + a, sizeof want - a, d ? ", %lld" : "%lld", (long long)shape[d]);
    }
    for (int d = 0; d < v->ndim && b < sizeof got - 24; d++)
        b += (size_t)snprintf(got + b, sizeof got - b, d ? ", %lld" : "%lld", (long long)v->shape[d]);
    PyErr_Format(PyExc_ValueError, "argument '%s' must have shape [%s], got [%s]", name, want, got);
    return -1;
}

static PyObject *finish(int rc, const char *fname) {
    if (rc == 0) Py_RETURN_NONE;
    const char *what = rc > 0 ? cudaGetErrorString((cudaError_t)rc)
                     : rc == DSC_CUDA_EDTYPE ? "unsupported dtype for this kernel"
                     : "invalid argument (a size out of range or a missing pointer)";
    PyErr_Format(PyExc_RuntimeError, "%s failed: %s (code %d)", fname, what, rc);
    return NULL;
}

/* torch's current stream on the tensors' device (NULL is the legacy default stream). */
static int stream_of(int device, cudaStream_t *stream) {
    void *s = dsc_current_cuda_stream(device);
    if (s == NULL && PyErr_Occurred()) return -1;
    *stream = (cudaStream_t)s;
    return 0;
}

static int flag_arg(PyObject *obj, const char *name, int *out) {
    if (!PyBool_Check(obj) && !PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "argument '%s' must be a bool, got %R", name, (PyObject *)Py_TYPE(obj));
        return -1;
    }
    const int v = PyObject_IsTrue(obj);
    if (v < 0) return -1;
    *out = v;
    return 0;
}

static PyObject *py_add_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("add_norm", nargs, 8) < 0) return NULL;
    dsc_view x, y, bias, gamma, beta, r, n;
    double eps;
    if (arg(args[0], "x", ACT, 0, NULL, NULL, 0, &x) < 0) return NULL;
    if (x.ndim != 2) return PyErr_Format(PyExc_ValueError, "argument 'x' must be [rows, cols], got %d dims", x.ndim);
    const int64_t rows = x.shape[0], cols = x.shape[1];
    if (arg(args[1], "y", ACT, 1, &x, "x", 1, &y) < 0 || want_numel(&y, "y", rows * cols) < 0 ||
        arg(args[2], "bias", ACT, 1, &x, "x", 1, &bias) < 0 || want_numel(&bias, "bias", cols) < 0 ||
        arg(args[3], "gamma", ACT, 0, &x, "x", 1, &gamma) < 0 || want_numel(&gamma, "gamma", cols) < 0 ||
        arg(args[4], "beta", ACT, 1, &x, "x", 1, &beta) < 0 || want_numel(&beta, "beta", cols) < 0 ||
        dsc_arg_double(args[5], "eps", &eps) < 0 ||
        arg(args[6], "r_out", ACT, 1, &x, "x", 1, &r) < 0 || want_numel(&r, "r_out", rows * cols) < 0 ||
        arg(args[7], "n_out", ACT, 0, &x, "x", 1, &n) < 0 || want_numel(&n, "n_out", rows * cols) < 0)
        return NULL;
    if (cols > DSC_INF_MAX_NORM_COLS)
        return PyErr_Format(PyExc_ValueError, "add_norm takes rows of at most %d columns, got %lld",
                            DSC_INF_MAX_NORM_COLS, (long long)cols);
    cudaStream_t stream;
    if (stream_of(x.device_id, &stream) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_inf_add_norm(x.data, y.is_none ? NULL : y.data, bias.is_none ? NULL : bias.data, gamma.data,
                          beta.is_none ? NULL : beta.data, r.is_none ? NULL : r.data, n.data, rows, cols, (float)eps,
                          cuda_dtype(x.dtype), x.device_id, stream);
    Py_END_ALLOW_THREADS
    return finish(rc, "add_norm");
}

static PyObject *py_qkv_rotary_cache(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("qkv_rotary_cache", nargs, 13) < 0) return NULL;
    dsc_view qkv, bias, cos, sin, pos, past, kc, vc, q;
    int64_t H, Hkv, D, rot;
    if (dsc_arg_int64(args[9], "n_heads", &H) < 0 || dsc_arg_int64(args[10], "n_kv", &Hkv) < 0 ||
        dsc_arg_int64(args[11], "head_dim", &D) < 0 || dsc_arg_int64(args[12], "rot", &rot) < 0)
        return NULL;
    if (H < 1 || Hkv < 1 || D < 1)
        return PyErr_Format(PyExc_ValueError, "n_heads, n_kv and head_dim must be positive, got %lld, %lld, %lld",
                            (long long)H, (long long)Hkv, (long long)D);
    if (arg(args[0], "qkv", ACT, 0, NULL, NULL, 0, &qkv) < 0) return NULL;
    const int64_t qshape[3] = {-1, -1, (H + 2 * Hkv) * D};
    if (want_dims(&qkv, "qkv", 3, qshape) < 0) return NULL;
    const int64_t B = qkv.shape[0], T = qkv.shape[1];
    if (arg(args[1], "bias", ACT, 1, &qkv, "qkv", 1, &bias) < 0 || want_numel(&bias, "bias", qshape[2]) < 0 ||
        arg(args[2], "cos", DSC_F32, 1, &qkv, "qkv", 0, &cos) < 0 ||
        arg(args[3], "sin", DSC_F32, 1, &qkv, "qkv", 0, &sin) < 0 ||
        arg(args[4], "positions", DSC_I64, 1, &qkv, "qkv", 0, &pos) < 0 ||
        arg(args[5], "past", DSC_I32, 0, &qkv, "qkv", 0, &past) < 0 || want_numel(&past, "past", 1) < 0 ||
        arg(args[6], "k_cache", ACT, 0, &qkv, "qkv", 1, &kc) < 0 ||
        arg(args[7], "v_cache", ACT, 0, &qkv, "qkv", 1, &vc) < 0 ||
        arg(args[8], "q_out", ACT, 0, &qkv, "qkv", 1, &q) < 0)
        return NULL;
    const int64_t cshape[4] = {B, Hkv, -1, D}, oshape[4] = {B, T, H, D};
    if (want_dims(&kc, "k_cache", 4, cshape) < 0 || want_dims(&vc, "v_cache", 4, kc.shape) < 0 ||
        want_dims(&q, "q_out", 4, oshape) < 0)
        return NULL;
    int64_t n_pos = 0;
    if (!cos.is_none) {
        if (sin.is_none || pos.is_none)
            return PyErr_Format(PyExc_ValueError, "rotary needs 'cos', 'sin' and 'positions' together");
        const int64_t tshape[2] = {-1, D}, pshape[2] = {B, T};
        if (want_dims(&cos, "cos", 2, tshape) < 0 || want_dims(&sin, "sin", 2, cos.shape) < 0 ||
            want_dims(&pos, "positions", 2, pshape) < 0)
            return NULL;
        if (rot < 2 || rot > D || rot % 2)
            return PyErr_Format(PyExc_ValueError, "argument 'rot' must be even and in [2, head_dim=%lld], got %lld",
                                (long long)D, (long long)rot);
        n_pos = cos.shape[0];
    }
    cudaStream_t stream;
    if (stream_of(qkv.device_id, &stream) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_inf_qkv_rotary_cache(qkv.data, bias.is_none ? NULL : bias.data, cos.is_none ? NULL : (const float *)cos.data,
                                  sin.is_none ? NULL : (const float *)sin.data, n_pos,
                                  pos.is_none ? NULL : (const int64_t *)pos.data, (const int32_t *)past.data, kc.data,
                                  vc.data, q.data, B, T, H, Hkv, D, rot, kc.shape[2], cuda_dtype(qkv.dtype),
                                  qkv.device_id, stream);
    Py_END_ALLOW_THREADS
    return finish(rc, "qkv_rotary_cache");
}

static PyObject *py_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("attention", nargs, 9) < 0) return NULL;
    dsc_view q, kc, vc, past, mask, out, ws;
    double scale;
    int64_t splits;
    if (arg(args[0], "q", ACT, 0, NULL, NULL, 0, &q) < 0) return NULL;
    const int64_t any4[4] = {-1, -1, -1, -1};
    if (want_dims(&q, "q", 4, any4) < 0) return NULL;
    const int64_t B = q.shape[0], T = q.shape[1], H = q.shape[2], D = q.shape[3];
    if (arg(args[1], "k_cache", ACT, 0, &q, "q", 1, &kc) < 0) return NULL;
    const int64_t cshape[4] = {B, -1, -1, D};
    if (want_dims(&kc, "k_cache", 4, cshape) < 0) return NULL;
    const int64_t Hkv = kc.shape[1], S = kc.shape[2];
    if (arg(args[2], "v_cache", ACT, 0, &q, "q", 1, &vc) < 0 || want_dims(&vc, "v_cache", 4, kc.shape) < 0 ||
        arg(args[3], "past", DSC_I32, 0, &q, "q", 0, &past) < 0 || want_numel(&past, "past", 1) < 0 ||
        arg(args[4], "key_mask", DSC_I32, 1, &q, "q", 0, &mask) < 0 || dsc_arg_double(args[5], "scale", &scale) < 0 ||
        arg(args[6], "out", ACT, 0, &q, "q", 1, &out) < 0 || want_dims(&out, "out", 4, q.shape) < 0 ||
        arg(args[7], "workspace", DSC_F32, 1, &q, "q", 0, &ws) < 0 || dsc_arg_int64(args[8], "splits", &splits) < 0)
        return NULL;
    if (H % Hkv != 0)
        return PyErr_Format(PyExc_ValueError, "the %lld query heads must be a multiple of the cache's %lld kv heads",
                            (long long)H, (long long)Hkv);
    if (D > DSC_INF_MAX_HEAD_DIM)
        return PyErr_Format(PyExc_ValueError, "attention takes head_dim up to %d, got %lld", DSC_INF_MAX_HEAD_DIM,
                            (long long)D);
    int64_t mask_stride = 0;
    if (!mask.is_none) {
        const int64_t mshape[2] = {B, -1};
        if (want_dims(&mask, "key_mask", 2, mshape) < 0) return NULL;
        mask_stride = mask.shape[1];
        if (mask_stride < S)
            return PyErr_Format(PyExc_ValueError, "argument 'key_mask' must have at least %lld columns (the cache), "
                                "got %lld", (long long)S, (long long)mask_stride);
    }
    if (splits < 1 || splits > 64)
        return PyErr_Format(PyExc_ValueError, "argument 'splits' must be in [1, 64], got %lld", (long long)splits);
    if (splits > 1) {
        const int64_t need = splits * B * T * H * (D + 2);
        if (ws.is_none || ws.numel < need)
            return PyErr_Format(PyExc_ValueError, "argument 'workspace' must hold %lld float32 elements for "
                                "splits=%lld", (long long)need, (long long)splits);
    }
    cudaStream_t stream;
    if (stream_of(q.device_id, &stream) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_inf_attention(q.data, kc.data, vc.data, (const int32_t *)past.data,
                           mask.is_none ? NULL : (const int32_t *)mask.data, mask_stride, out.data,
                           ws.is_none ? NULL : (float *)ws.data, splits, B, T, H, Hkv, D, S, (float)scale,
                           cuda_dtype(q.dtype), q.device_id, stream);
    Py_END_ALLOW_THREADS
    return finish(rc, "attention");
}

static PyObject *py_masked_softmax(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("masked_softmax", nargs, 6) < 0) return NULL;
    dsc_view sc, past, mask;
    int64_t T, rows_per_batch;
    double scale;
    if (arg(args[0], "scores", ACT, 0, NULL, NULL, 0, &sc) < 0 || dsc_arg_int64(args[1], "t", &T) < 0 ||
        dsc_arg_int64(args[2], "rows_per_batch", &rows_per_batch) < 0 ||
        arg(args[3], "past", DSC_I32, 0, &sc, "scores", 0, &past) < 0 || want_numel(&past, "past", 1) < 0 ||
        arg(args[4], "key_mask", DSC_I32, 1, &sc, "scores", 0, &mask) < 0 || dsc_arg_double(args[5], "scale", &scale) < 0)
        return NULL;
    if (sc.ndim < 2) return PyErr_Format(PyExc_ValueError, "argument 'scores' must be [..., rows, keys]");
    const int64_t L = sc.shape[sc.ndim - 1], rows = L ? sc.numel / L : 0;
    if (T < 1 || rows_per_batch < T || rows_per_batch % T || rows % rows_per_batch)
        return PyErr_Format(PyExc_ValueError, "masked_softmax: rows_per_batch=%lld must be a multiple of t=%lld and "
                            "divide the %lld score rows", (long long)rows_per_batch, (long long)T, (long long)rows);
    if (L > DSC_INF_MAX_NORM_COLS)
        return PyErr_Format(PyExc_ValueError, "masked_softmax takes at most %d keys, got %lld", DSC_INF_MAX_NORM_COLS,
                            (long long)L);
    int64_t mask_stride = 0;
    if (!mask.is_none) {
        const int64_t mshape[2] = {rows / rows_per_batch, -1};
        if (want_dims(&mask, "key_mask", 2, mshape) < 0) return NULL;
        mask_stride = mask.shape[1];
        if (mask_stride < L)
            return PyErr_Format(PyExc_ValueError, "argument 'key_mask' must have at least %lld columns, got %lld",
                                (long long)L, (long long)mask_stride);
    }
    cudaStream_t stream;
    if (stream_of(sc.device_id, &stream) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_inf_masked_softmax(sc.data, rows, L, T, rows_per_batch, (const int32_t *)past.data,
                                mask.is_none ? NULL : (const int32_t *)mask.data, mask_stride, (float)scale,
                                cuda_dtype(sc.dtype), sc.device_id, stream);
    Py_END_ALLOW_THREADS
    return finish(rc, "masked_softmax");
}

static PyObject *py_bias_gelu(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("bias_gelu", nargs, 3) < 0) return NULL;
    dsc_view h, bias;
    int approximate;
    if (arg(args[0], "h", ACT, 0, NULL, NULL, 0, &h) < 0) return NULL;
    if (h.ndim < 1) return PyErr_Format(PyExc_ValueError, "argument 'h' must have at least one dimension");
    const int64_t cols = h.shape[h.ndim - 1], rows = cols ? h.numel / cols : 0;
    if (arg(args[1], "bias", ACT, 1, &h, "h", 1, &bias) < 0 || want_numel(&bias, "bias", cols) < 0 ||
        flag_arg(args[2], "approximate", &approximate) < 0)
        return NULL;
    cudaStream_t stream;
    if (stream_of(h.device_id, &stream) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_inf_bias_gelu(h.data, bias.is_none ? NULL : bias.data, rows, cols, approximate, cuda_dtype(h.dtype),
                           h.device_id, stream);
    Py_END_ALLOW_THREADS
    return finish(rc, "bias_gelu");
}

static PyObject *py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("silu_mul", nargs, 3) < 0) return NULL;
    dsc_view gu, bias, out;
    if (arg(args[0], "gu", ACT, 0, NULL, NULL, 0, &gu) < 0) return NULL;
    if (gu.ndim < 1 || gu.shape[gu.ndim - 1] % 2)
        return PyErr_Format(PyExc_ValueError, "argument 'gu' must have an even last dimension (gate then up)");
    const int64_t f = gu.shape[gu.ndim - 1] / 2, rows = f ? gu.numel / (2 * f) : 0;
    if (arg(args[1], "bias", ACT, 1, &gu, "gu", 1, &bias) < 0 || want_numel(&bias, "bias", 2 * f) < 0 ||
        arg(args[2], "out", ACT, 0, &gu, "gu", 1, &out) < 0 || want_numel(&out, "out", rows * f) < 0)
        return NULL;
    cudaStream_t stream;
    if (stream_of(gu.device_id, &stream) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_inf_silu_mul(gu.data, bias.is_none ? NULL : bias.data, out.data, rows, f, cuda_dtype(gu.dtype),
                          gu.device_id, stream);
    Py_END_ALLOW_THREADS
    return finish(rc, "silu_mul");
}

/* q: int8 [N, K] or uint8 [N, K / 2]; scales float32 [N, K / group]. */
static int quant_args(PyObject *const *args, int64_t bits, int64_t group, int64_t N, int64_t K, const dsc_view *ref,
                      dsc_view *q, dsc_view *scales) {
    if (bits != 8 && bits != 4) {
        PyErr_Format(PyExc_ValueError, "argument 'bits' must be 8 or 4, got %lld", (long long)bits);
        return -1;
    }
    if (group < 1 || K % group) {
        PyErr_Format(PyExc_ValueError, "argument 'group' (%lld) must divide the input width %lld", (long long)group,
                     (long long)K);
        return -1;
    }
    const int64_t qshape[2] = {N, bits == 8 ? K : K / 2}, sshape[2] = {N, K / group};
    if (arg(args[0], "q", bits == 8 ? DSC_I8 : DSC_U8, 0, ref, "x", 0, q) < 0 || want_dims(q, "q", 2, qshape) < 0 ||
        arg(args[1], "scales", DSC_F32, 0, ref, "x", 0, scales) < 0 || want_dims(scales, "scales", 2, sshape) < 0)
        return -1;
    return 0;
}

static PyObject *py_quant_gemv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 && nargs != 7)
        return PyErr_Format(PyExc_TypeError, "quant_gemv() takes 6 or 7 arguments (%zd given)", nargs);
    dsc_view x, q, scales, out;
    if (arg(args[0], "x", ACT, 0, NULL, NULL, 0, &x) < 0) return NULL;
    if (x.ndim != 2) return PyErr_Format(PyExc_ValueError, "argument 'x' must be 2-D [M, K]");
    const int64_t M = x.shape[0], K = x.shape[1];
    const long long bits = PyLong_AsLongLong(args[4]), group = PyLong_AsLongLong(args[5]);
    const long long variant = nargs == 7 ? PyLong_AsLongLong(args[6]) : 0;
    if (PyErr_Occurred()) return NULL;
    if (M < 1 || M > 8) return PyErr_Format(PyExc_ValueError, "argument 'x' must have 1 to 8 rows, got %lld",
                                            (long long)M);
    if (variant < 0 || variant > 1808)
        return PyErr_Format(PyExc_ValueError, "argument 'variant' (%lld) must be 0 or [1000 +] 100 * warps + unroll",
                            variant);
    if (arg(args[3], "out", ACT, 0, &x, "x", 1, &out) < 0 || out.ndim != 2 || out.shape[0] != M)
        return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "argument 'out' must be [M, N]");
    const int64_t N = out.shape[1];
    if (quant_args(args + 1, bits, group, N, K, &x, &q, &scales) < 0) return NULL;
    const int64_t chunk = bits == 8 ? 16 : 32; /* weights a 16-byte load */
    if (K % chunk || group % chunk || K / chunk >= 65536)
        return PyErr_Format(PyExc_ValueError, "quant_gemv: int%lld needs the input width (%lld) and group (%lld) "
                            "multiples of %lld and the width below %lld", bits, (long long)K, group,
                            (long long)chunk, (long long)(chunk * 65536));
    if (((uintptr_t)x.data | (uintptr_t)q.data) & 15)
        return PyErr_Format(PyExc_ValueError, "quant_gemv: 'x' and 'q' must start 16-byte aligned");
    cudaStream_t stream;
    if (stream_of(x.device_id, &stream) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_inf_quant_gemv(x.data, q.data, (const float *)scales.data, out.data, M, N, K, (int)bits, group,
                            cuda_dtype(x.dtype), x.device_id, stream, (int)variant);
    Py_END_ALLOW_THREADS
    return finish(rc, "quant_gemv");
}

static PyObject *py_dequantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("dequantize", nargs, 5) < 0) return NULL;
    dsc_view q, scales, out;
    if (arg(args[2], "out", ACT, 0, NULL, NULL, 0, &out) < 0) return NULL;
    if (out.ndim != 2) return PyErr_Format(PyExc_ValueError, "argument 'out' must be 2-D [N, K]");
    const long long bits = PyLong_AsLongLong(args[3]), group = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (quant_args(args, bits, group, out.shape[0], out.shape[1], &out, &q, &scales) < 0) return NULL;
    cudaStream_t stream;
    if (stream_of(out.device_id, &stream) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_inf_dequantize(q.data, (const float *)scales.data, out.data, out.shape[0], out.shape[1], (int)bits, group,
                            cuda_dtype(out.dtype), out.device_id, stream);
    Py_END_ALLOW_THREADS
    return finish(rc, "dequantize");
}

/* x [T, C] (expand) or [T * k, C] (combine); idx int64 [T, k]; wts float32 [T, k] (combine); w [E, N, C];
 * out [T * k, N] (expand) or [T, N] (combine). */
static PyObject *py_moe_gemv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("moe_gemv", nargs, 6) < 0) return NULL;
    dsc_view x, idx, wts, w, out;
    const int combine = PyObject_IsTrue(args[5]);
    if (combine < 0) return NULL;
    if (arg(args[3], "w", ACT, 0, NULL, NULL, 0, &w) < 0) return NULL;
    if (w.ndim != 3) return PyErr_Format(PyExc_ValueError, "argument 'w' must be [experts, N, C], got %d dims", w.ndim);
    const int64_t E = w.shape[0], N = w.shape[1], C = w.shape[2];
    if (arg(args[1], "idx", DSC_I64, 0, &w, "w", 0, &idx) < 0) return NULL;
    if (idx.ndim != 2 || idx.shape[0] < 1 || idx.shape[1] < 1)
        return PyErr_Format(PyExc_ValueError, "argument 'idx' must be int64 [tokens, k]");
    const int64_t T = idx.shape[0], k = idx.shape[1];
    if ((combine ? T : T * k) > 65535)
        return PyErr_Format(PyExc_ValueError, "moe_gemv takes at most 65535 %s, got %lld", combine ? "tokens" : "pairs",
                            (long long)(combine ? T : T * k));
    const int64_t xshape[2] = {combine ? T * k : T, C}, oshape[2] = {combine ? T : T * k, N}, wshape[2] = {T, k};
    if (arg(args[0], "x", ACT, 0, &w, "w", 1, &x) < 0 || want_dims(&x, "x", 2, xshape) < 0 ||
        arg(args[2], "wts", DSC_F32, !combine, &w, "w", 0, &wts) < 0 ||
        (!wts.is_none && want_dims(&wts, "wts", 2, wshape) < 0) ||
        arg(args[4], "out", ACT, 0, &w, "w", 1, &out) < 0 || want_dims(&out, "out", 2, oshape) < 0)
        return NULL;
    cudaStream_t stream;
    if (stream_of(w.device_id, &stream) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_inf_moe_gemv(x.data, (const int64_t *)idx.data, wts.is_none ? NULL : (const float *)wts.data, w.data,
                          out.data, T, k, E, N, C, combine, cuda_dtype(w.dtype), w.device_id, stream);
    Py_END_ALLOW_THREADS
    return finish(rc, "moe_gemv");
}

#define METHOD(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}

static PyMethodDef methods[] = {
    METHOD("add_norm", py_add_norm, "add_norm(x, y, bias, gamma, beta, eps, r_out, n_out): bias + residual + norm."),
    METHOD("qkv_rotary_cache", py_qkv_rotary_cache,
           "qkv_rotary_cache(qkv, bias, cos, sin, positions, past, k_cache, v_cache, q_out, n_heads, n_kv, "
           "head_dim, rot): QKV bias, rotary, KV-cache append."),
    METHOD("attention", py_attention,
           "attention(q, k_cache, v_cache, past, key_mask, scale, out, workspace, splits): cached causal GQA attention."),
    METHOD("masked_softmax", py_masked_softmax,
           "masked_softmax(scores, t, rows_per_batch, past, key_mask, scale): prefill attention's softmax, in place."),
    METHOD("bias_gelu", py_bias_gelu, "bias_gelu(h, bias, approximate): h = gelu(h + bias) in place."),
    METHOD("silu_mul", py_silu_mul, "silu_mul(gu, bias, out): out = silu(gate) * up."),
    METHOD("quant_gemv", py_quant_gemv,
           "quant_gemv(x, q, scales, out, bits, group[, variant]): weight-only int8/int4 GEMV (variant: tuning)."),
    METHOD("moe_gemv", py_moe_gemv, "moe_gemv(x, idx, wts, w, out, combine): expert GEMVs of MoE decode."),
    METHOD("dequantize", py_dequantize, "dequantize(q, scales, out, bits, group): int8/int4 weights to out's dtype."),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR,
                                        "deepspeed_c fused decoder inference kernels (kernel injection).", -1, methods,
                                        NULL, NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
