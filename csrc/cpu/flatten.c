/* Flatten/unflatten on the host. Large tensors are split into 1 MiB pieces so that one big
 * tensor among small ones still spreads over every OpenMP thread. */
#include "dsc/flatten.h"

#include <stdlib.h>
#include <string.h>

#define PIECE ((int64_t)1 << 20)

/* Copy from[i] -> to[i] (nbytes[i] each) for every i, in parallel pieces. */
static void copy_lists(const char *const *from, char *const *to, const int64_t *nbytes, int64_t n) {
    int64_t *first_piece = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    if (!first_piece) { /* no scratch: still correct, just serial */
        for (int64_t i = 0; i < n; i++) memcpy(to[i], from[i], (size_t)nbytes[i]);
        return;
    }
    int64_t pieces = 0;
    for (int64_t i = 0; i < n; i++) {
        first_piece[i] = pieces;
        pieces += (nbytes[i] + PIECE - 1) / PIECE;
    }
#pragma omp parallel for schedule(dynamic, 4) if (pieces > 4)
    for (int64_t p = 0; p < pieces; p++) {
        /* the last tensor whose first piece is <= p holds piece p */
        int64_t lo = 0, hi = n - 1;
        while (lo < hi) {
            int64_t mid = (lo + hi + 1) / 2;
            if (first_piece[mid] <= p) lo = mid;
            else hi = mid - 1;
        }
        int64_t off = (p - first_piece[lo]) * PIECE;
        int64_t len = nbytes[lo] - off < PIECE ? nbytes[lo] - off : PIECE;
        if (len > 0) memcpy(to[lo] + off, from[lo] + off, (size_t)len);
    }
    free(first_piece);
}

/* Pointers into a flat buffer at the running byte offsets; NULL when out of memory. */
static char **flat_pointers(char *flat, const int64_t *nbytes, int64_t n) {
    char **ptrs = malloc(sizeof(char *) * (size_t)(n > 0 ? n : 1));
    if (!ptrs) return NULL;
    int64_t off = 0;
    for (int64_t i = 0; i < n; i++) {
        ptrs[i] = flat + off;
        off += nbytes[i];
    }
    return ptrs;
}

void dsc_flatten_bytes(const void *const *srcs, const int64_t *nbytes, int64_t n, void *dst) {
    char **dsts = flat_pointers(dst, nbytes, n);
    if (dsts) {
        copy_lists((const char *const *)srcs, dsts, nbytes, n);
        free(dsts);
        return;
    }
    char *out = dst;
    for (int64_t i = 0; i < n; i++) {
        memcpy(out, srcs[i], (size_t)nbytes[i]);
        out += nbytes[i];
    }
}

void dsc_unflatten_bytes(const void *src, void *const *dsts, const int64_t *nbytes, int64_t n) {
    char **srcs = flat_pointers((char *)src, nbytes, n);
    if (srcs) {
        copy_lists((const char *const *)srcs, (char *const *)dsts, nbytes, n);
        free(srcs);
        return;
    }
    const char *in = src;
    for (int64_t i = 0; i < n; i++) {
        memcpy(dsts[i], in, (size_t)nbytes[i]);
        in += nbytes[i];
    }
}
