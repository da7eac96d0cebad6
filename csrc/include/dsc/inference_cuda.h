/* Fused decoder inference kernels (csrc/cuda/inference_*.cu), the CUDA side of kernel injection.
 *
 * Every launcher runs on `stream` without synchronising and returns 0, a cudaError_t (> 0) or a
 * DSC_CUDA_E* code (< 0; dsc_cuda_strerror describes each). Activations, weights and the KV cache
 * share one dtype (`dtype`: a dsc_cuda_dtype); math runs in float32. Tensors are contiguous:
 *   x, y, r_out, n_out     [rows, cols]           norms and the residual stream
 *   qkv                    [B, T, (H + 2 Hkv) D]  the fused QKV GEMM's output, q heads then k then v
 *   q, attn out            [B, T, H, D]
 *   k_cache, v_cache       [B, Hkv, S, D]         S: the cache capacity (max_out_tokens)
 *   cos, sin               float32 [P, D]         rotary tables by position
 *   positions              int64 [B, T]
 *   past                   int32 [1], device      tokens already cached: read on the device so
 *                                                 a captured CUDA graph replays at any length
 *   key_mask               int32 [B, mask_stride] 0 hides key j of batch row b (padding)
 * Plain C: the binding (gcc) includes this header. */
#ifndef DSC_INFERENCE_CUDA_H
#define DSC_INFERENCE_CUDA_H

#include "dsc/cuda_multi_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The widest head the attention kernel takes (its per-lane accumulators are sized for it). */
#define DSC_INF_MAX_HEAD_DIM 256
/* The widest row the fused add + norm and the masked softmax take (the row is kept in shared
 * memory as float32: 64 KiB, past the default 48 KiB, opted into per kernel). */
#define DSC_INF_MAX_NORM_COLS 16384

/* r = x + y + bias (y, bias optional; r_out optional), n = LayerNorm(r) * gamma + beta, or
 * RMSNorm(r) * gamma when beta is NULL; the norm reads r rounded to dtype. */
int dsc_inf_add_norm(const void *x, const void *y, const void *bias, const void *gamma, const void *beta,
                     void *r_out, void *n_out, int64_t rows, int64_t cols, float eps, int dtype, int device,
                     cudaStream_t stream);

/* Adds the QKV bias (optional), rotates q and k by the tables at their positions (cos NULL: no
 * rotary; `rot` leading dims of each head rotate in half-split pairs), writes q to q_out and
 * k, v into the caches at rows past .. past + T (rows at or past S are not written). */
int dsc_inf_qkv_rotary_cache(const void *qkv, const void *bias, const float *cos, const float *sin, int64_t n_pos,
                             const int64_t *positions, const int32_t *past, void *k_cache, void *v_cache,
                             void *q_out, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t rot,
                             int64_t S, int dtype, int device, cudaStream_t stream);

/* Causal attention with GQA over the cache: query t of batch row b sees key j when
 * j <= past + t, j < S and key_mask[b, j] != 0 (key_mask optional). Online softmax in float32.
 * splits > 1 divides the keys among that many blocks (decode: few query rows, long cache); the
 * partial results go to `workspace` (float32, splits * B * T * H * (D + 2) elements) and a
 * second kernel combines them. A query row that sees no key gets zeros. */
int dsc_inf_attention(const void *q, const void *k_cache, const void *v_cache, const int32_t *past,
                      const int32_t *key_mask, int64_t mask_stride, void *out, float *workspace, int64_t splits,
                      int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t S, float scale, int dtype,
                      int device, cudaStream_t stream);

/* In place on scores [rows, L] (rows = B * rows_per_batch; row r is query token r % T of batch
 * row r / rows_per_batch): p = softmax(scale * s) over the keys j <= past + t with
 * key_mask[b, j] != 0 (key_mask optional); a row with no visible key becomes zeros. The softmax of
 * prefill attention, between the q k^T and p v GEMMs. L at most DSC_INF_MAX_NORM_COLS. */
int dsc_inf_masked_softmax(void *scores, int64_t rows, int64_t L, int64_t T, int64_t rows_per_batch,
                           const int32_t *past, const int32_t *key_mask, int64_t mask_stride, float scale, int dtype,
                           int device, cudaStream_t stream);

/* In place: h = gelu(h + bias); approximate != 0: the tanh form (GPT-2's gelu_new). */
int dsc_inf_bias_gelu(void *h, const void *bias, int64_t rows, int64_t cols, int approximate, int dtype,
                      int device, cudaStream_t stream);

/* gu [rows, 2F] (+ bias [2F]): out [rows, F] = silu(gate) * up, gate = gu[:, :F], up = gu[:, F:]. */
int dsc_inf_silu_mul(const void *gu, const void *bias, void *out, int64_t rows, int64_t f, int dtype, int device,
                     cudaStream_t stream);

/* Weight-only quantized linear (inference_quant.cu). q: int8 [N, K] (bits 8) or packed int4 [N, K / 2]
 * (bits 4: low nibble k even, high nibble k odd, each value + 8); scales float32 [N, K / group].
 * quant_gemv: out [M, N] = x [M, K] . dequant(q)^T for 1 <= M <= 8; K and group multiples of a 16-byte
 * weight chunk (16 for int8, 32 for int4), K below 2^16 chunks, x and q 16-byte aligned. variant 0 picks
 * the launch (M = 1, 16-bit: 1802; else by K); else 100 * warps a block (4 or 8; 0 = 8) + chunks in flight a lane (2, 4 or 8), plus 1000
 * for two weight rows a warp at M = 1; for tuning.
 * dequantize: out [N, K] in the activation dtype. */
int dsc_inf_quant_gemv(const void *x, const void *q, const float *scales, void *out, int64_t M, int64_t N, int64_t K,
                       int bits, int64_t group, int dtype, int device, cudaStream_t stream, int variant);
int dsc_inf_dequantize(const void *q, const float *scales, void *out, int64_t N, int64_t K, int bits, int64_t group,
                       int dtype, int device, cudaStream_t stream);

/* Expert GEMVs of MoE decode (inference_moe.cu). w [E, N, C] the stacked expert weights (activation dtype),
 * idx int64 [tokens, k] the experts each token was routed to. combine == 0 (expand): x [tokens, C],
 * out [tokens * k, N], out[t k + j] = x[t] . w[idx[t, j]]^T. combine != 0: x [tokens * k, C], wts float32
 * [tokens, k], out [tokens, N] = sum_j wts[t, j] x[t k + j] . w[idx[t, j]]^T (float32 sum, one rounding).
 * An index outside [0, E) adds nothing. tokens * k (expand) or tokens (combine) at most 65535. */
int dsc_inf_moe_gemv(const void *x, const int64_t *idx, const float *wts, const void *w, void *out, int64_t tokens,
                     int64_t k, int64_t experts, int64_t N, int64_t C, int combine, int dtype, int device,
                     cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
