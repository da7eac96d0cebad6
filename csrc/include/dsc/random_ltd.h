/* random-LTD's token moves: the kept tokens of each sample gathered out of the hidden states, the
 * layer's output on them scattered back, and the attention mask cut to the kept rows and columns.
 *
 * Hidden states are [batch, seq, hidden] (batch_first) or [seq, batch, hidden]; a "row" is one
 * token's hidden vector (hidden * itemsize bytes). idx is int32 [batch, keep]: the kept positions of
 * each sample, distinct within a sample (the sampler draws without replacement), in any order.
 *
 *   gather       out[b, j] = hidden[b, idx[b, j]]                  out: [batch, keep, hidden] (or [keep, batch, hidden])
 *   scatter      out = base, then out[b, idx[b, j]] = part[b, j]    base = hidden, or zeros when hidden is NULL;
 *                (accumulate: base + part[b, j]; part NULL: zeros)  out: the shape of hidden
 *   mask_gather  out[b, h, i, j] = mask[b or 0, h, idx[b, i], idx[b, j]]  mask [mask_batch (1 or batch), heads, seq, seq]
 *
 * These are the host reference (csrc/cpu/random_ltd.c, plain loops) of the CUDA launchers in
 * dsc/random_ltd_cuda.h. Return 0, DSC_RLTD_EINVAL for bad sizes or an index outside [0, seq),
 * DSC_RLTD_ENOMEM when scratch memory is short. */
#ifndef DSC_RANDOM_LTD_H
#define DSC_RANDOM_LTD_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { DSC_RLTD_OK = 0, DSC_RLTD_EINVAL = -1, DSC_RLTD_ENOMEM = -2 };
/* element types: only scatter's accumulate does arithmetic; every other move copies bytes */
enum { DSC_RLTD_F32 = 0, DSC_RLTD_F16 = 1, DSC_RLTD_BF16 = 2, DSC_RLTD_F64 = 3 };

typedef struct {
    int64_t batch, seq, hidden, keep;
    int batch_first; /* 1: [batch, seq, hidden]; 0: [seq, batch, hidden] */
    int dtype;       /* DSC_RLTD_* */
    int itemsize;    /* bytes per element */
} dsc_rltd_shape;

int dsc_rltd_gather(const void *hidden, const int32_t *idx, const dsc_rltd_shape *s, void *out);
int dsc_rltd_scatter(const void *hidden, const void *part, const int32_t *idx, const dsc_rltd_shape *s,
                     int accumulate, void *out);
int dsc_rltd_mask_gather(const void *mask, int64_t mask_batch, int64_t heads, int64_t seq, const int32_t *idx,
                         int64_t batch, int64_t keep, int itemsize, void *out);

#ifdef __cplusplus
}
#endif

#endif
