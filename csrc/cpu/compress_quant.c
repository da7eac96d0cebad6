/* Fused fake quantization on the host (contract and math: dsc/compress_quant.h). Two passes: the group
 * ranges (tiles of TILE elements reduced in parallel, then combined per group), then the elementwise
 * quantize-dequantize. `st` rounds each intermediate to the storage dtype, as torch's bf16/fp16 ops do; for
 * fp32 it is the identity and the compiler keeps the loop vectorisable. */
#include "dsc/compress_quant.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dsc/cpu_simd.h"

#define TILE (1 << 16)

static inline float ld(const void *x, int dtype, int64_t i) {
    if (dtype == DSC_CQ_F32) return ((const float *)x)[i];
    const uint16_t h = ((const uint16_t *)x)[i];
    return dtype == DSC_CQ_BF16 ? dsc_bf16_to_f32(h) : dsc_f16_to_f32(h);
}

static inline float st(float v, int dtype) {
    if (dtype == DSC_CQ_F32) return v;
    return dtype == DSC_CQ_BF16 ? dsc_bf16_to_f32(dsc_f32_to_bf16(v)) : dsc_f16_to_f32(dsc_f32_to_f16(v));
}

static inline void put(void *out, int dtype, int64_t i, float v) {
    if (dtype == DSC_CQ_F32)
        ((float *)out)[i] = v;
    else
        ((uint16_t *)out)[i] = dtype == DSC_CQ_BF16 ? dsc_f32_to_bf16(v) : dsc_f32_to_f16(v);
}

/* NaN-propagating min / max, as torch.amin / amax */
static inline float fmax_nan(float a, float b) { return a != a ? a : (b != b || b > a) ? b : a; }
static inline float fmin_nan(float a, float b) { return a != a ? a : (b != b || b < a) ? b : a; }

/* per-group (min, max), or (amax, amax) of |x| for symmetric; -1 when out of memory */
static int group_ranges(const void *x, int dtype, int64_t groups, int64_t n, int asym, float *glo, float *ghi) {
    const int64_t tiles_per = (n + TILE - 1) / TILE, tiles = groups * tiles_per;
    float *tlo = (float *)malloc(sizeof(float) * (size_t)tiles), *thi = (float *)malloc(sizeof(float) * (size_t)tiles);
    if (!tlo || !thi) {
        free(tlo);
        free(thi);
        return -1;
    }
#pragma omp parallel for schedule(static) if (groups * n > TILE)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t g = t / tiles_per, start = (t % tiles_per) * TILE;
        const int64_t end = start + TILE < n ? start + TILE : n;
        const int64_t base = g * n;
        float lo = INFINITY, hi = asym ? -INFINITY : 0.0f;
        if (dtype == DSC_CQ_F32) { /* branch-free so it vectorises; a NaN anywhere is the answer, as torch's */
            const float *xf = (const float *)x + base;
            int nan = 0;
            for (int64_t k = start; k < end; k++) {
                const float v = xf[k], a = fabsf(v);
                nan |= v != v;
                lo = v < lo ? v : lo;
                hi = asym ? (v > hi ? v : hi) : (a > hi ? a : hi);
            }
            tlo[t] = nan ? NAN : lo;
            thi[t] = nan ? NAN : hi;
            continue;
        }
        for (int64_t k = start; k < end; k++) {
            const float v = ld(x, dtype, base + k);
            if (asym) {
                lo = fmin_nan(lo, v);
                hi = fmax_nan(hi, v);
            } else {
                hi = fmax_nan(hi, fabsf(v));
            }
        }
        tlo[t] = lo;
        thi[t] = hi;
    }
    for (int64_t g = 0; g < groups; g++) {
        float lo = tlo[g * tiles_per], hi = thi[g * tiles_per];
        for (int64_t t = 1; t < tiles_per; t++) {
            lo = fmin_nan(lo, tlo[g * tiles_per + t]);
            hi = fmax_nan(hi, thi[g * tiles_per + t]);
        }
        glo[g] = asym ? lo : hi;
        ghi[g] = hi;
    }
    free(tlo);
    free(thi);
    return 0;
}

static inline float divide(float a, float s, float inv, int recip, int dtype) {
    return st(recip ? a * inv : a / s, dtype);
}

static inline float clampf(float r, float lo, float hi) {
    r = r < lo ? lo : r; /* NaN passes through both, as torch.clamp */
    return r > hi ? hi : r;
}

