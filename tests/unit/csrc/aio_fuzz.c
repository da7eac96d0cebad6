/* Randomised driver of the async I/O core (csrc/core/async_io.c) for the ASan/UBSan build run by
 * scripts/sanitize_tests.sh: random configurations (threads, queue depth, block size, O_DIRECT,
 * io_uring), random lengths and offsets (aligned and not, zero bytes, unaligned buffers), every
 * write mode, each write read back and compared, and the error paths. Usage:
 *   aio_fuzz DIR [SECONDS]   (files go under DIR; without SECONDS one fixed-seed pass) */
#define _GNU_SOURCE
#include "dsc/async_io.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* file contents the driver expects, kept beside the real file */
typedef struct { unsigned char *bytes; int64_t len; } model;

static void model_write(model *m, int mode, const unsigned char *src, int64_t n, int64_t off) {
    int64_t end = off + n;
    if (mode == DSC_AIO_WRITE && off == 0) m->len = 0; /* offset 0 replaces the file */
    if (end > m->len) {
        m->bytes = realloc(m->bytes, (size_t)end);
        memset(m->bytes + m->len, 0, (size_t)(end - m->len));
        m->len = end;
    }
    if (n) memcpy(m->bytes + off, src, (size_t)n);
    if (mode == DSC_AIO_WRITE_OVERWRITE) m->len = end;
}

static int pass(unsigned seed, const char *dir) {
    srand(seed);
    char err[DSC_AIO_ERRLEN], path[4096];
    dsc_aio_config cfg = {.block_size = DSC_AIO_ALIGNMENT * (1 + rand() % 4), .queue_depth = 1 + rand() % 8,
                          .threads = 1 + rand() % 3, .use_direct = rand() % 2, .use_uring = rand() % 2};
    dsc_aio_ctx *ctx = dsc_aio_create(&cfg, err, sizeof err);
    if (!ctx) { printf("create: %s\n", err); return 1; }
    snprintf(path, sizeof path, "%s/f%u.bin", dir, seed);
    model m = {NULL, 0};
    enum { MAXN = 5 * DSC_AIO_ALIGNMENT + 777 };
    unsigned char *src = NULL, *dst = NULL;
    if (posix_memalign((void **)&src, DSC_AIO_ALIGNMENT, MAXN + 64) ||
        posix_memalign((void **)&dst, DSC_AIO_ALIGNMENT, MAXN + 64)) return 2;
    int rc = 0;
    for (int it = 0; it < 24 && !rc; it++) {
        int64_t n = rand() % 3 == 0 ? (int64_t)(rand() % 3) * DSC_AIO_ALIGNMENT : rand() % MAXN;
        int64_t shift = rand() % 2 ? rand() % 64 : 0; /* an unaligned caller buffer */
        int mode = m.len == 0 ? DSC_AIO_WRITE : rand() % 4;
        if (mode == DSC_AIO_READ) mode = DSC_AIO_WRITE;
        int64_t off = mode == DSC_AIO_WRITE && rand() % 2 ? 0 : (m.len ? rand() % (m.len + 1) : 0);
        if (rand() % 3 == 0) off -= off % DSC_AIO_ALIGNMENT;
        for (int64_t i = 0; i < n; i++) src[shift + i] = (unsigned char)rand();
        int is_async = rand() % 2;
        int64_t id = dsc_aio_submit(ctx, mode, is_async, src + shift, n, path, off, err, sizeof err);
        if (id <= 0) { printf("write submit: %s\n", err); rc = 3; break; }
        if (is_async && rand() % 2) {
            int64_t failed = 0;
            if (dsc_aio_wait_all(ctx, &failed, err, sizeof err) < 0) { printf("write: %s\n", err); rc = 4; break; }
        } else if (dsc_aio_wait_op(ctx, id, err, sizeof err) != 1) { printf("write: %s\n", err); rc = 4; break; }
        model_write(&m, mode, src + shift, n, off);
        /* read back a random window of what the file should hold */
        int64_t roff = m.len ? rand() % (m.len + 1) : 0, rn = m.len - roff;
        if (rn > MAXN) rn = MAXN;
        rn = rn ? rand() % (rn + 1) : 0;
        int64_t rshift = rand() % 2 ? rand() % 64 : 0;
        memset(dst, 0xA5, MAXN + 64);
        id = dsc_aio_submit(ctx, DSC_AIO_READ, 0, dst + rshift, rn, path, roff, err, sizeof err);
        if (id <= 0 || dsc_aio_wait_op(ctx, id, err, sizeof err) != 1) { printf("read: %s\n", err); rc = 5; break; }
        if (rn && memcmp(dst + rshift, m.bytes + roff, (size_t)rn)) { printf("read back differs (seed %u)\n", seed); rc = 6; }
    }
    /* error paths: a read past the end, a missing directory, a bad config */
    if (!rc && dsc_aio_submit(ctx, DSC_AIO_READ, 0, dst, m.len + 1, path, 0, err, sizeof err) != -1) rc = 7;
    snprintf(path, sizeof path, "%s/missing/dir/f.bin", dir);
    if (!rc && dsc_aio_submit(ctx, DSC_AIO_WRITE, 1, src, 10, path, 0, err, sizeof err) != -1) rc = 8;
    if (!rc && dsc_aio_pending(ctx) != 0) rc = 9;
    dsc_aio_stats stats;
    dsc_aio_get_stats(ctx, &stats);
    dsc_aio_destroy(ctx);
    dsc_aio_config bad = cfg;
    bad.block_size = DSC_AIO_ALIGNMENT + 1;
    if (!rc && dsc_aio_create(&bad, err, sizeof err) != NULL) rc = 10;
    bad = cfg;
    bad.threads = 0;
    if (!rc && dsc_aio_create(&bad, err, sizeof err) != NULL) rc = 11;
    snprintf(path, sizeof path, "%s/f%u.bin", dir, seed);
    remove(path);
    free(m.bytes);
    free(src);
    free(dst);
    return rc;
}

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: %s DIR [SECONDS]\n", argv[0]); return 64; }
    double budget = argc > 2 ? atof(argv[2]) : 0, start = now();
    unsigned seed = 1, passes = 0;
    do {
        int rc = pass(seed, argv[1]);
        if (rc) { printf("seed %u failed: %d\n", seed, rc); return rc; }
        seed++;
        passes++;
    } while (now() - start < budget);
    printf("ok\n");
    fprintf(stderr, "aio_fuzz: %u passes in %.1f s\n", passes, now() - start);
    return 0;
}
