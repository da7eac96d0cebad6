/* Block-wise symmetric int8/int4 quantization on the host (contract: dsc/quantize.h). This file is
 * the reference the CUDA kernels (csrc/cuda/quantize.cu) are checked against.
 *
 * Each block is two passes over its elements, in chunks of CHUNK converted to fp32 on the stack:
 * the largest magnitude (as an unsigned maximum of the sign-cleared bits, which orders finite
 * floats like their values and vectorises to one integer max per lane), then the codes. The
 * loops are plain C that the AVX2/AVX-512 builds auto-vectorise (the scalar build is compiled with
 * -fno-tree-vectorize and is the reference of the reference: both give the same bits, every step
 * being a correctly rounded operation). Blocks are independent: OpenMP splits them. */
#include "dsc/quantize.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "dsc/cpu_simd.h"

#define CHUNK 256
#define PARALLEL_MIN_ELEMS (1 << 16) /* below this one thread is faster than waking a team */

static float qmax_of(int bits) { return bits == 4 ? 7.0f : 127.0f; }

/* elements [i, i + n) of x as fp32 into dst */
static void load_f32(const void *x, int dtype, int64_t i, int64_t n, float *dst) {
    if (dtype == DSC_Q_F32) {
        memcpy(dst, (const float *)x + i, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *h = (const uint16_t *)x + i;
    if (dtype == DSC_Q_BF16)
        for (int64_t k = 0; k < n; k++) dst[k] = dsc_bf16_to_f32(h[k]);
    else
        for (int64_t k = 0; k < n; k++) dst[k] = dsc_f16_to_f32(h[k]);
}

static void store_from_f32(void *out, int dtype, int64_t i, int64_t n, const float *src) {
    if (dtype == DSC_Q_F32) {
        memcpy((float *)out + i, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *h = (uint16_t *)out + i;
    if (dtype == DSC_Q_BF16)
        for (int64_t k = 0; k < n; k++) h[k] = dsc_f32_to_bf16(src[k]);
    else
        for (int64_t k = 0; k < n; k++) h[k] = dsc_f32_to_f16(src[k]);
}

static uint32_t absmax_bits(const float *v, int64_t n) {
    uint32_t m = 0;
    for (int64_t k = 0; k < n; k++) {
        uint32_t b;
        memcpy(&b, &v[k], sizeof b);
        b &= 0x7fffffffu;
        m = b > m ? b : m;
    }
    return m;
}

/* codes of v[0..n) as int32 (round half to even, clamped) */
static void codes_of(const float *v, int64_t n, float scale, float qmax, int32_t *c) {
    if (scale == 0.0f) {
        memset(c, 0, (size_t)n * sizeof(int32_t));
        return;
    }
    for (int64_t k = 0; k < n; k++) {
        float r = rintf(v[k] / scale); /* round half to even (the default rounding mode) */
        r = r == r ? r : 0.0f;        /* NaN (an inf or NaN block): code 0, the NaN scale carries it */
        r = r > qmax ? qmax : r;
        r = r < -qmax ? -qmax : r;
        c[k] = (int32_t)r;
    }
}

/* one block: elements [start, start + len) of segment s (global element offset base) */
static void quantize_block(const void *x, int dtype, int64_t base, int64_t start, int64_t len, int bits,
                           uint8_t *qseg, float *scale_out) {
    float buf[CHUNK];
    int32_t codes[CHUNK];
    uint32_t m = 0;
    for (int64_t off = 0; off < len; off += CHUNK) {
        const int64_t n = len - off < CHUNK ? len - off : CHUNK;
        load_f32(x, dtype, base + start + off, n, buf);
        const uint32_t mb = absmax_bits(buf, n);
        m = mb > m ? mb : m;
    }
    float amax;
    memcpy(&amax, &m, sizeof amax);
    const float qmax = qmax_of(bits);
    const float scale = amax / qmax;
    *scale_out = scale;
    for (int64_t off = 0; off < len; off += CHUNK) {
        const int64_t n = len - off < CHUNK ? len - off : CHUNK;
        load_f32(x, dtype, base + start + off, n, buf);
        codes_of(buf, n, scale, qmax, codes);
        const int64_t j0 = start + off; /* index inside the segment */
        if (bits == 8) {
            int8_t *dst = (int8_t *)qseg + j0;
            for (int64_t k = 0; k < n; k++) dst[k] = (int8_t)codes[k];
        } else { /* j0 is even: blocks and chunks are even-sized */
            uint8_t *dst = qseg + j0 / 2;
            int64_t k = 0;
            for (; k + 1 < n; k += 2)
                dst[k / 2] = (uint8_t)(((uint32_t)codes[k] & 0xfu) | (((uint32_t)codes[k + 1] & 0xfu) << 4));
            if (k < n) dst[k / 2] = (uint8_t)((uint32_t)codes[k] & 0xfu);
        }
    }
}

int dsc_quantize(const void *x, int dtype, int64_t segments, int64_t seg, int64_t block, int bits, uint8_t *q,
                 float *scales) {
    if (dsc_q_check(segments, seg, block, bits, dtype) != DSC_Q_OK) return DSC_Q_EINVAL;
    if (segments == 0 || seg == 0) return DSC_Q_OK;
    if (!x || !q || !scales) return DSC_Q_EINVAL;
    const int64_t bps = dsc_q_blocks_per_segment(seg, block), sbytes = dsc_q_segment_bytes(seg, bits);
    const int64_t nblocks = segments * bps;
#pragma omp parallel for schedule(static) if (segments * seg >= PARALLEL_MIN_ELEMS)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t s = b / bps, k = b % bps;
        const int64_t start = k * block, len = seg - start < block ? seg - start : block;
        quantize_block(x, dtype, s * seg, start, len, bits, q + s * sbytes, scales + b);
    }
    return DSC_Q_OK;
}

/* the codes of block elements [j0, j0 + n) of a segment as fp32 values */
static void decode(const uint8_t *qseg, int bits, int64_t j0, int64_t n, float scale, float *dst) {
    if (bits == 8) {
        const int8_t *src = (const int8_t *)qseg + j0;
        for (int64_t k = 0; k < n; k++) dst[k] = (float)src[k] * scale;
        return;
    }
    for (int64_t k = 0; k < n; k++) {
        const int64_t j = j0 + k;
        const uint32_t nib = (qseg[j / 2] >> ((j & 1) * 4)) & 0xfu;
        const int32_t code = (int32_t)nib - (int32_t)((nib & 0x8u) << 1); /* sign-extend 4 bits */
        dst[k] = (float)code * scale;
    }
}

int dsc_dequantize(const uint8_t *q, const float *scales, int64_t segments, int64_t seg, int64_t block, int bits,
                   void *out, int dtype) {
    if (dsc_q_check(segments, seg, block, bits, dtype) != DSC_Q_OK) return DSC_Q_EINVAL;
    if (segments == 0 || seg == 0) return DSC_Q_OK;
    if (!q || !scales || !out) return DSC_Q_EINVAL;
    const int64_t bps = dsc_q_blocks_per_segment(seg, block), sbytes = dsc_q_segment_bytes(seg, bits);
    const int64_t nblocks = segments * bps;
#pragma omp parallel for schedule(static) if (segments * seg >= PARALLEL_MIN_ELEMS)
    for (int64_t b = 0; b < nblocks; b++) {
        float buf[CHUNK];
        const int64_t s = b / bps, k = b % bps;
        const int64_t start = k * block, len = seg - start < block ? seg - start : block;
        for (int64_t off = 0; off < len; off += CHUNK) {
            const int64_t n = len - off < CHUNK ? len - off : CHUNK;
            decode(q + s * sbytes, bits, start + off, n, scales[b], buf);
            store_from_f32(out, dtype, s * seg + start + off, n, buf);
        }
    }
    return DSC_Q_OK;
}

int dsc_dequantize_sum(const uint8_t *q, const float *scales, int64_t segments, int64_t seg, int64_t block,
                       int bits, float *out) {
    if (dsc_q_check(segments, seg, block, bits, DSC_Q_F32) != DSC_Q_OK) return DSC_Q_EINVAL;
    if (seg == 0) return DSC_Q_OK;
    if (!out || (segments > 0 && (!q || !scales))) return DSC_Q_EINVAL;
    const int64_t bps = dsc_q_blocks_per_segment(seg, block), sbytes = dsc_q_segment_bytes(seg, bits);
#pragma omp parallel for schedule(static) if (segments * seg >= PARALLEL_MIN_ELEMS)
    for (int64_t k = 0; k < bps; k++) {
        float buf[CHUNK];
        const int64_t start = k * block, len = seg - start < block ? seg - start : block;
        for (int64_t off = 0; off < len; off += CHUNK) {
            const int64_t n = len - off < CHUNK ? len - off : CHUNK;
            float *dst = out + start + off;
            for (int64_t i = 0; i < n; i++) dst[i] = 0.0f;
            for (int64_t s = 0; s < segments; s++) {
                decode(q + s * sbytes, bits, start + off, n, scales[s * bps + k], buf);
                for (int64_t i = 0; i < n; i++) dst[i] += buf[i];
            }
        }
    }
    return DSC_Q_OK;
}
