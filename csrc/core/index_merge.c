/* The data analyzer's reduce: merge the map files of one metric into DeepSpeed's index files
 * (contract: dsc/index_merge.h). Inputs are mapped read-only; outputs are written through large
 * buffered streams; the sort is an LSD radix sort of (value - min) with the sample ids carried along, so
 * samples of equal value keep their input (worker, thread, processing) order. */
#define _GNU_SOURCE
#include "dsc/index_merge.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define RADIX_BITS 11
#define RADIX (1 << RADIX_BITS)
#define CHUNK 65536 /* elements converted per write */

static const char MAGIC[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};

struct dsc_imerge {
    int64_t n, unique, vmin, vmax;
    int64_t *values; /* sorted ascending */
    int64_t *ids;    /* the sample id of each sorted value */
    int64_t parts;
    dsc_imerge_input *inputs; /* the value files, for sample_to_metric */
    char **paths;
};

static int fail(char *err, size_t errlen, int rc, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return rc;
}

static int itemsize(int code) {
    switch (code) {
    case 1: case 2: return 1;
    case 3: case 6: return 2;
    case 4: case 7: return 4;
    case 5: case 8: return 8;
    default: return 0;
    }
}

typedef struct {
    void *base;
    size_t len;
} mapping;

static int map_input(const dsc_imerge_input *in, mapping *m, char *err, size_t errlen) {
    m->base = NULL;
    m->len = 0;
    const int is = itemsize(in->code);
    if (!is) return fail(err, errlen, DSC_IMERGE_EINVAL, "%s: unknown dtype code %d", in->path, in->code);
    if (in->count < 0) return fail(err, errlen, DSC_IMERGE_EINVAL, "%s: negative element count", in->path);
    const size_t need = (size_t)in->count * (size_t)is;
    int fd = open(in->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return fail(err, errlen, DSC_IMERGE_EIO, "%s: cannot open (%s)", in->path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        const int e = errno;
        close(fd);
        return fail(err, errlen, DSC_IMERGE_EIO, "%s: cannot stat (%s)", in->path, strerror(e));
    }
    if ((size_t)st.st_size < need) {
        close(fd);
        return fail(err, errlen, DSC_IMERGE_EINVAL, "%s: %lld bytes, shorter than the %lld its index describes",
                    in->path, (long long)st.st_size, (long long)need);
    }
    if (need) {
        void *p = mmap(NULL, need, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            close(fd);
            return fail(err, errlen, DSC_IMERGE_EIO, "%s: mmap failed (%s)", in->path, strerror(errno));
        }
        madvise(p, need, MADV_SEQUENTIAL);
        m->base = p;
        m->len = need;
    }
    close(fd);
    return 0;
}

static void unmap(mapping *m) {
    if (m->base) munmap(m->base, m->len);
    m->base = NULL;
}

/* src[0..n) of dtype code -> int64; a u64 above INT64_MAX is refused */
static int widen(const void *src, int code, int64_t n, int64_t *dst) {
    switch (code) {
    case 1: for (int64_t i = 0; i < n; i++) dst[i] = ((const uint8_t *)src)[i]; break;
    case 2: for (int64_t i = 0; i < n; i++) dst[i] = ((const int8_t *)src)[i]; break;
    case 3: for (int64_t i = 0; i < n; i++) dst[i] = ((const int16_t *)src)[i]; break;
    case 4: for (int64_t i = 0; i < n; i++) dst[i] = ((const int32_t *)src)[i]; break;
    case 5: memcpy(dst, src, (size_t)n * 8); break;
    case 6: for (int64_t i = 0; i < n; i++) dst[i] = ((const uint16_t *)src)[i]; break;
    case 7: for (int64_t i = 0; i < n; i++) dst[i] = ((const uint32_t *)src)[i]; break;
    case 8:
        for (int64_t i = 0; i < n; i++) {
            const uint64_t v = ((const uint64_t *)src)[i];
            if (v > (uint64_t)INT64_MAX) return -1;
            dst[i] = (int64_t)v;
        }
        break;
    default: return -1;
    }
    return 0;
}

/* int64 -> dtype code (the caller picked a dtype that holds every value) */
static void narrow(const int64_t *src, int64_t n, int code, void *dst) {
    switch (code) {
    case 1: for (int64_t i = 0; i < n; i++) ((uint8_t *)dst)[i] = (uint8_t)src[i]; break;
    case 2: for (int64_t i = 0; i < n; i++) ((int8_t *)dst)[i] = (int8_t)src[i]; break;
    case 3: for (int64_t i = 0; i < n; i++) ((int16_t *)dst)[i] = (int16_t)src[i]; break;
    case 4: for (int64_t i = 0; i < n; i++) ((int32_t *)dst)[i] = (int32_t)src[i]; break;
    case 6: for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = (uint16_t)src[i]; break;
    case 7: for (int64_t i = 0; i < n; i++) ((uint32_t *)dst)[i] = (uint32_t)src[i]; break;
    case 8: for (int64_t i = 0; i < n; i++) ((uint64_t *)dst)[i] = (uint64_t)src[i]; break;
    default: memcpy(dst, src, (size_t)n * 8);
    }
}

/* ---- sort ------------------------------------------------------------------------------------- */

/* stable LSD radix sort of keys (carrying ids) over the low `bits` bits; the result lands in *k / *v */
static void radix_sort(uint64_t **k, int64_t **v, uint64_t *tk, int64_t *tv, int64_t n, int bits) {
    int64_t count[RADIX];
    uint64_t *ka = *k, *kb = tk;
    int64_t *va = *v, *vb = tv;
    for (int shift = 0; shift < bits; shift += RADIX_BITS) {
        memset(count, 0, sizeof count);
        for (int64_t i = 0; i < n; i++) count[(ka[i] >> shift) & (RADIX - 1)]++;
        int64_t at = 0;
        for (int d = 0; d < RADIX; d++) {
            const int64_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (int64_t i = 0; i < n; i++) {
            const int64_t to = count[(ka[i] >> shift) & (RADIX - 1)]++;
            kb[to] = ka[i];
            vb[to] = va[i];
        }
        uint64_t *sk = ka;
        ka = kb;
        kb = sk;
        int64_t *sv = va;
        va = vb;
        vb = sv;
    }
    *k = ka;
    *v = va;
}

void dsc_imerge_free(dsc_imerge *m) {
    if (!m) return;
    free(m->values);
    free(m->ids);
    if (m->paths)
        for (int64_t p = 0; p < m->parts; p++) free(m->paths[p]);
    free(m->paths);
    free(m->inputs);
    free(m);
}

void dsc_imerge_info(const dsc_imerge *m, int64_t *samples, int64_t *unique, int64_t *vmin, int64_t *vmax) {
    *samples = m->n;
    *unique = m->unique;
    *vmin = m->vmin;
    *vmax = m->vmax;
}

/* read every part into one array (part order), checking the pairs agree */
static int load_parts(const dsc_imerge_input *in, int64_t parts, int64_t *dst, int64_t n, char *err, size_t errlen) {
    int64_t at = 0;
    for (int64_t p = 0; p < parts; p++) {
        mapping m;
        int rc = map_input(&in[p], &m, err, errlen);
        if (rc) return rc;
        if (at + in[p].count > n) {
            unmap(&m);
            return fail(err, errlen, DSC_IMERGE_EINVAL, "internal: part sizes exceed the total");
        }
        rc = widen(m.base, in[p].code, in[p].count, dst + at);
        unmap(&m);
        if (rc) return fail(err, errlen, DSC_IMERGE_EINVAL, "%s: a uint64 value above 2^63 - 1", in[p].path);
        at += in[p].count;
    }
    return 0;
}

int dsc_imerge_sort(const dsc_imerge_input *values, const dsc_imerge_input *ids, int64_t parts, dsc_imerge **out,
                    char *err, size_t errlen) {
    *out = NULL;
    if (parts < 1) return fail(err, errlen, DSC_IMERGE_EINVAL, "no map files to merge");
    int64_t n = 0;
    for (int64_t p = 0; p < parts; p++) {
        if (values[p].count != ids[p].count)
            return fail(err, errlen, DSC_IMERGE_EINVAL, "%s holds %lld values but %s holds %lld sample ids",
                        values[p].path, (long long)values[p].count, ids[p].path, (long long)ids[p].count);
        if (values[p].count < 0) return fail(err, errlen, DSC_IMERGE_EINVAL, "%s: negative count", values[p].path);
        n += values[p].count;
    }
    if (n == 0) return fail(err, errlen, DSC_IMERGE_EINVAL, "the map files hold no samples");
    dsc_imerge *m = calloc(1, sizeof *m);
    int64_t *vals = malloc((size_t)n * 8), *idv = malloc((size_t)n * 8);
    uint64_t *tk = malloc((size_t)n * 8);
    int64_t *tv = malloc((size_t)n * 8);
    int rc = 0;
    if (!m || !vals || !idv || !tk || !tv) {
        rc = fail(err, errlen, DSC_IMERGE_ENOMEM, "cannot allocate %lld bytes for %lld samples", (long long)n * 32,
                  (long long)n);
        goto done;
    }
    m->n = n;
    m->parts = parts;
    m->inputs = calloc((size_t)parts, sizeof *m->inputs);
    m->paths = calloc((size_t)parts, sizeof *m->paths);
    if (!m->inputs || !m->paths) {
        rc = fail(err, errlen, DSC_IMERGE_ENOMEM, "out of memory");
        goto done;
    }
    for (int64_t p = 0; p < parts; p++) {
        m->paths[p] = strdup(values[p].path);
        if (!m->paths[p]) {
            rc = fail(err, errlen, DSC_IMERGE_ENOMEM, "out of memory");
            goto done;
        }
        m->inputs[p] = values[p];
        m->inputs[p].path = m->paths[p];
    }
    if ((rc = load_parts(values, parts, vals, n, err, errlen)) || (rc = load_parts(ids, parts, idv, n, err, errlen)))
        goto done;
    int64_t lo = vals[0], hi = vals[0];
    for (int64_t i = 1; i < n; i++) {
        if (vals[i] < lo) lo = vals[i];
        if (vals[i] > hi) hi = vals[i];
    }
    /* keys relative to the minimum: unsigned order = value order, and small ranges need one pass */
    uint64_t *keys = (uint64_t *)vals;
    for (int64_t i = 0; i < n; i++) keys[i] = (uint64_t)vals[i] - (uint64_t)lo;
    const uint64_t range = (uint64_t)hi - (uint64_t)lo;
    const int bits = range ? 64 - __builtin_clzll(range) : 1;
    int64_t *idp = idv;
    radix_sort(&keys, &idp, tk, tv, n, bits);
    int64_t *sorted = (int64_t *)keys;
    int64_t uniq = 0;
    for (int64_t i = 0; i < n; i++) {
        sorted[i] = (int64_t)(keys[i] + (uint64_t)lo);
        uniq += i == 0 || sorted[i] != sorted[i - 1];
    }
    /* keep the buffers that hold the result, free the others */
    if ((void *)sorted == (void *)vals) {
        free(tk);
        free(tv);
    } else {
        free(vals);
        free(idv);
    }
    vals = NULL, idv = NULL, tk = NULL, tv = NULL;
    m->values = sorted;
    m->ids = idp;
    m->unique = uniq;
    m->vmin = lo;
    m->vmax = hi;
    *out = m;
    m = NULL;
done:
    free(vals);
    free(idv);
    free(tk);
    free(tv);
    dsc_imerge_free(m);
    return rc;
}

/* ---- write ------------------------------------------------------------------------------------ */

typedef struct {
    FILE *f;
    const char *path;
    char *err;
    size_t errlen;
    int rc;
} out_file;

static char *join(const char *prefix, const char *ext) {
    const size_t a = strlen(prefix), b = strlen(ext);
    char *p = malloc(a + b + 1);
    if (p) {
        memcpy(p, prefix, a);
        memcpy(p + a, ext, b + 1);
    }
    return p;
}

static int open_out(out_file *o, const char *path, char *err, size_t errlen) {
    o->path = path;
    o->err = err;
    o->errlen = errlen;
    o->rc = 0;
    o->f = fopen(path, "wb");
    if (!o->f) return o->rc = fail(err, errlen, DSC_IMERGE_EIO, "%s: cannot create (%s)", path, strerror(errno));
    setvbuf(o->f, NULL, _IOFBF, 1 << 20);
    return 0;
}

static void put(out_file *o, const void *p, size_t len) {
    if (o->rc || !len) return;
    if (fwrite(p, 1, len, o->f) != len)
        o->rc = fail(o->err, o->errlen, DSC_IMERGE_EIO, "%s: write failed (%s)", o->path, strerror(errno));
}

static int close_out(out_file *o) {
    if (o->f && fclose(o->f) != 0 && !o->rc)
        o->rc = fail(o->err, o->errlen, DSC_IMERGE_EIO, "%s: close failed (%s)", o->path, strerror(errno));
    o->f = NULL;
    return o->rc;
}

/* src values (stride 1) narrowed to code, in chunks */
static void put_values(out_file *o, const int64_t *src, int64_t n, int code, void *buf) {
    const int is = itemsize(code);
    for (int64_t at = 0; at < n && !o->rc; at += CHUNK) {
        const int64_t c = n - at < CHUNK ? n - at : CHUNK;
        narrow(src + at, c, code, buf);
        put(o, buf, (size_t)c * (size_t)is);
    }
}

/* group sizes: sizes[i] items of one element (sizes NULL) or sizes[i] elements each */
typedef struct {
    const int64_t *sizes; /* NULL: every item has one element */
    int64_t items;
} item_sizes;

static int write_idx(const char *prefix, int code, item_sizes s, const int64_t *docs, int64_t ndocs, void *buf,
                     char *err, size_t errlen) {
    char *path = join(prefix, ".idx");
    if (!path) return fail(err, errlen, DSC_IMERGE_ENOMEM, "out of memory");
    out_file o;
    if (open_out(&o, path, err, errlen)) {
        free(path);
        return o.rc;
    }
    const uint64_t version = 1, count = (uint64_t)s.items, ndoc = (uint64_t)ndocs;
    const uint8_t c8 = (uint8_t)code;
    put(&o, MAGIC, sizeof MAGIC);
    put(&o, &version, 8);
    put(&o, &c8, 1);
    put(&o, &count, 8);
    put(&o, &ndoc, 8);
    int32_t *sz = buf;
    for (int64_t at = 0; at < s.items && !o.rc; at += CHUNK) {
        const int64_t c = s.items - at < CHUNK ? s.items - at : CHUNK;
        for (int64_t i = 0; i < c; i++) {
            const int64_t v = s.sizes ? s.sizes[at + i] : 1;
            if (v > INT32_MAX) {
                o.rc = fail(err, errlen, DSC_IMERGE_EINVAL, "%s: an item of %lld elements (the format's sizes are int32)",
                            path, (long long)v);
                break;
            }
            sz[i] = (int32_t)v;
        }
        put(&o, sz, (size_t)c * 4);
    }
    int64_t *ptr = buf, off = 0;
    const int is = itemsize(code);
    for (int64_t at = 0; at < s.items && !o.rc; at += CHUNK) {
        const int64_t c = s.items - at < CHUNK ? s.items - at : CHUNK;
        for (int64_t i = 0; i < c; i++) {
            ptr[i] = off;
            off += (s.sizes ? s.sizes[at + i] : 1) * is;
        }
        put(&o, ptr, (size_t)c * 8);
    }
    put(&o, docs, (size_t)ndocs * 8);
    const int rc = close_out(&o);
    free(path);
    return rc;
}

static int write_bin_sorted(const char *prefix, const int64_t *src, int64_t n, int code, void *buf, char *err,
                            size_t errlen) {
    char *path = join(prefix, ".bin");
    if (!path) return fail(err, errlen, DSC_IMERGE_ENOMEM, "out of memory");
    out_file o;
    if (!open_out(&o, path, err, errlen)) put_values(&o, src, n, code, buf);
    const int rc = close_out(&o);
    free(path);
    return rc;
}

static int write_sample_to_metric(const dsc_imerge *m, const dsc_imerge_outputs *o, int64_t *wide, void *buf,
                                  char *err, size_t errlen) {
    char *path = join(o->sample_to_metric, ".bin");
    if (!path) return fail(err, errlen, DSC_IMERGE_ENOMEM, "out of memory");
    out_file f;
    if (!open_out(&f, path, err, errlen)) {
        for (int64_t p = 0; p < m->parts && !f.rc; p++) {
            mapping mp;
            if ((f.rc = map_input(&m->inputs[p], &mp, err, errlen))) break;
            const int is = itemsize(m->inputs[p].code);
            for (int64_t at = 0; at < m->inputs[p].count && !f.rc; at += CHUNK) {
                const int64_t c = m->inputs[p].count - at < CHUNK ? m->inputs[p].count - at : CHUNK;
                if (widen((const char *)mp.base + (size_t)at * (size_t)is, m->inputs[p].code, c, wide)) {
                    f.rc = fail(err, errlen, DSC_IMERGE_EINVAL, "%s changed since the sort", m->inputs[p].path);
                    break;
                }
                put_values(&f, wide, c, o->value_code, buf);
            }
            unmap(&mp);
        }
    }
    int rc = close_out(&f);
    free(path);
    if (rc) return rc;
    return write_idx(o->sample_to_metric, o->value_code, (item_sizes){NULL, m->n}, o->sample_docs, o->n_sample_docs,
                     buf, err, errlen);
}

static int docs_ok(const int64_t *docs, int64_t n, int64_t items) {
    if (n < 1 || docs[0] != 0) return 0;
    for (int64_t i = 1; i < n; i++)
        if (docs[i] < docs[i - 1] || docs[i] > items) return 0;
    return 1;
}

int dsc_imerge_write(const dsc_imerge *m, const dsc_imerge_outputs *o, char *err, size_t errlen) {
    if (!itemsize(o->value_code) || !itemsize(o->id_code))
        return fail(err, errlen, DSC_IMERGE_EINVAL, "unknown output dtype code %d / %d", o->value_code, o->id_code);
    if (o->merge_step < 1) return fail(err, errlen, DSC_IMERGE_EINVAL, "merge_step must be >= 1");
    if (o->sample_to_metric && !docs_ok(o->sample_docs, o->n_sample_docs, m->n))
        return fail(err, errlen, DSC_IMERGE_EINVAL, "sample_docs must start at 0, ascend and stay within %lld samples",
                    (long long)m->n);
    if ((o->index_to_sample || o->index_to_metric) && !docs_ok(o->value_docs, o->n_value_docs, m->unique))
        return fail(err, errlen, DSC_IMERGE_EINVAL, "value_docs must start at 0, ascend and stay within %lld values",
                    (long long)m->unique);
    int64_t *groups = malloc((size_t)m->unique * 8), *uniq = malloc((size_t)m->unique * 8);
    const int64_t merged_items = (m->unique + o->merge_step - 1) / o->merge_step;
    int64_t *merged = malloc((size_t)merged_items * 8);
    int64_t *wide = malloc(CHUNK * 8);
    void *buf = malloc(CHUNK * 8);
    int rc = 0;
    if (!groups || !uniq || !merged || !wide || !buf) {
        rc = fail(err, errlen, DSC_IMERGE_ENOMEM, "out of memory");
        goto done;
    }
    int64_t g = -1;
    for (int64_t i = 0; i < m->n; i++) {
        if (i == 0 || m->values[i] != m->values[i - 1]) {
            g++;
            groups[g] = 0;
            uniq[g] = m->values[i];
        }
        groups[g]++;
    }
    for (int64_t i = 0; i < merged_items; i++) {
        int64_t s = 0;
        for (int64_t j = i * o->merge_step; j < (i + 1) * o->merge_step && j < m->unique; j++) s += groups[j];
        merged[i] = s;
    }
    const int64_t merged_docs[2] = {0, merged_items}; /* one document */
    if (o->sample_to_metric && (rc = write_sample_to_metric(m, o, wide, buf, err, errlen))) goto done;
    if (o->index_to_sample &&
        ((rc = write_bin_sorted(o->index_to_sample, m->ids, m->n, o->id_code, buf, err, errlen)) ||
         (rc = write_idx(o->index_to_sample, o->id_code, (item_sizes){groups, m->unique}, o->value_docs,
                         o->n_value_docs, buf, err, errlen))))
        goto done;
    if (o->index_to_metric &&
        ((rc = write_bin_sorted(o->index_to_metric, uniq, m->unique, o->value_code, buf, err, errlen)) ||
         (rc = write_idx(o->index_to_metric, o->value_code, (item_sizes){NULL, m->unique}, o->value_docs,
                         o->n_value_docs, buf, err, errlen))))
        goto done;
    if (o->percentile_merged &&
        ((rc = write_bin_sorted(o->percentile_merged, m->ids, m->n, o->id_code, buf, err, errlen)) ||
         (rc = write_idx(o->percentile_merged, o->id_code, (item_sizes){merged, merged_items}, merged_docs, 2, buf, err,
                         errlen))))
        goto done;
done:
    free(groups);
    free(uniq);
    free(merged);
    free(wide);
    free(buf);
    return rc;
}
