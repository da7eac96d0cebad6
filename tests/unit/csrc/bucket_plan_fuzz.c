/* Randomised driver of the bucket planner for the ASan/UBSan build in test_bucket_plan.py: every
 * plan, round, query and error path, with each allocation freed. */
#include "dsc/bucket_plan.h"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static int pass(unsigned seed) {
    srand(seed);
    for (int it = 0; it < 2000; it++) {
        int64_t n = rand() % 50;
        int64_t *numels = malloc((size_t)(n ? n : 1) * sizeof(int64_t)), *keys = malloc((size_t)(n ? n : 1) * sizeof(int64_t)), *order = malloc((size_t)(n ? n : 1) * sizeof(int64_t));
        for (int64_t i = 0; i < n; i++) { numels[i] = rand() % 300; keys[i] = rand() % 3; order[i] = i; }
        for (int64_t i = n - 1; i > 0; i--) { int64_t j = rand() % (i + 1); int64_t t = order[i]; order[i] = order[j]; order[j] = t; }
        dsc_bucket_plan *p = NULL; const char *why = NULL;
        int rc = dsc_bucket_plan_create(n, numels, (it & 1) ? keys : NULL, (it & 2) ? order : NULL, 1 + rand() % 500, rand() % 50, 1 + rand() % 8, &p, &why);
        if (rc) { printf("rc %d %s\n", rc, why); return 1; }
        int64_t out[64];
        for (int round = 0; round < 2; round++) {
            dsc_bucket_plan_reset(p);
            for (int64_t k = 0; k < n / 2; k++) if (dsc_bucket_plan_mark(p, order[k]) < 0) return 2;
            dsc_bucket_plan_pending(p, out, 64);
            if (dsc_bucket_plan_mark_all(p) != dsc_bucket_plan_num_buckets(p)) return 3;
            if (dsc_bucket_plan_arrival(p, out, 64) != n) return 4;
            if (n && dsc_bucket_plan_mark(p, order[0]) != DSC_BP_ETWICE) return 5;
        }
        dsc_bucket_plan_free(p);
        free(numels); free(keys); free(order);
    }
    /* invalid args */
    dsc_bucket_plan *p; const char *why;
    int64_t bad[2] = {0, 0}, num[2] = {1, 2};
    if (dsc_bucket_plan_create(2, num, NULL, bad, 10, 0, 1, &p, &why) != DSC_BP_EINVAL) return 6;
    return 0;
}

/* No argument: one pass with the fixed seed (the unit test). SECONDS: passes with seeds 1, 2, ...
 * until that much time has gone (scripts/sanitize_tests.sh's bounded fuzzing). */
int main(int argc, char **argv) {
    double budget = argc > 1 ? atof(argv[1]) : 0;
    time_t start = time(NULL);
    unsigned seed = 1;
    do {
        int rc = pass(seed);
        if (rc) { printf("seed %u failed: %d\n", seed, rc); return rc; }
        seed++;
    } while (difftime(time(NULL), start) < budget);
    puts("ok");
    return 0;
}
