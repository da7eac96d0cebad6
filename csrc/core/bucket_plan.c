/* The bucket planner (see dsc/bucket_plan.h for the contract). */
#include "dsc/bucket_plan.h"

#include <stdlib.h>
#include <string.h>

struct dsc_bucket_plan {
    int64_t n;              /* parameters */
    int64_t nb;             /* buckets */
    int64_t *bucket_of;     /* [n] */
    int64_t *offset_of;     /* [n] elements into the bucket buffer */
    int64_t *order;         /* [n] planned arrival order */
    int64_t *bucket_numel;  /* [nb] */
    int64_t *bucket_key;    /* [nb] */
    int64_t *member_start;  /* [nb + 1] CSR into members */
    int64_t *members;       /* [n] */
    /* readiness state of the current round */
    int64_t *remaining;     /* [nb] members not yet marked */
    unsigned char *marked;  /* [n] */
    int64_t *arrival;       /* [n] marks in the order they came */
    int64_t n_marked;
    int64_t frontier;
};

/* Space for one open bucket per key while planning. */
typedef struct {
    int64_t key;
    int64_t bucket; /* -1 when none is open */
    int64_t fill;
} open_slot;

static int64_t align_up(int64_t v, int64_t align) { return (v + align - 1) / align * align; }

static void set_why(const char **why, const char *msg) {
    if (why) *why = msg;
}

void dsc_bucket_plan_free(dsc_bucket_plan *p) {
    if (!p) return;
    free(p->bucket_of);
    free(p->offset_of);
    free(p->order);
    free(p->bucket_numel);
    free(p->bucket_key);
    free(p->member_start);
    free(p->members);
    free(p->remaining);
    free(p->marked);
    free(p->arrival);
    free(p);
}

/* Checks that order is a permutation of 0..n-1 (seen is scratch of n bytes). */
static int is_permutation(int64_t n, const int64_t *order, unsigned char *seen) {
    memset(seen, 0, (size_t)n);
    for (int64_t k = 0; k < n; k++) {
        int64_t i = order[k];
        if (i < 0 || i >= n || seen[i]) return 0;
        seen[i] = 1;
    }
    return 1;
}

/* Assigns buckets and offsets in arrival order; fills bucket_of, offset_of and the per-bucket
 * numel and key (arrays sized n, the most buckets there can be). Returns the bucket count. */
static int64_t assign(dsc_bucket_plan *p, const int64_t *numels, const int64_t *keys, int64_t cap,
                      int64_t first_cap, int64_t align, open_slot *slots) {
    int64_t nslots = 0, nb = 0;
    for (int64_t k = 0; k < p->n; k++) {
        int64_t i = p->order[k];
        int64_t key = keys ? keys[i] : 0;
        open_slot *s = NULL;
        for (int64_t j = 0; j < nslots; j++) {
            if (slots[j].key == key) {
                s = &slots[j];
                break;
            }
        }
        if (!s) {
            s = &slots[nslots++];
            s->key = key;
            s->bucket = -1;
            s->fill = 0;
        }
        if (s->bucket < 0) {
            s->bucket = nb++;
            s->fill = 0;
            p->bucket_key[s->bucket] = key;
        }
        int64_t at = align_up(s->fill, align);
        p->bucket_of[i] = s->bucket;
        p->offset_of[i] = at;
        s->fill = at + numels[i];
        /* DeepSpeed's rule: a bucket is flushed once it holds more than cap elements */
        if (s->fill > (s->bucket == 0 ? first_cap : cap)) {
            p->bucket_numel[s->bucket] = align_up(s->fill, align);
            s->bucket = -1;
        }
    }
    for (int64_t j = 0; j < nslots; j++) {
        if (slots[j].bucket >= 0) p->bucket_numel[slots[j].bucket] = align_up(slots[j].fill, align);
    }
    return nb;
}

/* Buckets given per parameter: offsets follow the arrival order inside each bucket. Returns the
 * bucket count, or -1 when the ids are not 0..nb-1 with every bucket non-empty. */
static int64_t assign_fixed(dsc_bucket_plan *p, const int64_t *numels, const int64_t *fixed, int64_t align) {
    int64_t nb = 0;
    for (int64_t i = 0; i < p->n; i++) {
        if (fixed[i] < 0 || fixed[i] >= p->n) return -1;
        if (fixed[i] + 1 > nb) nb = fixed[i] + 1;
    }
    for (int64_t b = 0; b < nb; b++) p->bucket_numel[b] = -1; /* "empty" until a member lands */
    for (int64_t k = 0; k < p->n; k++) {
        int64_t i = p->order[k], b = fixed[i];
        int64_t at = p->bucket_numel[b] < 0 ? 0 : align_up(p->bucket_numel[b], align);
        p->bucket_of[i] = b;
        p->offset_of[i] = at;
        p->bucket_numel[b] = at + numels[i];
    }
    for (int64_t b = 0; b < nb; b++) {
        if (p->bucket_numel[b] < 0) return -1;
        p->bucket_numel[b] = align_up(p->bucket_numel[b], align);
    }
    return nb;
}

