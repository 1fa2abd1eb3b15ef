/* The C kernels' one interface: every function the library exports and every struct Python fills
 * in. Each kernel source includes it, so the compiler checks each definition against its
 * declaration here, and the sources call one another through it. The Python side of the same
 * interface is kernels/abi.py (ctypes signatures and mirrored structs); tests/unit/
 * test_kernel_abi.py holds the two to each other: the functions by name and parameter types,
 * the structs by size and field offsets as the library reports them (axon_struct_layout). */
#ifndef AXON_KERNELS_H
#define AXON_KERNELS_H

#include <stdint.h>

/* ---- structs Python fills in (mirrored in kernels/abi.py: keep the field order) ------------ */

/* A projection: up to 3 GGML (or float32) weights side by side in the output; int8: 8-bit
 * activations (ggml_q8.c), as the layer's GGMLWeights chose (activation_precision="int8"). */
typedef struct {
    int32_t parts, parallel, int8;
    int32_t types[3];
    const uint8_t *weights[3];
    int64_t rows[3];
} Projection;

/* Everything about one decoder layer that does not change between steps (cpu_layer.c). NULL
 * norms are absent. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, rotary_dim, inter, window;
    float eps, scale, softcap;
    int32_t unit_offset, activation;
    const float *input_norm;    /* before attention */
    const float *attn_out_norm; /* on attention's output before the residual add (Gemma) */
    const float *mlp_in_norm;   /* before the MLP */
    const float *mlp_out_norm;  /* on the MLP's output before the residual add (Gemma) */
    const float *q_norm, *k_norm, *qkv_bias, *inv_freq;
    void *k_cache, *v_cache;
    Projection qkv, o, gate_up, down;
    int32_t kv_type; /* the caches' element type: 0 float32, 1 float16, 2 q8_0 (cpu_ops.c) */
} Layer;

/* Every expert's three weights, fixed for the model's lifetime (cpu_moe.c). Expert e's gate is
 * gate[e], in format types[0]. int8: the products take 8-bit activations (ggml_q8.c,
 * activation_precision="int8"). */
typedef struct {
    int64_t experts, hidden, inter;
    int32_t types[3]; /* gate, up, down */
    int32_t activation, threads, int8;
    const uint8_t *const *gate;
    const uint8_t *const *up;
    const uint8_t *const *down;
    int64_t row_bytes[3]; /* of one row of gate, up, down */
} Experts;

/* The rest of a sparse layer's MLP half for axon_moe_block: its norm and its float32 router. */
typedef struct {
    const float *norm, *router; /* [hidden], [experts, hidden] */
    float eps;
    int32_t unit_offset, top_k, renormalize;
} Router;

/* A sparse decoder layer: cpu_layer.c's attention half, then norm, router and experts.
 * parallel: the experts' region runs on the step's threads (else on one: experts too small to
 * split). */
typedef struct {
    const Layer *attention;
    const Experts *experts;
    const Router *router;
    int64_t parallel;
} SparseLayer;

/* The model's final RMSNorm, applied after the last layer of axon_decode_stack. */
typedef struct {
    const float *weight; /* [dim] */
    int64_t dim;
    float eps;
    int32_t unit_offset;
} FinalNorm;

/* ---- layout.c ------------------------------------------------------------------------------ */

/* The layout of mirrored struct `index` (0, 1, ...): its name, its size and up to `capacity`
 * of its fields' names, offsets and sizes, in declaration order. Returns the number of fields,
 * or -1 past the last struct. */
int64_t axon_struct_layout(int64_t index, const char **name, int64_t *size, const char **fields,
                           int64_t *offsets, int64_t *sizes, int64_t capacity);

/* ---- cpu_ops.c: float32 operations of a layer ---------------------------------------------- */

void axon_rms_norm(const float *x, int64_t ldx, const float *w, float *out, int64_t ldo,
                   int64_t rows, int64_t dim, float eps, int unit_offset);
void axon_rms_norm_heads(const float *x, int64_t ldx, int64_t heads, const float *w, float *out,
                         int64_t tokens, int64_t dim, float eps, int unit_offset);
void axon_rotary(float *x, int64_t ldx, int64_t tokens, int64_t heads, int64_t head_dim,
                 int64_t rotary_dim, const int64_t *positions, const float *inv_freq);
void axon_rotary_angles(const int64_t *positions, int64_t tokens, const float *inv_freq,
                        int64_t half, float *cos_table, float *sin_table);
void axon_rotary_table(float *x, int64_t ldx, int64_t tokens, int64_t heads, int64_t head_dim,
                       int64_t rotary_dim, const float *cos_table, const float *sin_table);
