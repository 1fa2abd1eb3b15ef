/* One decoder layer of a decode step (Llama, Qwen2, Qwen3, Gemma 3) in a single call, for the
 * CPU: the same C functions the layer's own PyTorch forward calls one by one (RMSNorm, the GGML
 * or float32 matmul, rotary, the KV cache write, paged decode attention, the gated activation),
 * in the same order on the same data, without a Python round trip between them: a small model's
 * decode step is otherwise mostly Python dispatch around the matmuls. The layer's PyTorch
 * forward is the reference twin (layers/fused_decode.py). */
#include <stdint.h>
#include <string.h>

#include "axon_kernels.h"

/* Multiply-adds of decode attention from which it runs on the step's threads. Lower than
 * cpu_ops.py's PARALLEL_MIN_WORK (1 << 18, for a call from Python, whose second thread may have
 * gone to sleep): here the qkv projection's parallel region has just ended, its threads still
 * spin, and 2 threads already beat 1 at 16 heads x 32 keys x 64 (10 -> 7 us). */
#define ATTENTION_MIN_WORK (1 << 15)

static int project(const Projection *p, const float *x, int64_t tokens, int64_t cols, float *y,
                   int64_t ldy, int threads) {
    /* As GGMLWeights.matmul at decode sizes: a small weight runs on one thread. */
    const int use = p->parallel ? threads : 1;
    if (p->int8)
        return axon_q8_matmul_parts(p->parts, p->types, p->weights, p->rows, cols, x, tokens, y,
                                    ldy, use);
    return axon_ggml_matmul_parts(p->parts, p->types, p->weights, p->rows, cols, x, tokens, y,
                                  ldy, use);
}

/* hidden += norm(y) (norm may be NULL: hidden += y), rows of `dim`. */
static void residual_add(float *hidden, float *y, const float *norm, int64_t tokens, int64_t dim,
                         float eps, int unit_offset) {
    if (norm) axon_rms_norm(y, dim, norm, y, dim, tokens, dim, eps, unit_offset);
    for (int64_t i = 0; i < tokens * dim; i++) hidden[i] += y[i];
}

/* Floats of scratch axon_decode_layer needs. */
int64_t axon_decode_layer_scratch(const Layer *l, int64_t tokens, int64_t width, int threads) {
    const int64_t q_width = l->heads * l->head_dim, kv_width = l->kv_heads * l->head_dim;
    const int64_t per_token = 2 * l->hidden + q_width + 2 * kv_width + q_width + 3 * l->inter;
    /* attention's scores: heads x width per thread */
    return tokens * per_token + (int64_t)threads * l->heads * width;
}

/* hidden [tokens, hidden] += the layer's attention (its first half), in place, for `tokens`
 * decode queries (one per sequence): positions, cache slots of the new keys, each query's key
 * slots [tokens, width] and context lengths. The MLP projections of `l` are not read: a sparse
 * (mixture-of-experts) layer runs its MLP half in cpu_moe.c. Returns 0, or a matmul's failure:
 * -1 when it rejects its weights, -2 out of memory (the 8-bit kernel's buffers). */
int axon_decode_attention(const Layer *l, float *hidden, int64_t tokens, const int64_t *positions,
                          const int64_t *slot_mapping, const int64_t *key_slots, int64_t width,
                          const int64_t *lens, float *scratch, int threads) {
    const int64_t dim = l->hidden, D = l->head_dim, q_width = l->heads * D;
    const int64_t kv_width = l->kv_heads * D, qkv_width = q_width + 2 * kv_width;
    float *x = scratch, *qkv = x + tokens * dim, *attn = qkv + tokens * qkv_width;
    float *y = attn + tokens * q_width, *gate_up = y + tokens * dim;
    float *act = gate_up + tokens * 2 * l->inter, *scores = act + tokens * l->inter;
    int status;

    axon_rms_norm(hidden, dim, l->input_norm, x, dim, tokens, dim, l->eps, l->unit_offset);
    if ((status = project(&l->qkv, x, tokens, dim, qkv, qkv_width, threads))) return status;
    if (l->qkv_bias)
        for (int64_t t = 0; t < tokens; t++)
            for (int64_t i = 0; i < qkv_width; i++) qkv[t * qkv_width + i] += l->qkv_bias[i];
    float *q = qkv, *k = qkv + q_width, *v = k + kv_width;
    if (l->q_norm) /* per head, in place: a token's heads are consecutive rows of D */
        for (int64_t t = 0; t < tokens; t++) {
            float *qt = q + t * qkv_width, *kt = k + t * qkv_width;
            axon_rms_norm(qt, D, l->q_norm, qt, D, l->heads, D, l->eps, l->unit_offset);
            axon_rms_norm(kt, D, l->k_norm, kt, D, l->kv_heads, D, l->eps, l->unit_offset);
        }
    axon_rotary(q, qkv_width, tokens, l->heads, D, l->rotary_dim, positions, l->inv_freq);
    axon_rotary(k, qkv_width, tokens, l->kv_heads, D, l->rotary_dim, positions, l->inv_freq);
    axon_cache_write(k, qkv_width, v, qkv_width, slot_mapping, tokens, l->kv_heads, D,
                     l->k_cache, l->v_cache, l->kv_type);
    const int64_t work = tokens * l->heads * width * D;
    status = axon_paged_decode_attention(q, qkv_width, l->k_cache, l->v_cache, key_slots, width,
                                         lens, tokens, l->heads, l->kv_heads, D, l->scale,
                                         l->softcap, l->window, attn, scores,
                                         work >= ATTENTION_MIN_WORK ? threads : 1, l->kv_type);
    if (status) return status;
    if ((status = project(&l->o, attn, tokens, q_width, y, dim, threads))) return status;
    residual_add(hidden, y, l->attn_out_norm, tokens, dim, l->eps, l->unit_offset);
    return 0;
}

/* hidden [tokens, hidden] <- the layer's output, in place, for `tokens` decode queries (as
 * axon_decode_attention). Returns 0, or a matmul's failure as axon_decode_attention. */
int axon_decode_layer(const Layer *l, float *hidden, int64_t tokens, const int64_t *positions,
                      const int64_t *slot_mapping, const int64_t *key_slots, int64_t width,
                      const int64_t *lens, float *scratch, int threads) {
    int status = axon_decode_attention(l, hidden, tokens, positions, slot_mapping, key_slots,
                                       width, lens, scratch, threads);
    if (status) return status;
    const int64_t dim = l->hidden, q_width = l->heads * l->head_dim;
    const int64_t qkv_width = q_width + 2 * l->kv_heads * l->head_dim;
    float *x = scratch, *y = x + tokens * dim + tokens * qkv_width + tokens * q_width;
    float *gate_up = y + tokens * dim, *act = gate_up + tokens * 2 * l->inter;
    axon_rms_norm(hidden, dim, l->mlp_in_norm, x, dim, tokens, dim, l->eps, l->unit_offset);
    status = project(&l->gate_up, x, tokens, dim, gate_up, 2 * l->inter, threads);
    if (status) return status;
    axon_act_and_mul(gate_up, 2 * l->inter, act, tokens, l->inter, l->activation);
    if ((status = project(&l->down, act, tokens, l->inter, y, dim, threads))) return status;
    residual_add(hidden, y, l->mlp_out_norm, tokens, dim, l->eps, l->unit_offset);
    return 0;
}
