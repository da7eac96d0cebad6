/* The MoE gating core on the host (contract: dsc/moe_gating.h). */
#include "dsc/moe_gating.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* ---- element conversions (round to nearest even on the way down) -------------------------- */

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) {
        float v = (float)mant * 5.9604644775390625e-8f; /* mant * 2^-24, exact */
        return sign ? -v : v;
    }
    if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant ? 0x00400000u | (mant << 13) : 0u));
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

static inline uint16_t f32_to_f16(float f) {
    uint32_t u = f32_bits(f);
    uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint32_t out;
    if (u > 0x7f800000u) {
        out = 0x7e00u | ((u >> 13) & 0x3ffu);
    } else if (u >= 0x477ff000u) { /* rounds to >= 65520: inf */
        out = 0x7c00u;
    } else if (u < 0x38800000u) { /* subnormal half: let the FPU round (adding 0.5 aligns 2^-24 to the ulp) */
        float v = bits_f32(u) + 0.5f;
        out = f32_bits(v) - 0x3f000000u;
    } else {
        uint32_t odd = (u >> 13) & 1u;
        u += 0xc8000fffu + odd;
        out = u >> 13;
    }
    return (uint16_t)((sign >> 16) | out);
}

static inline float load_f(const void *base, int dtype, int64_t i) {
    switch (dtype) {
    case DSC_MOE_BF16: return bf16_to_f32(((const uint16_t *)base)[i]);
    case DSC_MOE_F16: return f16_to_f32(((const uint16_t *)base)[i]);
    default: return ((const float *)base)[i];
    }
}

static inline void store_f(void *base, int dtype, int64_t i, float v) {
    switch (dtype) {
    case DSC_MOE_BF16: ((uint16_t *)base)[i] = f32_to_bf16(v); break;
    case DSC_MOE_F16: ((uint16_t *)base)[i] = f32_to_f16(v); break;
    default: ((float *)base)[i] = v; break;
    }
}

static int64_t itemsize_of(int dtype) {
    switch (dtype) {
    case DSC_MOE_F32: return 4;
    case DSC_MOE_BF16:
    case DSC_MOE_F16: return 2;
    case DSC_MOE_F64: return 8;
    default: return 0;
    }
}

/* a > b as torch.argmax ranks values: NaN above everything, the first NaN kept */
static inline int ranks_above(float a, float b) { return (a > b) || (isnan(a) && !isnan(b)); }

/* ---- selection ------------------------------------------------------------------------------ */

int dsc_moe_select(const float *primary, const float *secondary, int64_t S, int64_t E, int64_t k, int64_t *idx) {
    if (!primary || !idx || S < 0 || E <= 0 || k <= 0 || k > E) return DSC_MOE_EINVAL;
    /* large work is split over threads; each thread marks the experts it chose in its own row flags */
#pragma omp parallel if (S * E > (1 << 16))
    {
        unsigned char *taken = calloc((size_t)E, 1);
        if (taken) {
#pragma omp for schedule(static)
            for (int64_t s = 0; s < S; s++) {
                int64_t *out = idx + s * k;
                for (int64_t r = 0; r < k; r++) {
                    const float *row = (r == 0 || !secondary) ? primary + s * E : secondary + s * E;
                    int64_t best = -1;
                    for (int64_t e = 0; e < E; e++) {
                        if (taken[e]) continue;
                        if (best < 0 || ranks_above(row[e], row[best])) best = e;
                    }
                    out[r] = best;
                    taken[best] = 1;
                }
                for (int64_t r = 0; r < k; r++) taken[out[r]] = 0;
            }
        } else {
            /* no flags: signal by a negative id; the caller sees ENOMEM below */
#pragma omp for schedule(static)
            for (int64_t s = 0; s < S; s++) idx[s * k] = -1;
        }
        free(taken);
    }
    for (int64_t s = 0; s < S; s++)
        if (idx[s * k] < 0) return DSC_MOE_ENOMEM;
    return DSC_MOE_OK;
}

/* ---- counts and plan -------------------------------------------------------------------------- */

static int check_ids(const int64_t *idx, int64_t n, int64_t E) {
    for (int64_t i = 0; i < n; i++)
        if (idx[i] < 0 || idx[i] >= E) return DSC_MOE_EINVAL;
    return DSC_MOE_OK;
}

int dsc_moe_counts(const int64_t *idx, const uint8_t *used, int64_t S, int64_t k, int64_t E, int64_t *counts) {
    if ((!idx && S * k > 0) || !counts || S < 0 || k <= 0 || E <= 0) return DSC_MOE_EINVAL;
    if (check_ids(idx, S * k, E) != DSC_MOE_OK) return DSC_MOE_EINVAL;
    memset(counts, 0, sizeof(int64_t) * (size_t)E);
    for (int64_t s = 0; s < S; s++) {
        if (used && !used[s]) continue;
        for (int64_t r = 0; r < k; r++) counts[idx[s * k + r]]++;
    }
    return DSC_MOE_OK;
}

