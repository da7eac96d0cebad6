/* Adagrad on the CPU (torch.optim.Adagrad's rule with lr_decay 0):
 *   g    = grad (+ weight_decay * p)
 *   sum += g * g
 *   p   -= lr * g / (sqrt(sum) + eps)
 * One pass over memory, 16-bit operands widened and narrowed in registers, optional 16-bit
 * copy of the updated parameter written in the same pass. */
#include "dsc/cpu_optim.h"
#include "dsc/cpu_simd.h"
#include "dsc/cpu_walk.h"

typedef struct {
    dsc_vf lr, eps, wd;
    int use_wd;
} adagrad_consts;

#define NO_COPY (-1)

DSC_INLINE void adagrad_lanes(void *P, const void *G, void *S, void *C, int64_t i, const adagrad_consts *k,
                              int32_t pd, int32_t gd, int32_t sd, int32_t cd) {
    dsc_vf p = dsc_vload(P, pd, i), g = dsc_vload(G, gd, i), s = dsc_vload(S, sd, i);
    if (k->use_wd) g = dsc_vadd(g, dsc_vmul(k->wd, p));
    s = dsc_vadd(s, dsc_vmul(g, g));
    p = dsc_vsub(p, dsc_vmul(k->lr, dsc_vdiv(g, dsc_vadd(dsc_vsqrt(s), k->eps))));
    dsc_vstore(P, pd, i, p);
    dsc_vstore(S, sd, i, s);
    if (cd != NO_COPY) dsc_vstore(C, cd, i, dsc_vround(p, pd)); /* the copy is the stored param, converted */
}

DSC_INLINE void adagrad_range(const dsc_opt_tensor *t, int64_t i, int64_t end, const adagrad_consts *kp,
                              int32_t pd, int32_t gd, int32_t sd, int32_t cd) {
    const adagrad_consts k = *kp;
    void *P = t->param.data, *S = t->state0.data, *C = t->copy.data;
    const void *G = t->grad.data;
    for (; i + DSC_VW <= end; i += DSC_VW) adagrad_lanes(P, G, S, C, i, &k, pd, gd, sd, cd);
    if (i < end) {
        int64_t rem = end - i;
        dsc_lane_buf bp, bg, bs, bc;
        dsc_operand p = dsc_tail_in(&bp, &t->param, i, rem), g = dsc_tail_in(&bg, &t->grad, i, rem);
        dsc_operand s = dsc_tail_in(&bs, &t->state0, i, rem), c = dsc_tail_in(&bc, &t->copy, i, rem);
        adagrad_lanes(p.data, g.data, s.data, c.data, 0, &k, pd, gd, sd, cd);
        dsc_tail_out(&t->param, &bp, i, rem);
        dsc_tail_out(&t->state0, &bs, i, rem);
        dsc_tail_out(&t->copy, &bc, i, rem);
    }
}

static void adagrad_f32(const dsc_opt_tensor *t, int64_t i, int64_t e, const adagrad_consts *k) {
    adagrad_range(t, i, e, k, DSC_CPU_F32, DSC_CPU_F32, DSC_CPU_F32, NO_COPY);
}

static void adagrad_generic(const dsc_opt_tensor *t, int64_t i, int64_t e, const adagrad_consts *k) {
    adagrad_range(t, i, e, k, t->param.dtype, t->grad.dtype, t->state0.dtype, t->copy.data ? t->copy.dtype : NO_COPY);
}

int dsc_cpu_adagrad_step(dsc_opt_tensor *tensors, int64_t n, const dsc_adagrad_hparams *hp) {
    adagrad_consts k;
    k.lr = dsc_vset1((float)hp->lr);
    k.eps = dsc_vset1((float)hp->eps);
    k.wd = dsc_vset1((float)hp->weight_decay);
    k.use_wd = hp->weight_decay != 0.0;
    dsc_chunk_map map;
    if (dsc_chunk_map_init(&map, &tensors[0].numel, sizeof(dsc_opt_tensor), n) < 0) return -1;
#define NUMEL(ti) tensors[ti].numel
    DSC_FOR_EACH_CHUNK(map, NUMEL, {
        const dsc_opt_tensor *t = &tensors[ti];
        int all_f32 = t->param.dtype == DSC_CPU_F32 && t->grad.dtype == DSC_CPU_F32 &&
                      t->state0.dtype == DSC_CPU_F32 && !t->copy.data;
        (all_f32 ? adagrad_f32 : adagrad_generic)(t, start, end, &k);
    })
#undef NUMEL
    dsc_chunk_map_free(&map);
    return 0;
}
