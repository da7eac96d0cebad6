/* Fused fake quantization of the compression library and MoQ (deepspeed_c/compression/quant_reference.py is
 * the math): x, viewed as `groups` rows of n elements, is quantized to `bits` and dequantized into out in one
 * call, with the precision of torch's own ops on that dtype (every operation rounded to the storage dtype,
 * round half to even), so results equal torch's bit for bit.
 *
 *   symmetric   s = 2 * amax / 2^bits              out = clamp(rint(x / s), -2^(bits-1), 2^(bits-1) - 1) * s
 *   asymmetric  s = (max - min) / 2^bits; zp = rint(min / s) * s
 *               out = clamp(rint((x - zp) / s), 0, 2^bits - 1) * s + zp
 * lo/hi (per group, fp32) fix the range instead of the group's (static activation ranges: min and max for
 * asymmetric; hi = amax for symmetric). recip: divide by s as x * (1 / s) in fp32 (torch's CPU path for a
 * bf16/fp16 tensor divided by a one-element tensor). seed != 0: stochastic rounding, uniform noise in
 * [-0.5, 0.5) from a counter hash of (seed, element index) added before rint (the CUDA kernel draws the same).
 *
 * ternary / binary take their per-group statistics (thres, alpha; m) computed by the caller:
 *   ternary     out = alpha * (x > thres) - alpha * (x < -thres)
 *   binary      out = sign(x) * m
 * Returns DSC_CQ_OK, DSC_CQ_EINVAL (bad sizes, bits outside 2..16, dtype) or DSC_CQ_ENOMEM (host scratch). */
#ifndef DSC_COMPRESS_QUANT_H
#define DSC_COMPRESS_QUANT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifdef __CUDACC__
#define DSC_CQ_HD __host__ __device__
#else
#define DSC_CQ_HD
#endif

enum { DSC_CQ_OK = 0, DSC_CQ_EINVAL = -1, DSC_CQ_ENOMEM = -2 };
enum { DSC_CQ_F32 = 0, DSC_CQ_BF16 = 1, DSC_CQ_F16 = 2 };

static inline int dsc_cq_check(int64_t groups, int64_t n, int bits, int dtype) {
    if (groups < 1 || n < 1 || bits < 2 || bits > 16) return DSC_CQ_EINVAL;
    if (dtype != DSC_CQ_F32 && dtype != DSC_CQ_BF16 && dtype != DSC_CQ_F16) return DSC_CQ_EINVAL;
    if (groups > INT64_MAX / n) return DSC_CQ_EINVAL;
    return DSC_CQ_OK;
}

/* the noise of element i: (hash >> 40) * 2^-24 - 0.5, exact in fp32 */
DSC_CQ_HD static inline float dsc_cq_noise(uint64_t seed, uint64_t i) {
    uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)(z >> 40) * 5.9604644775390625e-8f - 0.5f;
}

int dsc_cq_fake_quant(const void *x, void *out, int dtype, int64_t groups, int64_t n, int bits, int asym,
                      const float *lo, const float *hi, int recip, uint64_t seed);
int dsc_cq_ternary(const void *x, void *out, int dtype, int64_t groups, int64_t n, const float *thres,
                   const float *alpha);
int dsc_cq_binary(const void *x, void *out, int dtype, int64_t groups, int64_t n, const float *m);

#ifdef __cplusplus
}
#endif

#endif
