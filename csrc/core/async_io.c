/* The async I/O core: see dsc/async_io.h for the contract.
 *
 * Engine: a pool of worker threads over one FIFO of ops. An op is cut into blocks of
 * block_size bytes (the O_DIRECT-able prefix) plus the unaligned tail; each worker takes the next
 * block of the oldest op that still has blocks, moves it with pread/pwrite, and the worker that
 * completes the last block of an op finishes it (closes, renames or removes the temporary) and
 * wakes the waiters. No block is ever padded, so files hold exactly the bytes written. */
#define _GNU_SOURCE
#include "dsc/async_io.h"
#include "dsc/async_io_uring.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct aio_op {
    int64_t id;
    int is_write, is_async;
    char *buf;
    int64_t nbytes, file_offset;
    int fd_direct, fd_buf; /* fd_direct is -1 when O_DIRECT is refused or not asked for */
    char *path, *tmp_path; /* tmp_path: the temporary a replacing write goes to, else NULL */
    int64_t direct_len;    /* bytes [0, direct_len) move through fd_direct */
    int64_t n_direct, n_blocks, next_block, blocks_done;
    int failed, done;
    char err[DSC_AIO_ERRLEN];
    struct aio_op *next;
} aio_op;

/* One block of an op taken by a worker. */
typedef struct {
    aio_op *op;
    int64_t b;
    int rc, kind;
} taken_block;

typedef struct worker {
    struct dsc_aio_ctx *ctx;
    pthread_t thread;
    char *bounce; /* block_size bytes, DSC_AIO_ALIGNMENT-aligned */
    int started;
    dsc_uring *ring;      /* NULL: one block at a time with pread/pwrite */
    taken_block *batch;   /* ring capacity entries */
    dsc_uring_req *reqs;
} worker;

struct dsc_aio_ctx {
    dsc_aio_config cfg;
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;
    aio_op *head, *tail;
    int64_t next_id;
    int stop;
    worker *workers;
    dsc_aio_stats stats;
    int64_t n_open, max_open; /* ops holding descriptors (submitted, not finished), and their bound */
    int64_t n_queued;         /* of those, the ones handed to the workers (each will finish) */
};

static void fmt(char *err, size_t errlen, const char *f, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, f);
    vsnprintf(err, errlen, f, ap);
    va_end(ap);
}

const char *dsc_aio_backend(void) {
    return "io_uring per worker thread (raw system calls), pread/pwrite where io_uring is unavailable or "
           "DSC_AIO_ENGINE=pread; O_DIRECT when the filesystem allows";
}

