/* The ZeRO partitioner: for one parameter group, two maps of where every parameter element
 * lives across W data-parallel ranks.
 *
 * Runtime layout: parameters are packed (in runtime order) into buckets of at most bucket_cap
 * elements (a larger parameter gets a bucket of its own); each bucket is padded to a multiple
 * of W * align and split into W equal chunks, so one reduce_scatter per bucket hands rank r
 * chunk r. A rank's partition is the concatenation of its chunks, bucket by bucket.
 *
 * DeepSpeed layout: parameters in group order, flattened back to back, the total padded to a
 * multiple of W * align, each rank owning one contiguous [r * P, (r + 1) * P). This is the
 * layout of DeepSpeed's ZeRO-1/2 optimizer-state checkpoints.
 *
 * For each layout the plan lists slices: a run of `length` elements of parameter `param`,
 * starting at element `param_start`, held by `rank` at offset `local_start` of its partition. */
#ifndef DSC_PARTITION_H
#define DSC_PARTITION_H

#include <stdint.h>

typedef struct {
    int64_t param;
    int64_t rank;
    int64_t param_start;
    int64_t local_start;
    int64_t length;
    int64_t bucket; /* runtime layout: the bucket; DeepSpeed layout: 0 */
} dsc_slice;

typedef struct {
    int64_t num_params;
    int64_t world_size;
    /* runtime layout */
    int64_t num_buckets;
    int64_t *bucket_offset;   /* [num_buckets] start of each bucket in the padded flat buffer */
    int64_t *bucket_size;     /* [num_buckets] padded size, a multiple of world_size * align */
    int64_t *bucket_numel;    /* [num_buckets] unpadded elements (sum of its params) */
    int64_t *param_bucket;    /* [num_params] */
    int64_t *param_offset;    /* [num_params] start of each param in the padded flat buffer */
    int64_t runtime_total;    /* sum of bucket_size */
    int64_t runtime_partition_size; /* runtime_total / world_size */
    dsc_slice *runtime_slices;
    int64_t num_runtime_slices;
    /* DeepSpeed layout */
    int64_t ds_total;          /* padded flat size */
    int64_t ds_partition_size; /* ds_total / world_size */
    int64_t *ds_param_offset;  /* [num_params] */
    dsc_slice *ds_slices;
    int64_t num_ds_slices;
} dsc_partition_plan;

typedef enum {
    DSC_PARTITION_OK = 0,
    DSC_PARTITION_BAD_ARG = 1,
    DSC_PARTITION_NO_MEMORY = 2,
} dsc_partition_status;

/* numels[num_params] >= 0; runtime_order is a permutation of 0..num_params-1 or NULL (group
 * order); world_size >= 1; bucket_cap >= 1; align >= 1. On success the plan owns heap arrays:
 * release them with dsc_partition_plan_free (also safe on a zeroed plan). */
dsc_partition_status dsc_partition_plan_build(const int64_t *numels, int64_t num_params,
                                              const int64_t *runtime_order, int64_t world_size,
                                              int64_t bucket_cap, int64_t align,
                                              dsc_partition_plan *plan);
/* The same with the runtime buckets given instead of cut by a cap (e.g. aligned to modules for
 * ZeRO-3): param_bucket[i] is parameter i's bucket; along runtime_order the ids must run 0, 1, ...
 * with each bucket one contiguous run (else DSC_PARTITION_BAD_ARG). */
dsc_partition_status dsc_partition_plan_build_bucketed(const int64_t *numels, int64_t num_params,
                                                       const int64_t *runtime_order, int64_t world_size,
                                                       int64_t align, const int64_t *param_bucket,
                                                       dsc_partition_plan *plan);
void dsc_partition_plan_free(dsc_partition_plan *plan);

#endif
