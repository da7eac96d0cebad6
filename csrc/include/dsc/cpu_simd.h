/* The vector layer under the CPU optimizer kernels: one float vector type (16 lanes with
 * AVX-512, 8 with AVX2, 1 in the scalar build) and dtype-generic loads and stores that widen
 * bf16/fp16 into fp32 lanes and narrow back with round-to-nearest-even, in registers, so every
 * dtype combination is one pass over memory.
 *
 * The scalar converters reproduce the hardware's (F16C) results bit for bit, NaN payloads
 * included, and the kernels use only correctly rounded operations (add, mul, div, sqrt; no
 * FMA, the builds pass -ffp-contract=off), so the AVX-512, AVX2 and scalar builds produce
 * identical bits. Header-only: every kernel inlines its loads and stores. */
#ifndef DSC_CPU_SIMD_H
#define DSC_CPU_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dsc/cpu_optim.h"

#if defined(DSC_SIMD_AVX512) || defined(DSC_SIMD_AVX2)
#include <immintrin.h>
#elif !defined(DSC_SIMD_SCALAR)
#error "define one of DSC_SIMD_AVX512, DSC_SIMD_AVX2, DSC_SIMD_SCALAR (the op builder does)"
#endif

#define DSC_INLINE static inline __attribute__((always_inline))

/* ---- scalar conversions (the scalar build's loads/stores) ------------------------------- */

DSC_INLINE uint32_t dsc_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

DSC_INLINE float dsc_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

DSC_INLINE float dsc_bf16_to_f32(uint16_t h) { return dsc_bits_f32((uint32_t)h << 16); }

DSC_INLINE uint16_t dsc_f32_to_bf16(float f) {
    uint32_t u = dsc_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* NaN stays NaN, quiet */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

DSC_INLINE float dsc_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) {
        float v = (float)mant * 5.9604644775390625e-8f; /* mant * 2^-24, exact */
        return sign ? -v : v;
    }
    if (exp == 31) return dsc_bits_f32(sign | 0x7f800000u | (mant ? 0x00400000u | (mant << 13) : 0u));
    return dsc_bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

DSC_INLINE uint16_t dsc_f32_to_f16(float f) {
    uint32_t u = dsc_f32_bits(f);
    uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint32_t out;
    if (u > 0x7f800000u) { /* NaN: quiet, top payload bits kept (as vcvtps2ph) */
        out = 0x7e00u | ((u >> 13) & 0x3ffu);
    } else if (u >= 0x47800000u) { /* >= 65536 or inf */
        out = 0x7c00u;
    } else if (u < 0x38800000u) { /* below the smallest normal half: let the FPU round */
        float v = dsc_bits_f32(u) + 0.5f; /* 0.5 = 2^-1 puts 2^-24 at the last mantissa bit */
        out = dsc_f32_bits(v) - 0x3f000000u;
    } else {
        uint32_t odd = (u >> 13) & 1u;
        u += 0xc8000fffu + odd; /* rebias the exponent (-112 << 23), round to nearest even */
        out = u >> 13;
    }
    return (uint16_t)(out | (sign >> 16));
}

DSC_INLINE size_t dsc_dtype_size(int32_t dtype) { return dtype == DSC_CPU_F32 ? 4 : 2; }

/* ---- the vector type --------------------------------------------------------------------- */

#if defined(DSC_SIMD_AVX512)
#define DSC_VW 16
typedef __m512 dsc_vf;
typedef __m512d dsc_vd;
#define dsc_vset1 _mm512_set1_ps
#define dsc_vadd _mm512_add_ps
#define dsc_vsub _mm512_sub_ps
#define dsc_vmul _mm512_mul_ps
#define dsc_vdiv _mm512_div_ps
#define dsc_vsqrt _mm512_sqrt_ps

DSC_INLINE dsc_vf dsc_vload(const void *base, int32_t dtype, int64_t i) {
    if (dtype == DSC_CPU_F32) return _mm512_loadu_ps((const float *)base + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    if (dtype == DSC_CPU_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

DSC_INLINE void dsc_vstore(void *base, int32_t dtype, int64_t i, dsc_vf x) {
    if (dtype == DSC_CPU_F32) {
        _mm512_storeu_ps((float *)base + i, x);
        return;
    }
    __m256i *dst = (__m256i *)((uint16_t *)base + i);
    if (dtype == DSC_CPU_F16) {
        _mm256_storeu_si256(dst, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        return;
    }
    __m512i u = _mm512_castps_si512(x);
    __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(dst, _mm512_cvtepi32_epi16(rounded));
}

/* fp32 lanes to base + i (64-byte aligned) past the caches: no read of the line first (see dsc_vstream_ok) */
DSC_INLINE void dsc_vstream_f32(void *base, int64_t i, dsc_vf x) { _mm512_stream_ps((float *)base + i, x); }
#define DSC_STREAM_ALIGN 64

/* x > 0 -> 1, x < 0 -> -1, else x * 0 (0 keeps its sign, NaN stays NaN: torch.sign) */
DSC_INLINE dsc_vf dsc_vsign(dsc_vf x) {
    __m512 zero = _mm512_setzero_ps();
    __m512 s = _mm512_mul_ps(x, zero);
    s = _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ), _mm512_set1_ps(1.0f));
    return _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), _mm512_set1_ps(-1.0f));
}