typedef struct {
    float score;
    int64_t pos; /* position in the expert's ordered list */
} scored;

static int by_score_desc(const void *a, const void *b) {
    const scored *x = a, *y = b;
    if (ranks_above(x->score, y->score)) return -1;
    if (ranks_above(y->score, x->score)) return 1;
    return (x->pos > y->pos) - (x->pos < y->pos);
}

int dsc_moe_plan(const int64_t *idx, const float *score, const uint8_t *used, int64_t S, int64_t k, int64_t E,
                 int64_t capacity, int order, int64_t *route_slot, int64_t *slot_route) {
    const int64_t R = S * k;
    if ((!idx && R > 0) || (!route_slot && R > 0) || S < 0 || k <= 0 || E <= 0 || capacity < 0) return DSC_MOE_EINVAL;
    if (order != DSC_MOE_TOKEN_MAJOR && order != DSC_MOE_ROUTE_MAJOR) return DSC_MOE_EINVAL;
    if (capacity > 0 && !slot_route) return DSC_MOE_EINVAL;
    if (check_ids(idx, R, E) != DSC_MOE_OK) return DSC_MOE_EINVAL;

    int64_t *start = calloc((size_t)E + 1, sizeof(int64_t));
    int64_t *fill = malloc(sizeof(int64_t) * (size_t)E);
    int64_t *list = malloc(sizeof(int64_t) * (size_t)(R ? R : 1)); /* routes grouped by expert, in order */
    unsigned char *kept = calloc((size_t)(R ? R : 1), 1);
    scored *tmp = NULL;
    int rc = DSC_MOE_ENOMEM;
    if (!start || !fill || !list || !kept) goto done;

    for (int64_t s = 0; s < S; s++) {
        if (used && !used[s]) continue;
        for (int64_t r = 0; r < k; r++) start[idx[s * k + r] + 1]++;
    }
    int64_t largest = 0;
    for (int64_t e = 0; e < E; e++) {
        if (start[e + 1] > largest) largest = start[e + 1];
        start[e + 1] += start[e];
        fill[e] = start[e];
    }
    /* counting sort, stable in the chosen order */
    const int64_t outer = order == DSC_MOE_TOKEN_MAJOR ? S : k, inner = order == DSC_MOE_TOKEN_MAJOR ? k : S;
    for (int64_t a = 0; a < outer; a++) {
        for (int64_t b = 0; b < inner; b++) {
            const int64_t s = order == DSC_MOE_TOKEN_MAJOR ? a : b, r = order == DSC_MOE_TOKEN_MAJOR ? b : a;
            if (used && !used[s]) continue;
            const int64_t route = s * k + r;
            list[fill[idx[route]]++] = route;
        }
    }
    if (score && largest > capacity) {
        tmp = malloc(sizeof(scored) * (size_t)largest);
        if (!tmp) goto done;
    }
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = start[e + 1] - start[e];
        const int64_t *routes = list + start[e];
        if (n <= capacity) {
            for (int64_t i = 0; i < n; i++) kept[routes[i]] = 1;
        } else if (!score) {
            for (int64_t i = 0; i < capacity; i++) kept[routes[i]] = 1;
        } else {
            for (int64_t i = 0; i < n; i++) {
                tmp[i].score = score[routes[i]];
                tmp[i].pos = i;
            }
            qsort(tmp, (size_t)n, sizeof(scored), by_score_desc);
            for (int64_t i = 0; i < capacity; i++) kept[routes[tmp[i].pos]] = 1;
        }
    }
    for (int64_t i = 0; i < R; i++) route_slot[i] = -1;
    for (int64_t j = 0; j < E * capacity; j++) slot_route[j] = -1;
    for (int64_t e = 0; e < E; e++) {
        int64_t loc = 0;
        for (int64_t i = start[e]; i < start[e + 1]; i++) {
            const int64_t route = list[i];
            if (!kept[route]) continue;
            route_slot[route] = e * capacity + loc;
            slot_route[e * capacity + loc] = route;
            loc++;
        }
    }
    rc = DSC_MOE_OK;
done:
    free(start);
    free(fill);
    free(list);
    free(kept);
    free(tmp);
    return rc;
}

/* ---- moves -------------------------------------------------------------------------------------- */

