/* The parallel walk of the CPU kernels over a tensor list: the elements of all tensors are cut
 * into chunks of DSC_CHUNK (a tensor's last chunk is shorter), and OpenMP hands each thread one
 * contiguous run of chunks, so one large tensor among small ones still spreads over every
 * thread and each thread streams through memory in order. */
#ifndef DSC_CPU_WALK_H
#define DSC_CPU_WALK_H

#include <stdint.h>
#include <stdlib.h>

#define DSC_CHUNK 4096 /* elements; a multiple of every vector width */

/* chunk index -> (tensor, start): first_chunk[i] is tensor i's first chunk in the list */
typedef struct {
    int64_t *first_chunk;
    int64_t n, total;
} dsc_chunk_map;

/* numel of item i is *(const int64_t *)((const char *)base + i * stride): one map serves
 * dsc_opt_tensor lists and plain numel arrays alike. -1 when out of memory. */
static inline int dsc_chunk_map_init(dsc_chunk_map *m, const void *base, size_t stride, int64_t n) {
    m->first_chunk = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    if (!m->first_chunk) return -1;
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t numel = *(const int64_t *)((const char *)base + (size_t)i * stride);
        m->first_chunk[i] = c;
        c += (numel + DSC_CHUNK - 1) / DSC_CHUNK;
    }
    m->n = n;
    m->total = c;
    return 0;
}

static inline void dsc_chunk_map_free(dsc_chunk_map *m) { free(m->first_chunk); }

/* The tensor holding chunk c: the last one whose first chunk is <= c (empty tensors own none). */
static inline int64_t dsc_chunk_owner(const dsc_chunk_map *m, int64_t c) {
    int64_t lo = 0, hi = m->n - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (m->first_chunk[mid] <= c) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Parallel loop over the chunks of `map`; BODY sees `ti` (tensor index), `start` and `end`
 * (element range within tensor ti). NUMEL(ti) gives tensor ti's length. One chunk runs inline,
 * without waking the thread team. */
#define DSC_FOR_EACH_CHUNK(map, NUMEL, BODY)                                                     \
    _Pragma("omp parallel for schedule(static) if ((map).total > 1)")                            \
    for (int64_t chunk_ = 0; chunk_ < (map).total; chunk_++) {                                   \
        int64_t ti = dsc_chunk_owner(&(map), chunk_);                                           \
        int64_t start = (chunk_ - (map).first_chunk[ti]) * DSC_CHUNK;                           \
        int64_t end = NUMEL(ti) - start < DSC_CHUNK ? NUMEL(ti) : start + DSC_CHUNK;            \
        BODY                                                                                     \
    }

#endif
