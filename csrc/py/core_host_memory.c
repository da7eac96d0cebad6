/* Host buffers of exactly the size asked for, page-locked for the GPU, handed to torch as DLPack tensors.
 *
 * torch's pinned allocator rounds every block up to a power of two (a 5.2 GiB offload buffer holds 8 GiB of
 * locked memory) and keeps freed blocks cached for the process. ZeRO-Offload and ZeRO-Infinity keep a few
 * parameter-sized host buffers for a whole run, so the rounding is host memory a user cannot train with.
 * Here a buffer is its own anonymous mapping, registered with the CUDA runtime through a function the caller
 * passes (cudaHostRegister of the runtime torch loaded; the core links no CUDA), and unregistered and unmapped
 * when torch frees the storage. Without a registration function (a host without a GPU, a unit test) the mapping
 * is returned as it is.
 *
 * torch's allocator keeps a freed pinned block until the copies queued on it have run (it records events); here
 * the DLPack deleter only moves a freed block to a list, and host_release_freed() unregisters and unmaps the
 * listed blocks. The Python side calls it after synchronizing the device, so no copy still in flight can touch
 * memory that is gone. */
#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "dsc/dlpack_abi.h"

typedef int (*register_fn)(void *ptr, size_t size, unsigned int flags);
typedef int (*unregister_fn)(void *ptr);

typedef struct host_block {
    DLManagedTensor managed;
    int64_t shape[1];
    void *base;
    size_t mapped;
    unregister_fn unregister;
    struct host_block *next_freed;
} host_block;

static pthread_mutex_t freed_lock = PTHREAD_MUTEX_INITIALIZER;
static host_block *freed_head = NULL;
static size_t freed_bytes = 0;

static void host_block_release(host_block *b) {
    if (b->unregister) (void)b->unregister(b->base);
    (void)munmap(b->base, b->mapped);
    free(b);
}

/* The DLPack deleter: may run on any thread, with or without the GIL. */
static void host_block_free(DLManagedTensor *self) {
    host_block *b = (host_block *)self->manager_ctx;
    pthread_mutex_lock(&freed_lock);
    b->next_freed = freed_head;
    freed_head = b;
    freed_bytes += b->mapped;
    pthread_mutex_unlock(&freed_lock);
}

/* A capsule nobody consumed still owns its block (torch renames the ones it takes). */
static void capsule_destructor(PyObject *capsule) {
    if (!PyCapsule_IsValid(capsule, "dltensor")) return;
    DLManagedTensor *m = (DLManagedTensor *)PyCapsule_GetPointer(capsule, "dltensor");
    if (m && m->deleter) m->deleter(m);
}

/* A function pointer from the integer address Python's ctypes gives (0: none). */
static void *address(unsigned long long value) {
    void *p = NULL;
    uintptr_t u = (uintptr_t)value;
    memcpy(&p, &u, sizeof p);
    return p;
}

