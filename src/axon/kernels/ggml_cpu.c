/* GGML block formats on the CPU, read in place: y = x @ W.T with float32 activations, and a
 * float32 dequantization. Built and loaded by ggml_cpu.py (cc -O3 -march=native -fopenmp).
 *
 * Each block is dequantized the way gguf-py does it (float32 products of the fp16 scale and the
 * integer code), then dotted with the activations of every token in float32. Only the summation
 * order differs from `F.linear(x, dequantize(W))`. Layouts: see ggml_dequant.py, which these
 * loops follow element for element.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
#define MAX_TOKENS 64

static inline float f16(const uint8_t *p) {
#ifdef __F16C__
    uint16_t bits16;
    memcpy(&bits16, p, 2);
    return _cvtsh_ss(bits16);
#endif
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        int shift = 0;
        while (!(man & 0x400)) { man <<= 1; shift++; }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Eight lanes (AVX2 with -march=native; plain code elsewhere). */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8x __attribute__((vector_size(32)));

/* Eight bytes widened to int32 lanes. */
static inline i8x widen_u8(const uint8_t *p) {
#ifdef __AVX2__
    return (i8x)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    i8x out;
    for (int i = 0; i < 8; i++) out[i] = p[i];
    return out;
#endif
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline v8 to_float(i8x q) { return __builtin_convertvector(q, v8); }

static const i8x LANE = {0, 1, 2, 3, 4, 5, 6, 7};

static void q4_0(const uint8_t *b, float *w) {
    float d = f16(b);
    for (int j = 0; j < 16; j += 8) {
        i8x q = widen_u8(b + 2 + j);
        store8(w + j, d * to_float((q & 0x0F) - 8));
        store8(w + j + 16, d * to_float((q >> 4) - 8));
    }
}

static void q4_1(const uint8_t *b, float *w) {
    float d = f16(b), m = f16(b + 2);
    for (int j = 0; j < 16; j += 8) {
        i8x q = widen_u8(b + 4 + j);
        store8(w + j, d * to_float(q & 0x0F) + m);
        store8(w + j + 16, d * to_float(q >> 4) + m);
    }
}

/* The 5-bit codes of Q5_0 / Q5_1, eight at a time: low nibble, high bit from qh (LE u32). */
static void q5_codes(const uint8_t *qh, const uint8_t *qs, i8x *q) {
    uint32_t high;
    memcpy(&high, qh, 4);
    i8x bits = (i8x){0} + (int32_t)high;
    for (int j = 0; j < 16; j += 8) {
        i8x nib = widen_u8(qs + j);
        i8x lo_high = ((bits >> (LANE + j)) & 1) << 4, hi_high = ((bits >> (LANE + j + 16)) & 1) << 4;
        q[j / 8] = (nib & 0x0F) | lo_high;
        q[j / 8 + 2] = (nib >> 4) | hi_high;
    }
}

static void q5_0(const uint8_t *b, float *w) {
    i8x q[4];
    float d = f16(b);
    q5_codes(b + 2, b + 6, q);
    for (int j = 0; j < 4; j++) store8(w + 8 * j, d * to_float(q[j] - 16));
}

static void q5_1(const uint8_t *b, float *w) {
    i8x q[4];
    float d = f16(b), m = f16(b + 2);
    q5_codes(b + 4, b + 8, q);
    for (int j = 0; j < 4; j++) store8(w + 8 * j, d * to_float(q[j]) + m);
}

static void q8_0(const uint8_t *b, float *w) {
    float d = f16(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) w[j] = (float)q[j] * d;
}

/* Q4_K / Q5_K: per sub-block scale d * sc and offset dmin * mn (6-bit packed). */
static void k_affine(const uint8_t *b, float *scale, float *offset) {
    float d = f16(b), dmin = f16(b + 2);
    const uint8_t *s = b + 4;
    for (int j = 0; j < 4; j++) {
        scale[j] = d * (float)(s[j] & 0x3F);
        offset[j] = dmin * (float)(s[4 + j] & 0x3F);
        scale[j + 4] = d * (float)((s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30));
        offset[j + 4] = dmin * (float)((s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30));
    }
}

static void q4_k(const uint8_t *b, float *w) {
    float scale[8], offset[8];
    k_affine(b, scale, offset);
    const uint8_t *qs = b + 16;
    for (int g = 0; g < 4; g++)
        for (int l = 0; l < 32; l += 8) {
            i8x q = widen_u8(qs + g * 32 + l);
            store8(w + g * 64 + l, scale[2 * g] * to_float(q & 0x0F) - offset[2 * g]);
            store8(w + g * 64 + 32 + l, scale[2 * g + 1] * to_float(q >> 4) - offset[2 * g + 1]);
        }
}

static void q5_k(const uint8_t *b, float *w) {
    float scale[8], offset[8];
    k_affine(b, scale, offset);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int g = 0; g < 4; g++)
        for (int l = 0; l < 32; l += 8) {
            i8x q = widen_u8(qs + g * 32 + l), high = widen_u8(qh + l);
            i8x lo = (q & 0x0F) | (((high >> (2 * g)) & 1) << 4);
            i8x hi = (q >> 4) | (((high >> (2 * g + 1)) & 1) << 4);
            store8(w + g * 64 + l, scale[2 * g] * to_float(lo) - offset[2 * g]);
            store8(w + g * 64 + 32 + l, scale[2 * g + 1] * to_float(hi) - offset[2 * g + 1]);
        }
}