/* Move len bytes; 0 on success, an errno value, or -1 for end of file on a read. */
static int io_full(int fd, int is_write, char *p, int64_t len, int64_t off) {
    while (len > 0) {
        ssize_t r = is_write ? pwrite(fd, p, (size_t)len, (off_t)off) : pread(fd, p, (size_t)len, (off_t)off);
        if (r < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (r == 0) return is_write ? EIO : -1;
        p += r;
        off += r;
        len -= r;
    }
    return 0;
}

static int aligned(int64_t v) { return v % DSC_AIO_ALIGNMENT == 0; }

/* Where block b of an op goes: memory, length, file offset, and its kind: 0 through the page cache
 * (fd_buf), 1 direct from the caller's memory (fd_direct), 2 direct through the bounce buffer. */
static void block_geometry(const worker *w, const aio_op *op, int64_t b, char **mem, int64_t *len, int64_t *foff,
                           int *kind) {
    int64_t bs = w->ctx->cfg.block_size, off;
    if (b < op->n_direct) {
        off = b * bs;
        *len = op->direct_len - off < bs ? op->direct_len - off : bs;
    } else {
        off = op->direct_len + (b - op->n_direct) * bs;
        *len = op->nbytes - off < bs ? op->nbytes - off : bs;
    }
    *mem = op->buf + off;
    *foff = op->file_offset + off;
    *kind = b >= op->n_direct ? 0 : (((uintptr_t)*mem % DSC_AIO_ALIGNMENT) == 0 ? 1 : 2);
}

/* One block of an op; 0 or an error code as io_full. Sets *kind: 0 buffered, 1 direct, 2 bounced. */
static int do_block(worker *w, aio_op *op, int64_t b, int *kind) {
    char *mem;
    int64_t len, foff;
    block_geometry(w, op, b, &mem, &len, &foff, kind);
    if (*kind == 0) return io_full(op->fd_buf, op->is_write, mem, len, foff);
    if (*kind == 1) {
        int rc = io_full(op->fd_direct, op->is_write, mem, len, foff);
        /* a short direct transfer leaves an unaligned remainder: the page cache takes it */
        return rc == EINVAL ? io_full(op->fd_buf, op->is_write, mem, len, foff) : rc;
    }
    /* the caller's memory is not aligned: stage through this worker's bounce buffer */
    if (op->is_write) {
        memcpy(w->bounce, mem, (size_t)len);
        return io_full(op->fd_direct, 1, w->bounce, len, foff);
    }
    int rc = io_full(op->fd_direct, 0, w->bounce, len, foff);
    if (rc == 0) memcpy(mem, w->bounce, (size_t)len);
    return rc;
}

static void block_error(aio_op *op, int rc, int64_t b) {
    if (rc == -1)
        fmt(op->err, sizeof op->err, "read past the end of %s (the file shrank while being read)", op->path);
    else
        fmt(op->err, sizeof op->err, "%s %s failed (block %lld): %s", op->is_write ? "writing" : "reading",
            op->path, (long long)b, strerror(rc));
}

/* Close the op's files; a replacing write renames its temporary over the target or removes it. */
static void finish_files(aio_op *op) {
    if (op->fd_direct >= 0) close(op->fd_direct);
    if (op->is_write == DSC_AIO_WRITE_OVERWRITE && !op->failed && op->fd_buf >= 0 &&
        ftruncate(op->fd_buf, (off_t)(op->file_offset + op->nbytes)) != 0) {
        op->failed = 1;
        fmt(op->err, sizeof op->err, "cannot truncate %s to %lld bytes: %s", op->path,
            (long long)(op->file_offset + op->nbytes), strerror(errno));
    }
    if (op->fd_buf >= 0 && close(op->fd_buf) != 0 && op->is_write && !op->failed) {
        op->failed = 1;
        fmt(op->err, sizeof op->err, "writing %s failed at close: %s", op->path, strerror(errno));
    }
    op->fd_direct = op->fd_buf = -1;
    if (op->tmp_path) {
        if (!op->failed && rename(op->tmp_path, op->path) != 0) {
            op->failed = 1;
            fmt(op->err, sizeof op->err, "cannot rename %s to %s: %s", op->tmp_path, op->path, strerror(errno));
        }
        if (op->failed) unlink(op->tmp_path);
    }
}

/* A batch through the worker's ring: bounced blocks (one bounce buffer) go synchronously, the rest
 * are in flight together; a short transfer is completed through the page cache. */
static void run_batch_ring(worker *w, taken_block *t, int n) {
    int nr = 0;
    int idx[n > 0 ? n : 1];
    for (int i = 0; i < n; i++) {
        char *mem;
        int64_t len, foff;
        block_geometry(w, t[i].op, t[i].b, &mem, &len, &foff, &t[i].kind);
        if (t[i].kind == 2) {
            t[i].rc = do_block(w, t[i].op, t[i].b, &t[i].kind);
            continue;
        }
        dsc_uring_req *r = &w->reqs[nr];
        r->fd = t[i].kind == 1 ? t[i].op->fd_direct : t[i].op->fd_buf;
        r->is_write = t[i].op->is_write != DSC_AIO_READ;
        r->buf = mem;
        r->len = len;
        r->off = foff;
        idx[nr++] = i;
    }
    if (nr == 0) return;
    if (dsc_uring_run(w->ring, w->reqs, (unsigned)nr) != 0) { /* the ring failed: every request by hand */
        for (int k = 0; k < nr; k++) t[idx[k]].rc = do_block(w, t[idx[k]].op, t[idx[k]].b, &t[idx[k]].kind);
        return;
    }
    for (int k = 0; k < nr; k++) {
        dsc_uring_req *r = &w->reqs[k];
        taken_block *tb = &t[idx[k]];
        int wr = tb->op->is_write != DSC_AIO_READ;
        if (r->res == r->len) {
            tb->rc = 0;
        } else if (r->res < 0 && -r->res == EINVAL && tb->kind == 1) {
            tb->rc = io_full(tb->op->fd_buf, wr, r->buf, r->len, r->off); /* O_DIRECT refused this one */
        } else if (r->res < 0) {
            tb->rc = (int)-r->res;
        } else if (r->res == 0 && !wr) {
            tb->rc = -1; /* end of file */
        } else { /* short: the remainder through the page cache (no alignment needed there) */
            tb->rc = io_full(tb->op->fd_buf, wr, (char *)r->buf + r->res, r->len - r->res, r->off + r->res);
        }
    }
}

static void *worker_main(void *arg) {
    worker *w = arg;
    dsc_aio_ctx *ctx = w->ctx;
    int cap = w->ring ? (int)dsc_uring_capacity(w->ring) : 1;
    taken_block one;
    taken_block *batch = w->ring ? w->batch : &one;
    pthread_mutex_lock(&ctx->mu);
    for (;;) {
        int n = 0;
        for (aio_op *op = ctx->head; op && n < cap; op = op->next)
            while (op->next_block < op->n_blocks && n < cap) {
                batch[n].op = op;
                batch[n].b = op->next_block++;
                n++;
            }
        if (n == 0) {
            if (ctx->stop) break;
            pthread_cond_wait(&ctx->work_cv, &ctx->mu);
            continue;
        }
        pthread_mutex_unlock(&ctx->mu);
        if (w->ring && n > 1) {
            run_batch_ring(w, batch, n);
        } else {
            for (int i = 0; i < n; i++) batch[i].rc = do_block(w, batch[i].op, batch[i].b, &batch[i].kind);
        }
        pthread_mutex_lock(&ctx->mu);
        for (int i = 0; i < n; i++) {
            aio_op *op = batch[i].op;
            int kind = batch[i].kind, rc = batch[i].rc;
            if (kind == 0) ctx->stats.blocks_buffered++;
            else ctx->stats.blocks_direct++;
            if (kind == 2) ctx->stats.blocks_bounced++;
            op->blocks_done++;
            if (rc != 0 && !op->failed) {
                op->failed = 1;
                block_error(op, rc, batch[i].b);
                /* hand out no more of this op: count the blocks never started as done */
                op->blocks_done += op->n_blocks - op->next_block;
                op->next_block = op->n_blocks;
            }
            if (op->blocks_done == op->n_blocks) {
                pthread_mutex_unlock(&ctx->mu);
                finish_files(op);
                pthread_mutex_lock(&ctx->mu);
                op->done = 1;
                ctx->n_open--;
                ctx->n_queued--;
                ctx->stats.ops_completed++;
                pthread_cond_broadcast(&ctx->done_cv);
            }
        }
    }
    pthread_mutex_unlock(&ctx->mu);
    return NULL;
}

/* How many ops of one context may hold descriptors at once (each holds up to two: O_DIRECT and
 * page cache). Enough to keep every worker's queue full; never more than a 16th of the process's
 * descriptor limit, so thousands of queued small files (a swapper's sub-groups read for a
 * checkpoint) wait for earlier ones to finish instead of failing with EMFILE. */
static int64_t open_bound(const dsc_aio_config *cfg) {
    int64_t want = 2 * (int64_t)cfg->threads * (int64_t)cfg->queue_depth;
    if (want < 16) want = 16;
    if (want > 1024) want = 1024;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
        int64_t share = (int64_t)(rl.rlim_cur / 32); /* 32: two descriptors per op, a 16th of the limit */
        if (want > share) want = share;
    }
    return want < 1 ? 1 : want;
}

