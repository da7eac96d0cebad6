/* Layer partitions of a pipeline (contract in csrc/include/dsc/pipe_schedule.h). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "dsc/pipe_schedule.h"

int dsc_pipe_partition_uniform(int64_t n, int64_t parts_n, int64_t *parts) {
    if (n < 0 || parts_n < 1 || !parts) return DSC_PS_EINVAL;
    if (n <= parts_n) {
        for (int64_t p = 0; p <= parts_n; p++) parts[p] = p < n ? p : n;
        return DSC_PS_OK;
    }
    /* equal chunks, the first (n mod parts) parts one item longer */
    int64_t chunk = n / parts_n, extra = n - chunk * parts_n;
    parts[0] = 0;
    for (int64_t p = 1; p <= parts_n; p++) parts[p] = parts[p - 1] + chunk + (p <= extra ? 1 : 0);
    return DSC_PS_OK;
}

int dsc_pipe_partition_balanced(const double *w, int64_t n, int64_t m, int64_t *parts, char *err, size_t err_len) {
    if (n < 0 || m < 1 || !parts || (n > 0 && !w)) {
        if (err && err_len) snprintf(err, err_len, "partition_balanced needs num_parts >= 1, got %lld", (long long)m);
        return DSC_PS_EINVAL;
    }
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(w[i]) || w[i] < 0) {
            if (err && err_len) snprintf(err, err_len, "weights[%lld] must be finite and >= 0, got %g", (long long)i, w[i]);
            return DSC_PS_EINVAL;
        }
    }
    if (n <= m) return dsc_pipe_partition_uniform(n, m, parts);
    if (n >= (1 << 20) || (n + 1) * (m + 1) > (1 << 22)) { /* the tables are (n + 1) x (m + 1) */
        if (err && err_len)
            snprintf(err, err_len, "partition_balanced: %lld layers x %lld parts is too large (at most 4M cells)",
                     (long long)n, (long long)m);
        return DSC_PS_EINVAL;
    }
    /* best[i][j]: splitting the first i items into j parts with the smallest spread
     * (largest - smallest part); hi/lo are that split's largest and smallest part. An empty prefix
     * in zero parts has largest 0 and smallest +inf, so the first part sets the smallest. */
    size_t cells = (size_t)(n + 1) * (size_t)(m + 1);
    double *cost = malloc(sizeof(double) * cells), *hi = malloc(sizeof(double) * cells);
    double *lo = malloc(sizeof(double) * cells), *pre = malloc(sizeof(double) * (size_t)(n + 1));
    int64_t *cut = calloc(cells, sizeof(int64_t));
    if (!cost || !hi || !lo || !pre || !cut) {
        free(cost), free(hi), free(lo), free(pre), free(cut);
        if (err && err_len) snprintf(err, err_len, "out of memory partitioning %lld layers", (long long)n);
        return DSC_PS_ENOMEM;
    }
#define AT(a, i, j) a[(size_t)(i) * (size_t)(m + 1) + (size_t)(j)]
    for (size_t c = 0; c < cells; c++) cost[c] = hi[c] = lo[c] = INFINITY;
    pre[0] = 0.0;
    for (int64_t i = 0; i < n; i++) pre[i + 1] = pre[i] + w[i];
    AT(hi, 0, 0) = 0.0;
    AT(cost, 0, 0) = 0.0;
    for (int64_t i = 1; i <= n; i++) {
        int64_t jmax = i < m ? i : m;
        for (int64_t j = 1; j <= jmax; j++) {
            for (int64_t k = 0; k < i; k++) {
                double part = pre[i] - pre[k];
                double h = AT(hi, k, j - 1) > part ? AT(hi, k, j - 1) : part;
                double l = AT(lo, k, j - 1) < part ? AT(lo, k, j - 1) : part;
                double c = h - l;
                /* >=: on a tie the later split point wins (as DeepSpeed's) */
                if (AT(cost, i, j) >= c) {
                    AT(cost, i, j) = c;
                    AT(hi, i, j) = h;
                    AT(lo, i, j) = l;
                    AT(cut, i, j) = k;
                }
            }
        }
    }
    parts[m] = n;
    for (int64_t j = m; j >= 1; j--) parts[j - 1] = AT(cut, parts[j], j);
#undef AT
    free(cost), free(hi), free(lo), free(pre), free(cut);
    return DSC_PS_OK;
}
