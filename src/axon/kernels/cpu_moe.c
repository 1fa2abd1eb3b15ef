/* The routed experts of one mixture-of-experts layer for a few tokens (decode) in one call: the
 * grouping by expert, each chosen expert's gate/up and down products (ggml_cpu.c, in place on the
 * GGML blocks or on float32 rows; ggml_q8.c with opt-in 8-bit activations), the gated activation
 * (cpu_ops.c) and the weighted sum. At batch 1 the same work done from Python costs ~10 torch
 * ops per chosen expert, as much time as reading the expert's weights. The PyTorch reference
 * twin is `fused_moe` (layers/fused_moe.py): the same products in the same expert order, summed
 * per token in choice order.
 *
 * All of it runs in one OpenMP parallel region: the row quads of every chosen expert's gate and
 * up are split in contiguous shares across the threads (a thread done with its own takes from the
 * back of the others', work_shares.h), then (after a barrier) those of the downs. One region
 * per matmul cost ~8 fork/joins per layer, and splitting each small expert matrix on its own left
 * threads idle at every join. A row's product does not depend on which thread computes it, and
 * the split falls on quad boundaries, so the result equals the one-thread result to the bit. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "axon_kernels.h"
#include "work_shares.h"

typedef int (*Matmul)(int parts, const int *types, const uint8_t *const *ws, const int64_t *rows,
                      int64_t cols, const float *x, int64_t tokens, float *y, int64_t ldy,
                      int threads);
#define MAX_TOKENS 64 /* of one matmul call: a token chooses an expert at most once */

/* One kind of product of a phase: expert e's weight is w[e] (types, rows [rows, cols]), its
 * output goes to columns column .. column + rows - 1 of y, computed by `matmul`. */
typedef struct {
    const uint8_t *const *w;
    int type;
    int64_t rows, row_bytes, column;
    Matmul matmul;
} Part;

static int64_t quads_of(const Part *p) { return (p->rows + 3) / 4; }

#define PHASE_QUADS 8 /* row quads per unit of a phase's work (32 rows) */

/* A phase's units: for each chosen expert in `chosen` (groups of them, slots start[e] ..
 * start[e + 1] - 1), the row quads of each part in turn, PHASE_QUADS at a time. */
static int64_t phase_units(const Part *parts, int count_parts, int64_t groups) {
    int64_t per_group = 0;
    for (int p = 0; p < count_parts; p++) per_group += quads_of(&parts[p]);
    return (per_group * groups + PHASE_QUADS - 1) / PHASE_QUADS;
}

/* This thread's part of a phase, x [slots, cols] -> y [slots, ldy]: units from its share of
 * `shares`, then stolen from the others' (work_shares.h: a thread descheduled mid-phase does not
 * hold up the barrier after it by its whole share). Returns nonzero when a matmul rejects its
 * weights. */
static int phase(const Part *parts, int count_parts, const int64_t *chosen, int64_t groups,
                 const int64_t *start, const float *x, int64_t cols, float *y, int64_t ldy,
                 Share *shares, int threads, int me) {
    int64_t per_group = 0;
    for (int p = 0; p < count_parts; p++) per_group += quads_of(&parts[p]);
    const int64_t total = per_group * groups;
    int status = 0, k = 0;
    for (int64_t u; (u = next_unit(shares, threads, me, &k)) >= 0;) {
        const int64_t last = PHASE_QUADS * (u + 1) < total ? PHASE_QUADS * (u + 1) : total;
        for (int64_t q = PHASE_QUADS * u; q < last;) {
            const int64_t e = chosen[q / per_group], first = start[e], n = start[e + 1] - first;
            int64_t within = q % per_group;
            const Part *p = parts;
            while (within >= quads_of(p)) within -= quads_of(p++);
            const int64_t take = last - q < quads_of(p) - within ? last - q : quads_of(p) - within;
            const int64_t begin = 4 * within;
            const int64_t end = 4 * (within + take) < p->rows ? 4 * (within + take) : p->rows;
            const int64_t rows = end - begin;
            const uint8_t *w = p->w[e] + begin * p->row_bytes;
            /* int8: each call quantizes its n tokens again; that is cols values a token, cheap
             * next to reading rows x cols weights, and each token's codes are the same every
             * time. */
            status |= p->matmul(1, &p->type, &w, &rows, cols, x + first * cols, n,
                                y + first * ldy + p->column + begin, ldy, 1);
            q += take;
        }
    }
    return status;
}