static void q6_k(const uint8_t *b, float *w) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = f16(b + 208);
    for (int g = 0; g < 2; g++)
        for (int part = 0; part < 4; part++)
            for (int l = 0; l < 32; l += 8) {
                int e = g * 128 + part * 32 + l;
                float scale = d * (float)sc[e / 16]; /* 16 codes share one scale */
                i8x lo = (widen_u8(ql + g * 64 + (part % 2) * 32 + l) >> (4 * (part / 2))) & 0x0F;
                i8x hi = (widen_u8(qh + g * 32 + l) >> (2 * part)) & 3;
                store8(w + e, scale * to_float((lo | (hi << 4)) - 32));
            }
}

typedef void (*dequant_fn)(const uint8_t *, float *);

static int format(int type, dequant_fn *fn, int *block, int *bytes) {
    switch (type) {
    case Q4_0: *fn = q4_0; *block = 32; *bytes = 18; return 0;
    case Q4_1: *fn = q4_1; *block = 32; *bytes = 20; return 0;
    case Q5_0: *fn = q5_0; *block = 32; *bytes = 22; return 0;
    case Q5_1: *fn = q5_1; *block = 32; *bytes = 24; return 0;
    case Q8_0: *fn = q8_0; *block = 32; *bytes = 34; return 0;
    case Q4_K: *fn = q4_k; *block = 256; *bytes = 144; return 0;
    case Q5_K: *fn = q5_k; *block = 256; *bytes = 176; return 0;
    case Q6_K: *fn = q6_k; *block = 256; *bytes = 210; return 0;
    default: return -1;
    }
}

int axon_ggml_supported(int type) {
    dequant_fn fn;
    int block, bytes;
    return format(type, &fn, &block, &bytes) == 0;
}


static v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static float sum8(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* One output row per format: acc[t] = x[t] . W[n] over every block, in vector lanes. The
 * format's dequantizer is inlined (a macro instead of a function pointer), so that the compiler
 * keeps a 32-wide block in registers. */
#define ROW_DOT(fn, block, bytes)                                                              \
    static void row_dot_##fn(const uint8_t *row, int64_t blocks, const float *x, int64_t cols,  \
                             int64_t tokens, float *out, int64_t stride) {                     \
        v8 acc[MAX_TOKENS];                                                                    \
        float wb[block] __attribute__((aligned(32)));                                          \
        for (int64_t t = 0; t < tokens; t++) acc[t] = (v8){0};                                 \
        for (int64_t k = 0; k < blocks; k++) {                                                 \
            fn(row + k * (bytes), wb);                                                         \
            for (int64_t t = 0; t < tokens; t++) {                                             \
                const float *xt = x + t * cols + k * (block);                                  \
                v8 a = acc[t];                                                                 \
                for (int i = 0; i < (block); i += 8) a += load8(wb + i) * load8(xt + i);       \
                acc[t] = a;                                                                    \
            }                                                                                  \
        }                                                                                      \
        for (int64_t t = 0; t < tokens; t++) out[t * stride] = sum8(acc[t]);                   \
    }

