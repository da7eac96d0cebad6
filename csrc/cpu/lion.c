/* Lion on the CPU (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"):
 *   c  = beta1 * m + (1 - beta1) * g
 *   p  = p * (1 - lr * weight_decay) - lr * sign(c)        sign(0) = 0, as torch.sign
 *   m  = beta2 * m + (1 - beta2) * g */
#include "cpu_tiles.h"
#include "dsc/cpu_optim.h"

static void lion_tile(float *restrict p, const float *restrict g, float *restrict m, int64_t len, float lr,
                      float decay, float b1, float omb1, float b2, float omb2) {
    DSC_SIMD_LOOP
    for (int64_t i = 0; i < len; i++) {
        float c = b1 * m[i] + omb1 * g[i];
        float sign = (float)(c > 0.0f) - (float)(c < 0.0f);
        p[i] = p[i] * decay - lr * sign;
        m[i] = b2 * m[i] + omb2 * g[i];
    }
}

int dsc_cpu_lion_step(dsc_opt_tensor *tensors, int64_t n, const dsc_lion_hparams *hp) {
    const float lr = (float)hp->lr, decay = (float)(1.0 - hp->lr * hp->weight_decay);
    const float b1 = (float)hp->beta1, omb1 = (float)(1.0 - hp->beta1);
    const float b2 = (float)hp->beta2, omb2 = (float)(1.0 - hp->beta2);
    dsc_tile_map map;
    if (dsc_tile_map_init(&map, &tensors[0].numel, sizeof(dsc_opt_tensor), n) < 0) return -1;
    DSC_FOR_EACH_TILE(tensors, n, map, {
        (void)ts1;
        float *p = dsc_load_tile(&t->param, start, len, tp);
        float *g = dsc_load_tile(&t->grad, start, len, tg);
        float *m = dsc_load_tile(&t->state0, start, len, ts0);
        lion_tile(p, g, m, len, lr, decay, b1, omb1, b2, omb2);
        dsc_store_tile(&t->param, start, len, p);
        dsc_store_tile(&t->state0, start, len, m);
        if (t->copy.data) dsc_store_tile(&t->copy, start, len, p);
    })
    free(map.first_tile);
    return 0;
}
