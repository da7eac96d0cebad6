/* The host reference of random-LTD's token moves (contract: dsc/random_ltd.h). Plain loops over
 * whole rows (memcpy), so the CUDA kernels have something obvious to be compared with, bit for bit.
 * Indices are checked here (range, and distinct within a sample for scatter, whose result would
 * otherwise depend on the write order). */
#include <stdlib.h>
#include <string.h>

#include "dsc/cpu_simd.h"
#include "dsc/random_ltd.h"

static int shape_ok(const dsc_rltd_shape *s) {
    return s && s->batch >= 0 && s->seq >= 0 && s->hidden >= 0 && s->keep >= 0 && s->keep <= s->seq &&
           (s->itemsize == 1 || s->itemsize == 2 || s->itemsize == 4 || s->itemsize == 8);
}

/* index of token (b, t) among the rows of a [batch, len, hidden] or [len, batch, hidden] tensor */
static int64_t row_of(const dsc_rltd_shape *s, int64_t b, int64_t t, int64_t len) {
    return s->batch_first ? b * len + t : t * s->batch + b;
}

static int indices_ok(const int32_t *idx, const dsc_rltd_shape *s) {
    for (int64_t i = 0; i < s->batch * s->keep; i++)
        if (idx[i] < 0 || idx[i] >= s->seq) return 0;
    return 1;
}

int dsc_rltd_gather(const void *hidden, const int32_t *idx, const dsc_rltd_shape *s, void *out) {
    if (!shape_ok(s) || !indices_ok(idx, s)) return DSC_RLTD_EINVAL;
    const size_t row = (size_t)s->hidden * (size_t)s->itemsize;
    for (int64_t b = 0; b < s->batch; b++)
        for (int64_t j = 0; j < s->keep; j++) {
            const int64_t src = row_of(s, b, idx[b * s->keep + j], s->seq), dst = row_of(s, b, j, s->keep);
            memcpy((char *)out + (size_t)dst * row, (const char *)hidden + (size_t)src * row, row);
        }
    return DSC_RLTD_OK;
}

static void add_row(void *dst, const void *src, int64_t n, int dtype) {
    switch (dtype) {
    case DSC_RLTD_F64:
        for (int64_t i = 0; i < n; i++) ((double *)dst)[i] += ((const double *)src)[i];
        break;
    case DSC_RLTD_F32:
        for (int64_t i = 0; i < n; i++) ((float *)dst)[i] += ((const float *)src)[i];
        break;
    case DSC_RLTD_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t *d = (uint16_t *)dst + i;
            *d = dsc_f32_to_bf16(dsc_bf16_to_f32(*d) + dsc_bf16_to_f32(((const uint16_t *)src)[i]));
        }
        break;
    default:
        for (int64_t i = 0; i < n; i++) {
            uint16_t *d = (uint16_t *)dst + i;
            *d = dsc_f32_to_f16(dsc_f16_to_f32(*d) + dsc_f16_to_f32(((const uint16_t *)src)[i]));
        }
    }
}

int dsc_rltd_scatter(const void *hidden, const void *part, const int32_t *idx, const dsc_rltd_shape *s,
                     int accumulate, void *out) {
    if (!shape_ok(s) || !indices_ok(idx, s)) return DSC_RLTD_EINVAL;
    if (accumulate && s->dtype != DSC_RLTD_F32 && s->dtype != DSC_RLTD_F64 && s->dtype != DSC_RLTD_F16 &&
        s->dtype != DSC_RLTD_BF16)
        return DSC_RLTD_EINVAL;
    unsigned char *seen = calloc((size_t)(s->seq ? s->seq : 1), 1);
    if (!seen) return DSC_RLTD_ENOMEM;
    const size_t row = (size_t)s->hidden * (size_t)s->itemsize;
    const size_t all = (size_t)s->batch * (size_t)s->seq * row;
    if (hidden)
        memcpy(out, hidden, all);
    else
        memset(out, 0, all);
    int rc = DSC_RLTD_OK;
    for (int64_t b = 0; b < s->batch && rc == DSC_RLTD_OK; b++) {
        memset(seen, 0, (size_t)s->seq);
        for (int64_t j = 0; j < s->keep; j++) {
            const int32_t p = idx[b * s->keep + j];
            if (seen[p]) {
                rc = DSC_RLTD_EINVAL; /* a repeated position: the result would depend on the order */
                break;
            }
            seen[p] = 1;
            char *dst = (char *)out + (size_t)row_of(s, b, p, s->seq) * row;
            const char *src = part ? (const char *)part + (size_t)row_of(s, b, j, s->keep) * row : NULL;
            if (!src)
                memset(dst, 0, row);
            else if (accumulate)
                add_row(dst, src, s->hidden, s->dtype);
            else
                memcpy(dst, src, row);
        }
    }
    free(seen);
    return rc;
}

int dsc_rltd_mask_gather(const void *mask, int64_t mask_batch, int64_t heads, int64_t seq, const int32_t *idx,
                         int64_t batch, int64_t keep, int itemsize, void *out) {
    if (batch < 0 || keep < 0 || keep > seq || heads < 0 || (mask_batch != 1 && mask_batch != batch) ||
        (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8))
        return DSC_RLTD_EINVAL;
    for (int64_t i = 0; i < batch * keep; i++)
        if (idx[i] < 0 || idx[i] >= seq) return DSC_RLTD_EINVAL;
    const size_t is = (size_t)itemsize;
    for (int64_t b = 0; b < batch; b++) {
        const int32_t *k = idx + b * keep;
        const int64_t mb = mask_batch == 1 ? 0 : b;
        for (int64_t h = 0; h < heads; h++) {
            const char *m = (const char *)mask + (size_t)((mb * heads + h) * seq * seq) * is;
            char *o = (char *)out + (size_t)((b * heads + h) * keep * keep) * is;
            for (int64_t i = 0; i < keep; i++)
                for (int64_t j = 0; j < keep; j++)
                    memcpy(o + (size_t)(i * keep + j) * is, m + (size_t)((int64_t)k[i] * seq + k[j]) * is, is);
        }
    }
    return DSC_RLTD_OK;
}
