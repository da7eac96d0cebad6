/* Adam / AdamW on the CPU. Per element, in fp32 (the update rule of torch.optim.Adam/AdamW):
 *   g  = grad * grad_scale (+ weight_decay * p in Adam mode)
 *   m  = beta1 * m + (1 - beta1) * g
 *   v  = beta2 * v + (1 - beta2) * g * g
 *   p  = p * (1 - lr * weight_decay) in AdamW mode
 *   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)      bc_i = 1 - beta_i^step
 * The per-step scalars are computed once in double. Every operand is read once and written
 * once, widened and narrowed in registers, and the optional low-precision copy of the updated
 * parameter is written in the same pass (the ZeRO-Offload hot path). */
#include <math.h>

#include "dsc/cpu_optim.h"
#include "dsc/cpu_simd.h"
#include "dsc/cpu_walk.h"

typedef struct {
    dsc_vf b1, omb1, b2, omb2, eps, step_size, inv_sqrt_bc2, decay, l2, gscale;
    int use_l2, use_gscale;
} adam_consts;

static adam_consts adam_prepare(const dsc_adam_hparams *hp) {
    double bc1 = 1.0, bc2 = 1.0;
    if (hp->bias_correction) {
        bc1 = 1.0 - pow(hp->beta1, (double)hp->step);
        bc2 = 1.0 - pow(hp->beta2, (double)hp->step);
    }
    adam_consts k;
    k.b1 = dsc_vset1((float)hp->beta1);
    k.omb1 = dsc_vset1((float)(1.0 - hp->beta1));
    k.b2 = dsc_vset1((float)hp->beta2);
    k.omb2 = dsc_vset1((float)(1.0 - hp->beta2));
    k.eps = dsc_vset1((float)hp->eps);
    k.step_size = dsc_vset1((float)(hp->lr / bc1));
    k.inv_sqrt_bc2 = dsc_vset1((float)(1.0 / sqrt(bc2)));
    k.decay = dsc_vset1(hp->adamw_mode ? (float)(1.0 - hp->lr * hp->weight_decay) : 1.0f);
    k.l2 = dsc_vset1((float)hp->weight_decay);
    k.use_l2 = !hp->adamw_mode && hp->weight_decay != 0.0;
    /* an fp32 multiply, as torch's grad.float().mul_(coef) does: the same bits as scaling a copy first */
    k.gscale = dsc_vset1((float)hp->grad_scale);
    k.use_gscale = (float)hp->grad_scale != 1.0f;
    return k;
}

#define NO_COPY (-1)

/* DSC_VW elements starting at i. The dtype arguments are constants in the specialised
 * variants below, so every load/store branch folds away there. */
/* Reads P, M, V and writes the updated values to PO, MO, VO: the same pointers for the in-place step,
 * other buffers for SuperOffload's speculative step (the inputs stay as they were: a rollback is free). */
DSC_INLINE void adam_lanes(const void *P, const void *G, const void *M, const void *V, void *PO, void *MO, void *VO,
                           void *C, int64_t i, const adam_consts *k, int32_t pd, int32_t gd, int32_t md, int32_t vd,
                           int32_t cd, int nt) {
    dsc_vf p = dsc_vload(P, pd, i), g = dsc_vload(G, gd, i);
    dsc_vf m = dsc_vload(M, md, i), v = dsc_vload(V, vd, i);
    if (k->use_gscale) g = dsc_vmul(g, k->gscale);
    if (k->use_l2) g = dsc_vadd(g, dsc_vmul(k->l2, p));
    m = dsc_vadd(dsc_vmul(k->b1, m), dsc_vmul(k->omb1, g));
    v = dsc_vadd(dsc_vmul(k->b2, v), dsc_vmul(dsc_vmul(k->omb2, g), g));
    dsc_vf denom = dsc_vadd(dsc_vmul(dsc_vsqrt(v), k->inv_sqrt_bc2), k->eps);
    p = dsc_vsub(dsc_vmul(p, k->decay), dsc_vmul(k->step_size, dsc_vdiv(m, denom)));
    if (nt) { /* out of place, all fp32, aligned: the outputs bypass the caches (adam_range) */
        dsc_vstream_f32(PO, i, p);
        dsc_vstream_f32(MO, i, m);
        dsc_vstream_f32(VO, i, v);
    } else {
        dsc_vstore(PO, pd, i, p);
        dsc_vstore(MO, md, i, m);
        dsc_vstore(VO, vd, i, v);
    }
    if (cd != NO_COPY) dsc_vstore(C, cd, i, dsc_vround(p, pd)); /* the copy is the stored param, converted */
}

