/* Pipeline schedules (contract in csrc/include/dsc/pipe_schedule.h). */
#include "dsc/pipe_schedule.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void set_err(char *err, size_t len, const char *fmt, ...) {
    if (!err || !len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
}

/* ---- growable plan ---------------------------------------------------------------------- */
typedef struct {
    dsc_pipe_instr *v;
    int64_t n, cap;
    int64_t *starts;
    int64_t steps, scap;
} emitter;

static int emit(emitter *e, int op, int64_t buf, int64_t mb, int64_t chunk) {
    if (e->n == e->cap) {
        int64_t cap = e->cap ? 2 * e->cap : 64;
        dsc_pipe_instr *v = realloc(e->v, sizeof *v * (size_t)cap);
        if (!v) return DSC_PS_ENOMEM;
        e->v = v;
        e->cap = cap;
    }
    dsc_pipe_instr *in = &e->v[e->n++];
    in->op = op;
    in->buffer_id = (int32_t)buf;
    in->micro_batch = (int32_t)mb;
    in->chunk = (int32_t)chunk;
    return DSC_PS_OK;
}

/* Closes the current step (its instructions are those emitted since the previous close). */
static int end_step(emitter *e) {
    if (e->steps + 2 > e->scap) {
        int64_t cap = e->scap ? 2 * e->scap : 64;
        int64_t *s = realloc(e->starts, sizeof *s * (size_t)cap);
        if (!s) return DSC_PS_ENOMEM;
        e->starts = s;
        e->scap = cap;
    }
    if (e->steps == 0) e->starts[0] = 0;
    e->starts[++e->steps] = e->n;
    return DSC_PS_OK;
}

static int emit_batch_end(emitter *e) {
    int rc = emit(e, DSC_OP_REDUCE_TIED_GRADS, -1, -1, -1);
    if (!rc) rc = emit(e, DSC_OP_REDUCE_GRADS, -1, -1, -1);
    if (!rc) rc = emit(e, DSC_OP_OPTIMIZER_STEP, -1, -1, -1);
    return rc;
}

#define TRY(x)                 \
    do {                       \
        int rc_ = (x);         \
        if (rc_) return rc_;   \
    } while (0)

