/* The ZeRO-3 fetch planner: from a recorded trace of which parameter units every module step
 * needs, the all-gathers to issue when each step begins and the releases to make when it ends.
 *
 * Pure C, no Python, no CUDA. Every rank builds the same plan from the same trace (the plan is a
 * deterministic function of its inputs), so the collectives of all ranks line up.
 *
 * Vocabulary. A unit (ids 0..U-1) is a group of parameters gathered by one collective; numels[u]
 * elements. A step is one module run (forward and backward modules in execution order); the
 * trace lists, for each step, the distinct units it needs. A unit is "live" while gathered.
 * Persistent units are gathered once, at or before their first use, and never released; they do
 * not count as live numel. cap(i) = max(max_live, numel of step i's non-persistent units).
 *
 * Executing step i: issue the groups of fetch(i) in order (group 0 is step i's own missing units,
 * always present, possibly empty; then the prefetch groups, each non-empty), run the module, then
 * release every unit of release(i).
 *
 * Prefetch at step i (prefetch_bucket > 0). Walk the units of steps i+1, i+2, ... in order of
 * first use after i, skipping units of step i itself and persistent units already gathered. This
 * is the prefetch window: its cumulative numel (live units included) stays <= prefetch_bucket.
 * Units of the window that are not live are fetched, in window order, until the first that
 * would leave the window or push live numel over max_live; the walk stops there. (Holding a
 * unit prefetched for step k never pushes a step m in (i, k) over cap(m): step m's units come
 * earlier in the window, so they are live already and counted against max_live.) The window, not the
 * new fetches alone, is what the bucket bounds, so the lookahead stays one bucket deep instead
 * of growing by a bucket at every step. A prefetched unit is pinned: no release drops it before
 * the step that uses it.
 *
 * Batched prefetch (dsc_fetch_plan_build_batched, min_batch > 0): a step whose walk stopped at a
 * full window and would prefetch less than min_batch numel, none of it for step i+1, prefetches
 * nothing; the deficit grows until a later step fetches it as one larger group. The window bound,
 * max_live and every guarantee below are unchanged; only when prefetches are issued differs.
 *
 * Release after step i < last. Kept: every pinned unit; then, in order of next use (ties: lower
 * id), each live non-persistent unit whose next use j exists and whose reuse distance (the numel
 * of the units used by steps i+1..j-1, persistent ones included, a unit counted at each step that
 * uses it, as DeepSpeed counts the parameters of its module order) is <= max_reuse,
 * while live numel after step i+1's group 0 stays <= cap(i+1) (a unit that does not fit is
 * released and the next is tried). A unit used by step i+1 has distance 0 and costs nothing
 * against cap(i+1), so it is always kept. Everything else non-persistent is released, in
 * ascending id order. Release after the last step: every non-persistent live unit.
 *
 * Guarantees: after fetch(i) every unit of step i is live; live numel never exceeds cap(i) while
 * fetch(i) runs (a step over max_live alone prefetches nothing and keeps nothing extra into
 * it); no unit is fetched while live or released while not; persistent units are never
 * released; nothing non-persistent is live after the last step.
 *
 *     dsc_fetch_plan *plan;
 *     char err[256];
 *     if (dsc_fetch_plan_build(S, step_start, step_units, U, numels, persistent, bucket, max_live,
 *                              max_reuse, &plan, err, sizeof err) != DSC_FP_OK) ...
 *     for (g = 0; g < dsc_fetch_plan_num_groups(plan, i); g++) dsc_fetch_plan_group(plan, i, g, &n);
 *     dsc_fetch_plan_release(plan, i, &n);
 *     dsc_fetch_plan_free(plan);
 */
#ifndef DSC_FETCH_PLAN_H
#define DSC_FETCH_PLAN_H

#include <stddef.h>
#include <stdint.h>

typedef struct dsc_fetch_plan dsc_fetch_plan;

enum {
    DSC_FP_OK = 0,
    DSC_FP_EINVAL = -1,  /* bad argument (negative numel or limit, NULL array, sizes) */
    DSC_FP_ENOMEM = -2,
    DSC_FP_ERANGE = -3,  /* a step names a unit id outside 0..U-1 */
    DSC_FP_EDUP = -4,    /* a step names one unit twice */
    DSC_FP_EPLAN = -5,   /* the plan breaks a guarantee (simulate, or a guard in build): a planner bug */
};

/* Builds the plan of num_steps steps over num_units units.
 *   step_start[num_steps + 1]  CSR offsets into step_units (step_start[0] == 0, nondecreasing)
 *   step_units[step_start[S]]  unit ids, distinct within a step
 *   numels[num_units] >= 0; persistent[num_units] (0/1) or NULL (none persistent)
 *   prefetch_bucket, max_live, max_reuse >= 0 (numels); prefetch_bucket 0 disables prefetch
 * On failure *out is NULL and err (if not NULL) receives a message naming the argument, e.g.
 * "steps[3] names unit 17, but there are 10 units". */
int dsc_fetch_plan_build(int64_t num_steps, const int64_t *step_start, const int64_t *step_units,
                         int64_t num_units, const int64_t *numels, const unsigned char *persistent,
                         int64_t prefetch_bucket, int64_t max_live, int64_t max_reuse,
                         dsc_fetch_plan **out, char *err, size_t err_len);
/* The same with batched prefetch (above): min_batch >= 0 numel; 0 is dsc_fetch_plan_build. */
int dsc_fetch_plan_build_batched(int64_t num_steps, const int64_t *step_start, const int64_t *step_units,
                                 int64_t num_units, const int64_t *numels, const unsigned char *persistent,
                                 int64_t prefetch_bucket, int64_t max_live, int64_t max_reuse, int64_t min_batch,
                                 dsc_fetch_plan **out, char *err, size_t err_len);
void dsc_fetch_plan_free(dsc_fetch_plan *plan);

int64_t dsc_fetch_plan_num_steps(const dsc_fetch_plan *plan);
/* Groups of step i (>= 1: group 0 is the step's own missing units, possibly empty). */
int64_t dsc_fetch_plan_num_groups(const dsc_fetch_plan *plan, int64_t step);
const int64_t *dsc_fetch_plan_group(const dsc_fetch_plan *plan, int64_t step, int64_t group, int64_t *count);
/* Units to release after step i, ascending ids. */
const int64_t *dsc_fetch_plan_release(const dsc_fetch_plan *plan, int64_t step, int64_t *count);
/* Live non-persistent numel after all of step i's fetches (its peak during step i), and after
 * its releases. */
int64_t dsc_fetch_plan_live_after_fetch(const dsc_fetch_plan *plan, int64_t step);
int64_t dsc_fetch_plan_live_after_release(const dsc_fetch_plan *plan, int64_t step);
/* cap(i) = max(max_live, numel of step i's own non-persistent units). */
int64_t dsc_fetch_plan_step_cap(const dsc_fetch_plan *plan, int64_t step);
/* Peak live non-persistent numel over the whole plan. */
int64_t dsc_fetch_plan_peak_live(const dsc_fetch_plan *plan);

/* Executes the plan against the trace it was built from, from nothing live, checking every
 * guarantee above; writes the peak live non-persistent numel to *peak. Returns DSC_FP_OK, or
 * DSC_FP_EPLAN with err saying which step broke what, or DSC_FP_ENOMEM. */
int dsc_fetch_plan_simulate(const dsc_fetch_plan *plan, const int64_t *step_start, const int64_t *step_units,
                            const int64_t *numels, const unsigned char *persistent, int64_t *peak,
                            char *err, size_t err_len);

#endif
