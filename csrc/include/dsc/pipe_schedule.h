/* Pipeline schedules: for one stage of a pipeline of `stages` ranks running `micro_batches`
 * micro-batches, the list of instructions of every step, and the balanced layer partition.
 *
 * Pure C, no Python, no CUDA. Every rank builds its own plan; plans of all stages are a
 * deterministic function of (kind, micro_batches, stages, virtual_stages), so their sends and
 * receives line up.
 *
 * Kinds.
 *   DSC_PIPE_TRAIN          DeepSpeed's synchronous 1F1B TrainSchedule: 2 * (M + S - 1) steps; on
 *                           step t, stage s runs a forward when t + s is even (micro-batch
 *                           t/2 - s/2), else a backward (micro-batch t/2 - S + 1 + s/2), integer
 *                           halves; the exchange with the neighbours precedes the compute; buffer
 *                           of micro-batch b is b mod max(2, min(S - s, M)); the last step ends
 *                           with ReduceTiedGrads, ReduceGrads, OptimizerStep.
 *   DSC_PIPE_INFERENCE      DeepSpeed's InferenceSchedule: M + S - 1 steps, two buffers used
 *                           alternately; even stages send before they receive, odd stages after.
 *   DSC_PIPE_DATA_PARALLEL  gradient accumulation without a pipeline: M steps of load, forward,
 *                           backward on buffer 0.
 *   DSC_PIPE_INTERLEAVED    1F1B over V model chunks per rank (virtual stage of chunk c on rank r
 *                           is c * S + r); warm-up of 2 (S - r - 1) + (V - 1) S forwards, then
 *                           forward/backward pairs, then the remaining backwards. Needs M a
 *                           multiple of S (micro-batches go through the chunks in groups of S).
 *   DSC_PIPE_ZB_H1          zero-bubble H1: backward split into an input-gradient pass (B, sent
 *                           upstream at once) and a weight-gradient pass (W) that fills the idle
 *                           slots. The order is the greedy unit-time list schedule of all stages
 *                           (each stage prefers B, then F, then W; at most S - s micro-batches
 *                           between F and B and S - s waiting for W, so activation memory stays
 *                           that of 1F1B plus one W-pending micro-batch).
 * Interleaved and ZB-H1 plans have one compute instruction per step (its receive before it, its
 * send after it) and take their buffer ids from a free list (a buffer is held from a micro-batch's
 * forward to its last backward pass on this stage), so num_buffers is the peak in flight.
 */
#ifndef DSC_PIPE_SCHEDULE_H
#define DSC_PIPE_SCHEDULE_H

#include <stddef.h>
#include <stdint.h>

enum dsc_pipe_kind {
    DSC_PIPE_TRAIN = 0,
    DSC_PIPE_INFERENCE = 1,
    DSC_PIPE_DATA_PARALLEL = 2,
    DSC_PIPE_INTERLEAVED = 3,
    DSC_PIPE_ZB_H1 = 4,
};

/* Opcodes (DeepSpeed's instruction classes, plus the split backward of ZB-H1). */
enum dsc_pipe_op {
    DSC_OP_LOAD_MICRO_BATCH = 0,
    DSC_OP_FORWARD = 1,
    DSC_OP_BACKWARD = 2,
    DSC_OP_SEND_ACTIVATION = 3,
    DSC_OP_RECV_ACTIVATION = 4,
    DSC_OP_SEND_GRAD = 5,
    DSC_OP_RECV_GRAD = 6,
    DSC_OP_REDUCE_TIED_GRADS = 7,
    DSC_OP_REDUCE_GRADS = 8,
    DSC_OP_OPTIMIZER_STEP = 9,
    DSC_OP_BACKWARD_INPUT = 10,
    DSC_OP_BACKWARD_WEIGHT = 11,
    DSC_OP_COUNT = 12,
};

enum {
    DSC_PS_OK = 0,
    DSC_PS_EINVAL = -1,   /* bad argument; err names it */
    DSC_PS_ENOMEM = -2,
    DSC_PS_EDEADLOCK = -3, /* simulate: the plans of the stages cannot all finish (a bug) */
};

/* One instruction. buffer_id, micro_batch and chunk are -1 where they do not apply (the reduce
 * and step instructions). A send carries the micro-batch it sends. */
typedef struct {
    int32_t op;
    int32_t buffer_id;
    int32_t micro_batch;
    int32_t chunk;
} dsc_pipe_instr;

typedef struct {
    int64_t num_steps;
    int64_t num_instrs;
    int64_t num_buffers;
    int64_t *step_start;   /* num_steps + 1 offsets into instrs */
    dsc_pipe_instr *instrs;
} dsc_pipe_plan;

/* Builds the plan of stage_id (0 <= stage_id < stages). virtual_stages >= 1 (only interleaved
 * uses more than 1). On success *out owns its arrays (free with dsc_pipe_plan_free). */
int dsc_pipe_plan_build(int kind, int64_t micro_batches, int64_t stages, int64_t stage_id,
                        int64_t virtual_stages, dsc_pipe_plan *out, char *err, size_t err_len);
void dsc_pipe_plan_free(dsc_pipe_plan *plan);

/* Runs the plans of all stages together: sends are buffered, a receive waits for the matching
 * send (FIFO per channel; the micro-batch and chunk must match), compute costs forward 1/V,
 * backward 2/V, input and weight gradients 1/V each. Writes the makespan and the bubble fraction
 * (idle share of stages x makespan). DSC_PS_EDEADLOCK with err naming the stuck stage if they
 * cannot finish. */
int dsc_pipe_simulate(int kind, int64_t micro_batches, int64_t stages, int64_t virtual_stages,
                      double *makespan, double *bubble_fraction, char *err, size_t err_len);

/* DeepSpeed's partition_uniform: num_parts + 1 boundaries of num_items items. */
int dsc_pipe_partition_uniform(int64_t num_items, int64_t num_parts, int64_t *parts);

/* DeepSpeed's partition_balanced: the boundaries (num_parts + 1) of contiguous parts of weights
 * minimising (largest part sum - smallest part sum) by dynamic programming over prefix sums;
 * ties go to the later split point. num_items <= num_parts falls back to partition_uniform. */
int dsc_pipe_partition_balanced(const double *weights, int64_t num_items, int64_t num_parts,
                                int64_t *parts, char *err, size_t err_len);

#endif