int64_t axon_decode_split(int64_t positions);
int axon_paged_decode_attention(const float *q, int64_t ldq, const void *k_cache,
                                const void *v_cache, const int64_t *slots, int64_t width,
                                const int64_t *lens, int64_t batch, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, float scale, float softcap,
                                int64_t window, float *out, float *scratch, int threads,
                                int kv_type);
int axon_paged_prefill_attention(const float *q, int64_t ldq, const void *k_cache,
                                 const void *v_cache, const int64_t *slots,
                                 const int64_t *chunks, int64_t n_chunks, int64_t heads,
                                 int64_t kv_heads, int64_t head_dim, float scale, float softcap,
                                 int64_t window, float *out, int threads, int kv_type);
void axon_act_and_mul(const float *x, int64_t ldx, float *out, int64_t tokens, int64_t inter,
                      int kind);
void axon_cache_write(const float *k, int64_t ldk, const float *v, int64_t ldv,
                      const int64_t *slots, int64_t tokens, int64_t heads, int64_t head_dim,
                      void *k_cache, void *v_cache, int kv_type);

/* ---- ggml_cpu.c: GGML (or float32) weights times float32 activations ----------------------- */

int axon_ggml_supported(int type);
int axon_ggml_matmul_parts(int parts, const int *types, const uint8_t *const *ws,
                           const int64_t *rows, int64_t cols, const float *x, int64_t tokens,
                           float *y, int64_t ldy, int threads);
int axon_ggml_matmul(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x,
                     int64_t tokens, float *y, int64_t ldy, int threads);
int axon_ggml_dequant(int type, const uint8_t *w, int64_t rows, int64_t cols, float *out,
                      int threads);
int64_t axon_ggml_panel_rows(int64_t cols);
int axon_ggml_matmul_panels(int parts, const int *types, const uint8_t *const *ws,
                            const int64_t *rows, int64_t cols, const float *x, int64_t tokens,
                            float *y, int64_t ldy, int threads);

/* ---- ggml_q8.c: the same products with each token's activations quantized to 8 bits -------- */

int axon_q8_supported(int type);
int axon_q8_pack(int type, const uint8_t *w, int64_t rows, int64_t cols, uint8_t *out);
int axon_q8_matmul_parts(int parts, const int *types, const uint8_t *const *ws,
                         const int64_t *rows, int64_t cols, const float *x, int64_t tokens,
                         float *y, int64_t ldy, int threads);
void axon_q8_quantize(const float *x, int64_t cols, int k, int8_t *q, float *d, void *sums);

/* ---- cpu_layer.c: a dense decoder layer of a decode step ----------------------------------- */

int64_t axon_decode_layer_scratch(const Layer *l, int64_t tokens, int64_t width, int threads);
int axon_decode_attention(const Layer *l, float *hidden, int64_t tokens, const int64_t *positions,
                          const int64_t *slot_mapping, const int64_t *key_slots, int64_t width,
                          const int64_t *lens, float *scratch, int threads);
int axon_decode_layer(const Layer *l, float *hidden, int64_t tokens, const int64_t *positions,
                      const int64_t *slot_mapping, const int64_t *key_slots, int64_t width,
                      const int64_t *lens, float *scratch, int threads);

/* ---- cpu_moe.c: routed experts, a sparse layer, a decode step's whole stack ---------------- */

int axon_moe_experts(const Experts *m, const float *x, int64_t tokens, const int64_t *ids,
                     const float *weights, int64_t top_k, float *scratch, float *out);
int64_t axon_moe_block_scratch(const Experts *m, const Router *r, int64_t tokens);
int axon_moe_block(const Experts *m, const Router *r, float *hidden, int64_t tokens,
                   float *scratch);
int64_t axon_sparse_layer_scratch(const SparseLayer *l, int64_t tokens, int64_t width,
                                  int threads);
int axon_sparse_decode_layer(const SparseLayer *l, float *hidden, int64_t tokens,
                             const int64_t *positions, const int64_t *slot_mapping,
                             const int64_t *key_slots, int64_t width, const int64_t *lens,
                             float *scratch, int64_t scratch_floats, int threads);
/* layers[i] is a SparseLayer where sparse[i], else a Layer. */
int64_t axon_decode_stack_scratch(const void *const *layers, const int32_t *sparse,
                                  int64_t count, int64_t tokens, int64_t width, int threads);
int axon_decode_stack(const void *const *layers, const int32_t *sparse, int64_t count,
                      const FinalNorm *norm, float *hidden, int64_t tokens,
                      const int64_t *positions, const int64_t *slot_mapping,
                      const int64_t *key_slots, int64_t width, const int64_t *lens, float *scratch,
                      int64_t scratch_floats, int threads);

#endif