/* rem (< DSC_VW) elements from i through padded lane buffers: the vector arithmetic, ordinary stores */
DSC_INLINE void adam_part(const dsc_opt_tensor *t, const dsc_opt_tensor *o, int64_t i, int64_t rem,
                          const adam_consts *kp, int32_t pd, int32_t gd, int32_t md, int32_t vd, int32_t cd) {
    const adam_consts k = *kp;
    {
        dsc_lane_buf bp, bg, bm, bv, bc;
        dsc_operand p = dsc_tail_in(&bp, &t->param, i, rem), g = dsc_tail_in(&bg, &t->grad, i, rem);
        dsc_operand m = dsc_tail_in(&bm, &t->state0, i, rem), v = dsc_tail_in(&bv, &t->state1, i, rem);
        dsc_operand c = dsc_tail_in(&bc, &t->copy, i, rem);
        adam_lanes(p.data, g.data, m.data, v.data, p.data, m.data, v.data, c.data, 0, &k, pd, gd, md, vd, cd, 0);
        dsc_tail_out(&o->param, &bp, i, rem);
        dsc_tail_out(&o->state0, &bm, i, rem);
        dsc_tail_out(&o->state1, &bv, i, rem);
        dsc_tail_out(&t->copy, &bc, i, rem);
    }
}

DSC_INLINE void adam_range(const dsc_opt_tensor *t, const dsc_opt_tensor *o, int64_t i, int64_t end,
                           const adam_consts *kp, int32_t pd, int32_t gd, int32_t md, int32_t vd, int32_t cd) {
    const adam_consts k = *kp;
    const void *P = t->param.data, *M = t->state0.data, *V = t->state1.data;
    void *PO = o->param.data, *MO = o->state0.data, *VO = o->state1.data, *C = t->copy.data;
    const void *G = t->grad.data;
    /* SuperOffload's out-of-place step writes 12 bytes a parameter to buffers not in cache: streaming stores
     * spare the read of each line before its write. The first elements up to the outputs' alignment go through
     * the padded-lane path (same arithmetic, same bits), the aligned body streams. */
    int nt = PO != P && MO != M && VO != V && pd == DSC_CPU_F32 && md == DSC_CPU_F32 && vd == DSC_CPU_F32 &&
             DSC_VW > 1;
    if (nt) {
        uintptr_t a = (uintptr_t)((float *)PO + i);
        nt = (a % 4 == 0) && (a % DSC_STREAM_ALIGN) == ((uintptr_t)((float *)MO + i) % DSC_STREAM_ALIGN) &&
             (a % DSC_STREAM_ALIGN) == ((uintptr_t)((float *)VO + i) % DSC_STREAM_ALIGN);
        if (nt) {
            int64_t head = (int64_t)(((DSC_STREAM_ALIGN - a % DSC_STREAM_ALIGN) % DSC_STREAM_ALIGN) / 4);
            if (head > end - i) head = end - i;
            if (head > 0) adam_part(t, o, i, head, &k, pd, gd, md, vd, cd);
            i += head;
        }
    }
    if (nt) {
        for (; i + DSC_VW <= end; i += DSC_VW) adam_lanes(P, G, M, V, PO, MO, VO, C, i, &k, pd, gd, md, vd, cd, 1);
        dsc_vstream_fence();
    } else {
        for (; i + DSC_VW <= end; i += DSC_VW) adam_lanes(P, G, M, V, PO, MO, VO, C, i, &k, pd, gd, md, vd, cd, 0);
    }
    if (i < end) adam_part(t, o, i, end - i, &k, pd, gd, md, vd, cd);
}