/* Slots (token, choice) grouped by expert: start [experts + 1], order (slot of each grouped
 * row), at (grouped row of each slot), chosen (experts with a slot, ascending). Returns the
 * number of chosen experts, or -1 for a bad id. */
static int64_t group(const Experts *m, const int64_t *ids, int64_t slots, int64_t *start,
                     int64_t *order, int64_t *at, int64_t *chosen) {
    memset(start, 0, (m->experts + 1) * sizeof *start);
    for (int64_t s = 0; s < slots; s++) {
        if (ids[s] < 0 || ids[s] >= m->experts) return -1;
        start[ids[s] + 1]++;
    }
    int64_t groups = 0;
    for (int64_t e = 0; e < m->experts; e++) {
        if (start[e + 1] > 0) chosen[groups++] = e; /* an expert nobody chose is not read */
        start[e + 1] += start[e];
    }
    int64_t fill[m->experts];
    memcpy(fill, start, sizeof fill);
    for (int64_t s = 0; s < slots; s++) { /* slots grouped by expert, in token order */
        order[fill[ids[s]]] = s;
        at[s] = fill[ids[s]]++;
    }
    return groups;
}

/* out [tokens, hidden] = sum_j weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)), e =
 * ids[t, j], for x [tokens, hidden] float32. scratch holds tokens * top_k * (2 hidden + 3 inter)
 * floats. Returns -1 (nothing written) for a bad expert id, too many tokens or a format the
 * matmul does not handle. */
static int experts_run(const Experts *m, int threads, const float *x, int64_t tokens,
                       const int64_t *ids, const float *weights, int64_t top_k, float *scratch,
                       float *out) {
    const int64_t slots = tokens * top_k, hidden = m->hidden, inter = m->inter;
    if (tokens < 0 || tokens > MAX_TOKENS || top_k < 1) return -1;
    int64_t start[m->experts + 1], order[slots > 0 ? slots : 1], at[slots > 0 ? slots : 1];
    int64_t chosen[m->experts];
    const int64_t groups = group(m, ids, slots, start, order, at, chosen);
    if (groups < 0) return -1;
    float *xs = scratch, *gu = xs + slots * hidden, *h = gu + slots * 2 * inter;
    float *ys = h + slots * inter;
    for (int64_t i = 0; i < slots; i++)
        memcpy(xs + i * hidden, x + order[i] / top_k * hidden, hidden * sizeof(float));
    const Matmul matmul = m->int8 ? axon_q8_matmul_parts : axon_ggml_matmul_parts;
    const Part gate_up[2] = {{m->gate, m->types[0], inter, m->row_bytes[0], 0, matmul},
                             {m->up, m->types[1], inter, m->row_bytes[1], inter, matmul}};
    const Part down = {m->down, m->types[2], hidden, m->row_bytes[2], 0, matmul};
    if (threads < 1) threads = 1;
    Share up_shares[threads], down_shares[threads];
    shares_init(up_shares, threads, phase_units(gate_up, 2, groups));
    shares_init(down_shares, threads, phase_units(&down, 1, groups));
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#ifdef _OPENMP
        const int64_t id = omp_get_thread_num(), count = omp_get_num_threads();
#else
        const int64_t id = 0, count = 1;
#endif
        int status = phase(gate_up, 2, chosen, groups, start, xs, hidden, gu, 2 * inter, up_shares,
                           threads, (int)id);
#pragma omp barrier
        const int64_t s0 = slots * id / count, s1 = slots * (id + 1) / count;
        axon_act_and_mul(gu + s0 * 2 * inter, 2 * inter, h + s0 * inter, s1 - s0, inter,
                         m->activation);
#pragma omp barrier
        status |= phase(&down, 1, chosen, groups, start, h, inter, ys, hidden, down_shares, threads,
                        (int)id);
#pragma omp barrier
        const int64_t c0 = hidden * id / count, c1 = hidden * (id + 1) / count;
        for (int64_t t = 0; t < tokens; t++) { /* per column, the choices in order */
            float *o = out + t * hidden;
            for (int64_t i = c0; i < c1; i++) o[i] = 0.0f;
            for (int64_t j = 0; j < top_k; j++) {
                const float w = weights[t * top_k + j], *y = ys + at[t * top_k + j] * hidden;
                for (int64_t i = c0; i < c1; i++) o[i] += w * y[i];
            }
        }
        if (status != 0) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed ? -1 : 0;
}

