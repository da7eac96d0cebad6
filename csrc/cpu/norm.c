/* Multi-tensor sum of squares with inf/nan detection, and in-place scale: the engine's CPU path
 * for global-norm clipping and fp16 unscale. Squares accumulate in double (an fp32 square of a
 * large gradient would overflow where the norm itself does not). */
#include "dsc/cpu_optim.h"
#include "dsc/cpu_simd.h"
#include "dsc/cpu_walk.h"

DSC_INLINE double sumsq_range(const dsc_operand *op, int64_t i, int64_t end, int32_t dt, int *nonfinite) {
    dsc_vd acc0 = dsc_vd_zero(), acc1 = dsc_vd_zero();
    int bad = 0;
    for (; i + DSC_VW <= end; i += DSC_VW) {
        dsc_vf x = dsc_vload(op->data, dt, i);
        dsc_vsumsq(x, &acc0, &acc1);
        bad |= dsc_vnonfinite(x);
    }
    if (i < end) { /* zero padding adds nothing and is finite */
        dsc_lane_buf buf;
        dsc_operand t = dsc_tail_in(&buf, op, i, end - i);
        dsc_vf x = dsc_vload(t.data, dt, 0);
        dsc_vsumsq(x, &acc0, &acc1);
        bad |= dsc_vnonfinite(x);
    }
    *nonfinite = bad != 0;
    return dsc_vd_sum(acc0) + dsc_vd_sum(acc1);
}

static double sumsq_f32(const dsc_operand *op, int64_t i, int64_t e, int *bad) {
    return sumsq_range(op, i, e, DSC_CPU_F32, bad);
}
static double sumsq_bf16(const dsc_operand *op, int64_t i, int64_t e, int *bad) {
    return sumsq_range(op, i, e, DSC_CPU_BF16, bad);
}
static double sumsq_f16(const dsc_operand *op, int64_t i, int64_t e, int *bad) {
    return sumsq_range(op, i, e, DSC_CPU_F16, bad);
}

int dsc_cpu_sumsq(const dsc_operand *tensors, const int64_t *numels, int64_t n, double *sumsq,
                  int *found_nonfinite) {
    dsc_chunk_map map;
    if (dsc_chunk_map_init(&map, numels, sizeof(int64_t), n) < 0) return -1;
    double total = 0.0;
    int bad = 0;
#define NUMEL(ti) numels[ti]
#pragma omp parallel for schedule(static) reduction(+ : total) reduction(| : bad) if (map.total > 1)
    for (int64_t chunk = 0; chunk < map.total; chunk++) {
        int64_t ti = dsc_chunk_owner(&map, chunk);
        int64_t start = (chunk - map.first_chunk[ti]) * DSC_CHUNK;
        int64_t end = NUMEL(ti) - start < DSC_CHUNK ? NUMEL(ti) : start + DSC_CHUNK;
        const dsc_operand *op = &tensors[ti];
        int nonfinite;
        total += (op->dtype == DSC_CPU_F32    ? sumsq_f32
                  : op->dtype == DSC_CPU_BF16 ? sumsq_bf16
                                              : sumsq_f16)(op, start, end, &nonfinite);
        bad |= nonfinite;
    }
#undef NUMEL
    dsc_chunk_map_free(&map);
    *sumsq = total;
    *found_nonfinite = bad;
    return 0;
}

DSC_INLINE void scale_range(const dsc_operand *op, int64_t i, int64_t end, int32_t dt, dsc_vf f) {
    for (; i + DSC_VW <= end; i += DSC_VW) dsc_vstore(op->data, dt, i, dsc_vmul(dsc_vload(op->data, dt, i), f));
    if (i < end) {
        dsc_lane_buf buf;
        dsc_operand t = dsc_tail_in(&buf, op, i, end - i);
        dsc_vstore(t.data, dt, 0, dsc_vmul(dsc_vload(t.data, dt, 0), f));
        dsc_tail_out(op, &buf, i, end - i);
    }
}

static void scale_f32(const dsc_operand *op, int64_t i, int64_t e, dsc_vf f) { scale_range(op, i, e, DSC_CPU_F32, f); }
static void scale_bf16(const dsc_operand *op, int64_t i, int64_t e, dsc_vf f) { scale_range(op, i, e, DSC_CPU_BF16, f); }
static void scale_f16(const dsc_operand *op, int64_t i, int64_t e, dsc_vf f) { scale_range(op, i, e, DSC_CPU_F16, f); }

int dsc_cpu_scale(const dsc_operand *tensors, const int64_t *numels, int64_t n, float factor) {
    dsc_chunk_map map;
    if (dsc_chunk_map_init(&map, numels, sizeof(int64_t), n) < 0) return -1;
    const dsc_vf f = dsc_vset1(factor);
#define NUMEL(ti) numels[ti]
    DSC_FOR_EACH_CHUNK(map, NUMEL, {
        const dsc_operand *op = &tensors[ti];
        (op->dtype == DSC_CPU_F32 ? scale_f32 : op->dtype == DSC_CPU_BF16 ? scale_bf16 : scale_f16)(op, start, end, f);
    })
#undef NUMEL
    dsc_chunk_map_free(&map);
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