static PyObject *host_alloc(PyObject *self, PyObject *args) {
    unsigned long long nbytes = 0, reg_addr = 0, unreg_addr = 0;
    unsigned int flags = 0;
    if (!PyArg_ParseTuple(args, "KKKI", &nbytes, &reg_addr, &unreg_addr, &flags)) return NULL;
    if (nbytes == 0 || nbytes > (unsigned long long)INT64_MAX) {
        PyErr_Format(PyExc_ValueError, "host_alloc: nbytes must be in [1, 2^63), got %llu", nbytes);
        return NULL;
    }
    if ((reg_addr == 0) != (unreg_addr == 0)) {
        PyErr_SetString(PyExc_ValueError, "host_alloc: give both the register and unregister functions, or neither");
        return NULL;
    }
    const long page = sysconf(_SC_PAGESIZE);
    const size_t unit = page > 0 ? (size_t)page : 4096u;
    if (nbytes > (unsigned long long)(SIZE_MAX - unit)) {
        PyErr_Format(PyExc_ValueError, "host_alloc: %llu bytes do not fit this address space", nbytes);
        return NULL;
    }
    const size_t mapped = ((size_t)nbytes + unit - 1) / unit * unit;
    host_block *b = (host_block *)calloc(1, sizeof *b);
    if (!b) return PyErr_NoMemory();
    void *base = MAP_FAILED;
    int err = 0, rc = 0;
    Py_BEGIN_ALLOW_THREADS
    base = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    err = errno;
    /* a fork (DataLoader workers) must not make the parent's pages copy-on-write: the GPU's DMA would keep the
     * old physical pages while the parent writes new ones; the child does not get the mapping at all */
    if (base != MAP_FAILED && reg_addr && madvise(base, mapped, MADV_DONTFORK) != 0) rc = -1;
    if (base != MAP_FAILED && reg_addr && rc == 0) rc = ((register_fn)address(reg_addr))(base, mapped, flags);
    Py_END_ALLOW_THREADS
    if (base == MAP_FAILED) {
        free(b);
        PyErr_Format(PyExc_MemoryError, "host_alloc: mapping %llu bytes failed: %s", nbytes, strerror(err));
        return NULL;
    }
    if (rc != 0) {
        (void)munmap(base, mapped);
        free(b);
        PyErr_Format(PyExc_RuntimeError, "host_alloc: page-locking %llu bytes for the GPU failed (CUDA error %d)",
                     nbytes, rc);
        return NULL;
    }
    b->base = base;
    b->mapped = mapped;
    b->unregister = reg_addr ? (unregister_fn)address(unreg_addr) : NULL;
    b->shape[0] = (int64_t)nbytes;
    DLTensor *t = &b->managed.dl_tensor;
    t->data = base;
    t->device.device_type = DSC_DL_CPU;
    t->device.device_id = 0;
    t->ndim = 1;
    t->dtype.code = DSC_DL_UINT;
    t->dtype.bits = 8;
    t->dtype.lanes = 1;
    t->shape = b->shape;
    t->strides = NULL;
    t->byte_offset = 0;
    b->managed.manager_ctx = b;
    b->managed.deleter = host_block_free;
    PyObject *capsule = PyCapsule_New(&b->managed, "dltensor", capsule_destructor);
    if (!capsule) host_block_release(b);  /* never seen by torch: no copy can use it */
    return capsule;
}

static PyObject *host_freed_bytes(PyObject *self, PyObject *unused) {
    pthread_mutex_lock(&freed_lock);
    const size_t n = freed_bytes;
    pthread_mutex_unlock(&freed_lock);
    return PyLong_FromSize_t(n);
}

static PyObject *host_release_freed(PyObject *self, PyObject *unused) {
    pthread_mutex_lock(&freed_lock);
    host_block *b = freed_head;
    const size_t n = freed_bytes;
    freed_head = NULL;
    freed_bytes = 0;
    pthread_mutex_unlock(&freed_lock);
    Py_BEGIN_ALLOW_THREADS
    while (b) {
        host_block *next = b->next_freed;
        host_block_release(b);
        b = next;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromSize_t(n);
}

PyMethodDef dsc_host_memory_methods[] = {
    {"host_alloc", host_alloc, METH_VARARGS,
     "host_alloc(nbytes, register_addr, unregister_addr, flags) -> a DLPack capsule of a uint8 CPU tensor of exactly "
     "nbytes, its own page-aligned mapping, registered through register_addr(ptr, size, flags) and released through "
     "unregister_addr(ptr) then unmapped by host_release_freed once torch has freed it (addresses 0: plain mapping)."},
    {"host_freed_bytes", host_freed_bytes, METH_NOARGS,
     "host_freed_bytes() -> bytes of host_alloc buffers torch has freed and host_release_freed has not yet released."},
    {"host_release_freed", host_release_freed, METH_NOARGS,
     "host_release_freed() -> bytes released: unregisters and unmaps every freed host_alloc buffer. Call it only when "
     "no copy queued on the device can still use one (after synchronizing)."},
    {NULL, NULL, 0, NULL},
};
