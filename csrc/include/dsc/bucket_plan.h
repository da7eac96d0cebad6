/* The bucket planner: which gradients share a communication bucket, where each one sits in
 * its bucket's contiguous buffer, and when a bucket is ready to reduce.
 *
 * Pure C, no Python, no CUDA. The reducer shim builds one plan per engine from the parameter
 * sizes, then calls dsc_bucket_plan_mark() once per gradient as backward produces it (an integer
 * param index: cheap) and launches every bucket below the returned frontier. Buckets launch in
 * id order on every rank, so the collectives of all ranks line up even when gradients arrive in
 * a different order (unused parameters, data-dependent control flow).
 *
 *     dsc_bucket_plan *plan;
 *     const char *why;
 *     if (dsc_bucket_plan_create(n, numels, keys, NULL, cap, 0, 1, &plan, &why) != DSC_BP_OK) ...
 *     dsc_bucket_plan_reset(plan);
 *     int64_t frontier = dsc_bucket_plan_mark(plan, i);  // buckets [launched, frontier) go now
 *     ...
 *     dsc_bucket_plan_free(plan);
 */
#ifndef DSC_BUCKET_PLAN_H
#define DSC_BUCKET_PLAN_H

#include <stdint.h>

typedef struct dsc_bucket_plan dsc_bucket_plan;

enum {
    DSC_BP_OK = 0,
    DSC_BP_EINVAL = -1, /* bad argument: *why (create) says which */
    DSC_BP_ENOMEM = -2,
    DSC_BP_ERANGE = -3, /* param index out of range */
    DSC_BP_ETWICE = -4, /* param already marked ready in this round */
};

/* Plans n parameters.
 *   numels[i]  elements of parameter i (registration order), >= 0
 *   keys[i]    parameters with different keys never share a bucket (dtype, device); NULL: all 0
 *   order      a permutation of 0..n-1: the expected gradient arrival order; NULL: reverse
 *              registration order (backward visits the last layer first)
 *   cap        a bucket closes as soon as it holds more than cap elements (DeepSpeed's rule), > 0
 *   first_cap  the same for bucket 0 (<= 0 or > cap: cap); a small first bucket lets the first
 *              reduction start early in backward
 *   align      every offset is a multiple of align elements, >= 1
 * Bucket ids follow the arrival position of each bucket's first member, so bucket 0 holds the
 * first gradient to arrive. On failure *why (if not NULL) names the offending argument. */
int dsc_bucket_plan_create(int64_t n, const int64_t *numels, const int64_t *keys, const int64_t *order,
                           int64_t cap, int64_t first_cap, int64_t align, dsc_bucket_plan **out,
                           const char **why);
/* The same readiness counting over buckets given per parameter (bucket_of[i] in 0..nb-1, every
 * bucket non-empty), e.g. the buckets of a ZeRO partition plan; offsets inside a bucket follow the
 * arrival order, aligned to align. */
int dsc_bucket_plan_create_assigned(int64_t n, const int64_t *numels, const int64_t *order, const int64_t *bucket_of,
                                    int64_t align, dsc_bucket_plan **out, const char **why);
void dsc_bucket_plan_free(dsc_bucket_plan *plan);

/* Layout queries (valid for the plan's lifetime). */
int64_t dsc_bucket_plan_num_params(const dsc_bucket_plan *plan);
int64_t dsc_bucket_plan_num_buckets(const dsc_bucket_plan *plan);
int64_t dsc_bucket_plan_bucket_of(const dsc_bucket_plan *plan, int64_t param);
int64_t dsc_bucket_plan_offset_of(const dsc_bucket_plan *plan, int64_t param);
/* Buffer length of bucket b in elements (the last member's end, rounded up to align). */
int64_t dsc_bucket_plan_bucket_numel(const dsc_bucket_plan *plan, int64_t bucket);
int64_t dsc_bucket_plan_bucket_key(const dsc_bucket_plan *plan, int64_t bucket);
/* Members of bucket b in arrival order; *count receives their number. */
const int64_t *dsc_bucket_plan_members(const dsc_bucket_plan *plan, int64_t bucket, int64_t *count);

/* Readiness counting. reset() starts a round: every bucket waits for all of its members. */
void dsc_bucket_plan_reset(dsc_bucket_plan *plan);
/* Marks param's gradient ready. Returns the launch frontier F >= 0: buckets [0, F) are all
 * ready (launch the ones not launched yet, in id order), or a negative DSC_BP_* error. */
int64_t dsc_bucket_plan_mark(dsc_bucket_plan *plan, int64_t param);
/* Marks every pending parameter ready (end of backward: parameters that got no gradient);
 * returns the frontier, which is then num_buckets. */
int64_t dsc_bucket_plan_mark_all(dsc_bucket_plan *plan);
int64_t dsc_bucket_plan_frontier(const dsc_bucket_plan *plan);
/* Parameters not yet marked in this round, in planned arrival order; writes at most cap of them
 * to out and returns how many there are in total. */
int64_t dsc_bucket_plan_pending(const dsc_bucket_plan *plan, int64_t *out, int64_t cap);
/* Parameters marked so far in this round, in the order they were marked (the observed backward
 * order; mark_all appends the stragglers in planned order); same out/cap contract. */
int64_t dsc_bucket_plan_arrival(const dsc_bucket_plan *plan, int64_t *out, int64_t cap);

#endif
