/* A minimal io_uring over the raw system calls (no liburing), private to the async I/O core:
 * one ring per worker thread, used to keep up to queue_depth block reads/writes in flight. */
#ifndef DSC_ASYNC_IO_URING_H
#define DSC_ASYNC_IO_URING_H

#include <stdint.h>

typedef struct dsc_uring dsc_uring;

typedef struct {
    int fd;
    int is_write;
    void *buf;
    int64_t len;
    int64_t off;
    int64_t res; /* out: bytes moved, or -errno */
} dsc_uring_req;

/* NULL when io_uring is not available here (old kernel, seccomp, limits): callers use pread/pwrite. */
dsc_uring *dsc_uring_create(unsigned entries);
void dsc_uring_destroy(dsc_uring *ring);
unsigned dsc_uring_capacity(const dsc_uring *ring);
/* Submits n (<= capacity) requests and waits for all of them; each req's res is filled.
 * 0, or -errno when the ring itself failed (then no res is meaningful and none is in flight). */
int dsc_uring_run(dsc_uring *ring, dsc_uring_req *reqs, unsigned n);

#endif
