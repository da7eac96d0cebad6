/* The 1-bit compression core on the host (contract: dsc/onebit.h).
 *
 * Three builds, chosen at load time by the op builder from the running CPU (as the CPU
 * optimizers): AVX-512 (a 16-lane compare gives 16 sign bits in one mask register, stored as two
 * bytes), AVX2 (8 lanes -> movemask -> one byte) and scalar (the reference). Sign bits and the
 * error feedback are identical in every build (the error is y - (+/-scale), one correctly rounded
 * subtraction); the sum of squares is accumulated in double, in a build-dependent order.
 *
 * Work is cut into blocks of BLOCK elements (a multiple of every vector width and of 8, so a
 * block's bits start on a byte); OpenMP spreads a segment's blocks over threads when it is large. */
#include "dsc/onebit.h"

#include <stddef.h>
#include <string.h>

#if defined(DSC_SIMD_AVX512) || defined(DSC_SIMD_AVX2)
#include <immintrin.h>
#elif !defined(DSC_SIMD_SCALAR)
#error "define one of DSC_SIMD_AVX512, DSC_SIMD_AVX2, DSC_SIMD_SCALAR (the op builder does)"
#endif

#define BLOCK 4096
#define PARALLEL_MIN_BLOCKS 16

/* ---- scalar pieces (the reference, and every build's tail) ------------------------------- */

static inline int positive(float x) { return !(x < 0.0f); } /* +0, -0 and NaN are +1 */

static double compensate_scalar(float *y, const float *e, int64_t n) {
    double acc = 0.0;
    for (int64_t k = 0; k < n; k++) {
        float v = e ? y[k] + e[k] : y[k];
        y[k] = v;
        acc += (double)v * (double)v;
    }
    return acc;
}

/* n elements from a byte boundary; the last partial byte's unused bits are 0 */
static void pack_scalar(const float *y, float *e, uint8_t *bits, int64_t n, float scale) {
    for (int64_t b = 0; b * 8 < n; b++) {
        unsigned byte = 0;
        const int64_t end = (b + 1) * 8 < n ? (b + 1) * 8 : n;
        for (int64_t k = b * 8; k < end; k++) {
            const int pos = positive(y[k]);
            byte |= (unsigned)pos << (k - b * 8);
            if (e) e[k] = y[k] - (pos ? scale : -scale);
        }
        bits[b] = (uint8_t)byte;
    }
}

static void unpack_scalar(const uint8_t *bits, float *out, int64_t n, float scale, int acc) {
    for (int64_t k = 0; k < n; k++) {
        const float v = (bits[k >> 3] >> (k & 7)) & 1u ? scale : -scale;
        out[k] = acc ? out[k] + v : v;
    }
}

/* ---- vector bodies: each handles a prefix of whole vectors and returns how many elements ---- */

#if defined(DSC_SIMD_AVX512)
static int64_t compensate_vec(float *y, const float *e, int64_t n, double *acc_out) {
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        __m512 v = _mm512_loadu_ps(y + k);
        if (e) {
            v = _mm512_add_ps(v, _mm512_loadu_ps(e + k));
            _mm512_storeu_ps(y + k, v);
        }
        const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
        const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        a0 = _mm512_fmadd_pd(lo, lo, a0);
        a1 = _mm512_fmadd_pd(hi, hi, a1);
    }
    *acc_out = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
    return k;
}

static int64_t pack_vec(const float *y, float *e, uint8_t *bits, int64_t n, float scale) {
    const __m512 zero = _mm512_setzero_ps(), pos = _mm512_set1_ps(scale), neg = _mm512_set1_ps(-scale);
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        const __m512 v = _mm512_loadu_ps(y + k);
        const __mmask16 m = _mm512_cmp_ps_mask(v, zero, _CMP_NLT_UQ);
        const uint16_t m16 = (uint16_t)m;
        memcpy(bits + (k >> 3), &m16, 2); /* little-endian: elements 0-7 in the first byte */
        if (e) _mm512_storeu_ps(e + k, _mm512_sub_ps(v, _mm512_mask_blend_ps(m, neg, pos)));
    }
    return k;
}

static int64_t unpack_vec(const uint8_t *bits, float *out, int64_t n, float scale, int acc) {
    const __m512 pos = _mm512_set1_ps(scale), neg = _mm512_set1_ps(-scale);
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        uint16_t m16;
        memcpy(&m16, bits + (k >> 3), 2);
        __m512 v = _mm512_mask_blend_ps((__mmask16)m16, neg, pos);
        if (acc) v = _mm512_add_ps(_mm512_loadu_ps(out + k), v);
        _mm512_storeu_ps(out + k, v);
    }
    return k;
}
#elif defined(DSC_SIMD_AVX2)
static int64_t compensate_vec(float *y, const float *e, int64_t n, double *acc_out) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        __m256 v = _mm256_loadu_ps(y + k);
        if (e) {
            v = _mm256_add_ps(v, _mm256_loadu_ps(e + k));
            _mm256_storeu_ps(y + k, v);
        }
        const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
        const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        a0 = _mm256_fmadd_pd(lo, lo, a0);
        a1 = _mm256_fmadd_pd(hi, hi, a1);
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(a0, a1));
    *acc_out = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    return k;
}

