/* The async I/O core (DeepNVMe's engine): whole-tensor reads and writes between host memory
 * and files, split into blocks that a pool of worker threads moves with pread/pwrite.
 *
 * Direct I/O: each op opens its file twice, once with O_DIRECT and once through the page cache.
 * Blocks whose file offset and length are multiples of DSC_AIO_ALIGNMENT go through the O_DIRECT
 * descriptor (from the caller's memory when it is aligned too, else through a per-thread aligned
 * bounce buffer); the unaligned tail goes through the page cache. Files therefore hold exactly
 * the bytes written, never padding. A filesystem that refuses O_DIRECT (tmpfs) uses the page-cache
 * descriptor for everything.
 *
 * Writes at file offset 0 replace the file: the data go to a temporary name in the same
 * directory, space is reserved up front (fallocate: a full filesystem fails at submit), and the
 * temporary is renamed over the target only when every block succeeded; on failure it is
 * removed, so a complete file that stood there stays. Writes at a nonzero offset update the
 * existing file in place.
 *
 * Descriptors: an op holds its file's descriptors from submit until it finishes. A context keeps at
 * most a bounded number of ops open (enough for its workers, at most a 16th of RLIMIT_NOFILE when it
 * is created): a further submit waits for one to finish, and an open that fails with EMFILE/ENFILE
 * while the context has ops in flight waits for one of them and retries, so queueing thousands of
 * small files never runs the process out of descriptors.
 *
 * Thread safety: one context may be used from several threads; errors are reported as text in
 * caller-provided buffers (this core knows nothing of Python). */
#ifndef DSC_ASYNC_IO_H
#define DSC_ASYNC_IO_H

#include <stddef.h>
#include <stdint.h>

#define DSC_AIO_ALIGNMENT 4096
#define DSC_AIO_ERRLEN 512

typedef struct dsc_aio_ctx dsc_aio_ctx;

typedef struct {
    int64_t block_size;    /* bytes per request; a positive multiple of DSC_AIO_ALIGNMENT */
    int32_t queue_depth;   /* requests a worker keeps in flight (>= 1) */
    int32_t threads;       /* worker threads (intra_op_parallelism, >= 1) */
    int32_t single_submit; /* recorded for the API (submission is per request here) */
    int32_t overlap_events;
    int32_t use_direct;    /* 0: never ask for O_DIRECT (benchmarks of the page-cache path) */
    int32_t use_uring;     /* 1: each worker keeps up to queue_depth requests in flight through its own
                              io_uring (falls back to pread/pwrite where io_uring is unavailable) */
} dsc_aio_config;

typedef struct {
    int64_t ops_submitted;
    int64_t ops_completed;
    int64_t blocks_direct;   /* blocks moved through an O_DIRECT descriptor */
    int64_t blocks_bounced;  /* of those, blocks staged through a bounce buffer */
    int64_t blocks_buffered; /* blocks moved through the page cache */
    int64_t uring_workers;   /* workers that got an io_uring */
} dsc_aio_stats;

/* NULL with err filled on invalid configuration or resource failure. */
dsc_aio_ctx *dsc_aio_create(const dsc_aio_config *cfg, char *err, size_t errlen);
/* Waits for every op in flight, then stops and joins the workers and frees everything. */
void dsc_aio_destroy(dsc_aio_ctx *ctx);

enum { DSC_AIO_READ = 0, DSC_AIO_WRITE = 1, DSC_AIO_WRITE_IN_PLACE = 2, DSC_AIO_WRITE_OVERWRITE = 3 };

/* Submit one op: read nbytes from (is_write=0) or write nbytes to (is_write=1) filename at
 * file_offset, from/into buf. Returns an op id (> 0), or -1 with err filled when the op cannot
 * start (missing directory, file too short for the read, no space, bad arguments). nbytes may
 * be 0. The caller keeps buf alive until the op has been waited for. An async op is collected
 * by dsc_aio_wait_all (or dsc_aio_wait_op); a sync one only by dsc_aio_wait_op, so a
 * synchronous call never swallows another caller's async completions. is_write ==
 * DSC_AIO_WRITE_IN_PLACE writes into the existing file even at offset 0 (a descriptor the caller
 * opened, reached through /proc/self/fd). DSC_AIO_WRITE_OVERWRITE rewrites the file in place and
 * truncates it to file_offset + nbytes (no temporary: the swappers' scratch files, where rewriting
 * the same blocks is cheaper than allocating new ones and freeing the old). */
int64_t dsc_aio_submit(dsc_aio_ctx *ctx, int is_write, int is_async, void *buf, int64_t nbytes,
                       const char *filename, int64_t file_offset, char *err, size_t errlen);

/* Wait for one op. 1 on success; -1 with err filled when it failed. Either way it is gone. */
int dsc_aio_wait_op(dsc_aio_ctx *ctx, int64_t op_id, char *err, size_t errlen);

/* Wait for every op submitted so far and not yet waited for. Returns how many completed
 * (0 when none were pending). If any failed: -1 with the first failure in err and *n_failed set. */
int64_t dsc_aio_wait_all(dsc_aio_ctx *ctx, int64_t *n_failed, char *err, size_t errlen);

int64_t dsc_aio_pending(dsc_aio_ctx *ctx);
void dsc_aio_get_stats(dsc_aio_ctx *ctx, dsc_aio_stats *out);
/* Which engine moves the blocks (for the env report). */
const char *dsc_aio_backend(void);

#endif
