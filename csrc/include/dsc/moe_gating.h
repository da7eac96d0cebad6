/* The MoE gating core: which experts each token goes to, where in each expert's capacity buffer
 * it lands, and the dispatch (tokens -> expert buffers) and combine (expert outputs -> tokens)
 * moves, without DeepSpeed's dense [tokens, experts, capacity] one-hot tensors.
 *
 * Pure C11 (+ OpenMP), no Python, no CUDA. csrc/cuda/moe_gating.cu implements the same contract
 * on the device; this file is its reference.
 *
 * Vocabulary. S tokens, E experts, k routes per token. Route (s, r) is number s*k + r; idx[s*k+r]
 * is its expert. A route's slot is e*C + location in the flat [E*C] expert buffer (C = capacity).
 *
 * Ordering. The location of a route is its rank among the kept routes of its expert, counted
 * in one of two orders: DSC_MOE_TOKEN_MAJOR (token 0's routes, token 1's, ...: DeepSpeed's
 * top-1 and top-k cumulative sums) or DSC_MOE_ROUTE_MAJOR (every token's first route, then every
 * token's second, ...: DeepSpeed's top-2, whose second-choice locations start after the
 * first-choice count).
 *
 * Capacity drops. Without scores, an expert keeps its first C routes in the order (GShard's
 * positional dropping). With scores (one float per route: random numbers for random token
 * selection, gate probabilities for top-k's "probs" policy) it keeps its C highest-scoring
 * routes, ties to the earlier route in the order; the kept routes' locations are still ranks in
 * the order. Routes of tokens with used[s] == 0 belong to no expert and are dropped.
 *
 * Return codes: DSC_MOE_OK, DSC_MOE_EINVAL (a size, an expert id out of [0, E), a NULL array),
 * DSC_MOE_ENOMEM. Nothing is written on EINVAL detected before the work starts. */
#ifndef DSC_MOE_GATING_H
#define DSC_MOE_GATING_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { DSC_MOE_OK = 0, DSC_MOE_EINVAL = -1, DSC_MOE_ENOMEM = -2 };
enum { DSC_MOE_TOKEN_MAJOR = 0, DSC_MOE_ROUTE_MAJOR = 1 };
/* element types of the moved rows (dispatch, combine, route_dots) */
enum { DSC_MOE_F32 = 0, DSC_MOE_BF16 = 1, DSC_MOE_F16 = 2, DSC_MOE_F64 = 3 };

/* idx[s*k + r] for r < k: the expert of route r. Route 0 is the argmax of primary's row; routes
 * 1.. are successive argmaxes of secondary's row (primary's when secondary is NULL) over the
 * experts not yet chosen. Ties go to the lower expert id; NaN counts as the largest value (as
 * torch.argmax). primary, secondary: [S, E] row-major. */
int dsc_moe_select(const float *primary, const float *secondary, int64_t S, int64_t E, int64_t k, int64_t *idx);

/* counts[e] = routes of used tokens whose expert is e (DeepSpeed's exp_counts, before drops).
 * used: [S] bytes, NULL = every token. */
int dsc_moe_counts(const int64_t *idx, const uint8_t *used, int64_t S, int64_t k, int64_t E, int64_t *counts);

/* route_slot[S*k]: slot of each route, -1 when dropped. slot_route[E*C]: the route in each slot,
 * -1 when empty. score: [S*k] floats or NULL (see Capacity drops); used: as dsc_moe_counts. */
int dsc_moe_plan(const int64_t *idx, const float *score, const uint8_t *used, int64_t S, int64_t k, int64_t E,
                 int64_t capacity, int order, int64_t *route_slot, int64_t *slot_route);

/* out[j, :] = x[slot_route[j] / k, :] * w[slot_route[j]] (w NULL: * 1), zeros for an empty slot.
 * x: [S, M], out: [nslots, M], both of `dtype`. w is double[] for DSC_MOE_F64, float[] otherwise.
 * This is the dispatch, and (with the gate weights) the backward of the combine into y. */
int dsc_moe_dispatch(const void *x, int dtype, int64_t S, int64_t M, const int64_t *slot_route, int64_t nslots,
                     int64_t k, const void *w, void *out);

/* out[s, :] = sum over kept routes r of w[s*k+r] * y[route_slot[s*k+r], :] (w NULL: 1), summed in
 * fp32 (fp64 for DSC_MOE_F64) in route order, then stored in `dtype`. y: [nslots, M], out: [S, M].
 * This is the combine, and (w NULL) the backward of the dispatch. */
int dsc_moe_combine(const void *y, int dtype, int64_t nslots, int64_t M, const int64_t *route_slot, int64_t S,
                    int64_t k, const void *w, void *out);

/* out[s*k+r] = <g[s, :], y[route_slot[s*k+r], :]> (0 for a dropped route), in fp32 (fp64 for F64;
 * out is then double[]): the gradient of the combine with respect to its weights. */
int dsc_moe_route_dots(const void *g, const void *y, int dtype, int64_t S, int64_t M, int64_t nslots,
                       const int64_t *route_slot, int64_t k, void *out);

#ifdef __cplusplus
}
#endif

#endif