int axon_moe_experts(const Experts *m, const float *x, int64_t tokens, const int64_t *ids,
                     const float *weights, int64_t top_k, float *scratch, float *out) {
    return experts_run(m, m->threads, x, tokens, ids, weights, top_k, scratch, out);
}

/* Softmax over logits [experts], the top_k largest (ties: the lower id) with their
 * probabilities, renormalised to sum 1 when asked, as `select_experts` does. */
static void select_top_k(const float *logits, int64_t experts, int64_t top_k, int renormalize,
                         int64_t *ids, float *weights) {
    float most = logits[0], total = 0.0f, probs[experts];
    for (int64_t e = 1; e < experts; e++) most = logits[e] > most ? logits[e] : most;
    for (int64_t e = 0; e < experts; e++) total += probs[e] = expf(logits[e] - most);
    float chosen_sum = 0.0f;
    char taken[experts];
    memset(taken, 0, sizeof taken);
    for (int64_t j = 0; j < top_k; j++) { /* a valid id even where the logits are NaN */
        int64_t best = 0;
        while (taken[best]) best++;
        for (int64_t e = best + 1; e < experts; e++)
            if (!taken[e] && probs[e] > probs[best]) best = e;
        ids[j] = best;
        taken[best] = 1;
        chosen_sum += weights[j] = probs[best] / total;
    }
    if (renormalize)
        for (int64_t j = 0; j < top_k; j++) weights[j] /= chosen_sum;
}

/* Floats of scratch axon_moe_block needs for `tokens`. */
int64_t axon_moe_block_scratch(const Experts *m, const Router *r, int64_t tokens) {
    const int64_t slots = tokens * r->top_k;
    return tokens * (2 * m->hidden + m->experts + r->top_k) + slots * (2 * m->hidden + 3 * m->inter);
}

/* hidden [tokens, hidden] += experts(norm(hidden)) in place: the MLP half of a sparse layer at
 * decode, routing included (float32 logits, softmax top-k), the experts on `threads`. Returns
 * 0, or -1 as axon_moe_experts. */
static int block_run(const Experts *m, const Router *r, int threads, float *hidden,
                     int64_t tokens, float *scratch) {
    const int64_t dim = m->hidden, top_k = r->top_k;
    if (tokens < 0 || tokens > MAX_TOKENS || top_k < 1 || top_k > m->experts) return -1;
    float *x = scratch, *y = x + tokens * dim, *logits = y + tokens * dim;
    float *weights = logits + tokens * m->experts, *rest = weights + tokens * top_k;
    int64_t ids[tokens * top_k + 1];
    const int f32 = 0; /* GGML type F32: the router's float32 rows */
    axon_rms_norm(hidden, dim, r->norm, x, dim, tokens, dim, r->eps, r->unit_offset);
    const uint8_t *router = (const uint8_t *)r->router;
    if (axon_ggml_matmul_parts(1, &f32, &router, &m->experts, dim, x, tokens, logits,
                               m->experts, 1))
        return -1;
    for (int64_t t = 0; t < tokens; t++)
        select_top_k(logits + t * m->experts, m->experts, top_k, r->renormalize,
                     ids + t * top_k, weights + t * top_k);
    if (experts_run(m, threads, x, tokens, ids, weights, top_k, rest, y)) return -1;
    for (int64_t i = 0; i < tokens * dim; i++) hidden[i] += y[i];
    return 0;
}

