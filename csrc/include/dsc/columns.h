/* ZenFlow's column gather/scatter on the host: the selected columns of row-major matrices, read from or
 * written into a flat partition that holds arbitrary slices of those matrices (a ZeRO partition cuts a
 * matrix anywhere, even mid-row).
 *
 * A segment says: partition elements [part_start, part_start + len) hold elements [param_off,
 * param_off + len) of a row-major matrix with `cols` columns, whose selected columns are
 * idx[idx_start .. idx_start + idx_count) (sorted, distinct, each in [0, cols)). The selected elements of
 * a segment are those (row, column) pairs whose flat index falls inside its slice, taken in ascending
 * flat order; the values list holds every segment's selected elements, segment after segment. */
#ifndef DSC_COLUMNS_H
#define DSC_COLUMNS_H

#include <stdint.h>

typedef struct {
    int64_t part_start, len, param_off, cols, idx_start, idx_count;
} dsc_col_segment;

#define DSC_COL_SEGMENT_FIELDS 6

/* Selected elements of one segment. */
int64_t dsc_columns_count(const dsc_col_segment *seg, const int32_t *idx);

/* out[k] = part[position of the k-th selected element], over all segments (vals_start[s]: where
 * segment s's values begin, from dsc_columns_count's running sum). */
void dsc_columns_gather(const float *part, const dsc_col_segment *segs, int64_t nseg, const int32_t *idx,
                        const int64_t *vals_start, float *out);

/* part[position of the k-th selected element] = vals[k]. */
void dsc_columns_scatter(float *part, const dsc_col_segment *segs, int64_t nseg, const int32_t *idx,
                         const int64_t *vals_start, const float *vals);

#endif
