/* ZenFlow's column gather/scatter (see dsc/columns.h). A row that lies wholly inside its segment is one
 * indexed load/store per selected column: AVX-512 and AVX2 gather 16 / 8 of them per instruction, AVX-512
 * also scatters; the partial first and last rows of a segment, and the lanes left over, go one by one. */
#include "dsc/columns.h"

#if defined(DSC_SIMD_AVX512) || defined(DSC_SIMD_AVX2)
#include <immintrin.h>
#endif

/* first j in [0, n) with idx[j] >= v (idx sorted) */
static int64_t lower_bound(const int32_t *idx, int64_t n, int64_t v) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (idx[mid] < v) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Row r of a segment spans matrix columns [c0, c1) inside the slice; its selected columns are
 * idx[j0 .. j1). */
typedef struct {
    int64_t r0, r1;  /* rows touched: [r0, r1] */
    int64_t first_c0, last_c1;
} seg_rows;

static seg_rows rows_of(const dsc_col_segment *s) {
    seg_rows out;
    int64_t end = s->param_off + s->len;  /* exclusive */
    out.r0 = s->param_off / s->cols;
    out.r1 = (end - 1) / s->cols;
    out.first_c0 = s->param_off - out.r0 * s->cols;
    out.last_c1 = end - out.r1 * s->cols;
    return out;
}

int64_t dsc_columns_count(const dsc_col_segment *s, const int32_t *idx) {
    if (s->len <= 0 || s->idx_count <= 0) return 0;
    const int32_t *ix = idx + s->idx_start;
    int64_t k = s->idx_count;
    seg_rows rr = rows_of(s);
    if (rr.r0 == rr.r1) return lower_bound(ix, k, rr.last_c1) - lower_bound(ix, k, rr.first_c0);
    int64_t first = k - lower_bound(ix, k, rr.first_c0);
    int64_t last = lower_bound(ix, k, rr.last_c1);
    return first + last + (rr.r1 - rr.r0 - 1) * k;
}

/* One partial row: selected columns idx[j0 .. j1) of the row whose column 0 sits at base. */
static void row_gather_scalar(const float *base, const int32_t *ix, int64_t j0, int64_t j1, float *out) {
    for (int64_t j = j0; j < j1; j++) *out++ = base[ix[j]];
}

static void row_scatter_scalar(float *base, const int32_t *ix, int64_t j0, int64_t j1, const float *vals) {
    for (int64_t j = j0; j < j1; j++) base[ix[j]] = *vals++;
}

static void row_gather_full(const float *base, const int32_t *ix, int64_t k, float *out) {
    int64_t j = 0;
#if defined(DSC_SIMD_AVX512)
    for (; j + 16 <= k; j += 16) {
        __m512i vi = _mm512_loadu_si512((const void *)(ix + j));
        _mm512_storeu_ps(out + j, _mm512_i32gather_ps(vi, base, 4));
    }
#elif defined(DSC_SIMD_AVX2)
    for (; j + 8 <= k; j += 8) {
        __m256i vi = _mm256_loadu_si256((const __m256i *)(ix + j));
        _mm256_storeu_ps(out + j, _mm256_i32gather_ps(base, vi, 4));
    }
#endif
    for (; j < k; j++) out[j] = base[ix[j]];
}

static void row_scatter_full(float *base, const int32_t *ix, int64_t k, const float *vals) {
    int64_t j = 0;
#if defined(DSC_SIMD_AVX512)
    for (; j + 16 <= k; j += 16) {
        __m512i vi = _mm512_loadu_si512((const void *)(ix + j));
        _mm512_i32scatter_ps(base, vi, _mm512_loadu_ps(vals + j), 4);
    }
#endif
    for (; j < k; j++) base[ix[j]] = vals[j];  /* AVX2 has no scatter instruction */
}

/* Walks one segment: the partial first row, the full rows (in parallel), the partial last row. */
#define SEGMENT_WALK(PART, S, IDX, VALS, ROW_PARTIAL, ROW_FULL)                                        \
    do {                                                                                               \
        const int32_t *ix = (IDX) + (S)->idx_start;                                                    \
        int64_t k = (S)->idx_count;                                                                    \
        if ((S)->len <= 0 || k <= 0) break;                                                            \
        seg_rows rr = rows_of(S);                                                                      \
        /* column 0 of row r sits at partition index part_start + r * cols - param_off */              \
        int64_t shift = (S)->part_start - (S)->param_off;                                              \
        int64_t v = 0;                                                                                 \
        if (rr.r0 == rr.r1) {                                                                          \
            int64_t j0 = lower_bound(ix, k, rr.first_c0), j1 = lower_bound(ix, k, rr.last_c1);         \
            ROW_PARTIAL((PART) + shift + rr.r0 * (S)->cols, ix, j0, j1, (VALS));                       \
            break;                                                                                     \
        }                                                                                              \
        int64_t j0 = lower_bound(ix, k, rr.first_c0);                                                  \
        ROW_PARTIAL((PART) + shift + rr.r0 * (S)->cols, ix, j0, k, (VALS));                            \
        v = k - j0;                                                                                    \
        int64_t full = rr.r1 - rr.r0 - 1;                                                              \
        _Pragma("omp parallel for schedule(static) if (full * k > (1 << 16))")                         \
        for (int64_t q = 0; q < full; q++) {                                                           \
            int64_t r = rr.r0 + 1 + q;                                                                 \
            ROW_FULL((PART) + shift + r * (S)->cols, ix, k, (VALS) + v + q * k);                       \
        }                                                                                              \
        v += full * k;                                                                                 \
        ROW_PARTIAL((PART) + shift + rr.r1 * (S)->cols, ix, 0, lower_bound(ix, k, rr.last_c1), (VALS) + v); \
    } while (0)

void dsc_columns_gather(const float *part, const dsc_col_segment *segs, int64_t nseg, const int32_t *idx,
                        const int64_t *vals_start, float *out) {
    for (int64_t s = 0; s < nseg; s++) SEGMENT_WALK(part, &segs[s], idx, out + vals_start[s], row_gather_scalar,
                                                    row_gather_full);
}

void dsc_columns_scatter(float *part, const dsc_col_segment *segs, int64_t nseg, const int32_t *idx,
                         const int64_t *vals_start, const float *vals) {
    for (int64_t s = 0; s < nseg; s++) SEGMENT_WALK(part, &segs[s], idx, vals + vals_start[s], row_scatter_scalar,
                                                    row_scatter_full);
}