dsc_aio_ctx *dsc_aio_create(const dsc_aio_config *cfg, char *err, size_t errlen) {
    if (cfg->block_size <= 0 || !aligned(cfg->block_size)) {
        fmt(err, errlen, "block_size must be a positive multiple of %d bytes, got %lld", DSC_AIO_ALIGNMENT,
            (long long)cfg->block_size);
        return NULL;
    }
    if (cfg->queue_depth < 1) {
        fmt(err, errlen, "queue_depth must be >= 1, got %d", cfg->queue_depth);
        return NULL;
    }
    if (cfg->threads < 1 || cfg->threads > 1024) {
        fmt(err, errlen, "intra_op_parallelism must be in [1, 1024], got %d", cfg->threads);
        return NULL;
    }
    dsc_aio_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) goto oom;
    ctx->cfg = *cfg;
    ctx->next_id = 1;
    ctx->max_open = open_bound(cfg);
    ctx->workers = calloc((size_t)cfg->threads, sizeof *ctx->workers);
    if (!ctx->workers) {
        free(ctx);
        goto oom;
    }
    pthread_mutex_init(&ctx->mu, NULL);
    pthread_cond_init(&ctx->work_cv, NULL);
    pthread_cond_init(&ctx->done_cv, NULL);
    for (int i = 0; i < cfg->threads; i++) {
        worker *w = &ctx->workers[i];
        w->ctx = ctx;
        if (posix_memalign((void **)&w->bounce, DSC_AIO_ALIGNMENT, (size_t)cfg->block_size) != 0) {
            w->bounce = NULL;
            dsc_aio_destroy(ctx);
            goto oom;
        }
        if (cfg->use_uring && cfg->queue_depth > 1 && (w->ring = dsc_uring_create((unsigned)cfg->queue_depth))) {
            unsigned cap = dsc_uring_capacity(w->ring);
            w->batch = calloc(cap, sizeof *w->batch);
            w->reqs = calloc(cap, sizeof *w->reqs);
            if (!w->batch || !w->reqs) {
                dsc_aio_destroy(ctx);
                goto oom;
            }
            ctx->stats.uring_workers++;
        }
        int rc = pthread_create(&w->thread, NULL, worker_main, w);
        if (rc != 0) {
            dsc_aio_destroy(ctx);
            fmt(err, errlen, "cannot start I/O worker thread %d: %s", i, strerror(rc));
            return NULL;
        }
        w->started = 1;
    }
    return ctx;
