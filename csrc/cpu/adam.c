/* Adam / AdamW on the CPU. Per element, in fp32 (the update rule of torch.optim.Adam/AdamW):
 *   g  = grad (+ weight_decay * p in Adam mode)
 *   m  = beta1 * m + (1 - beta1) * g
 *   v  = beta2 * v + (1 - beta2) * g * g
 *   p  = p * (1 - lr * weight_decay) in AdamW mode
 *   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)      bc_i = 1 - beta_i^step
 * The per-step scalars are computed once in double; the element loop is fp32 and vectorised
 * (sqrtf needs -fno-math-errno to vectorise). */
#include <math.h>

#include "cpu_tiles.h"
#include "dsc/cpu_optim.h"

typedef struct {
    float b1, one_minus_b1, b2, one_minus_b2, eps, step_size, inv_sqrt_bc2, decay_factor, l2;
} adam_scalars;

static adam_scalars adam_prepare(const dsc_adam_hparams *hp) {
    double bc1 = 1.0, bc2 = 1.0;
    if (hp->bias_correction) {
        bc1 = 1.0 - pow(hp->beta1, (double)hp->step);
        bc2 = 1.0 - pow(hp->beta2, (double)hp->step);
    }
    adam_scalars s;
    s.b1 = (float)hp->beta1;
    s.one_minus_b1 = (float)(1.0 - hp->beta1);
    s.b2 = (float)hp->beta2;
    s.one_minus_b2 = (float)(1.0 - hp->beta2);
    s.eps = (float)hp->eps;
    s.step_size = (float)(hp->lr / bc1);
    s.inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2));
    s.decay_factor = hp->adamw_mode ? (float)(1.0 - hp->lr * hp->weight_decay) : 1.0f;
    s.l2 = hp->adamw_mode ? 0.0f : (float)hp->weight_decay;
    return s;
}

static void adam_tile(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                      int64_t len, const adam_scalars *s) {
    const adam_scalars c = *s;
    DSC_SIMD_LOOP
    for (int64_t i = 0; i < len; i++) {
        float grad = g[i] + c.l2 * p[i];
        float mi = c.b1 * m[i] + c.one_minus_b1 * grad;
        float vi = c.b2 * v[i] + c.one_minus_b2 * grad * grad;
        float denom = sqrtf(vi) * c.inv_sqrt_bc2 + c.eps;
        p[i] = p[i] * c.decay_factor - c.step_size * (mi / denom);
        m[i] = mi;
        v[i] = vi;
    }
}

/* Hot dtype combinations get one fused loop that widens and narrows in registers (bf16 <-> fp32
 * is integer shifts, so the loop still vectorises) instead of separate tile passes. */
#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)
#define FUSED_ADAM(NAME, PT, PLOAD, PSTORE, ST, SLOAD, SSTORE)                                        \
    static void NAME(const dsc_opt_tensor *t, int64_t start, int64_t len, const adam_scalars *s) {   \
        PT *restrict p = (PT *)t->param.data + start;                                                \
        const uint16_t *restrict g = (const uint16_t *)t->grad.data + start;                         \
        ST *restrict m = (ST *)t->state0.data + start;                                               \
        ST *restrict v = (ST *)t->state1.data + start;                                               \
        uint16_t *restrict c = t->copy.data ? (uint16_t *)t->copy.data + start : NULL;               \
        const adam_scalars k = *s;                                                                   \
        /* `c` is loop-invariant: -O3 unswitches the branch and vectorises both versions */        \
        DSC_SIMD_LOOP                                                                                \
        for (int64_t i = 0; i < len; i++) {                                                          \
            float pi = PLOAD(p[i]), grad = dsc_bf16_to_f32(g[i]) + k.l2 * pi;                        \
            float mi = k.b1 * SLOAD(m[i]) + k.one_minus_b1 * grad;                                   \
            float vi = k.b2 * SLOAD(v[i]) + k.one_minus_b2 * grad * grad;                            \
            pi = pi * k.decay_factor - k.step_size * (mi / (sqrtf(vi) * k.inv_sqrt_bc2 + k.eps));   \
            p[i] = PSTORE(pi);                                                                       \
            m[i] = SSTORE(mi);                                                                       \
            v[i] = SSTORE(vi);                                                                       \
            if (c) c[i] = dsc_f32_to_bf16(pi);                                                       \
        }                                                                                            \
    }

/* bf16 params + bf16 grads + fp32 states (a bf16 model on the CPU) */
FUSED_ADAM(adam_bf16p_f32s, uint16_t, dsc_bf16_to_f32, dsc_f32_to_bf16, float, F32_LOAD, F32_STORE)
/* fp32 master + bf16 grads + fp32 states (+ bf16 copy): the ZeRO-Offload hot path */
FUSED_ADAM(adam_f32p_f32s, float, F32_LOAD, F32_STORE, float, F32_LOAD, F32_STORE)
/* fp32 master + bf16 grads + bf16 states (+ bf16 copy): the 20-bytes-per-parameter variant */
FUSED_ADAM(adam_f32p_bf16s, float, F32_LOAD, F32_STORE, uint16_t, dsc_bf16_to_f32, dsc_f32_to_bf16)

typedef void (*fused_fn)(const dsc_opt_tensor *, int64_t, int64_t, const adam_scalars *);

/* The fused loop for this tensor's dtypes, or NULL for the general tile path. */
static fused_fn pick_fused(const dsc_opt_tensor *t) {
    if (t->grad.dtype != DSC_CPU_BF16 || t->state0.dtype != t->state1.dtype) return NULL;
    if (t->copy.data && t->copy.dtype != DSC_CPU_BF16) return NULL;
    if (t->param.dtype == DSC_CPU_BF16 && t->state0.dtype == DSC_CPU_F32 && !t->copy.data) return adam_bf16p_f32s;
    if (t->param.dtype == DSC_CPU_F32 && t->state0.dtype == DSC_CPU_F32) return adam_f32p_f32s;
    if (t->param.dtype == DSC_CPU_F32 && t->state0.dtype == DSC_CPU_BF16) return adam_f32p_bf16s;
    return NULL;
}

int dsc_cpu_adam_step(dsc_opt_tensor *tensors, int64_t n, const dsc_adam_hparams *hp) {
    adam_scalars s = adam_prepare(hp);
    dsc_tile_map map;
    if (dsc_tile_map_init(&map, &tensors[0].numel, sizeof(dsc_opt_tensor), n) < 0) return -1;
    DSC_FOR_EACH_TILE(tensors, n, map, {
        fused_fn fused = pick_fused(t);
        if (fused) {
            fused(t, start, len, &s);
            continue;
        }
        float *p = dsc_load_tile(&t->param, start, len, tp);
        float *g = dsc_load_tile(&t->grad, start, len, tg);
        float *m = dsc_load_tile(&t->state0, start, len, ts0);
        float *v = dsc_load_tile(&t->state1, start, len, ts1);
        adam_tile(p, g, m, v, len, &s);
        dsc_store_tile(&t->param, start, len, p);
        dsc_store_tile(&t->state0, start, len, m);
        dsc_store_tile(&t->state1, start, len, v);
        if (t->copy.data) dsc_store_tile(&t->copy, start, len, p);
    })
    free(map.first_tile);
    return 0;
}
