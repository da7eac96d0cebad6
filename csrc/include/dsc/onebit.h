/* The 1-bit compression core: signs packed into bits, fused with error feedback and the scale,
 * for the compressed all-reduce of the 1-bit optimizers (1-bit Adam, 0/1 Adam, 1-bit LAMB).
 *
 * Pure C11 (+ OpenMP), no Python, no CUDA. csrc/cuda/onebit.cu implements the same contract on
 * the device (dsc/onebit_cuda.h); the scalar build of csrc/cpu/onebit.c is the reference of both.
 *
 * Vocabulary. A flat float buffer is cut into segments; segment s is the row segs[3s .. 3s+2] =
 * {offset, len, scale_index}: elements [offset, offset + len) of the buffer, whose scale (or sum
 * of squares) is entry scale_index of a per-call array. Offsets are multiples of 8, so a
 * segment's bits start on a byte: element k lives in bit (k % 8) of byte k / 8 of the bit buffer
 * (least significant bit first). Segments may share a scale index (one tensor cut into the
 * chunks of several ranks); they must not overlap.
 *
 * The sign of x is +1 unless x < 0 (so +0, -0 and NaN are +1: a 1-bit code has no zero),
 * bit 1 for +1 and bit 0 for -1. Bits past the end of a segment's last byte are written 0.
 *
 * Return codes: DSC_ONEBIT_OK, DSC_ONEBIT_EINVAL (a negative size, an offset not a multiple of
 * 8, a NULL array that is required). Nothing is written on EINVAL. */
#ifndef DSC_ONEBIT_H
#define DSC_ONEBIT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { DSC_ONEBIT_OK = 0, DSC_ONEBIT_EINVAL = -1 };

/* y[k] += err[k] (err NULL: y unchanged) over every segment, and sumsq[scale_index] += the sum of
 * y[k]^2 over the segment (accumulated in double; the caller zeroes sumsq). The error feedback's
 * first half: the compensated buffer and the squares its scale (norm / sqrt(numel)) needs. */
int dsc_onebit_compensate(float *y, const float *err, const int64_t *segs, int64_t nseg, double *sumsq);

/* bits <- sign bits of y; with err non-NULL also err[k] = y[k] - scale * sign(y[k]) with
 * scale = scales[scale_index]: the compression error the next call feeds back. One pass. */
int dsc_onebit_pack(const float *y, float *err, uint8_t *bits, const int64_t *segs, int64_t nseg,
                    const float *scales);

/* out[k] = scale * sign_k (accumulate 0) or out[k] + scale * sign_k (accumulate 1), sign_k read
 * from the bits at element k: decompression, and the server's average of the ranks' chunks
 * (one call per source rank with its scale / world size). */
int dsc_onebit_unpack(const uint8_t *bits, float *out, const int64_t *segs, int64_t nseg, const float *scales,
                      int accumulate);

#ifdef __cplusplus
}
#endif

#endif
