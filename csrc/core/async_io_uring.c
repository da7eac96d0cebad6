/* io_uring through its two system calls and three shared mappings (see io_uring(7)): the
 * submission ring (indices into the SQE array), the SQE array and the completion ring. A batch is
 * submitted with one io_uring_enter and all of its completions are reaped before returning, so
 * no request outlives the call and no state crosses batches. */
#define _GNU_SOURCE
#include "dsc/async_io_uring.h"

#include <errno.h>
#include <linux/io_uring.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

struct dsc_uring {
    int fd;
    unsigned entries;
    void *sq_map, *cq_map;
    size_t sq_map_len, cq_map_len;
    struct io_uring_sqe *sqes;
    size_t sqes_len;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
};

static int sys_setup(unsigned entries, struct io_uring_params *p) {
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
}

void dsc_uring_destroy(dsc_uring *r) {
    if (!r) return;
    if (r->sqes && r->sqes != MAP_FAILED) munmap(r->sqes, r->sqes_len);
    if (r->cq_map && r->cq_map != MAP_FAILED && r->cq_map != r->sq_map) munmap(r->cq_map, r->cq_map_len);
    if (r->sq_map && r->sq_map != MAP_FAILED) munmap(r->sq_map, r->sq_map_len);
    if (r->fd >= 0) close(r->fd);
    free(r);
}

dsc_uring *dsc_uring_create(unsigned entries) {
    if (entries < 1) entries = 1;
    if (entries > 4096) entries = 4096;
    dsc_uring *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    r->fd = sys_setup(entries, &p);
    if (r->fd < 0) {
        free(r);
        return NULL;
    }
    r->entries = p.sq_entries;
    r->sq_map_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_map_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single && r->cq_map_len > r->sq_map_len) r->sq_map_len = r->cq_map_len;
    r->sq_map = mmap(NULL, r->sq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                     IORING_OFF_SQ_RING);
    if (r->sq_map == MAP_FAILED) goto fail;
    r->cq_map = single ? r->sq_map
                       : mmap(NULL, r->cq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                              IORING_OFF_CQ_RING);
    if (r->cq_map == MAP_FAILED) goto fail;
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) goto fail;
    char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return r;
fail:
    dsc_uring_destroy(r);
    return NULL;
}

unsigned dsc_uring_capacity(const dsc_uring *r) { return r->entries; }

int dsc_uring_run(dsc_uring *r, dsc_uring_req *reqs, unsigned n) {
    if (n == 0) return 0;
    if (n > r->entries) return -EINVAL;
    unsigned tail = *r->sq_tail; /* only this thread writes the tail */
    unsigned mask = *r->sq_mask;
    for (unsigned i = 0; i < n; i++) {
        unsigned idx = (tail + i) & mask;
        struct io_uring_sqe *sqe = &r->sqes[idx];
        memset(sqe, 0, sizeof *sqe);
        sqe->opcode = reqs[i].is_write ? IORING_OP_WRITE : IORING_OP_READ;
        sqe->fd = reqs[i].fd;
        sqe->addr = (uint64_t)(uintptr_t)reqs[i].buf;
        sqe->len = (uint32_t)reqs[i].len;
        sqe->off = (uint64_t)reqs[i].off;
        sqe->user_data = i;
        r->sq_array[idx] = idx;
        reqs[i].res = -EINPROGRESS;
    }
    __atomic_store_n(r->sq_tail, tail + n, __ATOMIC_RELEASE);
    unsigned submitted = 0, reaped = 0, target = n;
    while (reaped < target) {
        int rc = sys_enter(r->fd, target - submitted, 1, IORING_ENTER_GETEVENTS);
        if (rc < 0) {
            int e = errno;
            if (e == EINTR || e == EAGAIN || e == EBUSY) continue;
            /* the kernel took requests [0, submitted) only: take the rest back out of the ring */
            __atomic_store_n(r->sq_tail, tail + submitted, __ATOMIC_RELEASE);
            for (unsigned i = submitted; i < n; i++) reqs[i].res = -e;
            target = submitted;
            if (submitted == 0) return -e; /* nothing in flight: the caller falls back */
            continue;
        }
        submitted += (unsigned)rc;
        unsigned head = *r->cq_head;
        unsigned ctail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        while (head != ctail) {
            struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
            if (cqe->user_data < n) reqs[cqe->user_data].res = cqe->res;
            head++;
            reaped++;
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    }
    return 0;
}