typedef void (*adam_fn)(const dsc_opt_tensor *, const dsc_opt_tensor *, int64_t, int64_t, const adam_consts *);

/* (param, grad, states, copy) combinations with their own compiled loop; others take the
 * generic loop, which is as exact and branches per vector on the dtypes. */
#define DT_F32 DSC_CPU_F32
#define DT_BF16 DSC_CPU_BF16
#define DT_F16 DSC_CPU_F16
#define DT_NONE NO_COPY
#define ADAM_VARIANTS(X)                                                                                  \
    X(F32, F32, F32, NONE)    /* fp32 Adam */                                                            \
    X(F32, F32, F32, BF16)    /* fp32 master and grads, 16-bit model copy */                              \
    X(F32, F32, F32, F16)                                                                                 \
    X(F32, BF16, F32, NONE)                                                                               \
    X(F32, BF16, F32, BF16)   /* ZeRO-Offload: fp32 master, 16-bit grads read directly, 16-bit copy */   \
    X(F32, F16, F32, NONE)                                                                                \
    X(F32, F16, F32, F16)                                                                                 \
    X(F32, BF16, BF16, NONE)  /* fp32 master with bf16 states (20 bytes per parameter) */                 \
    X(F32, BF16, BF16, BF16)                                                                              \
    X(F32, F32, BF16, NONE)                                                                               \
    X(BF16, BF16, F32, NONE)  /* a bf16 model stepped on the CPU */                                       \
    X(BF16, BF16, BF16, NONE)                                                                             \
    X(F16, F16, F32, NONE)                                                                                \
    X(F16, F16, F16, NONE)

#define ADAM_DEFINE(P, G, S, C)                                                                          \
    static void adam_##P##_##G##_##S##_##C(const dsc_opt_tensor *t, const dsc_opt_tensor *o, int64_t i, int64_t e, \
                                           const adam_consts *k) {                                       \
        adam_range(t, o, i, e, k, DT_##P, DT_##G, DT_##S, DT_##S, DT_##C);                               \
    }
ADAM_VARIANTS(ADAM_DEFINE)

static void adam_generic(const dsc_opt_tensor *t, const dsc_opt_tensor *o, int64_t i, int64_t e,
                         const adam_consts *k) {
    adam_range(t, o, i, e, k, t->param.dtype, t->grad.dtype, t->state0.dtype, t->state1.dtype,
               t->copy.data ? t->copy.dtype : NO_COPY);
}

static adam_fn adam_pick(const dsc_opt_tensor *t) {
    int32_t c = t->copy.data ? t->copy.dtype : NO_COPY;
    if (t->state0.dtype != t->state1.dtype) return adam_generic;
#define ADAM_MATCH(P, G, S, C)                                                                           \
    if (t->param.dtype == DT_##P && t->grad.dtype == DT_##G && t->state0.dtype == DT_##S && c == DT_##C) \
        return adam_##P##_##G##_##S##_##C;
    ADAM_VARIANTS(ADAM_MATCH)
    return adam_generic;
}

int dsc_cpu_adam_step_into(dsc_opt_tensor *tensors, const dsc_opt_tensor *outs, int64_t n,
                           const dsc_adam_hparams *hp) {
    const adam_consts k = adam_prepare(hp);
    dsc_chunk_map map;
    if (dsc_chunk_map_init(&map, &tensors[0].numel, sizeof(dsc_opt_tensor), n) < 0) return -1;
#define NUMEL(ti) tensors[ti].numel
    DSC_FOR_EACH_CHUNK(map, NUMEL, { adam_pick(&tensors[ti])(&tensors[ti], &outs[ti], start, end, &k); })
#undef NUMEL
    dsc_chunk_map_free(&map);
    return 0;
}

int dsc_cpu_adam_step(dsc_opt_tensor *tensors, int64_t n, const dsc_adam_hparams *hp) {
    return dsc_cpu_adam_step_into(tensors, tensors, n, hp);
}
