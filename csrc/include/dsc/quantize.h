/* Block-wise symmetric integer quantization (ZeRO++'s qwZ weights and qgZ gradients).
 *
 * Layout. x holds `segments` equal segments of `seg` elements (n = segments * seg). Each segment
 * is cut into blocks of `block` elements from its start (the last block of a segment may be
 * shorter); a segment has bps = ceil(seg / block) blocks and block k of segment s owns scale
 * scales[s * bps + k]. The scale is the block's largest magnitude over qmax (127 for 8 bits, 7 for
 * 4 bits; 0 for an all-zero block), a code is round-half-even(x / scale) clamped to [-qmax, qmax],
 * and x comes back as code * scale, so |x - back| <= scale / 2 (plus the float rounding of the
 * product). Segments let each rank's chunk of a collective buffer carry its own blocks.
 *
 * Codes are packed per segment, each segment starting on a byte: 8 bits take seg bytes per
 * segment (int8); 4 bits take (seg + 1) / 2 bytes per segment, two's complement nibbles, the
 * element with the even index in the low nibble (a lone last element has a zero high nibble).
 * 4 bits need an even block so that no byte straddles two blocks.
 *
 * Pure C11 (+ OpenMP), no Python, no CUDA: csrc/cuda/quantize.cu implements the same contract on
 * the device and this file is its reference. Return codes: DSC_Q_OK, DSC_Q_EINVAL (sizes, bits,
 * dtype or a NULL array); nothing is written on EINVAL. */
#ifndef DSC_QUANTIZE_H
#define DSC_QUANTIZE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { DSC_Q_OK = 0, DSC_Q_EINVAL = -1 };
/* element types of the unquantized side */
enum { DSC_Q_F32 = 0, DSC_Q_BF16 = 1, DSC_Q_F16 = 2 };

/* bytes the codes of one segment take */
static inline int64_t dsc_q_segment_bytes(int64_t seg, int bits) { return bits == 4 ? (seg + 1) / 2 : seg; }
static inline int64_t dsc_q_blocks_per_segment(int64_t seg, int64_t block) { return (seg + block - 1) / block; }

/* 0 when (segments, seg, block, bits, dtype) describe a valid layout, else DSC_Q_EINVAL */
static inline int dsc_q_check(int64_t segments, int64_t seg, int64_t block, int bits, int dtype) {
    if (segments < 0 || seg < 0 || block < 1) return DSC_Q_EINVAL;
    if (bits != 8 && bits != 4) return DSC_Q_EINVAL;
    if (bits == 4 && (block & 1)) return DSC_Q_EINVAL;
    if (dtype != DSC_Q_F32 && dtype != DSC_Q_BF16 && dtype != DSC_Q_F16) return DSC_Q_EINVAL;
    if (segments > 0 && seg > INT64_MAX / segments) return DSC_Q_EINVAL;
    return DSC_Q_OK;
}

/* x (dtype) -> codes q (segments * segment_bytes) and scales (segments * bps, fp32) */
int dsc_quantize(const void *x, int dtype, int64_t segments, int64_t seg, int64_t block, int bits, uint8_t *q,
                 float *scales);
/* codes and scales -> out (dtype), segments * seg elements */
int dsc_dequantize(const uint8_t *q, const float *scales, int64_t segments, int64_t seg, int64_t block, int bits,
                   void *out, int dtype);
/* out[j] = sum over the segments s of the dequantized element j of segment s (seg fp32 elements, summed
 * in segment order): the reduction of qgZ, where segment s came from rank s */
int dsc_dequantize_sum(const uint8_t *q, const float *scales, int64_t segments, int64_t seg, int64_t block,
                       int bits, float *out);

#ifdef __cplusplus
}
#endif

#endif