int dsc_cq_fake_quant(const void *x, void *out, int dtype, int64_t groups, int64_t n, int bits, int asym,
                      const float *lo, const float *hi, int recip, uint64_t seed) {
    if (!x || !out || dsc_cq_check(groups, n, bits, dtype) != DSC_CQ_OK || (!lo) != (!hi)) return DSC_CQ_EINVAL;
    float *glo = (float *)malloc(sizeof(float) * (size_t)groups);
    float *ghi = (float *)malloc(sizeof(float) * (size_t)groups);
    if (!glo || !ghi) {
        free(glo);
        free(ghi);
        return DSC_CQ_ENOMEM;
    }
    if (lo) {
        memcpy(glo, lo, sizeof(float) * (size_t)groups);
        memcpy(ghi, hi, sizeof(float) * (size_t)groups);
    } else if (group_ranges(x, dtype, groups, n, asym, glo, ghi) < 0) {
        free(glo);
        free(ghi);
        return DSC_CQ_ENOMEM;
    }
    const float q_range = (float)(1 << bits);
    const float qlo = asym ? 0.0f : -q_range / 2, qhi = asym ? q_range - 1 : q_range / 2 - 1;
    /* the scale and zero point per group (in place of the range), each operation rounded as torch rounds it
     * (division by a power of two is exact, so x * (1/q) and x / q agree) */
    for (int64_t g = 0; g < groups; g++) {
        const float s = asym ? st(st(ghi[g] - glo[g], dtype) / q_range, dtype)
                             : st(st(2.0f * ghi[g], dtype) / q_range, dtype);
        glo[g] = asym ? st(rintf(divide(glo[g], s, 1.0f / s, recip, dtype)) * s, dtype) : 0.0f;
        ghi[g] = s;
    }
    /* tiles of TILE elements inside a group, so one big group spreads over every thread too */
    const int64_t tiles_per = (n + TILE - 1) / TILE, tiles = groups * tiles_per;
#pragma omp parallel for schedule(static) if (groups * n > TILE)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t g = t / tiles_per, start = (t % tiles_per) * TILE;
        const int64_t end = start + TILE < n ? start + TILE : n;
        const float s = ghi[g], inv = 1.0f / s, zp = glo[g];
        const int64_t base = g * n;
        if (dtype == DSC_CQ_F32 && !seed && !recip) { /* the common case, branch-free so it vectorises */
            const float *xf = (const float *)x;
            float *of = (float *)out;
            for (int64_t k = base + start; k < base + end; k++) {
                float r = rintf((asym ? xf[k] - zp : xf[k]) / s);
                r = r < qlo ? qlo : r;
                r = r > qhi ? qhi : r;
                of[k] = asym ? r * s + zp : r * s;
            }
            continue;
        }
        for (int64_t k = base + start; k < base + end; k++) {
            const float v = ld(x, dtype, k);
            float r = divide(asym ? st(v - zp, dtype) : v, s, inv, recip, dtype);
            if (seed) r = st(r + st(dsc_cq_noise(seed, (uint64_t)k), dtype), dtype);
            r = clampf(rintf(r), qlo, qhi);
            float o = st(r * s, dtype);
            if (asym) o = st(o + zp, dtype);
            put(out, dtype, k, o);
        }
    }
    free(glo);
    free(ghi);
    return DSC_CQ_OK;
}

int dsc_cq_ternary(const void *x, void *out, int dtype, int64_t groups, int64_t n, const float *thres,
                   const float *alpha) {
    if (!x || !out || !thres || !alpha || dsc_cq_check(groups, n, 2, dtype) != DSC_CQ_OK) return DSC_CQ_EINVAL;
#pragma omp parallel for schedule(static) if (groups * n > TILE)
    for (int64_t g = 0; g < groups; g++) {
        const float t = thres[g], a = alpha[g];
        for (int64_t k = g * n; k < (g + 1) * n; k++) {
            const float v = ld(x, dtype, k);
            const float pos = v > t ? 1.0f : 0.0f, neg = v < -t ? 1.0f : 0.0f;
            put(out, dtype, k, st(st(a * pos, dtype) - st(a * neg, dtype), dtype));
        }
    }
    return DSC_CQ_OK;
}

int dsc_cq_binary(const void *x, void *out, int dtype, int64_t groups, int64_t n, const float *m) {
    if (!x || !out || !m || dsc_cq_check(groups, n, 2, dtype) != DSC_CQ_OK) return DSC_CQ_EINVAL;
#pragma omp parallel for schedule(static) if (groups * n > TILE)
    for (int64_t g = 0; g < groups; g++) {
        const float s = m[g];
        for (int64_t k = g * n; k < (g + 1) * n; k++) {
            const float v = ld(x, dtype, k);
            const float sign = v > 0 ? 1.0f : (v < 0 ? -1.0f : (v != v ? v : 0.0f));
            put(out, dtype, k, st(sign * s, dtype));
        }
    }
    return DSC_CQ_OK;
}
