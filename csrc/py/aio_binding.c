/* Bindings of the async_io op. The Python shim (deepspeed_c/ops/aio) builds DeepSpeed's
 * aio_handle on these: a context lives in a capsule; submit/wait release the GIL while files
 * are opened and while waiting, so other Python threads run during I/O. */
#include "dsc/tensor_view.h" /* Python.h first */
#include "dsc/async_io.h"
#include "dsc/module.h"

#include <sys/mman.h>

#define CAPSULE_NAME "deepspeed_c.aio_ctx"

static const dsc_arg_spec BUFFER = {"buffer", DSC_ANY_DTYPE, DSC_DEV_CPU, DSC_CONTIGUOUS};

static void capsule_free(PyObject *cap) {
    dsc_aio_ctx *ctx = PyCapsule_GetPointer(cap, CAPSULE_NAME);
    if (!ctx) {
        PyErr_Clear();
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    dsc_aio_destroy(ctx); /* drains ops in flight first */
    Py_END_ALLOW_THREADS
}

static dsc_aio_ctx *get_ctx(PyObject *cap) {
    return PyCapsule_GetPointer(cap, CAPSULE_NAME); /* sets an exception on a wrong object */
}

static PyObject *create(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("create", nargs, 7) < 0) return NULL;
    int64_t bs, qd, ss, oe, th, direct, uring;
    if (dsc_arg_int64(args[0], "block_size", &bs) < 0 || dsc_arg_int64(args[1], "queue_depth", &qd) < 0 ||
        dsc_arg_int64(args[2], "single_submit", &ss) < 0 || dsc_arg_int64(args[3], "overlap_events", &oe) < 0 ||
        dsc_arg_int64(args[4], "intra_op_parallelism", &th) < 0 || dsc_arg_int64(args[5], "use_direct", &direct) < 0 ||
        dsc_arg_int64(args[6], "use_uring", &uring) < 0)
        return NULL;
    if (qd > INT32_MAX || th > INT32_MAX || qd < INT32_MIN || th < INT32_MIN)
        return PyErr_Format(PyExc_ValueError, "queue_depth/intra_op_parallelism out of range");
    dsc_aio_config cfg = {bs, (int32_t)qd, (int32_t)th, ss != 0, oe != 0, direct != 0, uring != 0};
    char err[DSC_AIO_ERRLEN] = "";
    dsc_aio_ctx *ctx;
    Py_BEGIN_ALLOW_THREADS
    ctx = dsc_aio_create(&cfg, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (!ctx) return PyErr_Format(PyExc_ValueError, "aio_handle: %s", err);
    PyObject *cap = PyCapsule_New(ctx, CAPSULE_NAME, capsule_free);
    if (!cap) dsc_aio_destroy(ctx);
    return cap;
}

/* submit(ctx, is_write, is_async, buffer, filename_bytes, file_offset) -> op id */
static PyObject *submit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("submit", nargs, 6) < 0) return NULL;
    dsc_aio_ctx *ctx = get_ctx(args[0]);
    if (!ctx) return NULL;
    int64_t is_write, is_async, file_offset;
    if (dsc_arg_int64(args[1], "is_write", &is_write) < 0 || dsc_arg_int64(args[2], "is_async", &is_async) < 0 ||
        dsc_arg_int64(args[5], "file_offset", &file_offset) < 0)
        return NULL;
    if (!PyBytes_Check(args[4])) return PyErr_Format(PyExc_TypeError, "argument 'filename' must be bytes");
    const char *filename = PyBytes_AsString(args[4]);
    if (!filename) return NULL;
    dsc_view view;
    if (dsc_view_from_object(args[3], &BUFFER, &view) < 0) return NULL;
    int64_t nbytes = view.numel * view.itemsize;
    char err[DSC_AIO_ERRLEN] = "";
    int64_t id;
    /* the argument tuple keeps the tensor (and the filename bytes) alive across the call */
    Py_BEGIN_ALLOW_THREADS
    id = dsc_aio_submit(ctx, (int)is_write, (int)is_async, view.data, nbytes, filename, file_offset, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (id < 0) return PyErr_Format(PyExc_OSError, "%s", err);
    return PyLong_FromLongLong((long long)id);
}

