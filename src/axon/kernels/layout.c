/* The layout of the structs Python mirrors with ctypes (kernels/abi.py), as this compiler lays
 * them out: a test compares it with ctypes' sizes and offsets, so a field added, moved or
 * retyped on one side only fails there instead of corrupting a decode step. */
#include <stddef.h>
#include <stdint.h>

#include "axon_kernels.h"

typedef struct {
    const char *name;
    int64_t offset, size;
} Field;

typedef struct {
    const char *name;
    int64_t size, count;
    const Field *fields;
} Struct;

#define FIELD(type, field) {#field, offsetof(type, field), sizeof(((type *)0)->field)}
#define STRUCT(type, fields) {#type, sizeof(type), sizeof(fields) / sizeof(Field), fields}

/* Every field, in declaration order (the test also fails on one left out here). */
static const Field projection[] = {
    FIELD(Projection, parts), FIELD(Projection, parallel), FIELD(Projection, int8),
    FIELD(Projection, types), FIELD(Projection, weights), FIELD(Projection, rows),
};
static const Field layer[] = {
    FIELD(Layer, hidden), FIELD(Layer, heads), FIELD(Layer, kv_heads), FIELD(Layer, head_dim),
    FIELD(Layer, rotary_dim), FIELD(Layer, inter), FIELD(Layer, window), FIELD(Layer, eps),
    FIELD(Layer, scale), FIELD(Layer, softcap), FIELD(Layer, unit_offset), FIELD(Layer, activation),
    FIELD(Layer, input_norm), FIELD(Layer, attn_out_norm), FIELD(Layer, mlp_in_norm),
    FIELD(Layer, mlp_out_norm), FIELD(Layer, q_norm), FIELD(Layer, k_norm), FIELD(Layer, qkv_bias),
    FIELD(Layer, inv_freq), FIELD(Layer, k_cache), FIELD(Layer, v_cache), FIELD(Layer, qkv),
    FIELD(Layer, o), FIELD(Layer, gate_up), FIELD(Layer, down), FIELD(Layer, kv_type),
};
static const Field experts[] = {
    FIELD(Experts, experts), FIELD(Experts, hidden), FIELD(Experts, inter), FIELD(Experts, types),
    FIELD(Experts, activation), FIELD(Experts, threads), FIELD(Experts, int8), FIELD(Experts, gate),
    FIELD(Experts, up), FIELD(Experts, down), FIELD(Experts, row_bytes),
};
static const Field router[] = {
    FIELD(Router, norm), FIELD(Router, router), FIELD(Router, eps), FIELD(Router, unit_offset),
    FIELD(Router, top_k), FIELD(Router, renormalize),
};
static const Field sparse_layer[] = {
    FIELD(SparseLayer, attention), FIELD(SparseLayer, experts), FIELD(SparseLayer, router),
    FIELD(SparseLayer, parallel),
};
static const Field final_norm[] = {
    FIELD(FinalNorm, weight), FIELD(FinalNorm, dim), FIELD(FinalNorm, eps),
    FIELD(FinalNorm, unit_offset),
};

static const Struct structs[] = {
    STRUCT(Projection, projection), STRUCT(Layer, layer), STRUCT(Experts, experts),
    STRUCT(Router, router), STRUCT(SparseLayer, sparse_layer), STRUCT(FinalNorm, final_norm),
};

int64_t axon_struct_layout(int64_t index, const char **name, int64_t *size, const char **fields,
                           int64_t *offsets, int64_t *sizes, int64_t capacity) {
    if (index < 0 || index >= (int64_t)(sizeof(structs) / sizeof(Struct))) return -1;
    const Struct *s = &structs[index];
    *name = s->name;
    *size = s->size;
    for (int64_t i = 0; i < s->count && i < capacity; i++) {
        fields[i] = s->fields[i].name;
        offsets[i] = s->fields[i].offset;
        sizes[i] = s->fields[i].size;
    }
    return s->count;
}