DSC_INLINE dsc_vd dsc_vd_zero(void) { return _mm512_setzero_pd(); }

/* acc0 += squares of the low lanes, acc1 += squares of the high lanes, in double */
DSC_INLINE void dsc_vsumsq(dsc_vf x, dsc_vd *acc0, dsc_vd *acc1) {
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    *acc0 = _mm512_add_pd(*acc0, _mm512_mul_pd(lo, lo));
    *acc1 = _mm512_add_pd(*acc1, _mm512_mul_pd(hi, hi));
}

DSC_INLINE double dsc_vd_sum(dsc_vd x) { return _mm512_reduce_add_pd(x); }

/* non-zero when a lane is inf or nan (x - x is nan exactly there) */
DSC_INLINE int dsc_vnonfinite(dsc_vf x) {
    return (int)_mm512_cmp_ps_mask(_mm512_sub_ps(x, x), _mm512_setzero_ps(), _CMP_NEQ_UQ);
}

#elif defined(DSC_SIMD_AVX2)
#define DSC_VW 8
typedef __m256 dsc_vf;
typedef __m256d dsc_vd;
#define dsc_vset1 _mm256_set1_ps
#define dsc_vadd _mm256_add_ps
#define dsc_vsub _mm256_sub_ps
#define dsc_vmul _mm256_mul_ps
#define dsc_vdiv _mm256_div_ps
#define dsc_vsqrt _mm256_sqrt_ps

DSC_INLINE dsc_vf dsc_vload(const void *base, int32_t dtype, int64_t i) {
    if (dtype == DSC_CPU_F32) return _mm256_loadu_ps((const float *)base + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (dtype == DSC_CPU_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

DSC_INLINE void dsc_vstore(void *base, int32_t dtype, int64_t i, dsc_vf x) {
    if (dtype == DSC_CPU_F32) {
        _mm256_storeu_ps((float *)base + i, x);
        return;
    }
    __m128i *dst = (__m128i *)((uint16_t *)base + i);
    if (dtype == DSC_CPU_F16) {
        _mm_storeu_si128(dst, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        return;
    }
    __m256i u = _mm256_castps_si256(x);
    __m256i hi = _mm256_srli_epi32(u, 16);
    __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1)));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    rounded = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), nan));
    /* 32 -> 16 bits: values are < 2^16, so the unsigned saturating pack is exact; it packs
     * within 128-bit lanes, and the permute gathers the two useful quarters */
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xd8);
    _mm_storeu_si128(dst, _mm256_castsi256_si128(packed));
}

DSC_INLINE dsc_vf dsc_vsign(dsc_vf x) {
    __m256 zero = _mm256_setzero_ps();
    __m256 s = _mm256_mul_ps(x, zero);
    s = _mm256_blendv_ps(s, _mm256_set1_ps(1.0f), _mm256_cmp_ps(x, zero, _CMP_GT_OQ));
    return _mm256_blendv_ps(s, _mm256_set1_ps(-1.0f), _mm256_cmp_ps(x, zero, _CMP_LT_OQ));
}

DSC_INLINE dsc_vd dsc_vd_zero(void) { return _mm256_setzero_pd(); }

DSC_INLINE void dsc_vsumsq(dsc_vf x, dsc_vd *acc0, dsc_vd *acc1) {
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    *acc0 = _mm256_add_pd(*acc0, _mm256_mul_pd(lo, lo));
    *acc1 = _mm256_add_pd(*acc1, _mm256_mul_pd(hi, hi));
}

DSC_INLINE double dsc_vd_sum(dsc_vd x) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

DSC_INLINE void dsc_vstream_f32(void *base, int64_t i, dsc_vf x) { _mm256_stream_ps((float *)base + i, x); }
#define DSC_STREAM_ALIGN 32

DSC_INLINE int dsc_vnonfinite(dsc_vf x) {
    return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_sub_ps(x, x), _mm256_setzero_ps(), _CMP_NEQ_UQ));
}