oom:
    fmt(err, errlen, "out of memory creating an I/O context (%d threads x %lld-byte bounce buffers)", cfg->threads,
        (long long)cfg->block_size);
    return NULL;
}

static void free_op(aio_op *op) {
    free(op->path);
    free(op->tmp_path);
    free(op);
}

static void unlink_op(dsc_aio_ctx *ctx, aio_op *op) {
    aio_op **pp = &ctx->head, *prev = NULL;
    while (*pp && *pp != op) {
        prev = *pp;
        pp = &(*pp)->next;
    }
    if (!*pp) return;
    *pp = op->next;
    if (ctx->tail == op) ctx->tail = prev;
}

void dsc_aio_destroy(dsc_aio_ctx *ctx) {
    if (!ctx) return;
    pthread_mutex_lock(&ctx->mu);
    for (;;) { /* never free memory a worker is still moving: drain first */
        int busy = 0;
        for (aio_op *op = ctx->head; op; op = op->next) busy |= !op->done;
        if (!busy) break;
        pthread_cond_wait(&ctx->done_cv, &ctx->mu);
    }
    ctx->stop = 1;
    pthread_cond_broadcast(&ctx->work_cv);
    pthread_mutex_unlock(&ctx->mu);
    for (int i = 0; i < ctx->cfg.threads; i++) {
        if (ctx->workers[i].started) pthread_join(ctx->workers[i].thread, NULL);
        free(ctx->workers[i].bounce);
        dsc_uring_destroy(ctx->workers[i].ring);
        free(ctx->workers[i].batch);
        free(ctx->workers[i].reqs);
    }
    while (ctx->head) {
        aio_op *op = ctx->head;
        ctx->head = op->next;
        free_op(op);
    }
    pthread_mutex_destroy(&ctx->mu);
    pthread_cond_destroy(&ctx->work_cv);
    pthread_cond_destroy(&ctx->done_cv);
    free(ctx->workers);
    free(ctx);
}

