/* The ZeRO-3 fetch planner (see dsc/fetch_plan.h for the contract). */
#include "dsc/fetch_plan.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct dsc_fetch_plan {
    int64_t num_steps;
    int64_t num_units;
    int64_t *step_group;      /* [S + 1] CSR: step i's groups are [step_group[i], step_group[i+1]) */
    int64_t *group_start;     /* [groups + 1] CSR into fetched */
    int64_t *fetched;         /* [fetches] */
    int64_t *release_start;   /* [S + 1] CSR into released */
    int64_t *released;        /* [releases] */
    int64_t *live_fetch;      /* [S] */
    int64_t *live_release;    /* [S] */
    int64_t *cap;             /* [S] */
    int64_t peak;
};

/* Scratch of one build; every array freed by scratch_free. */
typedef struct {
    int64_t *own;           /* [S] numel of step i's non-persistent units */
    int64_t *pin_diff;      /* [S + 1] difference array: numel held at step m by pins whose use
                             * comes after m is the prefix sum up to m */
    int64_t *future;        /* [S] units with a use after step i */
    int64_t *next_after;    /* [T] per trace entry: the next step using the same unit, or S */
    int64_t *cur_next;      /* [U] next use after the current step */
    int64_t *pinned_until;  /* [U] the step a prefetched unit waits for, or -1 */
    int64_t *seen;          /* [U] stamp: window walk */
    int64_t *seen2;         /* [U] stamp: reuse-distance walk */
    int64_t *is_cand;       /* [U] stamp: a reuse candidate after step i */
    int64_t *live_list;     /* [U] live units (any order) */
    int64_t *live_pos;      /* [U] index in live_list, or -1 */
    int64_t *pending;       /* [U] this step's prefetched units, then scratch */
    int64_t *pend_step;     /* [U] the step each pending prefetch is for */
    int64_t *cand;          /* [U] the reuse candidates met at one step */
    unsigned char *keep;    /* [U] */
} scratch;