int dsc_moe_dispatch(const void *x, int dtype, int64_t S, int64_t M, const int64_t *slot_route, int64_t nslots,
                     int64_t k, const void *w, void *out) {
    const int64_t isz = itemsize_of(dtype);
    if (!isz || S < 0 || M < 0 || nslots < 0 || k <= 0 || (nslots > 0 && (!slot_route || !out)) ||
        (S > 0 && M > 0 && !x))
        return DSC_MOE_EINVAL;
    for (int64_t j = 0; j < nslots; j++)
        if (slot_route[j] < -1 || slot_route[j] >= S * k) return DSC_MOE_EINVAL;
    const size_t row = (size_t)(M * isz);
#pragma omp parallel for schedule(static) if (nslots * M > (1 << 15))
    for (int64_t j = 0; j < nslots; j++) {
        char *dst = (char *)out + (size_t)j * row;
        const int64_t route = slot_route[j];
        if (route < 0) {
            memset(dst, 0, row);
            continue;
        }
        const int64_t s = route / k;
        if (!w) {
            memcpy(dst, (const char *)x + (size_t)s * row, row);
        } else if (dtype == DSC_MOE_F64) {
            const double c = ((const double *)w)[route];
            const double *src = (const double *)x + s * M;
            for (int64_t m = 0; m < M; m++) ((double *)dst)[m] = src[m] * c;
        } else {
            const float c = ((const float *)w)[route];
            for (int64_t m = 0; m < M; m++) store_f(dst, dtype, m, load_f(x, dtype, s * M + m) * c);
        }
    }
    return DSC_MOE_OK;
}

int dsc_moe_combine(const void *y, int dtype, int64_t nslots, int64_t M, const int64_t *route_slot, int64_t S,
                    int64_t k, const void *w, void *out) {
    if (!itemsize_of(dtype) || S < 0 || M < 0 || nslots < 0 || k <= 0 || (S > 0 && (!route_slot || !out)))
        return DSC_MOE_EINVAL;
    for (int64_t i = 0; i < S * k; i++)
        if (route_slot[i] < -1 || route_slot[i] >= nslots) return DSC_MOE_EINVAL;
    if (dtype == DSC_MOE_F64) {
        const double *yy = y, *ww = w;
        double *oo = out;
#pragma omp parallel for schedule(static) if (S * M > (1 << 15))
        for (int64_t s = 0; s < S; s++) {
            double *dst = oo + s * M;
            for (int64_t m = 0; m < M; m++) dst[m] = 0.0;
            for (int64_t r = 0; r < k; r++) {
                const int64_t slot = route_slot[s * k + r];
                if (slot < 0) continue;
                const double c = ww ? ww[s * k + r] : 1.0;
                const double *src = yy + slot * M;
                for (int64_t m = 0; m < M; m++) dst[m] += src[m] * c;
            }
        }
        return DSC_MOE_OK;
    }
    int rc = DSC_MOE_OK;
#pragma omp parallel if (S * M > (1 << 15))
    {
        /* fp32 accumulator row per thread (float outputs accumulate in place) */
        float *acc = dtype == DSC_MOE_F32 ? NULL : malloc(sizeof(float) * (size_t)(M ? M : 1));
        if (dtype != DSC_MOE_F32 && !acc) {
#pragma omp atomic write
            rc = DSC_MOE_ENOMEM;
        }
#pragma omp for schedule(static)
        for (int64_t s = 0; s < S; s++) {
            if (dtype != DSC_MOE_F32 && !acc) continue;
            float *dst = acc ? acc : (float *)out + s * M;
            for (int64_t m = 0; m < M; m++) dst[m] = 0.0f;
            for (int64_t r = 0; r < k; r++) {
                const int64_t slot = route_slot[s * k + r];
                if (slot < 0) continue;
                const float c = w ? ((const float *)w)[s * k + r] : 1.0f;
                for (int64_t m = 0; m < M; m++) dst[m] += load_f(y, dtype, slot * M + m) * c;
            }
            if (acc)
                for (int64_t m = 0; m < M; m++) store_f(out, dtype, s * M + m, acc[m]);
        }
        free(acc);
    }
    return rc;
}

int dsc_moe_route_dots(const void *g, const void *y, int dtype, int64_t S, int64_t M, int64_t nslots,
                       const int64_t *route_slot, int64_t k, void *out) {
    if (!itemsize_of(dtype) || S < 0 || M < 0 || nslots < 0 || k <= 0 || (S > 0 && (!route_slot || !out)))
        return DSC_MOE_EINVAL;
    for (int64_t i = 0; i < S * k; i++)
        if (route_slot[i] < -1 || route_slot[i] >= nslots) return DSC_MOE_EINVAL;
#pragma omp parallel for schedule(static) if (S * M > (1 << 15))
    for (int64_t i = 0; i < S * k; i++) {
        const int64_t slot = route_slot[i], s = i / k;
        if (dtype == DSC_MOE_F64) {
            double acc = 0.0;
            if (slot >= 0)
                for (int64_t m = 0; m < M; m++) acc += ((const double *)g)[s * M + m] * ((const double *)y)[slot * M + m];
            ((double *)out)[i] = acc;
        } else {
            float acc = 0.0f;
            if (slot >= 0)
                for (int64_t m = 0; m < M; m++) acc += load_f(g, dtype, s * M + m) * load_f(y, dtype, slot * M + m);
            ((float *)out)[i] = acc;
        }
    }
    return DSC_MOE_OK;
}