static int create(int64_t n, const int64_t *numels, const int64_t *keys, const int64_t *order, int64_t cap,
                  int64_t first_cap, int64_t align, const int64_t *fixed, dsc_bucket_plan **out, const char **why);

int dsc_bucket_plan_create(int64_t n, const int64_t *numels, const int64_t *keys, const int64_t *order,
                           int64_t cap, int64_t first_cap, int64_t align, dsc_bucket_plan **out,
                           const char **why) {
    return create(n, numels, keys, order, cap, first_cap, align, NULL, out, why);
}

int dsc_bucket_plan_create_assigned(int64_t n, const int64_t *numels, const int64_t *order, const int64_t *bucket_of,
                                    int64_t align, dsc_bucket_plan **out, const char **why) {
    if (n > 0 && !bucket_of) {
        set_why(why, "bucket_of must not be NULL");
        if (out) *out = NULL;
        return DSC_BP_EINVAL;
    }
    return create(n, numels, NULL, order, 1, 0, align, bucket_of, out, why);
}

static int create(int64_t n, const int64_t *numels, const int64_t *keys, const int64_t *order, int64_t cap,
                  int64_t first_cap, int64_t align, const int64_t *fixed, dsc_bucket_plan **out, const char **why) {
    if (!out) {
        set_why(why, "out must not be NULL");
        return DSC_BP_EINVAL;
    }
    *out = NULL;
    if (n < 0) {
        set_why(why, "n must be >= 0");
        return DSC_BP_EINVAL;
    }
    if (n > 0 && !numels) {
        set_why(why, "numels must not be NULL");
        return DSC_BP_EINVAL;
    }
    if (cap <= 0) {
        set_why(why, "cap must be > 0");
        return DSC_BP_EINVAL;
    }
    if (first_cap <= 0 || first_cap > cap) first_cap = cap;
    if (align <= 0) {
        set_why(why, "align must be >= 1");
        return DSC_BP_EINVAL;
    }
    /* keep every offset computation far from int64 overflow */
    const int64_t limit = (int64_t)1 << 60;
    if (cap > limit || align > limit) {
        set_why(why, "cap and align must be < 2**60");
        return DSC_BP_EINVAL;
    }
    for (int64_t i = 0; i < n; i++) {
        if (numels[i] < 0 || numels[i] > limit) {
            set_why(why, "numels must be >= 0 and < 2**60");
            return DSC_BP_EINVAL;
        }
    }

    dsc_bucket_plan *p = calloc(1, sizeof(*p));
    if (!p) return DSC_BP_ENOMEM;
    size_t cnt = n > 0 ? (size_t)n : 1;
    p->n = n;
    p->bucket_of = malloc(cnt * sizeof(int64_t));
    p->offset_of = malloc(cnt * sizeof(int64_t));
    p->order = malloc(cnt * sizeof(int64_t));
    p->bucket_numel = calloc(cnt, sizeof(int64_t));
    p->bucket_key = calloc(cnt, sizeof(int64_t));
    p->member_start = calloc(cnt + 1, sizeof(int64_t));
    p->members = malloc(cnt * sizeof(int64_t));
    p->remaining = malloc(cnt * sizeof(int64_t));
    p->marked = malloc(cnt);
    p->arrival = malloc(cnt * sizeof(int64_t));
    open_slot *slots = malloc(cnt * sizeof(open_slot));
    if (!p->bucket_of || !p->offset_of || !p->order || !p->bucket_numel || !p->bucket_key ||
        !p->member_start || !p->members || !p->remaining || !p->marked || !p->arrival || !slots) {
        free(slots);
        dsc_bucket_plan_free(p);
        return DSC_BP_ENOMEM;
    }

    if (order) {
        if (!is_permutation(n, order, p->marked)) {
            free(slots);
            dsc_bucket_plan_free(p);
            set_why(why, "order must be a permutation of 0..n-1");
            return DSC_BP_EINVAL;
        }
        memcpy(p->order, order, (size_t)n * sizeof(int64_t));
    } else {
        for (int64_t k = 0; k < n; k++) p->order[k] = n - 1 - k;
    }

    p->nb = fixed ? assign_fixed(p, numels, fixed, align) : assign(p, numels, keys, cap, first_cap, align, slots);
    free(slots);
    if (p->nb < 0) {
        dsc_bucket_plan_free(p);
        set_why(why, "bucket_of must number the buckets 0..nb-1, each with at least one parameter");
        return DSC_BP_EINVAL;
    }

    /* CSR membership in arrival order: count, prefix-sum, scatter */
    for (int64_t i = 0; i < n; i++) p->member_start[p->bucket_of[i] + 1]++;
    for (int64_t b = 0; b < p->nb; b++) p->member_start[b + 1] += p->member_start[b];
    int64_t *cursor = p->remaining; /* scratch until reset() gives it its real job */
    for (int64_t b = 0; b < p->nb; b++) cursor[b] = p->member_start[b];
    for (int64_t k = 0; k < n; k++) {
        int64_t i = p->order[k];
        p->members[cursor[p->bucket_of[i]]++] = i;
    }

    dsc_bucket_plan_reset(p);
    *out = p;
    return DSC_BP_OK;
}