static void say(char *err, size_t len, const char *fmt, ...) {
    if (!err || len == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
}

static void scratch_free(scratch *s) {
    free(s->own);
    free(s->pin_diff);
    free(s->future);
    free(s->next_after);
    free(s->cur_next);
    free(s->pinned_until);
    free(s->seen);
    free(s->seen2);
    free(s->is_cand);
    free(s->live_list);
    free(s->live_pos);
    free(s->pending);
    free(s->pend_step);
    free(s->cand);
    free(s->keep);
}

void dsc_fetch_plan_free(dsc_fetch_plan *p) {
    if (!p) return;
    free(p->step_group);
    free(p->group_start);
    free(p->fetched);
    free(p->release_start);
    free(p->released);
    free(p->live_fetch);
    free(p->live_release);
    free(p->cap);
    free(p);
}

static void *alloc(size_t n, size_t size) { return malloc((n ? n : 1) * size); }

static int64_t sat_add(int64_t a, int64_t b) { return b > INT64_MAX - a ? INT64_MAX : a + b; } /* a, b >= 0 */

static int is_persistent(const unsigned char *persistent, int64_t u) { return persistent && persistent[u]; }

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Validates the inputs; DSC_FP_OK or an error with err filled. seen is scratch of U stamps. */
static int validate(int64_t S, const int64_t *step_start, const int64_t *step_units, int64_t U,
                    const int64_t *numels, int64_t bucket, int64_t max_live, int64_t max_reuse, int64_t *seen,
                    char *err, size_t len) {
    if (bucket < 0 || max_live < 0 || max_reuse < 0) {
        say(err, len, "%s must be >= 0, got %lld",
            bucket < 0 ? "prefetch_bucket_size" : max_live < 0 ? "max_live_parameters" : "max_reuse_distance",
            (long long)(bucket < 0 ? bucket : max_live < 0 ? max_live : max_reuse));
        return DSC_FP_EINVAL;
    }
    int64_t total = 0;
    for (int64_t u = 0; u < U; u++) {
        if (numels[u] < 0) {
            say(err, len, "numels[%lld] must be >= 0, got %lld", (long long)u, (long long)numels[u]);
            return DSC_FP_EINVAL;
        }
        if (numels[u] > INT64_MAX / 4 - total) {
            say(err, len, "numels sum to more than %lld elements", (long long)(INT64_MAX / 4));
            return DSC_FP_EINVAL;
        }
        total += numels[u];
        seen[u] = -1;
    }
    if (step_start[0] != 0) {
        say(err, len, "step offsets must start at 0, got %lld", (long long)step_start[0]);
        return DSC_FP_EINVAL;
    }
    for (int64_t i = 0; i < S; i++) {
        if (step_start[i + 1] < step_start[i]) {
            say(err, len, "step offsets must not decrease (step %lld)", (long long)i);
            return DSC_FP_EINVAL;
        }
        for (int64_t e = step_start[i]; e < step_start[i + 1]; e++) {
            int64_t u = step_units[e];
            if (u < 0 || u >= U) {
                say(err, len, "steps[%lld] names unit %lld, but there are %lld units", (long long)i, (long long)u,
                    (long long)U);
                return DSC_FP_ERANGE;
            }
            if (seen[u] == i) {
                say(err, len, "steps[%lld] names unit %lld twice", (long long)i, (long long)u);
                return DSC_FP_EDUP;
            }
            seen[u] = i;
        }
    }
    return DSC_FP_OK;
}

static void live_add(scratch *s, int64_t *n_live, int64_t u) {
    s->live_pos[u] = *n_live;
    s->live_list[(*n_live)++] = u;
}

static void live_remove(scratch *s, int64_t *n_live, int64_t u) {
    int64_t at = s->live_pos[u], last = s->live_list[--(*n_live)];
    s->live_list[at] = last;
    s->live_pos[last] = at;
    s->live_pos[u] = -1;
}

/* Appends the prefetched units of one step to the plan as groups of at most max(bucket, 1)
 * numel (a larger unit alone). */
static void pack_groups(dsc_fetch_plan *p, int64_t *n_groups, int64_t *n_fetched, const int64_t *units, int64_t n,
                        const int64_t *numels, int64_t bucket) {
    int64_t limit = bucket > 1 ? bucket : 1, fill = 0;
    for (int64_t k = 0; k < n; k++) {
        int64_t v = numels[units[k]];
        if (k == 0 || fill + v > limit) {
            p->group_start[++(*n_groups)] = *n_fetched; /* opens a group (closes the previous) */
            fill = 0;
        }
        p->fetched[(*n_fetched)++] = units[k];
        p->group_start[*n_groups] = *n_fetched;
        fill += v;
    }
}

int dsc_fetch_plan_build(int64_t S, const int64_t *step_start, const int64_t *step_units, int64_t U,
                         const int64_t *numels, const unsigned char *persistent, int64_t bucket, int64_t max_live,
                         int64_t max_reuse, dsc_fetch_plan **out, char *err, size_t len) {
    return dsc_fetch_plan_build_batched(S, step_start, step_units, U, numels, persistent, bucket, max_live, max_reuse,
                                        0, out, err, len);
}

int dsc_fetch_plan_build_batched(int64_t S, const int64_t *step_start, const int64_t *step_units, int64_t U,
                                 const int64_t *numels, const unsigned char *persistent, int64_t bucket,
                                 int64_t max_live, int64_t max_reuse, int64_t min_batch, dsc_fetch_plan **out,
                                 char *err, size_t len) {
    if (out) *out = NULL;
    if (min_batch < 0) {
        say(err, len, "min_prefetch_batch must be >= 0, got %lld", (long long)min_batch);
        return DSC_FP_EINVAL;
    }
    if (!out || S < 0 || U < 0 || !step_start || (U > 0 && !numels)) {
        say(err, len, "%s", !out ? "out must not be NULL" : S < 0 ? "num_steps must be >= 0"
                          : U < 0 ? "num_units must be >= 0" : "step_start and numels must not be NULL");
        return DSC_FP_EINVAL;
    }
    int64_t T = step_start[S] > 0 ? step_start[S] : 0;
    if (T > 0 && !step_units) {
        say(err, len, "step_units must not be NULL");
        return DSC_FP_EINVAL;
    }
    scratch s;
    memset(&s, 0, sizeof s);
    dsc_fetch_plan *p = calloc(1, sizeof *p);
    s.seen = alloc((size_t)U, sizeof(int64_t));
    if (!p || !s.seen) {
        free(p);
        scratch_free(&s);
        return DSC_FP_ENOMEM;
    }
    int rc = validate(S, step_start, step_units, U, numels, bucket, max_live, max_reuse, s.seen, err, len);
    if (rc != DSC_FP_OK) {
        free(p);
        scratch_free(&s);
        return rc;
    }
    p->num_steps = S;
    p->num_units = U;
    /* Every fetch serves one later (or same-step) use of its unit with no release in between, so
     * fetches and releases are at most T; groups at most S + T. */
    p->step_group = alloc((size_t)S + 1, sizeof(int64_t));
    p->group_start = alloc((size_t)(S + T) + 1, sizeof(int64_t));
    p->fetched = alloc((size_t)T, sizeof(int64_t));
    p->release_start = alloc((size_t)S + 1, sizeof(int64_t));
    p->released = alloc((size_t)T, sizeof(int64_t));
    p->live_fetch = alloc((size_t)S, sizeof(int64_t));
    p->live_release = alloc((size_t)S, sizeof(int64_t));
    p->cap = alloc((size_t)S, sizeof(int64_t));
    s.own = alloc((size_t)S, sizeof(int64_t));
    s.pin_diff = calloc((size_t)S + 1, sizeof(int64_t));
    s.future = calloc((size_t)(S ? S : 1), sizeof(int64_t));
    s.next_after = alloc((size_t)T, sizeof(int64_t));
    s.cur_next = alloc((size_t)U, sizeof(int64_t));
    s.pinned_until = alloc((size_t)U, sizeof(int64_t));
    s.seen2 = alloc((size_t)U, sizeof(int64_t));
    s.is_cand = alloc((size_t)U, sizeof(int64_t));
    s.live_list = alloc((size_t)U, sizeof(int64_t));
    s.live_pos = alloc((size_t)U, sizeof(int64_t));
    s.pending = alloc((size_t)U, sizeof(int64_t));
    s.pend_step = alloc((size_t)U, sizeof(int64_t));
    s.cand = alloc((size_t)U, sizeof(int64_t));
    s.keep = calloc((size_t)(U ? U : 1), 1);
    if (!p->step_group || !p->group_start || !p->fetched || !p->release_start || !p->released || !p->live_fetch ||
        !p->live_release || !p->cap || !s.own || !s.pin_diff || !s.future || !s.next_after || !s.cur_next ||
        !s.pinned_until || !s.seen2 || !s.is_cand || !s.live_list || !s.live_pos || !s.pending ||
        !s.pend_step || !s.cand ||
        !s.keep) {
        dsc_fetch_plan_free(p);
        scratch_free(&s);
        return DSC_FP_ENOMEM;
    }

    /* per-step own numel and cap; next use of every trace entry (backward scan) */
    for (int64_t u = 0; u < U; u++) {
        s.cur_next[u] = S; /* here: the next use seen so far in the backward scan */
        s.pinned_until[u] = -1;
        s.seen[u] = s.seen2[u] = s.is_cand[u] = -1;
        s.live_pos[u] = -1;
    }
    /* the largest reuse distance the trace allows: every entry's numel (saturating) */
    int64_t total = 0, n_future = 0;
    for (int64_t e = 0; e < step_start[S]; e++) total = sat_add(total, numels[step_units[e]]);
    for (int64_t i = S - 1; i >= 0; i--) {
        int64_t own = 0;
        s.future[i] = n_future;
        for (int64_t e = step_start[i]; e < step_start[i + 1]; e++) {
            int64_t u = step_units[e];
            if (!is_persistent(persistent, u)) own += numels[u];
            if (s.cur_next[u] == S) n_future++; /* its last use */
            s.next_after[e] = s.cur_next[u];
            s.cur_next[u] = i;
        }
        s.own[i] = own;
        p->cap[i] = own > max_live ? own : max_live;
    }
    /* cur_next[u] now holds each unit's first use: the "next use" of a unit not yet used */

    int64_t n_groups = 0, n_fetched = 0, n_released = 0, n_live = 0, live = 0, peak = 0, pinned_run = 0;
    int64_t n_live_future = 0; /* live units with a use after the current step */
    int64_t pinned_live = 0;   /* numel of live pinned units */
    p->group_start[0] = 0;
    for (int64_t i = 0; i < S; i++) {
        /* group 0: the step's own missing units */
        p->step_group[i] = n_groups;
        for (int64_t e = step_start[i]; e < step_start[i + 1]; e++) {
            int64_t u = step_units[e];
            if (s.live_pos[u] < 0) {
                if (n_fetched >= T) goto broken;
                p->fetched[n_fetched++] = u;
                live_add(&s, &n_live, u);
                if (!is_persistent(persistent, u)) live += numels[u];
            } else {
                n_live_future--; /* live with a use at i; counted back below if used again */
            }
            s.cur_next[u] = s.next_after[e];
            if (s.cur_next[u] < S) n_live_future++;
            if (s.pinned_until[u] == i) {
                s.pinned_until[u] = -1;
                pinned_live -= numels[u];
            }
            s.seen[u] = i; /* excluded from the prefetch window */
        }
        p->group_start[++n_groups] = n_fetched;

        /* prefetch: walk the window of future units in first-use order, stopping at the first
         * unit that does not fit. A unit pinned for step k also stays within cap(m) for every
         * step m in (i, k): the non-persistent units of step m came earlier in the walk, so they
         * are live now (fetched, kept, or just prefetched), as are the pins held at m; they are
         * all counted in `live`, so live + v <= max_live bounds own(m) + pinned(m) + v too. */
        int64_t n_pending = 0;
        if (bucket > 0 && s.future[i] > n_live_future) { /* some future unit is not live */
            int64_t window = 0, wanted = 0, added = 0;
            int stop = 0; /* 1: the window is full; 2: max_live stopped the walk */
            for (int64_t k = i + 1; k < S && !stop; k++) {
                for (int64_t e = step_start[k]; e < step_start[k + 1]; e++) {
                    int64_t u = step_units[e];
                    if (s.seen[u] == i) continue;
                    s.seen[u] = i;
                    int pers = is_persistent(persistent, u);
                    int is_live = s.live_pos[u] >= 0;
                    if (pers && is_live) continue;
                    int64_t v = numels[u];
                    if (window + v > bucket) {
                        stop = 1;
                        break;
                    }
                    if (!is_live) {
                        if (!pers && live + added + v > max_live) {
                            stop = 2;
                            break;
                        }
                        s.pending[n_pending] = u;
                        s.pend_step[n_pending++] = k;
                        wanted += v;
                        if (!pers) added += v;
                    }
                    window += v;
                }
            }
            /* Batching: while the window is still full, a step that would prefetch less than min_batch
             * waits, so that the prefetches go out as fewer, larger groups. It never waits when a unit
             * is wanted by the very next step, when the walk reached the end of the trace, or when
             * max_live (not the window) stopped it: then waiting would only delay the gather. */
            if (n_pending > 0 && stop == 1 && wanted < min_batch && s.pend_step[0] > i + 1) n_pending = 0;
            for (int64_t q = 0; q < n_pending; q++) {
                int64_t u = s.pending[q], k = s.pend_step[q], v = numels[u];
                live_add(&s, &n_live, u);
                n_live_future++;
                if (!is_persistent(persistent, u)) {
                    live += v;
                    s.pinned_until[u] = k;
                    pinned_live += v;
                    s.pin_diff[i + 1] += v; /* held at steps i+1..k-1 */
                    s.pin_diff[k] -= v;
                }
            }
        }
        if (n_pending > T - n_fetched) goto broken;
        pack_groups(p, &n_groups, &n_fetched, s.pending, n_pending, numels, bucket);
        p->live_fetch[i] = live;
        if (live > peak) peak = live;

        /* release */
        p->release_start[i] = n_released;
        int64_t n_rel = 0;
        int fast = 0;
        if (i + 1 < S) {
            pinned_run += s.pin_diff[i + 1]; /* later pins start after i + 1: the sum is final */
            int64_t used = s.own[i + 1] + pinned_run;
            /* Fast path: no distance can pass max_reuse and every candidate fits beside step
             * i+1, so every live unit with a next use stays. Units kept or pinned before step i
             * and not used by it still have a next use; only step i's own units can have none. */
            int64_t gone = 0;
            for (int64_t e = step_start[i]; e < step_start[i + 1]; e++) {
                int64_t u = step_units[e];
                if (!is_persistent(persistent, u) && s.cur_next[u] == S) gone += numels[u];
            }
            if (max_reuse >= total && used + (live - pinned_live - gone) <= p->cap[i + 1]) {
                fast = 1;
                for (int64_t e = step_start[i]; e < step_start[i + 1]; e++) {
                    int64_t u = step_units[e];
                    if (!is_persistent(persistent, u) && s.cur_next[u] == S) s.pending[n_rel++] = u;
                }
            }
        }
        if (!fast) {
            int64_t used = i + 1 < S ? s.own[i + 1] + pinned_run : 0, n_cand = 0;
            for (int64_t k = 0; k < n_live; k++) {
                int64_t u = s.live_list[k];
                s.keep[u] = 0;
                if (is_persistent(persistent, u) || i + 1 == S) continue;
                if (s.pinned_until[u] > i) s.keep[u] = 1;
                else if (s.cur_next[u] < S) {
                    s.is_cand[u] = i;
                    n_cand++;
                }
            }
            /* Walk steps i+1, i+2, ... once: a candidate first met at step m has its next use
             * at m and reuse distance = the numel of steps i+1..m-1 walked so far, each step
             * counting all its units (a unit used again counts again, as DeepSpeed's walk over
             * the module order counts parameters). The candidates of one step go in ascending id
             * order. Stop once every candidate is met or the distance is past max_reuse (it only
             * grows). */
            int64_t dist = 0, met = 0;
            for (int64_t m = i + 1; m < S && met < n_cand && dist <= max_reuse; m++) {
                int64_t n_here = 0, add = 0;
                for (int64_t e = step_start[m]; e < step_start[m + 1]; e++) {
                    int64_t w = step_units[e];
                    add = sat_add(add, numels[w]);
                    if (s.seen2[w] == i) continue;
                    s.seen2[w] = i;
                    if (s.is_cand[w] == i) s.cand[n_here++] = w;
                }
                qsort(s.cand, (size_t)n_here, sizeof(int64_t), cmp_i64);
                for (int64_t c = 0; c < n_here; c++) {
                    int64_t u = s.cand[c], extra = m == i + 1 ? 0 : numels[u];
                    if (used + extra <= p->cap[i + 1]) {
                        s.keep[u] = 1;
                        used += extra;
                    }
                }
                met += n_here;
                dist = sat_add(dist, add);
            }
            for (int64_t k = 0; k < n_live; k++) {
                int64_t u = s.live_list[k];
                if (!is_persistent(persistent, u) && !s.keep[u]) s.pending[n_rel++] = u;
            }
        }
        if (n_rel > T - n_released) goto broken;
        qsort(s.pending, (size_t)n_rel, sizeof(int64_t), cmp_i64);
        for (int64_t k = 0; k < n_rel; k++) {
            int64_t u = s.pending[k];
            p->released[n_released++] = u;
            live_remove(&s, &n_live, u);
            live -= numels[u];
            if (s.cur_next[u] < S) n_live_future--;
        }
        p->live_release[i] = live;
    }
    p->step_group[S] = n_groups;
    p->release_start[S] = n_released;
    p->peak = peak;
    scratch_free(&s);
    *out = p;
    return DSC_FP_OK;
broken: /* unreachable while the bound above holds; a guard against writing past the arrays */
    say(err, len, "internal error: the plan needs more fetches or releases than the trace has uses");
    dsc_fetch_plan_free(p);
    scratch_free(&s);
    return DSC_FP_EPLAN;
}

int64_t dsc_fetch_plan_num_steps(const dsc_fetch_plan *p) { return p->num_steps; }

int64_t dsc_fetch_plan_num_groups(const dsc_fetch_plan *p, int64_t i) {
    if (i < 0 || i >= p->num_steps) return 0;
    return p->step_group[i + 1] - p->step_group[i];
}

const int64_t *dsc_fetch_plan_group(const dsc_fetch_plan *p, int64_t i, int64_t g, int64_t *count) {
    if (i < 0 || i >= p->num_steps || g < 0 || g >= dsc_fetch_plan_num_groups(p, i)) {
        if (count) *count = 0;
        return NULL;
    }
    int64_t k = p->step_group[i] + g;
    if (count) *count = p->group_start[k + 1] - p->group_start[k];
    return p->fetched + p->group_start[k];
}

const int64_t *dsc_fetch_plan_release(const dsc_fetch_plan *p, int64_t i, int64_t *count) {
    if (i < 0 || i >= p->num_steps) {
        if (count) *count = 0;
        return NULL;
    }
    if (count) *count = p->release_start[i + 1] - p->release_start[i];
    return p->released + p->release_start[i];
}

int64_t dsc_fetch_plan_live_after_fetch(const dsc_fetch_plan *p, int64_t i) {
    return i >= 0 && i < p->num_steps ? p->live_fetch[i] : 0;
}

int64_t dsc_fetch_plan_live_after_release(const dsc_fetch_plan *p, int64_t i) {
    return i >= 0 && i < p->num_steps ? p->live_release[i] : 0;
}

int64_t dsc_fetch_plan_step_cap(const dsc_fetch_plan *p, int64_t i) {
    return i >= 0 && i < p->num_steps ? p->cap[i] : 0;
}

int64_t dsc_fetch_plan_peak_live(const dsc_fetch_plan *p) { return p->peak; }

int dsc_fetch_plan_simulate(const dsc_fetch_plan *p, const int64_t *step_start, const int64_t *step_units,
                            const int64_t *numels, const unsigned char *persistent, int64_t *peak_out, char *err,
                            size_t len) {
    int64_t U = p->num_units, S = p->num_steps;
    unsigned char *is_live = calloc((size_t)(U ? U : 1), 1);
    if (!is_live) return DSC_FP_ENOMEM;
    int rc = DSC_FP_OK;
    int64_t live = 0, peak = 0;
    for (int64_t i = 0; i < S && rc == DSC_FP_OK; i++) {
        int64_t ng = dsc_fetch_plan_num_groups(p, i);
        for (int64_t g = 0; g < ng && rc == DSC_FP_OK; g++) {
            int64_t n = 0;
            const int64_t *units = dsc_fetch_plan_group(p, i, g, &n);
            for (int64_t k = 0; k < n; k++) {
                int64_t u = units[k];
                if (is_live[u]) {
                    say(err, len, "step %lld fetches unit %lld, which is live", (long long)i, (long long)u);
                    rc = DSC_FP_EPLAN;
                    break;
                }
                is_live[u] = 1;
                if (!is_persistent(persistent, u)) live += numels[u];
                if (live > p->cap[i]) {
                    say(err, len, "step %lld holds %lld live elements, over its cap %lld", (long long)i,
                        (long long)live, (long long)p->cap[i]);
                    rc = DSC_FP_EPLAN;
                    break;
                }
            }
        }
        if (live > peak) peak = live;
        for (int64_t e = step_start[i]; e < step_start[i + 1] && rc == DSC_FP_OK; e++) {
            if (!is_live[step_units[e]]) {
                say(err, len, "step %lld runs without unit %lld", (long long)i, (long long)step_units[e]);
                rc = DSC_FP_EPLAN;
            }
        }
        int64_t n = 0;
        const int64_t *rel = dsc_fetch_plan_release(p, i, &n);
        for (int64_t k = 0; k < n && rc == DSC_FP_OK; k++) {
            int64_t u = rel[k];
            if (!is_live[u] || is_persistent(persistent, u)) {
                say(err, len, "step %lld releases unit %lld, which is %s", (long long)i, (long long)u,
                    is_live[u] ? "persistent" : "not live");
                rc = DSC_FP_EPLAN;
                break;
            }
            is_live[u] = 0;
            live -= numels[u];
        }
    }
    if (rc == DSC_FP_OK && live != 0) {
        say(err, len, "%lld non-persistent elements stay live after the last step", (long long)live);
        rc = DSC_FP_EPLAN;
    }
    free(is_live);
    if (rc == DSC_FP_OK && peak_out) *peak_out = peak;
    return rc;
}