static int64_t floordiv(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

/* ---- DeepSpeed's schedules ----------------------------------------------------------------- */
static int build_train(emitter *e, int64_t M, int64_t S, int64_t s, int64_t *nbuf_out) {
    int64_t nbuf = S - s < M ? S - s : M;
    if (nbuf < 2) nbuf = 2;
    *nbuf_out = nbuf;
    int64_t total = 2 * (M + S - 1), prev = -1;
    int has_prev_stage = s > 0, has_next_stage = s < S - 1;
    for (int64_t t = 0; t < total; t++) {
        /* Stages alternate forward and backward steps, even stages starting with a forward. */
        int fwd = ((t + s) % 2) == 0;
        int64_t mb = fwd ? floordiv(t, 2) - s / 2 : floordiv(t, 2) - S + 1 + s / 2;
        int cur_ok = mb >= 0 && mb < M, prev_ok = prev >= 0 && prev < M;
        if (fwd) {
            if (prev_ok && has_prev_stage) TRY(emit(e, DSC_OP_SEND_GRAD, prev % nbuf, prev, 0));
            if (cur_ok && has_prev_stage) TRY(emit(e, DSC_OP_RECV_ACTIVATION, mb % nbuf, mb, 0));
        } else {
            if (cur_ok && has_next_stage) TRY(emit(e, DSC_OP_RECV_GRAD, mb % nbuf, mb, 0));
            if (prev_ok && has_next_stage) TRY(emit(e, DSC_OP_SEND_ACTIVATION, prev % nbuf, prev, 0));
        }
        if ((s == 0 || s == S - 1) && fwd && cur_ok) TRY(emit(e, DSC_OP_LOAD_MICRO_BATCH, mb % nbuf, mb, 0));
        if (cur_ok) TRY(emit(e, fwd ? DSC_OP_FORWARD : DSC_OP_BACKWARD, mb % nbuf, mb, 0));
        if (t == total - 1) TRY(emit_batch_end(e));
        prev = mb;
        TRY(end_step(e));
    }
    return DSC_PS_OK;
}

static int build_inference(emitter *e, int64_t M, int64_t S, int64_t s) {
    int64_t total = M + S - 1;
    for (int64_t t = 0; t < total; t++) {
        int64_t mb = t - s;
        /* Two buffers in turn; neighbours use them in opposite phase so a send never overwrites
         * what the next receive fills. */
        int64_t recv_buf = (s % 2 == 0) ? t % 2 : (t + 1) % 2;
        int64_t send_buf = 1 - recv_buf;
        int cur_ok = mb >= 0 && mb < M, prev_ok = mb - 1 >= 0 && mb - 1 < M;
        if ((s == 0 || s == S - 1) && cur_ok) TRY(emit(e, DSC_OP_LOAD_MICRO_BATCH, recv_buf, mb, 0));
        if (s % 2 == 0) {
            if (s < S - 1 && prev_ok) TRY(emit(e, DSC_OP_SEND_ACTIVATION, send_buf, mb - 1, 0));
            if (s > 0 && cur_ok) TRY(emit(e, DSC_OP_RECV_ACTIVATION, recv_buf, mb, 0));
        } else {
            if (s > 0 && cur_ok) TRY(emit(e, DSC_OP_RECV_ACTIVATION, recv_buf, mb, 0));
            if (s < S - 1 && prev_ok) TRY(emit(e, DSC_OP_SEND_ACTIVATION, send_buf, mb - 1, 0));
        }
        if (cur_ok) TRY(emit(e, DSC_OP_FORWARD, recv_buf, mb, 0));
        TRY(end_step(e));
    }
    return DSC_PS_OK;
}

static int build_data_parallel(emitter *e, int64_t M) {
    for (int64_t t = 0; t < M; t++) {
        TRY(emit(e, DSC_OP_LOAD_MICRO_BATCH, 0, t, 0));
        TRY(emit(e, DSC_OP_FORWARD, 0, t, 0));
        TRY(emit(e, DSC_OP_BACKWARD, 0, t, 0));
        if (t == M - 1) {
            TRY(emit(e, DSC_OP_REDUCE_GRADS, -1, -1, -1));
            TRY(emit(e, DSC_OP_OPTIMIZER_STEP, -1, -1, -1));
        }
        TRY(end_step(e));
    }
    return DSC_PS_OK;
}

/* ---- order-based schedules (interleaved, ZB-H1) ------------------------------------------ */
enum { C_F = 0, C_B = 1, C_W = 2 };
typedef struct {
    int kind;
    int64_t mb, chunk;
} compute_op;

/* Stage s's compute order for interleaved 1F1B (n = 2 M V ops). */
static void interleaved_order(int64_t M, int64_t S, int64_t V, int64_t s, compute_op *ops) {
    int64_t total = M * V, group = S * V;
    int64_t warm = V == 1 ? S - s - 1 : 2 * (S - s - 1) + (V - 1) * S;
    if (warm > total) warm = total;
    int64_t n = 0, f = 0, b = 0;
#define PUSH_F()                                                          \
    do {                                                                  \
        int64_t w_ = f % group;                                           \
        ops[n].kind = C_F, ops[n].chunk = w_ / S;                         \
        ops[n].mb = (f / group) * S + w_ % S, n++, f++;                   \
    } while (0)
#define PUSH_B()                                                          \
    do {                                                                  \
        int64_t w_ = b % group;                                           \
        ops[n].kind = C_B, ops[n].chunk = V - 1 - w_ / S;                 \
        ops[n].mb = (b / group) * S + w_ % S, n++, b++;                   \
    } while (0)
    for (int64_t i = 0; i < warm; i++) PUSH_F();
    for (int64_t i = 0; i < total - warm; i++) {
        PUSH_F();
        PUSH_B();
    }
    while (b < total) PUSH_B();
#undef PUSH_F
#undef PUSH_B
}

/* ZB-H1 orders of all stages: a unit-time list schedule. ops is S x (3 M). */
static int zb_h1_orders(int64_t M, int64_t S, compute_op *ops) {
    const int64_t NEVER = INT64_MAX;
    size_t cells = (size_t)(S * M);
    int64_t *fdone = malloc(sizeof(int64_t) * cells), *bdone = malloc(sizeof(int64_t) * cells);
    int64_t *cnt = calloc((size_t)(4 * S), sizeof(int64_t)); /* nf, nb, nw, n per stage */
    if (!fdone || !bdone || !cnt) {
        free(fdone), free(bdone), free(cnt);
        return DSC_PS_ENOMEM;
    }
    for (size_t i = 0; i < cells; i++) fdone[i] = bdone[i] = NEVER;
    int64_t *nf = cnt, *nb = cnt + S, *nw = cnt + 2 * S, *n = cnt + 3 * S;
    /* every step runs at least one op somewhere while work remains (a stage can always run its
     * next B or W once its neighbours caught up), so 3 M S steps bound the loop; the guard turns a
     * violation into an error instead of a hang */
    int64_t bound = 3 * M * S + 2 * S + 8;
    for (int64_t t = 0;; t++) {
        if (t > bound) {
            free(fdone), free(bdone), free(cnt);
            return DSC_PS_EDEADLOCK;
        }
        int all_done = 1;
        for (int64_t r = 0; r < S; r++) all_done &= nw[r] == M;
        if (all_done) break;
        for (int64_t r = 0; r < S; r++) {
            int64_t lim = S - r, pend_w = nb[r] - nw[r];
            int op = -1;
            int64_t mb = 0;
            if (nb[r] < nf[r] && pend_w < lim) {
                int64_t dep = r == S - 1 ? fdone[r * M + nb[r]] : bdone[(r + 1) * M + nb[r]];
                if (dep <= t) op = C_B, mb = nb[r];
            }
            if (op < 0 && nf[r] < M && nf[r] - nb[r] < lim && pend_w < lim &&
                (r == 0 || fdone[(r - 1) * M + nf[r]] <= t))
                op = C_F, mb = nf[r];
            if (op < 0 && nw[r] < nb[r]) op = C_W, mb = nw[r];
            if (op < 0) continue;
            /* a unit op started at t is done at t + 1: visible to the others from step t + 1 */
            if (op == C_F) fdone[r * M + nf[r]++] = t + 1;
            else if (op == C_B) bdone[r * M + nb[r]++] = t + 1;
            else nw[r]++;
            compute_op *o = &ops[r * 3 * M + n[r]++];
            o->kind = op, o->mb = mb, o->chunk = 0;
        }
    }
    free(fdone), free(bdone), free(cnt);
    return DSC_PS_OK;
}

/* Expands a compute order into steps with their exchanges and buffers from a free list. */
static int expand_order(emitter *e, const compute_op *ops, int64_t n, int64_t M, int64_t S, int64_t V,
                        int64_t s, int split, int64_t *nbuf_out) {
    /* buffer of (chunk, micro-batch), and the free list as a flag per id (at most M V live) */
    int64_t *slot = malloc(sizeof(int64_t) * (size_t)(M * V));
    unsigned char *used = calloc((size_t)(M * V), 1);
    if (!slot || !used) {
        free(slot), free(used);
        return DSC_PS_ENOMEM;
    }
    int64_t peak = 0, live = 0, last_vs = S * V - 1;
    int rc = DSC_PS_OK;
    for (int64_t i = 0; i < n && !rc; i++) {
        const compute_op *o = &ops[i];
        int64_t vs = o->chunk * S + s, key = o->chunk * M + o->mb;
        if (o->kind == C_F) {
            int64_t id = 0;
            while (used[id]) id++;
            used[id] = 1, slot[key] = id;
            if (++live > peak) peak = live;
            if (vs > 0) rc = rc ? rc : emit(e, DSC_OP_RECV_ACTIVATION, id, o->mb, o->chunk);
            if (vs == 0 || vs == last_vs) rc = rc ? rc : emit(e, DSC_OP_LOAD_MICRO_BATCH, id, o->mb, o->chunk);
            rc = rc ? rc : emit(e, DSC_OP_FORWARD, id, o->mb, o->chunk);
            if (vs < last_vs) rc = rc ? rc : emit(e, DSC_OP_SEND_ACTIVATION, id, o->mb, o->chunk);
        } else if (o->kind == C_B) {
            int64_t id = slot[key];
            if (vs < last_vs) rc = rc ? rc : emit(e, DSC_OP_RECV_GRAD, id, o->mb, o->chunk);
            rc = rc ? rc : emit(e, split ? DSC_OP_BACKWARD_INPUT : DSC_OP_BACKWARD, id, o->mb, o->chunk);
            if (vs > 0) rc = rc ? rc : emit(e, DSC_OP_SEND_GRAD, id, o->mb, o->chunk);
            if (!split) used[id] = 0, live--;
        } else {
            int64_t id = slot[key];
            rc = rc ? rc : emit(e, DSC_OP_BACKWARD_WEIGHT, id, o->mb, o->chunk);
            used[id] = 0, live--;
        }
        if (!rc && i == n - 1) rc = emit_batch_end(e);
        if (!rc) rc = end_step(e);
    }
    free(slot), free(used);
    *nbuf_out = peak;
    return rc;
}

/* ---- public ---------------------------------------------------------------------------------- */
void dsc_pipe_plan_free(dsc_pipe_plan *plan) {
    if (!plan) return;
    free(plan->step_start);
    free(plan->instrs);
    memset(plan, 0, sizeof *plan);
}

static int check_args(int kind, int64_t M, int64_t S, int64_t s, int64_t V, char *err, size_t len) {
    if (kind < DSC_PIPE_TRAIN || kind > DSC_PIPE_ZB_H1) {
        set_err(err, len, "unknown schedule kind %d", kind);
        return DSC_PS_EINVAL;
    }
    if (M < 1) {
        set_err(err, len, "micro_batches must be >= 1, got %lld", (long long)M);
        return DSC_PS_EINVAL;
    }
    if (S < 1) {
        set_err(err, len, "stages must be >= 1, got %lld", (long long)S);
        return DSC_PS_EINVAL;
    }
    if (s < 0 || s >= S) {
        set_err(err, len, "stage_id must be in [0, %lld), got %lld", (long long)S, (long long)s);
        return DSC_PS_EINVAL;
    }
    if (V < 1 || (V > 1 && kind != DSC_PIPE_INTERLEAVED)) {
        set_err(err, len, "virtual_stages must be 1 (or >= 1 for the interleaved schedule), got %lld", (long long)V);
        return DSC_PS_EINVAL;
    }
    if (kind == DSC_PIPE_INTERLEAVED && M % S != 0) {
        set_err(err, len,
                "the interleaved schedule needs micro_batches (gradient_accumulation_steps) a multiple of "
                "the %lld stages, got %lld",
                (long long)S, (long long)M);
        return DSC_PS_EINVAL;
    }
    if (M > (1 << 24) || S > (1 << 16) || V > 1024 || M * V > (1 << 24) || M * S > (1 << 26)) {
        set_err(err, len, "micro_batches x stages x virtual_stages too large");
        return DSC_PS_EINVAL;
    }
    return DSC_PS_OK;
}

int dsc_pipe_plan_build(int kind, int64_t M, int64_t S, int64_t s, int64_t V, dsc_pipe_plan *out, char *err,
                        size_t err_len) {
    if (!out) return DSC_PS_EINVAL;
    memset(out, 0, sizeof *out);
    int rc = check_args(kind, M, S, s, V, err, err_len);
    if (rc) return rc;
    emitter e = {0};
    int64_t nbuf = 0;
    compute_op *ops = NULL;
    if (kind == DSC_PIPE_TRAIN) {
        rc = build_train(&e, M, S, s, &nbuf);
    } else if (kind == DSC_PIPE_INFERENCE) {
        rc = build_inference(&e, M, S, s);
        nbuf = 2;
    } else if (kind == DSC_PIPE_DATA_PARALLEL) {
        rc = build_data_parallel(&e, M);
        nbuf = 1;
    } else if (kind == DSC_PIPE_INTERLEAVED) {
        ops = malloc(sizeof *ops * (size_t)(2 * M * V));
        if (!ops) rc = DSC_PS_ENOMEM;
        if (!rc) {
            interleaved_order(M, S, V, s, ops);
            rc = expand_order(&e, ops, 2 * M * V, M, S, V, s, 0, &nbuf);
        }
    } else {
        ops = malloc(sizeof *ops * (size_t)(3 * M * S));
        if (!ops) rc = DSC_PS_ENOMEM;
        if (!rc) rc = zb_h1_orders(M, S, ops);
        if (rc == DSC_PS_EDEADLOCK) set_err(err, err_len, "ZB-H1 list scheduling made no progress (a bug)");
        if (!rc) rc = expand_order(&e, ops + s * 3 * M, 3 * M, M, S, 1, s, 1, &nbuf);
    }
    free(ops);
    if (rc) {
        free(e.v), free(e.starts);
        if (rc == DSC_PS_ENOMEM) set_err(err, err_len, "out of memory building the pipeline schedule");
        return rc;
    }
    out->num_steps = e.steps;
    out->num_instrs = e.n;
    out->num_buffers = nbuf;
    out->step_start = e.starts;
    out->instrs = e.v;
    return DSC_PS_OK;
}

/* ---- simulation ------------------------------------------------------------------------------ */
typedef struct {
    int32_t mb, chunk;
    double time;
} message;

typedef struct {
    message *q;
    int64_t head, tail;
} channel;

static double op_cost(int op, int64_t V) {
    switch (op) {
    case DSC_OP_FORWARD: case DSC_OP_BACKWARD_INPUT: case DSC_OP_BACKWARD_WEIGHT: return 1.0 / (double)V;
    case DSC_OP_BACKWARD: return 2.0 / (double)V;
    default: return 0.0;
    }
}

int dsc_pipe_simulate(int kind, int64_t M, int64_t S, int64_t V, double *makespan, double *bubble, char *err,
                      size_t err_len) {
    int rc = check_args(kind, M, S, 0, V, err, err_len);
    if (rc) return rc;
    dsc_pipe_plan *plans = calloc((size_t)S, sizeof *plans);
    int64_t *pc = calloc((size_t)S, sizeof(int64_t));
    double *clock = calloc((size_t)S, sizeof(double)), busy = 0.0;
    channel *ch = calloc((size_t)(2 * S), sizeof *ch); /* [2r]: activations r -> r+1, [2r+1]: grads r -> r-1 */
    if (!plans || !pc || !clock || !ch) rc = DSC_PS_ENOMEM;
    for (int64_t r = 0; r < S && !rc; r++) rc = dsc_pipe_plan_build(kind, M, S, r, V, &plans[r], err, err_len);
    for (int64_t c = 0; c < 2 * S && !rc; c++) {
        ch[c].q = malloc(sizeof(message) * (size_t)(M * V));
        if (!ch[c].q) rc = DSC_PS_ENOMEM;
    }
    int64_t done = 0;
    while (!rc && done < S) {
        int progressed = 0;
        done = 0;
        for (int64_t r = 0; r < S && !rc; r++) {
            const dsc_pipe_plan *p = &plans[r];
            while (pc[r] < p->num_instrs) {
                const dsc_pipe_instr *in = &p->instrs[pc[r]];
                if (in->op == DSC_OP_SEND_ACTIVATION || in->op == DSC_OP_SEND_GRAD) {
                    channel *c = &ch[2 * r + (in->op == DSC_OP_SEND_GRAD)];
                    if (c->tail == M * V) {
                        set_err(err, err_len, "stage %lld sends more than %lld messages", (long long)r, (long long)(M * V));
                        rc = DSC_PS_EDEADLOCK;
                        break;
                    }
                    c->q[c->tail++] = (message){in->micro_batch, in->chunk, clock[r]};
                } else if (in->op == DSC_OP_RECV_ACTIVATION || in->op == DSC_OP_RECV_GRAD) {
                    int grad = in->op == DSC_OP_RECV_GRAD;
                    int64_t src = grad ? (r + 1) % S : (r + S - 1) % S;
                    channel *c = &ch[2 * src + grad];
                    if (c->head == c->tail) break; /* blocked */
                    message m = c->q[c->head++];
                    /* the sender's virtual stage must be this one's neighbour */
                    int64_t vs_recv = (int64_t)in->chunk * S + r, vs_send = (int64_t)m.chunk * S + src;
                    if (m.mb != in->micro_batch || vs_send != vs_recv + (grad ? 1 : -1)) {
                        set_err(err, err_len,
                                "stage %lld received micro-batch %d of virtual stage %lld, expected micro-batch %d of %lld",
                                (long long)r, m.mb, (long long)vs_send, in->micro_batch,
                                (long long)(vs_recv + (grad ? 1 : -1)));
                        rc = DSC_PS_EDEADLOCK;
                        break;
                    }
                    if (m.time > clock[r]) clock[r] = m.time;
                } else {
                    double cost = op_cost(in->op, V);
                    clock[r] += cost;
                    busy += cost;
                }
                pc[r]++;
                progressed = 1;
            }
            done += pc[r] == p->num_instrs;
        }
        if (!rc && done < S && !progressed) {
            int64_t r = 0;
            while (pc[r] == plans[r].num_instrs) r++;
            set_err(err, err_len, "the stages cannot all finish: stage %lld waits at instruction %lld", (long long)r,
                    (long long)pc[r]);
            rc = DSC_PS_EDEADLOCK;
        }
    }
    if (!rc) {
        double span = 0.0;
        for (int64_t r = 0; r < S; r++) span = clock[r] > span ? clock[r] : span;
        *makespan = span;
        *bubble = span > 0 ? 1.0 - busy / ((double)S * span) : 0.0;
    }
    for (int64_t r = 0; plans && r < S; r++) dsc_pipe_plan_free(&plans[r]);
    for (int64_t c = 0; ch && c < 2 * S; c++) free(ch[c].q);
    free(plans), free(pc), free(clock), free(ch);
    if (rc == DSC_PS_ENOMEM) set_err(err, err_len, "out of memory simulating the pipeline schedule");
    return rc;
}
