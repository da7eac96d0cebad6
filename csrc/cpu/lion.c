/* Lion on the CPU (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"):
 *   c  = beta1 * m + (1 - beta1) * g
 *   p  = p * (1 - lr * weight_decay) - lr * sign(c)        sign as torch.sign (0 -> 0)
 *   m  = beta2 * m + (1 - beta2) * g
 * One pass over memory, 16-bit operands widened and narrowed in registers, optional 16-bit
 * copy of the updated parameter written in the same pass. */
#include "dsc/cpu_optim.h"
#include "dsc/cpu_simd.h"
#include "dsc/cpu_walk.h"

typedef struct {
    dsc_vf lr, decay, b1, omb1, b2, omb2;
} lion_consts;

#define NO_COPY (-1)

DSC_INLINE void lion_lanes(void *P, const void *G, void *M, void *C, int64_t i, const lion_consts *k, int32_t pd,
                           int32_t gd, int32_t md, int32_t cd) {
    dsc_vf p = dsc_vload(P, pd, i), g = dsc_vload(G, gd, i), m = dsc_vload(M, md, i);
    dsc_vf c = dsc_vadd(dsc_vmul(k->b1, m), dsc_vmul(k->omb1, g));
    p = dsc_vsub(dsc_vmul(p, k->decay), dsc_vmul(k->lr, dsc_vsign(c)));
    m = dsc_vadd(dsc_vmul(k->b2, m), dsc_vmul(k->omb2, g));
    dsc_vstore(P, pd, i, p);
    dsc_vstore(M, md, i, m);
    if (cd != NO_COPY) dsc_vstore(C, cd, i, dsc_vround(p, pd)); /* the copy is the stored param, converted */
}

DSC_INLINE void lion_range(const dsc_opt_tensor *t, int64_t i, int64_t end, const lion_consts *kp, int32_t pd,
                           int32_t gd, int32_t md, int32_t cd) {
    const lion_consts k = *kp;
    void *P = t->param.data, *M = t->state0.data, *C = t->copy.data;
    const void *G = t->grad.data;
    for (; i + DSC_VW <= end; i += DSC_VW) lion_lanes(P, G, M, C, i, &k, pd, gd, md, cd);
    if (i < end) {
        int64_t rem = end - i;
        dsc_lane_buf bp, bg, bm, bc;
        dsc_operand p = dsc_tail_in(&bp, &t->param, i, rem), g = dsc_tail_in(&bg, &t->grad, i, rem);
        dsc_operand m = dsc_tail_in(&bm, &t->state0, i, rem), c = dsc_tail_in(&bc, &t->copy, i, rem);
        lion_lanes(p.data, g.data, m.data, c.data, 0, &k, pd, gd, md, cd);
        dsc_tail_out(&t->param, &bp, i, rem);
        dsc_tail_out(&t->state0, &bm, i, rem);
        dsc_tail_out(&t->copy, &bc, i, rem);
    }
}

static void lion_f32(const dsc_opt_tensor *t, int64_t i, int64_t e, const lion_consts *k) {
    lion_range(t, i, e, k, DSC_CPU_F32, DSC_CPU_F32, DSC_CPU_F32, NO_COPY);
}

static void lion_generic(const dsc_opt_tensor *t, int64_t i, int64_t e, const lion_consts *k) {
    lion_range(t, i, e, k, t->param.dtype, t->grad.dtype, t->state0.dtype, t->copy.data ? t->copy.dtype : NO_COPY);
}

int dsc_cpu_lion_step(dsc_opt_tensor *tensors, int64_t n, const dsc_lion_hparams *hp) {
    lion_consts k;
    k.lr = dsc_vset1((float)hp->lr);
    k.decay = dsc_vset1((float)(1.0 - hp->lr * hp->weight_decay));
    k.b1 = dsc_vset1((float)hp->beta1);
    k.omb1 = dsc_vset1((float)(1.0 - hp->beta1));
    k.b2 = dsc_vset1((float)hp->beta2);
    k.omb2 = dsc_vset1((float)(1.0 - hp->beta2));
    dsc_chunk_map map;
    if (dsc_chunk_map_init(&map, &tensors[0].numel, sizeof(dsc_opt_tensor), n) < 0) return -1;
#define NUMEL(ti) tensors[ti].numel
    DSC_FOR_EACH_CHUNK(map, NUMEL, {
        const dsc_opt_tensor *t = &tensors[ti];
        int all_f32 = t->param.dtype == DSC_CPU_F32 && t->grad.dtype == DSC_CPU_F32 &&
                      t->state0.dtype == DSC_CPU_F32 && !t->copy.data;
        (all_f32 ? lion_f32 : lion_generic)(t, start, end, &k);
    })
#undef NUMEL
    dsc_chunk_map_free(&map);
    return 0;
}
