/* Randomised driver of the fetch planner for the ASan/UBSan build in test_fetch_plan.py: random
 * traces and limits, every query, the simulator, the error paths, and each allocation failed in
 * turn (fetch_plan.c is built with fetch_plan_fail_alloc.h force-included). */
#include "dsc/fetch_plan.h"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long fail_at = -1, n_alloc = 0;
void *dsc_test_malloc(size_t n) { return ++n_alloc == fail_at ? NULL : malloc(n); }
void *dsc_test_calloc(size_t n, size_t size) { return ++n_alloc == fail_at ? NULL : calloc(n, size); }

static int pass(unsigned seed) {
    srand(seed);
    static const int64_t sizes[] = {0, 1, 5, 10, 50, 100, 1000};
    static const int64_t limits[] = {0, 1, 10, 100, 500, 1000000};
    for (int it = 0; it < 3000; it++) {
        int64_t U = 1 + rand() % 20, S = rand() % 30;
        int64_t numels[20], start[31], units[31 * 20];
        unsigned char pers[20];
        for (int64_t u = 0; u < U; u++) { numels[u] = sizes[rand() % 7]; pers[u] = rand() % 8 == 0; }
        start[0] = 0;
        for (int64_t i = 0; i < S; i++) {
            int64_t n = rand() % 4, t = start[i];
            for (int64_t k = 0; k < n; k++) {
                int64_t u = rand() % U, dup = 0;
                for (int64_t q = start[i]; q < t; q++) dup |= units[q] == u;
                if (!dup) units[t++] = u;
            }
            start[i + 1] = t;
        }
        dsc_fetch_plan *p = NULL;
        char err[256];
        /* every third plan batches its prefetches (min_batch from the same limits) */
        int64_t min_batch = it % 3 == 0 ? limits[rand() % 6] : 0;
        int rc = dsc_fetch_plan_build_batched(S, start, units, U, numels, (it & 1) ? pers : NULL, limits[rand() % 6],
                                              limits[rand() % 6], limits[rand() % 6], min_batch, &p, err, sizeof err);
        if (rc) { printf("build rc %d %s\n", rc, err); return 1; }
        int64_t peak = -1, n = 0;
        if (dsc_fetch_plan_simulate(p, start, units, numels, (it & 1) ? pers : NULL, &peak, err, sizeof err)) {
            printf("simulate: %s\n", err);
            return 2;
        }
        if (peak != dsc_fetch_plan_peak_live(p)) return 3;
        for (int64_t i = -1; i <= S; i++) {
            for (int64_t g = -1; g <= dsc_fetch_plan_num_groups(p, i); g++) dsc_fetch_plan_group(p, i, g, &n);
            dsc_fetch_plan_release(p, i, &n);
            dsc_fetch_plan_live_after_fetch(p, i);
            dsc_fetch_plan_live_after_release(p, i);
            dsc_fetch_plan_step_cap(p, i);
        }
        dsc_fetch_plan_free(p);
    }
    /* errors */
    int64_t numels[3] = {1, 2, 3}, bad_numels[3] = {1, -2, 3}, start[3] = {0, 2, 4};
    int64_t out_of_range[4] = {0, 1, 2, 3}, dup[4] = {0, 1, 2, 2}, ok[4] = {0, 1, 1, 2};
    dsc_fetch_plan *p = (dsc_fetch_plan *)&p;
    char err[256];
    if (dsc_fetch_plan_build(2, start, out_of_range, 3, numels, NULL, 1, 1, 1, &p, err, sizeof err) != DSC_FP_ERANGE || p) return 4;
    if (dsc_fetch_plan_build(2, start, dup, 3, numels, NULL, 1, 1, 1, &p, err, sizeof err) != DSC_FP_EDUP) return 5;
    if (dsc_fetch_plan_build(2, start, ok, 3, bad_numels, NULL, 1, 1, 1, &p, err, sizeof err) != DSC_FP_EINVAL) return 6;
    if (dsc_fetch_plan_build(2, start, ok, 3, numels, NULL, -1, 1, 1, &p, err, sizeof err) != DSC_FP_EINVAL) return 7;
    if (dsc_fetch_plan_build_batched(2, start, ok, 3, numels, NULL, 1, 1, 1, -1, &p, err, sizeof err) != DSC_FP_EINVAL ||
        p)
        return 7;
    if (dsc_fetch_plan_build(2, start, ok, 3, numels, NULL, 1, 1, 1, NULL, err, sizeof err) != DSC_FP_EINVAL) return 8;
    if (dsc_fetch_plan_build(2, start, ok, 3, numels, NULL, 1, 1, 1, &p, NULL, 0) != DSC_FP_OK) return 9;
    dsc_fetch_plan_free(p);
    dsc_fetch_plan_free(NULL);
    /* every allocation failed in turn: ENOMEM, nothing leaked (ASan checks at exit) */
    int64_t fstart[4] = {0, 2, 3, 5}, funits[5] = {0, 1, 2, 0, 1};
    int saw_ok = 0;
    for (fail_at = 1; fail_at < 100 && !saw_ok; fail_at++) {
        n_alloc = 0;
        int rc = dsc_fetch_plan_build(3, fstart, funits, 3, numels, NULL, 10, 10, 10, &p, err, sizeof err);
        if (rc == DSC_FP_OK) { saw_ok = 1; dsc_fetch_plan_free(p); }
        else if (rc != DSC_FP_ENOMEM || p) return 10;
    }
    if (!saw_ok) return 11;
    fail_at = -1;
    return 0;
}

/* No argument: one pass with the fixed seed (the unit test). SECONDS: passes with seeds 7, 8, ...
 * until that much time has gone (scripts/sanitize_tests.sh's bounded fuzzing). */
int main(int argc, char **argv) {
    double budget = argc > 1 ? atof(argv[1]) : 0;
    time_t start = time(NULL);
    unsigned seed = 7;
    do {
        int rc = pass(seed);
        if (rc) { printf("seed %u failed: %d\n", seed, rc); return rc; }
        seed++;
    } while (difftime(time(NULL), start) < budget);
    puts("ok");
    return 0;
}
