/* The reduce step of the offline data analyzer: the per-worker map files of one metric (each a .bin of
 * one value per sample, in processing order, and a .bin of the matching sample ids) merged into the
 * index files DeepSpeedDataSampler reads, in the memory-mapped indexed-dataset format (MMIDIDX):
 *
 *   sample_to_metric                 the values in worker/thread order, one item per sample
 *   index_to_sample                  one item per distinct value, ascending: the ids of its samples in
 *                                    worker/thread/processing order (a stable sort by value)
 *   index_to_metric                  one item per distinct value: the value
 *   index_to_sample_percentile_merged  index_to_sample's items joined `merge_step` at a time
 *
 * Two calls so the caller can choose the output dtypes and document boundaries from the sizes:
 * dsc_imerge_sort maps the inputs read-only and sorts (LSD radix on value - min, 11 bits a pass, ids
 * carried: stable, so equal to a stable one-process sort of the concatenation); dsc_imerge_write writes the
 * four pairs (sample_to_metric by a second read of the mapped value files). Memory: 32 bytes a sample.
 * dtype codes are the format's: 1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 u16, 7 u32, 8 u64. Functions return
 * 0, or DSC_IMERGE_EINVAL / EIO / ENOMEM with a message in err. */
#ifndef DSC_INDEX_MERGE_H
#define DSC_INDEX_MERGE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { DSC_IMERGE_OK = 0, DSC_IMERGE_EINVAL = -1, DSC_IMERGE_EIO = -2, DSC_IMERGE_ENOMEM = -3 };

typedef struct {
    const char *path; /* a .bin file holding at least `count` elements of `code` */
    int code;
    int64_t count;
} dsc_imerge_input;

typedef struct {
    const char *sample_to_metric, *index_to_sample, *index_to_metric, *percentile_merged; /* prefixes, NULL: skip */
    int value_code, id_code;
    const int64_t *sample_docs; /* doc_idx of sample_to_metric (starts at 0, item counts) */
    int64_t n_sample_docs;
    const int64_t *value_docs; /* doc_idx of index_to_sample and index_to_metric */
    int64_t n_value_docs;
    int64_t merge_step; /* distinct values per percentile_merged item, >= 1 */
} dsc_imerge_outputs;

typedef struct dsc_imerge dsc_imerge;

/* values[p] and ids[p] describe part p (same count); parts are taken in the order given. */
int dsc_imerge_sort(const dsc_imerge_input *values, const dsc_imerge_input *ids, int64_t parts, dsc_imerge **out,
                    char *err, size_t errlen);
void dsc_imerge_info(const dsc_imerge *m, int64_t *samples, int64_t *unique, int64_t *vmin, int64_t *vmax);
int dsc_imerge_write(const dsc_imerge *m, const dsc_imerge_outputs *o, char *err, size_t errlen);
void dsc_imerge_free(dsc_imerge *m);

#ifdef __cplusplus
}
#endif

#endif
