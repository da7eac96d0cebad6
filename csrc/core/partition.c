/* See dsc/partition.h. Two passes per layout: count the slices, then fill them, so every
 * array is allocated exactly once at its final size. */
#include "dsc/partition.h"

#include <stdlib.h>
#include <string.h>

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Emit the slices of the element range [start, start + len) of the flat buffer region that
 * begins at region_start, is split into W chunks of chunk_size, and whose chunk r begins at
 * rank_base + (r's offset) in rank r's partition. Returns the number of slices; writes only
 * when out is non-NULL. */
static int64_t split_range(int64_t param, int64_t bucket, int64_t start, int64_t len,
                           int64_t region_start, int64_t chunk_size, int64_t rank_base, dsc_slice *out) {
    int64_t count = 0;
    int64_t pos = start, end = start + len;
    while (pos < end) {
        int64_t rel = pos - region_start;
        int64_t rank = rel / chunk_size;
        int64_t chunk_end = region_start + (rank + 1) * chunk_size;
        int64_t stop = end < chunk_end ? end : chunk_end;
        if (out) {
            out[count].param = param;
            out[count].rank = rank;
            out[count].param_start = pos - start;
            out[count].local_start = rank_base + rel - rank * chunk_size;
            out[count].length = stop - pos;
            out[count].bucket = bucket;
        }
        count++;
        pos = stop;
    }
    return count;
}

static int valid_order(const int64_t *order, int64_t n) {
    char *seen = calloc((size_t)(n > 0 ? n : 1), 1);
    if (!seen) return -1;
    int ok = 1;
    for (int64_t i = 0; i < n && ok; i++) {
        if (order[i] < 0 || order[i] >= n || seen[order[i]]) ok = 0;
        else seen[order[i]] = 1;
    }
    free(seen);
    return ok;
}

static int64_t *alloc_i64(int64_t n) { return malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1)); }

/* Runtime layout: bucket packing, offsets, then slices. */
/* Whether the param at position i of the order opens a new bucket: by the cap (a bucket closes
 * before the param that would take it past cap elements), or where the given bucket ids change. */
static int opens_bucket(int64_t pos, int64_t idx, int64_t fill, int64_t numel, int64_t cap, const int64_t *fixed,
                        int64_t prev_idx) {
    if (pos == 0) return 1;
    if (fixed) return fixed[idx] != fixed[prev_idx];
    return fill > 0 && fill + numel > cap;
}

static dsc_partition_status build_runtime(const int64_t *numels, int64_t n, const int64_t *order,
                                          int64_t W, int64_t cap, int64_t align, const int64_t *fixed,
                                          dsc_partition_plan *p) {
    /* pass 1: bucket count */
    int64_t buckets = 0, fill = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t idx = order ? order[i] : i;
        int64_t numel = numels[idx];
        if (opens_bucket(i, idx, fill, numel, cap, fixed, i > 0 ? (order ? order[i - 1] : i - 1) : 0)) {
            buckets++;
            fill = 0;
        }
        fill += numel;
    }
    p->num_buckets = buckets;
    p->bucket_offset = alloc_i64(buckets);
    p->bucket_size = alloc_i64(buckets);
    p->bucket_numel = alloc_i64(buckets);
    if (!p->bucket_offset || !p->bucket_size || !p->bucket_numel) return DSC_PARTITION_NO_MEMORY;
    /* pass 2: assign params to buckets */
    int64_t b = -1;
    fill = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t idx = order ? order[i] : i;
        if (opens_bucket(i, idx, fill, numels[idx], cap, fixed, i > 0 ? (order ? order[i - 1] : i - 1) : 0)) {
            b++;
            fill = 0;
            p->bucket_numel[b] = 0;
        }
        p->param_bucket[idx] = b;
        p->param_offset[idx] = fill; /* bucket-relative for now */
        fill += numels[idx];
        p->bucket_numel[b] = fill;
    }
    int64_t offset = 0;
    for (b = 0; b < buckets; b++) {
        int64_t size = round_up(p->bucket_numel[b], W * align);
        p->bucket_offset[b] = offset;
        p->bucket_size[b] = size;
        offset += size;
    }
    p->runtime_total = offset;
    p->runtime_partition_size = offset / W;
    for (int64_t i = 0; i < n; i++) p->param_offset[i] += p->bucket_offset[p->param_bucket[i]];
    /* slices: count, allocate, fill */
    int64_t total = 0;
    for (int pass = 0; pass < 2; pass++) {
        int64_t k = 0;
        for (int64_t i = 0; i < n; i++) {
            int64_t idx = order ? order[i] : i;
            int64_t bk = p->param_bucket[idx];
            int64_t chunk = p->bucket_size[bk] / W;
            int64_t rank_base = p->bucket_offset[bk] / W; /* chunks of earlier buckets */
            k += split_range(idx, bk, p->param_offset[idx], numels[idx], p->bucket_offset[bk], chunk,
                             rank_base, pass ? p->runtime_slices + k : NULL);
        }
        if (pass == 0) {
            total = k;
            p->runtime_slices = malloc(sizeof(dsc_slice) * (size_t)(k > 0 ? k : 1));
            if (!p->runtime_slices) return DSC_PARTITION_NO_MEMORY;
        }
    }
    p->num_runtime_slices = total;
    return DSC_PARTITION_OK;
}