static PyObject *wait_op(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("wait_op", nargs, 2) < 0) return NULL;
    dsc_aio_ctx *ctx = get_ctx(args[0]);
    int64_t id;
    if (!ctx || dsc_arg_int64(args[1], "op_id", &id) < 0) return NULL;
    char err[DSC_AIO_ERRLEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = dsc_aio_wait_op(ctx, id, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (rc < 0) return PyErr_Format(PyExc_OSError, "%s", err);
    return PyLong_FromLong(rc);
}

static PyObject *wait_all(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("wait_all", nargs, 1) < 0) return NULL;
    dsc_aio_ctx *ctx = get_ctx(args[0]);
    if (!ctx) return NULL;
    char err[DSC_AIO_ERRLEN] = "";
    int64_t n, failed = 0;
    Py_BEGIN_ALLOW_THREADS
    n = dsc_aio_wait_all(ctx, &failed, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (n < 0) {
        if (failed > 1) return PyErr_Format(PyExc_OSError, "%s (and %lld more failed ops)", err, (long long)(failed - 1));
        return PyErr_Format(PyExc_OSError, "%s", err);
    }
    return PyLong_FromLongLong((long long)n);
}

static PyObject *pending(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("pending", nargs, 1) < 0) return NULL;
    dsc_aio_ctx *ctx = get_ctx(args[0]);
    if (!ctx) return NULL;
    return PyLong_FromLongLong((long long)dsc_aio_pending(ctx));
}

static PyObject *stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("stats", nargs, 1) < 0) return NULL;
    dsc_aio_ctx *ctx = get_ctx(args[0]);
    if (!ctx) return NULL;
    dsc_aio_stats s;
    dsc_aio_get_stats(ctx, &s);
    return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:L}", "ops_submitted", (long long)s.ops_submitted, "ops_completed",
                         (long long)s.ops_completed, "blocks_direct", (long long)s.blocks_direct, "blocks_bounced",
                         (long long)s.blocks_bounced, "blocks_buffered", (long long)s.blocks_buffered,
                         "uring_workers", (long long)s.uring_workers);
}

static PyObject *backend(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    (void)args;
    if (dsc_check_nargs("backend", nargs, 0) < 0) return NULL;
    return PyUnicode_FromString(dsc_aio_backend());
}

/* lock_memory(tensor, lock) -> bool: mlock/munlock the tensor's bytes (best effort: a small
 * RLIMIT_MEMLOCK refuses, and the tensor is still usable, only pageable). */
static PyObject *lock_memory(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (dsc_check_nargs("lock_memory", nargs, 2) < 0) return NULL;
    dsc_view view;
    int64_t lock;
    if (dsc_view_from_object(args[0], &BUFFER, &view) < 0 || dsc_arg_int64(args[1], "lock", &lock) < 0) return NULL;
    size_t n = (size_t)(view.numel * view.itemsize);
    if (n == 0) return PyBool_FromLong(1);
    int rc = lock ? mlock(view.data, n) : munlock(view.data, n);
    return PyBool_FromLong(rc == 0);
}

static PyMethodDef methods[] = {
    {"create", (PyCFunction)(void (*)(void))create, METH_FASTCALL,
     "create(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism, use_direct, use_uring) "
     "-> context"},
    {"submit", (PyCFunction)(void (*)(void))submit, METH_FASTCALL,
     "submit(ctx, is_write, is_async, buffer, filename_bytes, file_offset) -> op id"},
    {"wait_op", (PyCFunction)(void (*)(void))wait_op, METH_FASTCALL, "wait_op(ctx, op_id) -> 1"},
    {"wait_all", (PyCFunction)(void (*)(void))wait_all, METH_FASTCALL,
     "wait_all(ctx) -> number of async ops completed"},
    {"pending", (PyCFunction)(void (*)(void))pending, METH_FASTCALL, "pending(ctx) -> async ops not yet waited for"},
    {"stats", (PyCFunction)(void (*)(void))stats, METH_FASTCALL, "stats(ctx) -> dict of counters"},
    {"backend", (PyCFunction)(void (*)(void))backend, METH_FASTCALL, "backend() -> the I/O engine's name"},
    {"lock_memory", (PyCFunction)(void (*)(void))lock_memory, METH_FASTCALL, "lock_memory(tensor, lock) -> bool"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, DSC_MODULE_NAME_STR, "deepspeed_c async I/O core.", -1,
                                        methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC DSC_PYINIT(void) { return PyModule_Create(&module_def); }