#else /* DSC_SIMD_SCALAR: portable C, one lane */
#define DSC_VW 1
typedef float dsc_vf;
typedef double dsc_vd;
DSC_INLINE dsc_vf dsc_vset1(float x) { return x; }
DSC_INLINE dsc_vf dsc_vadd(dsc_vf a, dsc_vf b) { return a + b; }
DSC_INLINE dsc_vf dsc_vsub(dsc_vf a, dsc_vf b) { return a - b; }
DSC_INLINE dsc_vf dsc_vmul(dsc_vf a, dsc_vf b) { return a * b; }
DSC_INLINE dsc_vf dsc_vdiv(dsc_vf a, dsc_vf b) { return a / b; }
DSC_INLINE dsc_vf dsc_vsqrt(dsc_vf a) { return sqrtf(a); }

DSC_INLINE dsc_vf dsc_vload(const void *base, int32_t dtype, int64_t i) {
    if (dtype == DSC_CPU_F32) return ((const float *)base)[i];
    uint16_t h = ((const uint16_t *)base)[i];
    return dtype == DSC_CPU_BF16 ? dsc_bf16_to_f32(h) : dsc_f16_to_f32(h);
}

DSC_INLINE void dsc_vstore(void *base, int32_t dtype, int64_t i, dsc_vf x) {
    if (dtype == DSC_CPU_F32) ((float *)base)[i] = x;
    else ((uint16_t *)base)[i] = dtype == DSC_CPU_BF16 ? dsc_f32_to_bf16(x) : dsc_f32_to_f16(x);
}

DSC_INLINE dsc_vf dsc_vsign(dsc_vf x) { return x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : x * 0.0f; }
DSC_INLINE dsc_vd dsc_vd_zero(void) { return 0.0; }

DSC_INLINE void dsc_vsumsq(dsc_vf x, dsc_vd *acc0, dsc_vd *acc1) {
    (void)acc1;
    *acc0 += (double)x * (double)x;
}

DSC_INLINE double dsc_vd_sum(dsc_vd x) { return x; }
DSC_INLINE int dsc_vnonfinite(dsc_vf x) { return (x - x) != 0.0f; }
DSC_INLINE void dsc_vstream_f32(void *base, int64_t i, dsc_vf x) { ((float *)base)[i] = x; }
#define DSC_STREAM_ALIGN 4
#endif

/* Streaming stores make a written line skip the read that an ordinary store of a line not in cache does
 * first (write-allocate): for an out-of-place step over buffers far larger than the caches that read is a
 * third of the extra traffic. They are weakly ordered: dsc_vstream_fence() before other threads read. */
DSC_INLINE void dsc_vstream_fence(void) {
#if defined(DSC_SIMD_AVX512) || defined(DSC_SIMD_AVX2)
    _mm_sfence();
#endif
}

/* x as stored in `dtype` and read back: what a copy of a 16-bit parameter must start from, so
 * that the copy is the parameter converted, not a differently rounded fp32 value */
DSC_INLINE dsc_vf dsc_vround(dsc_vf x, int32_t dtype) {
    if (dtype == DSC_CPU_F32) return x;
    _Alignas(64) uint16_t lanes[DSC_VW];
    dsc_vstore(lanes, dtype, 0, x);
    return dsc_vload(lanes, dtype, 0);
}

/* ---- vector tails ------------------------------------------------------------------------
 * The last (numel % DSC_VW) elements of a tensor run through the same vector code on padded
 * stack copies, so a tail is computed exactly as the lanes before it. */
typedef struct {
    _Alignas(64) unsigned char bytes[DSC_VW * sizeof(float)];
} dsc_lane_buf;

/* An operand whose element 0 is element i of op (rem elements copied, the rest zero). */
DSC_INLINE dsc_operand dsc_tail_in(dsc_lane_buf *buf, const dsc_operand *op, int64_t i, int64_t rem) {
    if (!op->data) return *op;
    size_t es = dsc_dtype_size(op->dtype);
    memset(buf->bytes, 0, sizeof(buf->bytes));
    memcpy(buf->bytes, (const char *)op->data + (size_t)i * es, (size_t)rem * es);
    return (dsc_operand){buf->bytes, op->dtype};
}

DSC_INLINE void dsc_tail_out(const dsc_operand *op, const dsc_lane_buf *buf, int64_t i, int64_t rem) {
    if (!op->data) return;
    size_t es = dsc_dtype_size(op->dtype);
    memcpy((char *)op->data + (size_t)i * es, buf->bytes, (size_t)rem * es);
}

#endif
