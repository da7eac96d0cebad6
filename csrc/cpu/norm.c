/* Multi-tensor sum of squares with inf/nan detection, and in-place scale: the engine's CPU path
 * for global-norm clipping and fp16 unscale. Accumulates in double per tile. */
#include "cpu_tiles.h"
#include "dsc/cpu_optim.h"

int dsc_cpu_sumsq(const dsc_operand *tensors, const int64_t *numels, int64_t n, double *sumsq,
                  int *found_nonfinite) {
    dsc_tile_map map;
    if (dsc_tile_map_init(&map, numels, sizeof(int64_t), n) < 0) return -1;
    double total = 0.0;
    int bad = 0;
#pragma omp parallel reduction(+ : total) reduction(| : bad)
    {
        float tile_buf[DSC_TILE];
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < map.total_tiles; tile++) {
            int64_t ti = dsc_tile_owner(&map, n, tile);
            int64_t start = (tile - map.first_tile[ti]) * DSC_TILE;
            int64_t len = numels[ti] - start < DSC_TILE ? numels[ti] - start : DSC_TILE;
            const float *x = dsc_load_tile(&tensors[ti], start, len, tile_buf);
            double acc = 0.0;
            int nonfinite = 0;
            DSC_SIMD_SUM2(acc, nonfinite)
            for (int64_t i = 0; i < len; i++) {
                acc += (double)x[i] * (double)x[i];
                nonfinite += (x[i] - x[i]) != 0.0f; /* inf - inf and nan - nan are nan */
            }
            total += acc;
            bad |= nonfinite != 0;
        }
    }
    free(map.first_tile);
    *sumsq = total;
    *found_nonfinite = bad;
    return 0;
}

int dsc_cpu_scale(const dsc_operand *tensors, const int64_t *numels, int64_t n, float factor) {
    dsc_tile_map map;
    if (dsc_tile_map_init(&map, numels, sizeof(int64_t), n) < 0) return -1;
#pragma omp parallel
    {
        float tile_buf[DSC_TILE];
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < map.total_tiles; tile++) {
            int64_t ti = dsc_tile_owner(&map, n, tile);
            int64_t start = (tile - map.first_tile[ti]) * DSC_TILE;
            int64_t len = numels[ti] - start < DSC_TILE ? numels[ti] - start : DSC_TILE;
            float *x = dsc_load_tile(&tensors[ti], start, len, tile_buf);
            DSC_SIMD_LOOP
            for (int64_t i = 0; i < len; i++) x[i] *= factor;
            dsc_store_tile(&tensors[ti], start, len, x);
        }
    }
    free(map.first_tile);
    return 0;
}

const char *dsc_cpu_simd_name(void) {
#if defined(DSC_SIMD_AVX512)
    return "avx512";
#elif defined(DSC_SIMD_AVX2)
    return "avx2";
#else
    return "scalar";
#endif
}
