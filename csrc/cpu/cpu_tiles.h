/* Shared machinery of the CPU optimizer kernels: dtype conversion into and out of fp32 tiles
 * (round-to-nearest-even, NaN kept NaN), and the parallel walk over the tiles of a tensor list.
 * Header-only so each kernel inlines its conversions. */
#ifndef DSC_CPU_TILES_H
#define DSC_CPU_TILES_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dsc/cpu_optim.h"

#if defined(DSC_SIMD_AVX512) || defined(DSC_SIMD_AVX2)
#include <immintrin.h>
#endif

/* Elements per tile: four fp32 tiles (param, grad, two states) stay within L1. */
#define DSC_TILE 1024

#if defined(DSC_SIMD_SCALAR)
#define DSC_SIMD_LOOP
#define DSC_SIMD_SUM2(a, b)
#else
#define DSC_SIMD_LOOP _Pragma("omp simd")
#define DSC_PRAGMA_(x) _Pragma(#x)
#define DSC_SIMD_SUM2(a, b) DSC_PRAGMA_(omp simd reduction(+ : a, b))
#endif

static inline uint32_t dsc_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static inline float dsc_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static inline float dsc_bf16_to_f32(uint16_t h) { return dsc_bits_f32((uint32_t)h << 16); }

static inline uint16_t dsc_f32_to_bf16(float f) {
    uint32_t u = dsc_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float dsc_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) {
        float v = (float)mant * 5.9604644775390625e-8f; /* mant * 2^-24, exact */
        return sign ? -v : v;
    }
    if (exp == 31) return dsc_bits_f32(sign | 0x7f800000u | (mant << 13));
    return dsc_bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

static inline uint16_t dsc_f32_to_f16(float f) {
    uint32_t u = dsc_f32_bits(f);
    uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint32_t out;
    if (u >= 0x47800000u) { /* >= 65536, inf or nan */
        out = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (u < 0x38800000u) { /* below the smallest normal half: let the FPU round */
        float v = dsc_bits_f32(u) + 0.5f; /* 0.5 = 2^-1 puts 2^-24 at the last mantissa bit */
        out = dsc_f32_bits(v) - 0x3f000000u;
    } else {
        uint32_t odd = (u >> 13) & 1u;
        u += 0xc8000fffu + odd; /* rebias exponent (-112 << 23) and round to nearest even */
        out = u >> 13;
    }
    return (uint16_t)(out | (sign >> 16));
}

/* fp32 view of operand elements [start, start + len): the tensor itself when it is fp32, else
 * the tile filled by conversion. */
static inline float *dsc_load_tile(const dsc_operand *op, int64_t start, int64_t len, float *tile) {
    switch (op->dtype) {
    case DSC_CPU_F32:
        return (float *)op->data + start;
    case DSC_CPU_BF16: {
        const uint16_t *src = (const uint16_t *)op->data + start;
        DSC_SIMD_LOOP
        for (int64_t i = 0; i < len; i++) tile[i] = dsc_bf16_to_f32(src[i]);
        return tile;
    }
    default: {
        const uint16_t *src = (const uint16_t *)op->data + start;
        int64_t i = 0;
#if defined(DSC_SIMD_AVX512)
        for (; i + 16 <= len; i += 16)
            _mm512_storeu_ps(tile + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
#elif defined(DSC_SIMD_AVX2)
        for (; i + 8 <= len; i += 8)
            _mm256_storeu_ps(tile + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
        for (; i < len; i++) tile[i] = dsc_f16_to_f32(src[i]);
        return tile;
    }
    }
}

/* Write fp32 values back to an operand's storage (no-op when vals already is the tensor). */
static inline void dsc_store_tile(const dsc_operand *op, int64_t start, int64_t len, const float *vals) {
    switch (op->dtype) {
    case DSC_CPU_F32: {
        float *dst = (float *)op->data + start;
        if (dst != vals) memcpy(dst, vals, sizeof(float) * (size_t)len);
        return;
    }
    case DSC_CPU_BF16: {
        uint16_t *dst = (uint16_t *)op->data + start;
        DSC_SIMD_LOOP
        for (int64_t i = 0; i < len; i++) dst[i] = dsc_f32_to_bf16(vals[i]);
        return;
    }
    default: {
        uint16_t *dst = (uint16_t *)op->data + start;
        int64_t i = 0;
#if defined(DSC_SIMD_AVX512)
        for (; i + 16 <= len; i += 16)
            _mm256_storeu_si256((__m256i *)(dst + i),
                                _mm512_cvtps_ph(_mm512_loadu_ps(vals + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(DSC_SIMD_AVX2)
        for (; i + 8 <= len; i += 8)
            _mm_storeu_si128((__m128i *)(dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(vals + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
        for (; i < len; i++) dst[i] = dsc_f32_to_f16(vals[i]);
        return;
    }
    }
}

/* Tile index -> (tensor, start) over a list: first_tile[i] is tensor i's first global tile. */
typedef struct {
    int64_t *first_tile;
    int64_t total_tiles;
} dsc_tile_map;

/* numel of item i is *(const int64_t *)((const char *)base + i * stride): one walker serves
 * both dsc_opt_tensor lists and plain numel arrays. -1 when out of memory. */
static inline int dsc_tile_map_init(dsc_tile_map *m, const void *base, size_t stride, int64_t n) {
    m->first_tile = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    if (!m->first_tile) return -1;
    int64_t t = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t numel = *(const int64_t *)((const char *)base + (size_t)i * stride);
        m->first_tile[i] = t;
        t += (numel + DSC_TILE - 1) / DSC_TILE;
    }
    m->total_tiles = t;
    return 0;
}

static inline int64_t dsc_tile_owner(const dsc_tile_map *m, int64_t n, int64_t tile) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (m->first_tile[mid] <= tile) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* The body every step kernel shares: for each tile, widen the operands, run `update`, narrow
 * the written operands back, and fill the optional low-precision copy. */
#define DSC_FOR_EACH_TILE(tensors, n, map, BODY)                                             \
    _Pragma("omp parallel") {                                                                 \
        float tp[DSC_TILE], tg[DSC_TILE], ts0[DSC_TILE], ts1[DSC_TILE];                       \
        _Pragma("omp for schedule(static)") for (int64_t tile = 0; tile < (map).total_tiles; tile++) { \
            int64_t ti = dsc_tile_owner(&(map), (n), tile);                                   \
            const dsc_opt_tensor *t = &(tensors)[ti];                                          \
            int64_t start = (tile - (map).first_tile[ti]) * DSC_TILE;                         \
            int64_t len = t->numel - start < DSC_TILE ? t->numel - start : DSC_TILE;          \
            BODY                                                                              \
        }                                                                                     \
    }

#endif