int axon_moe_block(const Experts *m, const Router *r, float *hidden, int64_t tokens,
                   float *scratch) {
    return block_run(m, r, m->threads, hidden, tokens, scratch);
}

/* ---- a whole sparse decoder layer ------------------------------------------------------- */

/* Floats of scratch axon_sparse_decode_layer needs: the two halves use it in turn. */
int64_t axon_sparse_layer_scratch(const SparseLayer *l, int64_t tokens, int64_t width,
                                  int threads) {
    const int64_t attention = axon_decode_layer_scratch(l->attention, tokens, width, threads);
    const int64_t mlp = axon_moe_block_scratch(l->experts, l->router, tokens);
    return attention > mlp ? attention : mlp;
}

/* hidden [tokens, hidden] <- the sparse layer's output, in place, for `tokens` decode queries
 * (arguments as axon_decode_attention): the attention half, then the MLP half as
 * axon_moe_block, one call instead of two from Python plus the glue between them. Returns 0,
 * -1 (rejected weights or ids), -2 (no memory for 8-bit activations) or -3 (scratch holds
 * fewer than axon_sparse_layer_scratch floats; nothing done). */
int axon_sparse_decode_layer(const SparseLayer *l, float *hidden, int64_t tokens,
                             const int64_t *positions, const int64_t *slot_mapping,
                             const int64_t *key_slots, int64_t width, const int64_t *lens,
                             float *scratch, int64_t scratch_floats, int threads) {
    if (scratch_floats < axon_sparse_layer_scratch(l, tokens, width, threads)) return -3;
    const int status = axon_decode_attention(l->attention, hidden, tokens, positions,
                                             slot_mapping, key_slots, width, lens, scratch,
                                             threads);
    if (status) return status;
    return block_run(l->experts, l->router, l->parallel ? threads : 1, hidden, tokens, scratch);
}

/* ---- a decode step's whole stack of layers ---------------------------------------------- */

/* Floats of scratch axon_decode_stack needs: the most any one layer does. */
int64_t axon_decode_stack_scratch(const void *const *layers, const int32_t *sparse,
                                  int64_t count, int64_t tokens, int64_t width, int threads) {
    int64_t most = 0;
    for (int64_t i = 0; i < count; i++) {
        const int64_t need =
            sparse[i] ? axon_sparse_layer_scratch(layers[i], tokens, width, threads)
                      : axon_decode_layer_scratch(layers[i], tokens, width, threads);
        most = need > most ? need : most;
    }
    return most;
}

/* hidden [tokens, hidden] <- norm(the output of `count` decoder layers in turn), in place: layer
 * i is a SparseLayer where sparse[i], else cpu_layer.c's dense Layer (a model's dense layers
 * among sparse ones). The same calls as one per layer and then RMSNorm from Python, without the
 * Python between them (slow at batch 1: it runs with caches just flushed by the weights).
 * Returns 0, -3 before touching hidden when scratch is short of
 * axon_decode_stack_scratch floats, or a layer's failure (-1, -2: hidden then undefined). */
int axon_decode_stack(const void *const *layers, const int32_t *sparse, int64_t count,
                      const FinalNorm *norm, float *hidden, int64_t tokens,
                      const int64_t *positions,
                      const int64_t *slot_mapping, const int64_t *key_slots, int64_t width,
                      const int64_t *lens, float *scratch, int64_t scratch_floats, int threads) {
    if (scratch_floats < axon_decode_stack_scratch(layers, sparse, count, tokens, width, threads))
        return -3;
    for (int64_t i = 0; i < count; i++) {
        const int status =
            sparse[i] ? axon_sparse_decode_layer(layers[i], hidden, tokens, positions,
                                                 slot_mapping, key_slots, width, lens, scratch,
                                                 scratch_floats, threads)
                      : axon_decode_layer(layers[i], hidden, tokens, positions, slot_mapping,
                                          key_slots, width, lens, scratch, threads);
        if (status) return status;
    }
    axon_rms_norm(hidden, norm->dim, norm->weight, hidden, norm->dim, tokens, norm->dim,
                  norm->eps, norm->unit_offset);
    return 0;
}