int64_t dsc_bucket_plan_num_params(const dsc_bucket_plan *p) { return p->n; }
int64_t dsc_bucket_plan_num_buckets(const dsc_bucket_plan *p) { return p->nb; }

int64_t dsc_bucket_plan_bucket_of(const dsc_bucket_plan *p, int64_t i) {
    return (i >= 0 && i < p->n) ? p->bucket_of[i] : DSC_BP_ERANGE;
}

int64_t dsc_bucket_plan_offset_of(const dsc_bucket_plan *p, int64_t i) {
    return (i >= 0 && i < p->n) ? p->offset_of[i] : DSC_BP_ERANGE;
}

int64_t dsc_bucket_plan_bucket_numel(const dsc_bucket_plan *p, int64_t b) {
    return (b >= 0 && b < p->nb) ? p->bucket_numel[b] : DSC_BP_ERANGE;
}

int64_t dsc_bucket_plan_bucket_key(const dsc_bucket_plan *p, int64_t b) {
    return (b >= 0 && b < p->nb) ? p->bucket_key[b] : DSC_BP_ERANGE;
}

const int64_t *dsc_bucket_plan_members(const dsc_bucket_plan *p, int64_t b, int64_t *count) {
    if (b < 0 || b >= p->nb) {
        if (count) *count = 0;
        return NULL;
    }
    if (count) *count = p->member_start[b + 1] - p->member_start[b];
    return p->members + p->member_start[b];
}

void dsc_bucket_plan_reset(dsc_bucket_plan *p) {
    for (int64_t b = 0; b < p->nb; b++) p->remaining[b] = p->member_start[b + 1] - p->member_start[b];
    if (p->n > 0) memset(p->marked, 0, (size_t)p->n);
    p->n_marked = 0;
    p->frontier = 0;
}

static void advance(dsc_bucket_plan *p) {
    while (p->frontier < p->nb && p->remaining[p->frontier] == 0) p->frontier++;
}

int64_t dsc_bucket_plan_mark(dsc_bucket_plan *p, int64_t i) {
    if (i < 0 || i >= p->n) return DSC_BP_ERANGE;
    if (p->marked[i]) return DSC_BP_ETWICE;
    p->marked[i] = 1;
    p->arrival[p->n_marked++] = i;
    p->remaining[p->bucket_of[i]]--;
    advance(p);
    return p->frontier;
}

int64_t dsc_bucket_plan_mark_all(dsc_bucket_plan *p) {
    for (int64_t k = 0; k < p->n; k++) {
        int64_t i = p->order[k];
        if (!p->marked[i]) {
            p->marked[i] = 1;
            p->arrival[p->n_marked++] = i;
            p->remaining[p->bucket_of[i]]--;
        }
    }
    advance(p);
    return p->frontier;
}

int64_t dsc_bucket_plan_frontier(const dsc_bucket_plan *p) { return p->frontier; }

int64_t dsc_bucket_plan_pending(const dsc_bucket_plan *p, int64_t *out, int64_t cap) {
    int64_t total = 0;
    for (int64_t k = 0; k < p->n; k++) {
        int64_t i = p->order[k];
        if (p->marked[i]) continue;
        if (out && total < cap) out[total] = i;
        total++;
    }
    return total;
}

int64_t dsc_bucket_plan_arrival(const dsc_bucket_plan *p, int64_t *out, int64_t cap) {
    if (out) {
        int64_t m = p->n_marked < cap ? p->n_marked : cap;
        if (m > 0) memcpy(out, p->arrival, (size_t)m * sizeof(int64_t));
    }
    return p->n_marked;
}