static char *dupstr(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* Open the op's descriptors; 0, or -1 with err filled and *open_errno the errno of a failed open
 * (0 when something else failed). */
static int open_files(dsc_aio_ctx *ctx, aio_op *op, char *err, size_t errlen, int *open_errno) {
    *open_errno = 0;
    int want_direct = ctx->cfg.use_direct && aligned(op->file_offset) && op->nbytes >= DSC_AIO_ALIGNMENT;
    if (!op->is_write) {
        op->fd_buf = open(op->path, O_RDONLY | O_CLOEXEC);
        if (op->fd_buf < 0) {
            *open_errno = errno;
            fmt(err, errlen, "cannot open %s for reading: %s", op->path, strerror(errno));
            return -1;
        }
        struct stat st;
        if (fstat(op->fd_buf, &st) != 0) {
            fmt(err, errlen, "cannot stat %s: %s", op->path, strerror(errno));
            return -1;
        }
        if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode)) {
            fmt(err, errlen, "%s is not a regular file", op->path);
            return -1;
        }
        if (S_ISREG(st.st_mode) && (int64_t)st.st_size < op->file_offset + op->nbytes) {
            fmt(err, errlen,
                "read past the end of %s: the file has %lld bytes, the read wants bytes [%lld, %lld) "
                "(buffer of %lld bytes at file_offset %lld)",
                op->path, (long long)st.st_size, (long long)op->file_offset,
                (long long)(op->file_offset + op->nbytes), (long long)op->nbytes, (long long)op->file_offset);
            return -1;
        }
        if (want_direct) op->fd_direct = open(op->path, O_RDONLY | O_DIRECT | O_CLOEXEC);
        return 0;
    }
    const char *target = op->path;
    if (op->is_write == DSC_AIO_WRITE && op->file_offset == 0) {
        /* replacing write: temporary beside the target, renamed at the end */
        size_t n = strlen(op->path) + 64;
        op->tmp_path = malloc(n);
        if (!op->tmp_path) {
            fmt(err, errlen, "out of memory");
            return -1;
        }
        snprintf(op->tmp_path, n, "%s.dsc-tmp-%ld-%lld", op->path, (long)getpid(), (long long)op->id);
        target = op->tmp_path;
        op->fd_buf = open(target, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    } else {
        op->fd_buf = open(target, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    }
    if (op->fd_buf < 0) {
        *open_errno = errno;
        fmt(err, errlen, "cannot open %s for writing: %s", op->path, strerror(errno));
        free(op->tmp_path);
        op->tmp_path = NULL;
        return -1;
    }
    if (op->nbytes > 0) { /* reserve the space now: a full filesystem fails here, not half-way */
        int rc = posix_fallocate(op->fd_buf, (off_t)op->file_offset, (off_t)op->nbytes);
        if (rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) {
            fmt(err, errlen, "no room to write %lld bytes to %s: %s", (long long)op->nbytes, op->path, strerror(rc));
            return -1;
        }
    }
    if (want_direct) op->fd_direct = open(target, O_WRONLY | O_DIRECT | O_CLOEXEC);
    return 0;
}

int64_t dsc_aio_submit(dsc_aio_ctx *ctx, int is_write, int is_async, void *buf, int64_t nbytes,
                       const char *filename, int64_t file_offset, char *err, size_t errlen) {
    if (nbytes < 0 || file_offset < 0) {
        fmt(err, errlen, "negative size or file_offset (%lld, %lld) for %s", (long long)nbytes,
            (long long)file_offset, filename);
        return -1;
    }
    if (nbytes > 0 && !buf) {
        fmt(err, errlen, "null buffer for %s", filename);
        return -1;
    }
    aio_op *op = calloc(1, sizeof *op);
    if (!op || !(op->path = dupstr(filename))) {
        free(op);
        fmt(err, errlen, "out of memory");
        return -1;
    }
    op->is_write = is_write;
    op->is_async = is_async;
    op->buf = buf;
    op->nbytes = nbytes;
    op->file_offset = file_offset;
    op->fd_direct = op->fd_buf = -1;
    pthread_mutex_lock(&ctx->mu);
    op->id = ctx->next_id++;
    while (ctx->n_open >= ctx->max_open) pthread_cond_wait(&ctx->done_cv, &ctx->mu);
    ctx->n_open++;
    /* ops finished (their descriptors closed) before this open attempt */
    int64_t seen = ctx->stats.ops_completed;
    pthread_mutex_unlock(&ctx->mu);
    for (;;) {
        int open_errno;
        if (open_files(ctx, op, err, errlen, &open_errno) == 0) break;
        op->failed = 1; /* removes a temporary already created, closes what was opened */
        finish_files(op);
        pthread_mutex_lock(&ctx->mu);
        /* out of descriptors while this context's ops hold some: retry once one of them is done (the failed
         * open created nothing: no temporary, no descriptor). One may have finished between the failed open
         * and this lock, leaving none queued: its closed descriptors are free now, so retry at once. */
        int retry = (open_errno == EMFILE || open_errno == ENFILE) &&
                    (ctx->n_queued > 0 || ctx->stats.ops_completed != seen);
        if (retry) {
            while (ctx->stats.ops_completed == seen) pthread_cond_wait(&ctx->done_cv, &ctx->mu);
            seen = ctx->stats.ops_completed;
            op->failed = 0;
            op->err[0] = 0;
        } else {
            ctx->n_open--;
            pthread_cond_broadcast(&ctx->done_cv);
        }
        pthread_mutex_unlock(&ctx->mu);
        if (!retry) {
            op->failed = 1;
            free_op(op);
            return -1;
        }
    }
    int64_t bs = ctx->cfg.block_size;
    op->direct_len = op->fd_direct >= 0 ? nbytes - nbytes % DSC_AIO_ALIGNMENT : 0;
    op->n_direct = (op->direct_len + bs - 1) / bs;
    op->n_blocks = op->n_direct + (nbytes - op->direct_len + bs - 1) / bs;
    if (op->n_blocks == 0) finish_files(op); /* nothing to move (0 bytes): finish inline */
    pthread_mutex_lock(&ctx->mu);
    op->done = op->n_blocks == 0;
    if (op->done) {
        ctx->n_open--;
        pthread_cond_broadcast(&ctx->done_cv);
    } else {
        ctx->n_queued++;
    }
    if (op->done && op->failed) fmt(err, errlen, "%s", op->err);
    if (ctx->tail) ctx->tail->next = op;
    else ctx->head = op;
    ctx->tail = op;
    ctx->stats.ops_submitted++;
    if (op->done) ctx->stats.ops_completed++;
    else pthread_cond_broadcast(&ctx->work_cv);
    int64_t id = op->id;
    pthread_mutex_unlock(&ctx->mu);
    return id;
}

int dsc_aio_wait_op(dsc_aio_ctx *ctx, int64_t op_id, char *err, size_t errlen) {
    pthread_mutex_lock(&ctx->mu);
    aio_op *op = ctx->head;
    while (op && op->id != op_id) op = op->next;
    if (!op) {
        pthread_mutex_unlock(&ctx->mu);
        fmt(err, errlen, "no pending I/O op with id %lld", (long long)op_id);
        return -1;
    }
    while (!op->done) pthread_cond_wait(&ctx->done_cv, &ctx->mu);
    unlink_op(ctx, op);
    pthread_mutex_unlock(&ctx->mu);
    int failed = op->failed;
    if (failed) fmt(err, errlen, "%s", op->err);
    free_op(op);
    return failed ? -1 : 1;
}

int64_t dsc_aio_wait_all(dsc_aio_ctx *ctx, int64_t *n_failed, char *err, size_t errlen) {
    int64_t count = 0, failed = 0;
    pthread_mutex_lock(&ctx->mu);
    for (;;) {
        aio_op *op = ctx->head; /* the oldest async op; sync ops belong to their submitters */
        while (op && !op->is_async) op = op->next;
        if (!op) break;
        if (!op->done) {
            pthread_cond_wait(&ctx->done_cv, &ctx->mu);
            continue;
        }
        unlink_op(ctx, op);
        count++;
        if (op->failed && failed++ == 0) fmt(err, errlen, "%s", op->err);
        free_op(op);
    }
    pthread_mutex_unlock(&ctx->mu);
    if (n_failed) *n_failed = failed;
    return failed ? -1 : count;
}

int64_t dsc_aio_pending(dsc_aio_ctx *ctx) {
    int64_t n = 0;
    pthread_mutex_lock(&ctx->mu);
    for (aio_op *op = ctx->head; op; op = op->next) n += op->is_async;
    pthread_mutex_unlock(&ctx->mu);
    return n;
}

void dsc_aio_get_stats(dsc_aio_ctx *ctx, dsc_aio_stats *out) {
    pthread_mutex_lock(&ctx->mu);
    *out = ctx->stats;
    pthread_mutex_unlock(&ctx->mu);
}
