/* Adagrad on the CPU (torch.optim.Adagrad's rule with lr_decay 0):
 *   g    = grad (+ weight_decay * p)
 *   sum += g * g
 *   p   -= lr * g / (sqrt(sum) + eps) */
#include <math.h>

#include "cpu_tiles.h"
#include "dsc/cpu_optim.h"

static void adagrad_tile(float *restrict p, const float *restrict g, float *restrict sum, int64_t len,
                         float lr, float eps, float wd) {
    DSC_SIMD_LOOP
    for (int64_t i = 0; i < len; i++) {
        float grad = g[i] + wd * p[i];
        float si = sum[i] + grad * grad;
        p[i] = p[i] - lr * (grad / (sqrtf(si) + eps));
        sum[i] = si;
    }
}

int dsc_cpu_adagrad_step(dsc_opt_tensor *tensors, int64_t n, const dsc_adagrad_hparams *hp) {
    const float lr = (float)hp->lr, eps = (float)hp->eps, wd = (float)hp->weight_decay;
    dsc_tile_map map;
    if (dsc_tile_map_init(&map, &tensors[0].numel, sizeof(dsc_opt_tensor), n) < 0) return -1;
    DSC_FOR_EACH_TILE(tensors, n, map, {
        (void)ts1;
        float *p = dsc_load_tile(&t->param, start, len, tp);
        float *g = dsc_load_tile(&t->grad, start, len, tg);
        float *sum = dsc_load_tile(&t->state0, start, len, ts0);
        adagrad_tile(p, g, sum, len, lr, eps, wd);
        dsc_store_tile(&t->param, start, len, p);
        dsc_store_tile(&t->state0, start, len, sum);
        if (t->copy.data) dsc_store_tile(&t->copy, start, len, p);
    })
    free(map.first_tile);
    return 0;
}