ROW_DOT(q4_0, 32, 18)
ROW_DOT(q4_1, 32, 20)
ROW_DOT(q5_0, 32, 22)
ROW_DOT(q5_1, 32, 24)
ROW_DOT(q4_k, 256, 144)
ROW_DOT(q5_k, 256, 176)
ROW_DOT(q6_k, 256, 210)

typedef void (*row_fn)(const uint8_t *, int64_t, const float *, int64_t, int64_t, float *,
                       int64_t);

/* Q8_0 without the float buffer: codes widen straight into lanes, the scale applies per block. */
static inline v8 widen8(const uint8_t *codes) {
#ifdef __AVX2__
    __m128i bytes = _mm_loadl_epi64((const __m128i *)codes);
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
#else
    v8 out;
    for (int i = 0; i < 8; i++) out[i] = (float)(int8_t)codes[i];
    return out;
#endif
}

static void row_dot_q8_0(const uint8_t *row, int64_t blocks, const float *x, int64_t cols,
                         int64_t tokens, float *out, int64_t stride) {
    v8 acc[MAX_TOKENS];
    for (int64_t t = 0; t < tokens; t++) acc[t] = (v8){0};
    for (int64_t k = 0; k < blocks; k++) {
        const uint8_t *b = row + k * 34;
        v8 w[4];
        for (int j = 0; j < 4; j++) w[j] = widen8(b + 2 + 8 * j);
        const float d = f16(b);
        for (int64_t t = 0; t < tokens; t++) {
            const float *xt = x + t * cols + k * 32;
            v8 p = w[0] * load8(xt) + w[1] * load8(xt + 8);
            p += w[2] * load8(xt + 16) + w[3] * load8(xt + 24);
            acc[t] += d * p;
        }
    }
    for (int64_t t = 0; t < tokens; t++) out[t * stride] = sum8(acc[t]);
}

/* y [tokens, rows] = x [tokens, cols] @ W.T, W [rows, cols] in `type`. tokens <= MAX_TOKENS. */
int axon_ggml_matmul(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x,
                     int64_t tokens, float *y, int threads) {
    dequant_fn fn;
    int block, bytes;
    if (format(type, &fn, &block, &bytes) || tokens > MAX_TOKENS || cols % block) return -1;
    const int64_t blocks = cols / block, row_bytes = blocks * bytes;
    row_fn row = type == Q8_0   ? row_dot_q8_0
                 : type == Q4_0 ? row_dot_q4_0
                 : type == Q4_1 ? row_dot_q4_1
                 : type == Q5_0 ? row_dot_q5_0
                 : type == Q5_1 ? row_dot_q5_1
                 : type == Q4_K ? row_dot_q4_k
                 : type == Q5_K ? row_dot_q5_k
                                : row_dot_q6_k;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < rows; n++)
        row(w + n * row_bytes, blocks, x, cols, tokens, y + n, rows);
    return 0;
}

/* out [rows, cols] float32 = W [rows, cols] in `type`. */
int axon_ggml_dequant(int type, const uint8_t *w, int64_t rows, int64_t cols, float *out,
                      int threads) {
    dequant_fn fn;
    int block, bytes;
    if (format(type, &fn, &block, &bytes) || cols % block) return -1;
    const int64_t blocks = rows * (cols / block);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t k = 0; k < blocks; k++) fn(w + k * bytes, out + k * block);
    return 0;
}