/* DeepSpeed layout: one padded flat buffer, contiguous per-rank partitions. */
static dsc_partition_status build_deepspeed(const int64_t *numels, int64_t n, int64_t W, int64_t align,
                                            dsc_partition_plan *p) {
    int64_t offset = 0;
    for (int64_t i = 0; i < n; i++) {
        p->ds_param_offset[i] = offset;
        offset += numels[i];
    }
    p->ds_total = round_up(offset, W * align);
    p->ds_partition_size = p->ds_total / W;
    int64_t total = 0;
    for (int pass = 0; pass < 2; pass++) {
        int64_t k = 0;
        for (int64_t i = 0; i < n; i++)
            k += split_range(i, 0, p->ds_param_offset[i], numels[i], 0, p->ds_partition_size, 0,
                             pass ? p->ds_slices + k : NULL);
        if (pass == 0) {
            total = k;
            p->ds_slices = malloc(sizeof(dsc_slice) * (size_t)(k > 0 ? k : 1));
            if (!p->ds_slices) return DSC_PARTITION_NO_MEMORY;
        }
    }
    p->num_ds_slices = total;
    return DSC_PARTITION_OK;
}

/* Given bucket ids must number the buckets 0, 1, ... in the order's sequence, each a contiguous run. */
static int valid_buckets(const int64_t *fixed, const int64_t *order, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int64_t b = fixed[order ? order[i] : i];
        int64_t prev = i > 0 ? fixed[order ? order[i - 1] : i - 1] : 0;
        if (b < 0 || (i == 0 && b != 0) || (i > 0 && b != prev && b != prev + 1)) return 0;
    }
    return 1;
}

static dsc_partition_status build(const int64_t *numels, int64_t n, const int64_t *order, int64_t W, int64_t cap,
                                  int64_t align, const int64_t *fixed, dsc_partition_plan *p);

dsc_partition_status dsc_partition_plan_build(const int64_t *numels, int64_t n, const int64_t *order,
                                              int64_t W, int64_t cap, int64_t align,
                                              dsc_partition_plan *p) {
    return build(numels, n, order, W, cap, align, NULL, p);
}

dsc_partition_status dsc_partition_plan_build_bucketed(const int64_t *numels, int64_t n, const int64_t *order,
                                                       int64_t W, int64_t align, const int64_t *param_bucket,
                                                       dsc_partition_plan *p) {
    memset(p, 0, sizeof(*p));
    if (!param_bucket && n > 0) return DSC_PARTITION_BAD_ARG;
    return build(numels, n, order, W, 1, align, param_bucket, p);
}

static dsc_partition_status build(const int64_t *numels, int64_t n, const int64_t *order, int64_t W, int64_t cap,
                                  int64_t align, const int64_t *fixed, dsc_partition_plan *p) {
    memset(p, 0, sizeof(*p));
    if (n < 0 || W < 1 || cap < 1 || align < 1) return DSC_PARTITION_BAD_ARG;
    for (int64_t i = 0; i < n; i++)
        if (numels[i] < 0) return DSC_PARTITION_BAD_ARG;
    if (order) {
        int ok = valid_order(order, n);
        if (ok < 0) return DSC_PARTITION_NO_MEMORY;
        if (!ok) return DSC_PARTITION_BAD_ARG;
    }
    if (fixed && !valid_buckets(fixed, order, n)) return DSC_PARTITION_BAD_ARG;
    p->num_params = n;
    p->world_size = W;
    p->param_bucket = alloc_i64(n);
    p->param_offset = alloc_i64(n);
    p->ds_param_offset = alloc_i64(n);
    dsc_partition_status st = DSC_PARTITION_NO_MEMORY;
    if (p->param_bucket && p->param_offset && p->ds_param_offset) {
        st = build_runtime(numels, n, order, W, cap, align, fixed, p);
        if (st == DSC_PARTITION_OK) st = build_deepspeed(numels, n, W, align, p);
    }
    if (st != DSC_PARTITION_OK) dsc_partition_plan_free(p);
    return st;
}

void dsc_partition_plan_free(dsc_partition_plan *p) {
    free(p->bucket_offset);
    free(p->bucket_size);
    free(p->bucket_numel);
    free(p->param_bucket);
    free(p->param_offset);
    free(p->runtime_slices);
    free(p->ds_param_offset);
    free(p->ds_slices);
    memset(p, 0, sizeof(*p));
}