static int64_t pack_vec(const float *y, float *e, uint8_t *bits, int64_t n, float scale) {
    const __m256 zero = _mm256_setzero_ps(), pos = _mm256_set1_ps(scale), neg = _mm256_set1_ps(-scale);
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m256 v = _mm256_loadu_ps(y + k);
        const __m256 m = _mm256_cmp_ps(v, zero, _CMP_NLT_UQ);
        bits[k >> 3] = (uint8_t)_mm256_movemask_ps(m);
        if (e) _mm256_storeu_ps(e + k, _mm256_sub_ps(v, _mm256_blendv_ps(neg, pos, m)));
    }
    return k;
}

static int64_t unpack_vec(const uint8_t *bits, float *out, int64_t n, float scale, int acc) {
    const __m256 pos = _mm256_set1_ps(scale), neg = _mm256_set1_ps(-scale);
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m256i b = _mm256_set1_epi32(bits[k >> 3]);
        const __m256 m = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, sel), sel));
        __m256 v = _mm256_blendv_ps(neg, pos, m);
        if (acc) v = _mm256_add_ps(_mm256_loadu_ps(out + k), v);
        _mm256_storeu_ps(out + k, v);
    }
    return k;
}
#else
static int64_t compensate_vec(float *y, const float *e, int64_t n, double *acc_out) {
    (void)y, (void)e, (void)n;
    *acc_out = 0.0;
    return 0;
}
static int64_t pack_vec(const float *y, float *e, uint8_t *bits, int64_t n, float scale) {
    (void)y, (void)e, (void)bits, (void)n, (void)scale;
    return 0;
}
static int64_t unpack_vec(const uint8_t *bits, float *out, int64_t n, float scale, int acc) {
    (void)bits, (void)out, (void)n, (void)scale, (void)acc;
    return 0;
}
#endif

/* ---- one block (vector prefix + scalar tail) ------------------------------------------------ */

static double compensate_block(float *y, const float *e, int64_t n) {
    double acc;
    const int64_t k = compensate_vec(y, e, n, &acc);
    return acc + compensate_scalar(y + k, e ? e + k : NULL, n - k);
}

static void pack_block(const float *y, float *e, uint8_t *bits, int64_t n, float scale) {
    const int64_t k = pack_vec(y, e, bits, n, scale); /* a multiple of 8: the tail starts on a byte */
    pack_scalar(y + k, e ? e + k : NULL, bits + (k >> 3), n - k, scale);
}

static void unpack_block(const uint8_t *bits, float *out, int64_t n, float scale, int acc) {
    const int64_t k = unpack_vec(bits, out, n, scale, acc);
    unpack_scalar(bits + (k >> 3), out + k, n - k, scale, acc);
}

/* ---- the contract ---------------------------------------------------------------------------- */

static int check_segments(const int64_t *segs, int64_t nseg) {
    if (nseg < 0 || (nseg > 0 && !segs)) return DSC_ONEBIT_EINVAL;
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t off = segs[3 * s], len = segs[3 * s + 1], idx = segs[3 * s + 2];
        if (off < 0 || len < 0 || idx < 0 || (off & 7)) return DSC_ONEBIT_EINVAL;
    }
    return DSC_ONEBIT_OK;
}

static inline int64_t blocks_of(int64_t len) { return (len + BLOCK - 1) / BLOCK; }

int dsc_onebit_compensate(float *y, const float *err, const int64_t *segs, int64_t nseg, double *sumsq) {
    if (check_segments(segs, nseg) != DSC_ONEBIT_OK || (nseg > 0 && (!y || !sumsq))) return DSC_ONEBIT_EINVAL;
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t off = segs[3 * s], len = segs[3 * s + 1], nb = blocks_of(len);
        double total = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : total) if (nb >= PARALLEL_MIN_BLOCKS)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t start = off + b * BLOCK, n = len - b * BLOCK < BLOCK ? len - b * BLOCK : BLOCK;
            total += compensate_block(y + start, err ? err + start : NULL, n);
        }
        sumsq[segs[3 * s + 2]] += total;
    }
    return DSC_ONEBIT_OK;
}

int dsc_onebit_pack(const float *y, float *err, uint8_t *bits, const int64_t *segs, int64_t nseg,
                    const float *scales) {
    if (check_segments(segs, nseg) != DSC_ONEBIT_OK || (nseg > 0 && (!y || !bits || !scales)))
        return DSC_ONEBIT_EINVAL;
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t off = segs[3 * s], len = segs[3 * s + 1], nb = blocks_of(len);
        const float scale = scales[segs[3 * s + 2]];
#pragma omp parallel for schedule(static) if (nb >= PARALLEL_MIN_BLOCKS)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t start = off + b * BLOCK, n = len - b * BLOCK < BLOCK ? len - b * BLOCK : BLOCK;
            pack_block(y + start, err ? err + start : NULL, bits + (start >> 3), n, scale);
        }
    }
    return DSC_ONEBIT_OK;
}

int dsc_onebit_unpack(const uint8_t *bits, float *out, const int64_t *segs, int64_t nseg, const float *scales,
                      int accumulate) {
    if (check_segments(segs, nseg) != DSC_ONEBIT_OK || (nseg > 0 && (!bits || !out || !scales)))
        return DSC_ONEBIT_EINVAL;
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t off = segs[3 * s], len = segs[3 * s + 1], nb = blocks_of(len);
        const float scale = scales[segs[3 * s + 2]];
#pragma omp parallel for schedule(static) if (nb >= PARALLEL_MIN_BLOCKS)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t start = off + b * BLOCK, n = len - b * BLOCK < BLOCK ? len - b * BLOCK : BLOCK;
            unpack_block(bits + (start >> 3), out + start, n, scale, accumulate != 0);
        }
    }
    return DSC_ONEBIT_OK;
}
