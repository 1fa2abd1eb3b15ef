/* Fused float32 operations for the CPU forward pass, called through ctypes by cpu_ops.py.
 *
 * At decode, a small model's step is hundreds of tiny tensor operations (an RMSNorm is seven
 * torch ops, rotary a dozen, paged attention a gather, a mask and SDPA), each costing a few
 * microseconds of dispatch for well under a microsecond of arithmetic. Each function here does
 * one such sequence in a single call. The math is the reference's, in float32; only summation
 * orders (and the last bit of cos / sin / exp) may differ.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
/* q8_0 keys times q8_0 queries as integer dot products, 64 channels an instruction */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define Q8_DOT 1
#else
#define Q8_DOT 0
#endif
#include "axon_kernels.h"

/* Elementwise work (floats) from which a prefill-sized call runs on torch's threads: the
 * threads otherwise spin idle while one does it. */
#define PARALLEL_FLOATS (1 << 16)

static float dot(const float *a, const float *b, int64_t n) {
    float lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] += a[i + l] * b[i + l];
    float s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
              ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* o = xr * rsqrt(mean(xr^2) + eps) * (w, or 1 + w with unit_offset), `dim` values. */
static inline void rms_row(const float *xr, const float *w, float *o, int64_t dim, float eps,
                           int unit_offset) {
    const float inv = 1.0f / sqrtf(dot(xr, xr, dim) / (float)dim + eps);
    int64_t i;
    if (unit_offset)
        for (i = 0; i < dim; i++) o[i] = (xr[i] * inv) * (1.0f + w[i]);
    else
        for (i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
}

/* out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * (w, or 1 + w with unit_offset); rows may be
 * strided (ldx, ldo floats apart), each row's `dim` values contiguous. */
void axon_rms_norm(const float *x, int64_t ldx, const float *w, float *out, int64_t ldo,
                   int64_t rows, int64_t dim, float eps, int unit_offset) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) rms_row(x + r * ldx, w, out + r * ldo, dim, eps, unit_offset);
}

/* The same per head: token t's `heads` rows of `dim` start at x + t * ldx, each next to the last
 * (a q / k view of a fused projection); out [tokens, heads, dim] contiguous. */
void axon_rms_norm_heads(const float *x, int64_t ldx, int64_t heads, const float *w, float *out,
                         int64_t tokens, int64_t dim, float eps, int unit_offset) {
#pragma omp parallel for schedule(static) if (tokens * heads * dim >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++)
            rms_row(x + t * ldx + h * dim, w, out + (t * heads + h) * dim, dim, eps, unit_offset);
}

/* Rotary embedding (neox / rotate-half layout) in place on the first 2 * half channels of each
 * of a token's heads (head_dim floats apart): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin. */
static void rotate_token(float *x, int64_t heads, int64_t head_dim, int64_t half,
                         const float *cos_t, const float *sin_t) {
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = v[i], x2 = v[i + half];
            v[i] = x1 * cos_t[i] - x2 * sin_t[i];
            v[i + half] = x2 * cos_t[i] + x1 * sin_t[i];
        }
    }
}

/* Rotary embedding on the first `rotary_dim` channels of every head, angle = position *
 * inv_freq[i]. Token t's heads start at x + t * ldx, head_dim floats apart. */
void axon_rotary(float *x, int64_t ldx, int64_t tokens, int64_t heads, int64_t head_dim,
                 int64_t rotary_dim, const int64_t *positions, const float *inv_freq) {
    const int64_t half = rotary_dim / 2;
    float cos_t[half > 0 ? half : 1], sin_t[half > 0 ? half : 1];
    for (int64_t t = 0; t < tokens; t++) {
        const float pos = (float)positions[t];
        for (int64_t i = 0; i < half; i++) {
            const float angle = pos * inv_freq[i];
            cos_t[i] = cosf(angle);
            sin_t[i] = sinf(angle);
        }
        rotate_token(x + t * ldx, heads, head_dim, half, cos_t, sin_t);
    }
}

/* cos / sin [tokens, half] of each token's angles, position * inv_freq[i], in the arithmetic
 * axon_rotary (a decode step's) uses: a token's rotation, so its keys and every later layer,
 * must not depend on how many tokens its step computes (a speculative verify chunk's row equals
 * the decode step's to the bit). Split across threads at prefill sizes. */
void axon_rotary_angles(const int64_t *positions, int64_t tokens, const float *inv_freq,
                        int64_t half, float *cos_table, float *sin_table) {
#pragma omp parallel for schedule(static) if (tokens * half >= PARALLEL_FLOATS / 16)
    for (int64_t t = 0; t < tokens; t++) {
        const float pos = (float)positions[t];
        for (int64_t i = 0; i < half; i++) {
            const float angle = pos * inv_freq[i];
            cos_table[t * half + i] = cosf(angle);
            sin_table[t * half + i] = sinf(angle);
        }
    }
}

/* As axon_rotary with each token's angles' cos and sin given ([tokens, rotary_dim / 2] each, so
 * a prefill computes them once for q and k), split across threads at prefill sizes. */
void axon_rotary_table(float *x, int64_t ldx, int64_t tokens, int64_t heads, int64_t head_dim,
                       int64_t rotary_dim, const float *cos_table, const float *sin_table) {
    const int64_t half = rotary_dim / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * rotary_dim >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < tokens; t++)
        rotate_token(x + t * ldx, heads, head_dim, half, cos_table + t * half,
                     sin_table + t * half);
}

/* ---- eight-lane float vectors ------------------------------------------------------------- */

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

/* mask ? a : b, lane by lane (C has no vector ternary). */
static inline f32x8 select8(i32x8 mask, f32x8 a, f32x8 b) {
    return (f32x8)(((i32x8)a & mask) | ((i32x8)b & ~mask));
}

static inline f32x8 load8(const float *p) {
    f32x8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, f32x8 v) { memcpy(p, &v, sizeof v); }

/* exp(x) in float32 to about 1 ulp, a vector at a time in plain vector arithmetic (libm's expf
 * is a call per element): 2^n * exp(r) with r = x - n ln2 (ln2 in two parts), exp(r) by Cephes'
 * expf polynomial, 2^n built in the exponent bits. Defined for each vector width used here. */
#define DEFINE_EXP(NAME, V, IV)                                                                   \
    static inline V NAME(V x) {                                                                \
        const V lo = (V){0} - 87.0f, hi = (V){0} + 88.0f;                                      \
        x = (V)(((IV)lo & (IV)(x < lo)) | ((IV)x & ~(IV)(x < lo)));                            \
        x = (V)(((IV)hi & (IV)(x > hi)) | ((IV)x & ~(IV)(x > hi)));                            \
        const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */    \
        const V n = (x * 1.44269504088896341f + shifter) - shifter;                            \
        V r = x - n * 0.693359375f;                                                            \
        r = r - n * -2.12194440e-4f;                                                           \
        V p = (V){0} + 1.9875691500e-4f;                                                       \
        p = p * r + 1.3981999507e-3f;                                                          \
        p = p * r + 8.3334519073e-3f;                                                          \
        p = p * r + 4.1665795894e-2f;                                                          \
        p = p * r + 1.6666665459e-1f;                                                          \
        p = p * r + 5.0000001201e-1f;                                                          \
        p = p * (r * r) + r + 1.0f;                                                            \
        const IV bits = (__builtin_convertvector(n, IV) + 127) << 23;                          \
        return p * (V)bits;                                                                    \
    }

DEFINE_EXP(exp8, f32x8, i32x8)

/* Lane i of the result = the sum of a[i]'s eight lanes: a transpose folded into the adds. */
static inline f32x8 lane_sums8(const f32x8 a[8]) {
    const i32x8 even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
    const i32x8 low2 = {0, 1, 8, 9, 4, 5, 12, 13}, high2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const i32x8 low4 = {0, 1, 2, 3, 8, 9, 10, 11}, high4 = {4, 5, 6, 7, 12, 13, 14, 15};
    f32x8 pairs[4], quads[2];
    for (int i = 0; i < 4; i++) /* [a0 01, a1 01, a0 23, a1 23, a0 45, a1 45, a0 67, a1 67] */
        pairs[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], even) +
                   __builtin_shuffle(a[2 * i], a[2 * i + 1], odd);
    for (int i = 0; i < 2; i++) /* [a0 0-3, a1 0-3, a2 0-3, a3 0-3, a0 4-7, ..., a3 4-7] */
        quads[i] = __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], low2) +
                   __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], high2);
    return __builtin_shuffle(quads[0], quads[1], low4) +
           __builtin_shuffle(quads[0], quads[1], high4);
}

static inline float max_lanes8(f32x8 v) {
    float m = v[0];
    for (int l = 1; l < 8; l++) m = v[l] > m ? v[l] : m;
    return m;
}

static inline float sum_lanes8(f32x8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* ---- the KV cache's element types ---------------------------------------------------------- */

/* A KV cache (kv_type) holds float32, float16 (half the bytes read a decode step, as
 * llama.cpp's default cache: written rounded to nearest even, as torch's .to(float16)), or q8_0
 * (17/32 of float16's bytes: llama.cpp's q8_0, each group of Q8_GROUP channels of a head as int8
 * values times one float16 scale). The attention kernels widen a few rows at a time back to
 * float32, read in place from the cache (q8_0 keys at decode: integer products, Q8_DOT). */
typedef _Float16 half;
enum { KV_F32 = 0, KV_F16 = 1, KV_Q8 = 2 };

/* q8_0's group: 32 channels, or the whole head where head_dim is no multiple of 32. A head's
 * row is its head_dim int8 values, then its head_dim / group float16 scales
 * (layers/kv_quant.py lays it out the same). */
#define Q8_GROUP(D) ((D) % 32 ? (D) : 32)

/* Bytes of one KV head of one cache slot. */
static inline int64_t kv_head_bytes(int kv_type, int64_t D) {
    if (kv_type == KV_Q8) return D + 2 * (D / Q8_GROUP(D));
    return kv_type == KV_F16 ? 2 * D : 4 * D;
}

/* Eight or sixteen lanes at a time where the CPU converts vectors (F16C, AVX-512): GCC leaves
 * the _Float16 loops scalar, each conversion waiting on the last (~4 cycles a value). */
static inline void widen(const half *src, float *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
#endif
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = (float)src[i];
}

/* dst = src rounded to float16, to nearest even. */
static inline void narrow(const float *src, half *dst, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) dst[i] = (half)src[i];
}

/* A head's D channels quantized to q8_0 at dst: per group, scale = fp16(max |x| / 127) and
 * value = round(x / scale) (half to even), the same arithmetic as quantize_q8 (kv_quant.py),
 * so the two write the same bytes. */
static void quantize_head(const float *x, uint8_t *dst, int64_t D) {
    const int64_t G = Q8_GROUP(D);
    int8_t *values = (int8_t *)dst;
    for (int64_t g = 0; g < D; g += G) {
        float amax = 0.0f;
        for (int64_t i = g; i < g + G; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        const half scale = (half)(amax / 127.0f);
        const float d = (float)scale;
        for (int64_t i = g; i < g + G; i++) {
            const float r = d > 0.0f ? nearbyintf(x[i] / d) : 0.0f;
            values[i] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
        }
        memcpy(dst + D + 2 * (g / G), &scale, sizeof scale);
    }
}

/* dst [D] = a q8_0 head's values times their group's scale (exact in float32: 8 x 11 bits). */
static inline void dequantize_head(const uint8_t *src, float *dst, int64_t D) {
    const int64_t G = Q8_GROUP(D);
    const int8_t *values = (const int8_t *)src;
    for (int64_t g = 0; g < D; g += G) {
        half scale;
        memcpy(&scale, src + D + 2 * (g / G), sizeof scale);
        const float d = (float)scale;
        int64_t i = g;
#if defined(__AVX512F__) /* GCC leaves the widening of int8 lanes scalar */
        for (; i + 16 <= g + G; i += 16) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(values + i));
            const __m512i lanes = _mm512_cvtepi8_epi32(bytes);
            _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtepi32_ps(lanes), _mm512_set1_ps(d)));
        }
#endif
        for (; i < g + G; i++) dst[i] = (float)values[i] * d;
    }
}

/* dst [heads, D] float32 = `heads` consecutive heads of a float16 or q8_0 cache slot at src. */
static inline void widen_heads(int kv_type, const char *src, float *dst, int64_t heads,
                               int64_t D) {
    if (kv_type == KV_F16) {
        widen((const half *)src, dst, heads * D);
        return;
    }
    for (int64_t h = 0; h < heads; h++)
        dequantize_head((const uint8_t *)src + h * kv_head_bytes(KV_Q8, D), dst + h * D, D);
}

/* A query head rounded to q8_0 as a cache row is (quantize_head, then back to float32): the
 * attention of a q8_0 cache takes the dot products of q8_0 queries and q8_0 keys, as
 * llama.cpp's does, the same in every build (integer products where the CPU has VNNI) and in
 * the PyTorch twin (kv_quant.round_query). */
static void round_query(const float *q, float *out, int64_t D) {
    uint8_t row[D + 2 * (D / Q8_GROUP(D))];
    quantize_head(q, row, D);
    dequantize_head(row, out, D);
}

/* ---- paged decode attention --------------------------------------------------------------- */

/* Positions are taken eight at a time: eight cache rows (keys, then values) per block. */
#define ROWS 8

/* One unit of decode attention: `kvs` consecutive KV heads of one sequence, `group` query heads
 * each (or, kvs = 1, a part of one KV head's group), over positions [start, len). Query head
 * (kv, h) is at q + (kv * group + h) * head_dim, its scores at scores + (kv * group + h) *
 * width, its output at out + (kv * group + h) * head_dim. */
typedef struct {
    const float *q;
    const char *k, *v;    /* cache + the first KV head's offset; position p's at + slots[p] * row */
    const int64_t *slots; /* the sequence's slots */
    int64_t row, start, len, kvs, group, head_dim; /* row: bytes a cache slot */
    float *stage; /* float16, q8_0 caches: ROWS rows of kvs heads widened to float32 here */
    int kv_type;
} Unit;

/* The cache rows (as float32) of positions p0 .. p0 + ROWS - 1; past len they repeat p0's (read,
 * unused). A float16 or q8_0 cache's rows are widened into the unit's stage first. */
static inline void block_rows(const Unit *u, const char *cache, int64_t p0, const float **rows) {
    const int64_t n = u->len - p0 < ROWS ? u->len - p0 : ROWS, width = u->kvs * u->head_dim;
    for (int j = 0; j < n; j++) {
        const char *at = cache + u->slots[p0 + j] * u->row;
        if (u->stage) {
            widen_heads(u->kv_type, at, u->stage + j * width, u->kvs, u->head_dim);
            rows[j] = u->stage + j * width;
        } else {
            rows[j] = (const float *)at;
        }
    }
    for (int64_t j = n; j < ROWS; j++) rows[j] = rows[0];
}

/* scores[(kv, h), p] = q_(kv, h) . k_(kv, p) * scale (softcapped): a block's key rows are read
 * once for all heads of a KV head (ROWS rows stay in L1 while the heads pass over them), the
 * KV heads of a position next to each other in the cache read in turn; ROWS independent dot
 * products per head, their lanes summed together. */
static void unit_scores(const Unit *u, float scale, float softcap, float *scores, int64_t width) {
    const int64_t D = u->head_dim;
    for (int64_t p0 = u->start; p0 < u->len; p0 += ROWS) {
        const float *rows[ROWS];
        block_rows(u, u->k, p0, rows);
        const int n = u->len - p0 < ROWS ? (int)(u->len - p0) : ROWS;
        for (int64_t hq = 0; hq < u->kvs * u->group; hq++) {
            const int64_t off = hq / u->group * D;
            const float *qh = u->q + hq * D;
            f32x8 acc[ROWS] = {0};
            int64_t i = 0;
            for (; i + 8 <= D; i += 8) {
                const f32x8 qv = load8(qh + i);
                for (int j = 0; j < ROWS; j++) acc[j] += qv * load8(rows[j] + off + i);
            }
            f32x8 s = lane_sums8(acc);
            for (; i < D; i++)
                for (int j = 0; j < ROWS; j++) s[j] += qh[i] * rows[j][off + i];
            s *= scale;
            float *out = scores + hq * width + p0;
            for (int j = 0; j < n; j++)
                out[j] = softcap > 0.0f ? tanhf(s[j] / softcap) * softcap : s[j];
        }
    }
}

#if Q8_DOT
/* Bytes of the prepared queries (prepare_queries) of `heads` heads. */
#define Q8_PREP_BYTES(heads, D) ((heads) * 3 * (D))

/* The unit's query heads for q8_0 keys: per head its q8_0 values (int8 [D]), then per 64
 * channels (a 512-bit vector, two groups) the int32 lanes its accumulator starts from and its
 * groups' scales, each in the eight lanes of its group. Keys are read as unsigned (k + 128, one
 * xor) for VNNI's unsigned x signed product; the start lanes, -16 x the group's query sum in
 * each of its eight lanes, take the 128 x sum back out: the lanes of a group add up to the
 * exact integer dot product. */
static void prepare_queries(const float *q, int64_t heads, int64_t D, uint8_t *prep) {
    const int64_t chunks = D / 64;
    int8_t *values = (int8_t *)prep;
    int32_t *start = (int32_t *)(prep + heads * D);
    float *scales = (float *)(start + heads * chunks * 16);
    uint8_t row[D + 2 * (D / 32)];
    for (int64_t h = 0; h < heads; h++) {
        quantize_head(q + h * D, row, D);
        memcpy(values + h * D, row, D);
        for (int64_t g = 0; g < D / 32; g++) {
            int32_t sum = 0;
            for (int64_t i = 32 * g; i < 32 * g + 32; i++) sum += (int8_t)row[i];
            half scale;
            memcpy(&scale, row + D + 2 * g, sizeof scale);
            for (int64_t lane = 8 * g; lane < 8 * g + 8; lane++) {
                start[h * chunks * 16 + lane] = -16 * sum;
                scales[h * chunks * 16 + lane] = (float)scale;
            }
        }
    }
}

/* unit_scores for a q8_0 cache (D a multiple of 64, at most 512): a block's key rows are
 * flipped to unsigned and their scales spread over their groups' lanes once, then each query
 * head's dot products are VNNI's, scaled per group in float32. */
static void unit_scores_q8(const Unit *u, const uint8_t *prep, float scale, float softcap,
                           float *scores, int64_t width) {
    const int64_t D = u->head_dim, chunks = D / 64, heads = u->kvs * u->group;
    const int64_t head_bytes = kv_head_bytes(KV_Q8, D);
    const int8_t *values = (const int8_t *)prep;
    const int32_t *start = (const int32_t *)(prep + heads * D);
    const float *q_scales = (const float *)(start + heads * chunks * 16);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i upper = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __mmask16 groups = (__mmask16)((1u << (D / 32)) - 1);
    __m512i keys[ROWS][8];
    __m512 key_scales[ROWS][8];
    for (int64_t p0 = u->start; p0 < u->len; p0 += ROWS) {
        const int n = u->len - p0 < ROWS ? (int)(u->len - p0) : ROWS;
        for (int64_t kv = 0; kv < u->kvs; kv++) {
            for (int j = 0; j < n; j++) {
                const uint8_t *row =
                    (const uint8_t *)u->k + u->slots[p0 + j] * u->row + kv * head_bytes;
                const __m512 s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(groups, row + D));
                for (int64_t c = 0; c < chunks; c++) {
                    keys[j][c] = _mm512_xor_si512(_mm512_loadu_si512(row + 64 * c), flip);
                    const __m512i pick = _mm512_add_epi32(_mm512_set1_epi32(2 * c), upper);
                    key_scales[j][c] = _mm512_permutexvar_ps(pick, s);
                }
            }
            for (int64_t hq = kv * u->group; hq < (kv + 1) * u->group; hq++) {
                f32x8 part[ROWS] = {0};
                for (int j = 0; j < n; j++) {
                    __m512 acc = _mm512_setzero_ps();
                    for (int64_t c = 0; c < chunks; c++) {
                        const int64_t at = (hq * chunks + c) * 16;
                        const __m512i dot = _mm512_dpbusd_epi32(
                            _mm512_loadu_si512(start + at), keys[j][c],
                            _mm512_loadu_si512(values + hq * D + 64 * c));
                        const __m512 both =
                            _mm512_mul_ps(key_scales[j][c], _mm512_loadu_ps(q_scales + at));
                        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), both, acc);
                    }
                    const __m256 high =
                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
                    const __m256 folded = _mm256_add_ps(_mm512_castps512_ps256(acc), high);
                    memcpy(&part[j], &folded, sizeof folded);
                }
                const f32x8 s = lane_sums8(part) * scale;
                float *out = scores + hq * width + p0;
                for (int j = 0; j < n; j++)
                    out[j] = softcap > 0.0f ? tanhf(s[j] / softcap) * softcap : s[j];
            }
        }
    }
}
#endif

/* unit_scores for a q8_0 cache: the unit's queries rounded to q8_0 (round_query) in `queries`
 * (its heads x head_dim floats), then VNNI's integer products where the build has them and the
 * head_dim allows, else the float32 products of the rounded values. */
static void unit_scores_of_q8(Unit *u, float *queries, float scale, float softcap, float *scores,
                              int64_t width) {
    const int64_t D = u->head_dim, heads = u->kvs * u->group;
#if Q8_DOT
    if (D % 64 == 0 && D <= 512) {
        prepare_queries(u->q, heads, D, (uint8_t *)queries);
        unit_scores_q8(u, (const uint8_t *)queries, scale, softcap, scores, width);
        return;
    }
#endif
    for (int64_t h = 0; h < heads; h++) round_query(u->q + h * D, queries + h * D, D);
    u->q = queries;
    unit_scores(u, scale, softcap, scores, width);
}

/* scores[start, len) <- exp(score - their maximum), in place; returns the maximum, *total the
 * sum of the exponentials. */
static float exp_row(float *scores, int64_t start, int64_t len, float *total) {
    f32x8 top8 = (f32x8){0} - INFINITY;
    int64_t p = start;
    for (; p + 8 <= len; p += 8) {
        const f32x8 s = load8(scores + p);
        top8 = select8(s > top8, s, top8);
    }
    float top = max_lanes8(top8);
    for (int64_t t = p; t < len; t++) top = scores[t] > top ? scores[t] : top;
    f32x8 total8 = {0};
    for (p = start; p + 8 <= len; p += 8) {
        const f32x8 e = exp8(load8(scores + p) - top);
        store8(scores + p, e);
        total8 += e;
    }
    if (p < len) { /* the last 1-7, through a vector padded with -inf (exp: 0) */
        f32x8 s = (f32x8){0} - INFINITY;
        for (int64_t t = p; t < len; t++) s[t - p] = scores[t] - top;
        const f32x8 e = select8(s > -INFINITY, exp8(s), (f32x8){0});
        for (int64_t t = p; t < len; t++) scores[t] = e[t - p];
        total8 += e;
    }
    *total = sum_lanes8(total8);
    return top;
}

/* scores[start, len) <- their softmax, in place. */
static void softmax_row(float *scores, int64_t start, int64_t len) {
    float total;
    exp_row(scores, start, len, &total);
    const float norm = 1.0f / total;
    for (int64_t p = start; p < len; p++) scores[p] *= norm;
}

/* out_h[i0, i0 + 8 TILE) += sum over the block's n positions of w_h[p] * v_p, for HEADS heads:
 * HEADS x TILE accumulators in registers across the block, each value row read from L1. */
static inline __attribute__((always_inline)) void
weigh_tile(const int HEADS, const int TILE, float *out, int64_t D, const float *weights,
           int64_t width, const float *const *rows, int n, int64_t i0) {
    f32x8 acc[2][8]; /* [HEADS][TILE] used */
    for (int h = 0; h < HEADS; h++)
        for (int t = 0; t < TILE; t++) acc[h][t] = load8(out + h * D + i0 + 8 * t);
    for (int j = 0; j < n; j++) {
        f32x8 v[8];
        for (int t = 0; t < TILE; t++) v[t] = load8(rows[j] + i0 + 8 * t);
        for (int h = 0; h < HEADS; h++) {
            const float w = weights[h * width + j];
            for (int t = 0; t < TILE; t++) acc[h][t] += w * v[t];
        }
    }
    for (int h = 0; h < HEADS; h++)
        for (int t = 0; t < TILE; t++) store8(out + h * D + i0 + 8 * t, acc[h][t]);
}

/* out_h += the block's weighted value rows for `heads` (1 or 2) heads, in tiles of 4 or 8
 * vectors (8 accumulators), then single vectors, then single lanes. */
static void weigh_block(int heads, float *out, int64_t D, const float *weights, int64_t width,
                        const float *const *rows, int n) {
    const int64_t tile = heads == 2 ? 32 : 64;
    int64_t i = 0;
    for (; i + tile <= D; i += tile) {
        if (heads == 2)
            weigh_tile(2, 4, out, D, weights, width, rows, n, i);
        else
            weigh_tile(1, 8, out, D, weights, width, rows, n, i);
    }
    for (; i + 8 <= D; i += 8) {
        if (heads == 2)
            weigh_tile(2, 1, out, D, weights, width, rows, n, i);
        else
            weigh_tile(1, 1, out, D, weights, width, rows, n, i);
    }
    for (; i < D; i++)
        for (int h = 0; h < heads; h++)
            for (int j = 0; j < n; j++) out[h * D + i] += weights[h * width + j] * rows[j][i];
}

/* out [kvs * group, head_dim] = the weights' (scores') sums of value rows, each row read once
 * per block for the heads that share it. */
static void unit_values(const Unit *u, const float *weights, int64_t width, float *out) {
    const int64_t D = u->head_dim, heads = u->kvs * u->group;
    memset(out, 0, heads * D * sizeof(float));
    for (int64_t p0 = u->start; p0 < u->len; p0 += ROWS) {
        const float *rows[ROWS], *kv_rows[ROWS];
        block_rows(u, u->v, p0, rows);
        const int n = u->len - p0 < ROWS ? (int)(u->len - p0) : ROWS;
        for (int64_t kv = 0; kv < u->kvs; kv++) {
            for (int j = 0; j < ROWS; j++) kv_rows[j] = rows[j] + kv * D;
            for (int64_t h = kv * u->group; h < (kv + 1) * u->group; h += 2)
                weigh_block((kv + 1) * u->group - h >= 2 ? 2 : 1, out + h * D, D,
                            weights + h * width + p0, width, kv_rows, n);
        }
    }
}

/* Positions of a part of a context longer than it (axon_decode_split): a fixed number, so a
 * sequence's parts, and so its result to the bit, depend on its context alone, never on the
 * batch or the threads (a speculative verify row equals the decode row of its position). */
static int64_t decode_split = 1024;

/* Sets the positions of a decode context part (> 0; the tests cross parts at a few hundred
 * positions); returns the previous setting. */
int64_t axon_decode_split(int64_t positions) {
    const int64_t previous = decode_split;
    if (positions > 0) decode_split = positions;
    return previous;
}

/* The context [start, len)'s parts: one up to decode_split positions (and for an empty one). */
static inline int64_t context_parts(int64_t start, int64_t len) {
    return len - start <= decode_split ? 1 : (len - start + decode_split - 1) / decode_split;
}

/* The sequence whose parts hold part `part` (first[b] <= part < first[b + 1]). */
static int64_t sequence_of(const int64_t *first, int64_t batch, int64_t part) {
    int64_t lo = 0, hi = batch - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (first[mid] <= part) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* out [D] = the parts' outputs (each unnormalized, as their own maximum's exponentials
 * weighed them) rescaled to the largest maximum, over the sum of their rescaled totals.
 * A part's block: its heads' outputs [heads, D], then their maxima [heads], then totals. */
static void combine_parts(const float *blocks, int64_t parts, int64_t heads, int64_t h,
                          int64_t D, float *out) {
    const int64_t block = heads * (D + 2);
    float top = -INFINITY, total = 0.0f;
    for (int64_t p = 0; p < parts; p++) {
        const float m = blocks[p * block + heads * D + h];
        top = m > top ? m : top;
    }
    memset(out, 0, D * sizeof(float));
    for (int64_t p = 0; p < parts; p++) {
        const float *at = blocks + p * block;
        const float c = expf(at[heads * D + h] - top);
        total += c * at[heads * D + heads + h];
        for (int64_t i = 0; i < D; i++) out[i] += c * at[h * D + i];
    }
    const float norm = 1.0f / total;
    for (int64_t i = 0; i < D; i++) out[i] *= norm;
}

/* One unit's attention over its positions [u->start, u->len): normalized into `o` when they are
 * the whole context, else unnormalized into its part's block (with its heads' maxima and totals
 * at `stats`, `heads` floats apart). */
static void unit_attention(Unit *u, float *queries, float scale, float softcap, float *scores,
                           int64_t width, float *o, float *stats, int64_t heads) {
    if (u->kv_type == KV_Q8)
        unit_scores_of_q8(u, queries, scale, softcap, scores, width);
    else
        unit_scores(u, scale, softcap, scores, width);
    for (int64_t h = 0; h < u->kvs * u->group; h++) {
        if (!stats) {
            softmax_row(scores + h * width, u->start, u->len);
            continue;
        }
        stats[h] = exp_row(scores + h * width, u->start, u->len, &stats[heads + h]);
    }
    unit_values(u, scores, width, o);
}

/* One decode query per sequence over its cached keys, read in place from the paged cache.
 * Returns 0, or -2 when scratch (staging rows, a split context's parts) cannot be allocated.
 *   q        [batch, heads, head_dim], rows ldq floats apart; query head h reads KV head
 *            h / (heads / kv_heads)
 *   k/v      [slots, kv_heads, head_dim] caches
 *   slots    [batch, width] cache slot of each context position (padding beyond its length)
 *   lens     [batch] context lengths; a window > 0 keeps the last `window` positions
 *   softcap  > 0: scores = tanh(scores / softcap) * softcap
 *   out      [batch, heads, head_dim]
 *   kv_type  the caches' element type (KV_F32, KV_F16, KV_Q8)
 * `scratch` holds threads * heads * width floats of scores.
 *
 * Each unit of work is a part of a sequence's context, two passes over its cache (scores, then
 * their softmax's sum of values) that read each key and value row once for the query heads
 * sharing it, a block of positions' KV heads side by side in the cache read in turn. A context
 * longer than decode_split positions is split in parts of it (flash decoding): each part's
 * output, maximum and total are combined after, so one long sequence spreads over the threads
 * with every row still read once. With fewer than two sequences a thread, a unit is also a part
 * of the KV heads; with fewer parts and KV heads than threads, a part of one KV head's query
 * heads (gemma-3-270m has one KV head), at the price of reading its rows once per part. */
int axon_paged_decode_attention(const float *q, int64_t ldq, const void *k_cache,
                                const void *v_cache, const int64_t *slots, int64_t width,
                                const int64_t *lens, int64_t batch, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, float scale, float softcap,
                                int64_t window, float *out, float *scratch, int threads,
                                int kv_type) {
    const int64_t group = heads / kv_heads, D = head_dim;
    int64_t *first = malloc((batch + 1) * sizeof(int64_t)); /* each sequence's first part */
    if (!first) return -2;
    first[0] = 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = lens[b], start = window > 0 && len > window ? len - window : 0;
        first[b + 1] = first[b] + context_parts(start, len);
    }
    const int64_t parts = first[batch];
    int64_t kv_parts = 1, head_parts = 1;
    /* two units a thread at least, for balance: a sequence's KV heads split at no extra reads
     * (by the batch, not the parts: a part of all the KV heads stages more rows than L1 holds) */
    while (kv_parts < kv_heads && batch * kv_parts < 2 * threads) kv_parts++;
    const int64_t kvs = (kv_heads + kv_parts - 1) / kv_parts;
    kv_parts = (kv_heads + kvs - 1) / kvs;
    while (kvs == 1 && head_parts < group && parts * kv_parts * head_parts < threads)
        head_parts++;
    const int64_t part_heads = (group + head_parts - 1) / head_parts;
    head_parts = (group + part_heads - 1) / part_heads;
    const int64_t units = parts * kv_parts * head_parts;
    const int64_t head_bytes = kv_head_bytes(kv_type, D), block = heads * (D + 2);
    float *blocks = parts > batch ? malloc(parts * block * sizeof(float)) : NULL;
    /* a q8_0 cache: the staging rows, then a unit's queries rounded to q8_0 */
    const int64_t queries = kv_type == KV_Q8 ? kvs * part_heads : 0;
    const int64_t stage_floats = (ROWS * kvs + queries) * D;
    int failed = parts > batch && !blocks;
#pragma omp parallel num_threads(threads) if (threads > 1 && !failed) reduction(| : failed)
    {
        float *stage = kv_type ? malloc(stage_floats * sizeof(float)) : NULL;
        failed = (kv_type && !stage) || (parts > batch && !blocks);
#pragma omp for schedule(dynamic)
        for (int64_t unit = 0; unit < units; unit++) {
            if (failed) continue;
#ifdef _OPENMP
            float *scores = scratch + (int64_t)omp_get_thread_num() * heads * width;
#else
            float *scores = scratch;
#endif
            const int64_t part = unit / (kv_parts * head_parts);
            const int64_t b = sequence_of(first, batch, part), n = first[b + 1] - first[b];
            const int64_t kv0 = unit / head_parts % kv_parts * kvs, hp = unit % head_parts;
            const int64_t h0 = kv0 * group + hp * part_heads;
            const int64_t len = lens[b], start = window > 0 && len > window ? len - window : 0;
            const int64_t from = start + (part - first[b]) * decode_split;
            Unit u = {q + b * ldq + h0 * D, (const char *)k_cache + kv0 * head_bytes,
                      (const char *)v_cache + kv0 * head_bytes, slots + b * width,
                      kv_heads * head_bytes, from,
                      n == 1 || from + decode_split > len ? len : from + decode_split,
                      kv0 + kvs <= kv_heads ? kvs : kv_heads - kv0,
                      group - hp * part_heads < part_heads ? group - hp * part_heads : part_heads,
                      D, stage, kv_type};
            float *o = out + (b * heads + h0) * D;
            if (start >= len) {
                memset(o, 0, u.kvs * u.group * D * sizeof(float));
                continue;
            }
            float *at = n > 1 ? blocks + part * block : NULL;
            float *rounded = kv_type == KV_Q8 ? stage + ROWS * kvs * D : NULL;
            unit_attention(&u, rounded, scale, softcap, scores, width,
                           at ? at + h0 * D : o, at ? at + heads * D + h0 : NULL, heads);
        }
        if (blocks) { /* every thread or none reaches the loop (a failed unit: -2 anyway) */
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < batch * heads; bh++) {
                const int64_t b = bh / heads, n = first[b + 1] - first[b];
                if (n > 1)
                    combine_parts(blocks + first[b] * block, n, heads, bh % heads, D,
                                  out + bh * D);
            }
        }
        free(stage);
    }
    free(blocks);
    free(first);
    return failed ? -2 : 0;
}

/* ---- paged prefill attention -------------------------------------------------------------- */

/* A prefill chunk's queries against its keys, read in place from the cache. The query rows of a
 * unit of work, (token, query head) pairs of one KV head, sit in the lanes of two vectors: the
 * scores of a key block are a key-major [keys, rows] tile (each key row's channels broadcast
 * against the transposed queries, so no reduction across lanes), the softmax runs down the
 * rows' lanes online across key blocks (flash attention's running maximum and sum), and the
 * weighted sum of value rows is a [rows, channels] tile (each weight broadcast against a value
 * row). Only the keys a unit's rows can see are read: the causal triangle, not the square. */
#ifdef __AVX512F__
#define PVL 16
#define SCORE_KEYS 8 /* a score tile: SCORE_KEYS keys x the two row vectors */
#define VALUE_ROWS 8 /* a value tile: VALUE_ROWS rows x two vectors of channels */
#else
#define PVL 8
#define SCORE_KEYS 4
#define VALUE_ROWS 4
#endif
#define QROWS (2 * PVL) /* query rows (token, head) a unit */
#define KEYS 64         /* keys a block */

typedef float fv __attribute__((vector_size(4 * PVL)));
typedef int32_t iv __attribute__((vector_size(4 * PVL)));

DEFINE_EXP(expv, fv, iv)

static inline fv loadv(const float *p) {
    fv v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storev(float *p, fv v) { memcpy(p, &v, sizeof v); }

static inline fv selectv(iv mask, fv a, fv b) { return (fv)(((iv)a & mask) | ((iv)b & ~mask)); }

/* One unit: `rows` (token, head) query rows of KV head `kv`; row r is token t0 + r / heads_in,
 * query head h0 + r % heads_in. Each thread's scratch (PREFILL_SCRATCH floats): qt [D, QROWS],
 * s [KEYS, QROWS], o [QROWS, D], then (float16, q8_0 caches) a block's keys and values
 * [KEYS, D]. */
#define PREFILL_SCRATCH(D) ((2 * (D) + KEYS) * QROWS + 2 * KEYS * (D))
typedef struct {
    const float *q;       /* at the unit's first (token, head) */
    const char *k, *v;    /* the caches + KV head kv's offset */
    const int64_t *slots; /* the chunk's key slots, position order */
    int64_t ldq, row, D, rows, heads_in; /* row: bytes a cache slot */
    int64_t first_pos; /* the position of the unit's first token */
    int kv_type;       /* float16, q8_0 caches: a block's rows widened into the thread's scratch */
} PrefillUnit;

/* s[j, :] = the scores of keys j0 + j (j < SCORE_KEYS) against all rows. */
static inline __attribute__((always_inline)) void
score_tile(float *s, const float *qt, const float *const *keys, int64_t D) {
    fv acc[SCORE_KEYS][2];
    for (int j = 0; j < SCORE_KEYS; j++) acc[j][0] = acc[j][1] = (fv){0};
    for (int64_t d = 0; d < D; d++) {
        const fv q0 = loadv(qt + d * QROWS), q1 = loadv(qt + d * QROWS + PVL);
        for (int j = 0; j < SCORE_KEYS; j++) {
            const float kd = keys[j][d];
            acc[j][0] += kd * q0;
            acc[j][1] += kd * q1;
        }
    }
    for (int j = 0; j < SCORE_KEYS; j++) {
        storev(s + j * QROWS, acc[j][0]);
        storev(s + j * QROWS + PVL, acc[j][1]);
    }
}

/* o[r, i0 : i0 + W PVL] += sum over j < n of s[j, r] * values[j][i0 : ...], rows r0 .. r0 + R. */
static inline __attribute__((always_inline)) void
value_tile(const int R, const int W, float *o, int64_t D, const float *s,
           const float *const *values, int n, int64_t r0, int64_t i0) {
    fv acc[VALUE_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int w = 0; w < W; w++) acc[r][w] = loadv(o + (r0 + r) * D + i0 + w * PVL);
    for (int j = 0; j < n; j++) {
        fv x[2];
        for (int w = 0; w < W; w++) x[w] = loadv(values[j] + i0 + w * PVL);
        for (int r = 0; r < R; r++) {
            const float p = s[j * QROWS + r0 + r];
            for (int w = 0; w < W; w++) acc[r][w] += p * x[w];
        }
    }
    for (int r = 0; r < R; r++)
        for (int w = 0; w < W; w++) storev(o + (r0 + r) * D + i0 + w * PVL, acc[r][w]);
}

static void value_block(float *o, int64_t D, int64_t rows, const float *s,
                        const float *const *values, int n) {
    int64_t i = 0;
    for (; i + 2 * PVL <= D; i += 2 * PVL) {
        int64_t r = 0;
        for (; r + VALUE_ROWS <= rows; r += VALUE_ROWS)
            value_tile(VALUE_ROWS, 2, o, D, s, values, n, r, i);
        for (; r < rows; r++) value_tile(1, 2, o, D, s, values, n, r, i);
    }
    for (; i + PVL <= D; i += PVL)
        for (int64_t r = 0; r < rows; r++) value_tile(1, 1, o, D, s, values, n, r, i);
    for (; i < D; i++)
        for (int64_t r = 0; r < rows; r++)
            for (int j = 0; j < n; j++) o[r * D + i] += s[j * QROWS + r] * values[j][i];
}

static void prefill_unit(const PrefillUnit *u, float scale, float softcap, int64_t window,
                         float *out, int64_t ldo, float *scratch) {
    const int64_t D = u->D, rows = u->rows, heads_in = u->heads_in;
    float *qt = scratch, *s = qt + D * QROWS, *o = s + KEYS * QROWS;
    /* the rows' positions and first visible keys, in lanes; padding lanes copy row 0 */
    fv pos[2], lo[2], m[2], l[2];
    for (int w = 0; w < 2; w++) {
        for (int lane = 0; lane < PVL; lane++) {
            const int64_t r = w * PVL + lane < rows ? w * PVL + lane : 0;
            const int64_t p = u->first_pos + r / heads_in;
            pos[w][lane] = (float)p;
            lo[w][lane] = window > 0 && p >= window ? (float)(p - window + 1) : 0.0f;
        }
        m[w] = (fv){0} - INFINITY;
        l[w] = (fv){0};
    }
    float rounded[u->kv_type == KV_Q8 ? D : 1];
    for (int64_t r = 0; r < QROWS; r++) {
        const float *qr = u->q + (r / heads_in) * u->ldq + (r % heads_in) * D;
        if (u->kv_type == KV_Q8 && r < rows) { /* q8_0 queries against q8_0 keys, as decode */
            round_query(qr, rounded, D);
            qr = rounded;
        }
        for (int64_t d = 0; d < D; d++) qt[d * QROWS + r] = r < rows ? qr[d] * scale : 0.0f;
    }
    memset(o, 0, rows * D * sizeof(float));
    const int64_t last_pos = u->first_pos + (rows - 1) / heads_in;
    const int64_t first_lo = window > 0 && u->first_pos >= window ? u->first_pos - window + 1 : 0;
    const int64_t last_lo = window > 0 && last_pos >= window ? last_pos - window + 1 : 0;
    for (int64_t j0 = first_lo; j0 <= last_pos; j0 += KEYS) {
        const int n = last_pos + 1 - j0 < KEYS ? (int)(last_pos + 1 - j0) : KEYS;
        const float *keys[KEYS], *values[KEYS];
        for (int j = 0; j < n; j++) {
            const int64_t at = u->slots[j0 + j] * u->row;
            if (u->kv_type) {
                float *key = o + QROWS * D + j * D, *value = key + KEYS * D;
                widen_heads(u->kv_type, u->k + at, key, 1, D);
                widen_heads(u->kv_type, u->v + at, value, 1, D);
                keys[j] = key, values[j] = value;
            } else {
                keys[j] = (const float *)(u->k + at), values[j] = (const float *)(u->v + at);
            }
        }
        for (int j = n; j < KEYS; j++) keys[j] = keys[0], values[j] = values[0];
        for (int j = 0; j < n; j += SCORE_KEYS) score_tile(s + j * QROWS, qt, keys + j, D);
        if (softcap > 0.0f)
            for (int64_t i = 0; i < n * QROWS; i++) s[i] = tanhf(s[i] / softcap) * softcap;
        const int masked = j0 + n - 1 > u->first_pos || j0 < last_lo;
        fv top[2] = {m[0], m[1]};
        for (int j = 0; j < n; j++)
            for (int w = 0; w < 2; w++) {
                fv x = loadv(s + j * QROWS + w * PVL);
                if (masked) {
                    const fv key = (fv){0} + (float)(j0 + j);
                    x = selectv((iv)(key > pos[w]) | (iv)(key < lo[w]), (fv){0} - INFINITY, x);
                    storev(s + j * QROWS + w * PVL, x);
                }
                top[w] = selectv((iv)(x > top[w]), x, top[w]);
            }
        fv shift[2], rescale[2];
        for (int w = 0; w < 2; w++) { /* a row that has seen no key yet keeps 0 (no NaN) */
            const iv none = (iv)(top[w] == (fv){0} - INFINITY);
            shift[w] = selectv(none, (fv){0}, top[w]);
            rescale[w] = selectv((iv)(m[w] == (fv){0} - INFINITY), (fv){0},
                                 expv(m[w] - shift[w]));
            l[w] *= rescale[w];
            m[w] = top[w];
        }
        for (int j = 0; j < n; j++)
            for (int w = 0; w < 2; w++) {
                const fv x = loadv(s + j * QROWS + w * PVL);
                fv e = expv(x - shift[w]);
                if (masked) e = selectv((iv)(x == (fv){0} - INFINITY), (fv){0}, e);
                storev(s + j * QROWS + w * PVL, e);
                l[w] += e;
            }
        if (j0 > first_lo)
            for (int64_t r = 0; r < rows; r++) {
                const float c = rescale[r / PVL][r % PVL];
                if (c != 1.0f)
                    for (int64_t i = 0; i < D; i++) o[r * D + i] *= c;
            }
        value_block(o, D, rows, s, values, n);
    }
    for (int64_t r = 0; r < rows; r++) {
        const float norm = 1.0f / l[r / PVL][r % PVL];
        float *dst = out + (r / heads_in) * ldo + (r % heads_in) * D;
        for (int64_t i = 0; i < D; i++) dst[i] = o[r * D + i] * norm;
    }
}

/* Prefill attention for every chunk of a step, each query over the keys it may see, read in
 * place from the paged cache (the step's keys already written).
 *   q        [tokens, heads, head_dim], token rows ldq floats apart; query head h reads KV head
 *            h / (heads / kv_heads)
 *   k/v      [slots, kv_heads, head_dim] caches
 *   chunks   [n_chunks, 4]: query_start, query_len, context_len, offset of its key slots in
 *            `slots` (context_len of them, position order); query i is at position
 *            context_len - query_len + i and sees keys up to it (the last `window` of them when
 *            window > 0)
 *   softcap  > 0: scores = tanh(scores / softcap) * softcap
 *   out      [tokens, heads, head_dim]: the chunks' rows written, others untouched
 *   kv_type  the caches' element type (KV_F32, KV_F16, KV_Q8)
 * A unit of work is one KV head's query rows for a block of tokens; the longest (latest tokens)
 * are handed out first. Returns 0, or -2 when a thread's scratch cannot be allocated. */
int axon_paged_prefill_attention(const float *q, int64_t ldq, const void *k_cache,
                                 const void *v_cache, const int64_t *slots,
                                 const int64_t *chunks, int64_t n_chunks, int64_t heads,
                                 int64_t kv_heads, int64_t head_dim, float scale, float softcap,
                                 int64_t window, float *out, int threads, int kv_type) {
    const int64_t D = head_dim, group = heads / kv_heads, head_bytes = kv_head_bytes(kv_type, D);
    const int64_t heads_in = group < QROWS ? group : QROWS;
    const int64_t parts = (group + heads_in - 1) / heads_in, tokens_in = QROWS / heads_in;
    int64_t units = 0;
    for (int64_t c = 0; c < n_chunks; c++)
        units += (chunks[4 * c + 1] + tokens_in - 1) / tokens_in * kv_heads * parts;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        float *scratch = malloc(PREFILL_SCRATCH(D) * sizeof(float));
        failed = !scratch;
#pragma omp for schedule(dynamic)
        for (int64_t unit = 0; unit < units; unit++) {
            if (!scratch) continue;
            int64_t c = 0, first = 0, blocks = 0;
            for (;; c++) { /* the chunk holding this unit */
                blocks = (chunks[4 * c + 1] + tokens_in - 1) / tokens_in;
                if (unit < first + blocks * kv_heads * parts) break;
                first += blocks * kv_heads * parts;
            }
            const int64_t *chunk = chunks + 4 * c, i = unit - first;
            const int64_t block = blocks - 1 - i / (kv_heads * parts);
            const int64_t kv = i / parts % kv_heads, part = i % parts;
            const int64_t t0 = block * tokens_in;
            const int64_t ntok = chunk[1] - t0 < tokens_in ? chunk[1] - t0 : tokens_in;
            const int64_t h_in = group - part * heads_in < heads_in ? group - part * heads_in
                                                                   : heads_in;
            const int64_t h0 = kv * group + part * heads_in;
            const int64_t tok = chunk[0] + t0;
            PrefillUnit u = {q + tok * ldq + h0 * D, (const char *)k_cache + kv * head_bytes,
                             (const char *)v_cache + kv * head_bytes, slots + chunk[3], ldq,
                             kv_heads * head_bytes, D, ntok * h_in, h_in, chunk[2] - chunk[1] + t0,
                             kv_type};
            prefill_unit(&u, scale, softcap, window, out + (tok * heads + h0) * D, heads * D,
                         scratch);
        }
        free(scratch);
    }
    return failed ? -2 : 0;
}

/* ---- gated activations -------------------------------------------------------------------- */

/* act(gate) * up for eight lanes: silu (kind 0), or gelu with the tanh approximation written as
 * g * sigmoid(2u), the same function as 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3). */
static inline f32x8 act_mul8(f32x8 g, f32x8 up, int kind) {
    if (kind == 0) return g / (1.0f + exp8(-g)) * up;
    const f32x8 u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return g / (1.0f + exp8(-2.0f * u)) * up;
}

/* out [T, I] = act(x[:, :I]) * x[:, I:] for x [T, 2I] (rows ldx apart). */
void axon_act_and_mul(const float *x, int64_t ldx, float *out, int64_t tokens, int64_t inter,
                      int kind) {
#pragma omp parallel for schedule(static) if (tokens * inter >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *gate = x + t * ldx, *up = gate + inter;
        float *o = out + t * inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) {
            f32x8 g, u;
            memcpy(&g, gate + i, sizeof g);
            memcpy(&u, up + i, sizeof u);
            const f32x8 r = act_mul8(g, u, kind);
            memcpy(o + i, &r, sizeof r);
        }
        if (i < inter) { /* the last 1-7 lanes, through a zero-padded vector */
            f32x8 g = {0}, u = {0};
            for (int64_t l = 0; l < inter - i; l++) g[l] = gate[i + l], u[l] = up[i + l];
            const f32x8 r = act_mul8(g, u, kind);
            for (int64_t l = 0; l < inter - i; l++) o[i + l] = r[l];
        }
    }
}

/* ---- the KV cache write ------------------------------------------------------------------- */

/* k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t]; rows of `heads` heads of head_dim
 * values, k / v token rows ldk / ldv floats apart, in the caches' kv_type: float16 rounded to
 * nearest even, q8_0 quantized per head (quantize_head). */
void axon_cache_write(const float *k, int64_t ldk, const float *v, int64_t ldv,
                      const int64_t *slots, int64_t tokens, int64_t heads, int64_t head_dim,
                      void *k_cache, void *v_cache, int kv_type) {
    const int64_t width = heads * head_dim, head_bytes = kv_head_bytes(kv_type, head_dim);
#pragma omp parallel for schedule(static) if (kv_type == KV_Q8 && tokens * width >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t at = slots[t] * heads * head_bytes;
        if (kv_type == KV_F32) {
            memcpy((char *)k_cache + at, k + t * ldk, width * sizeof(float));
            memcpy((char *)v_cache + at, v + t * ldv, width * sizeof(float));
        } else if (kv_type == KV_F16) {
            narrow(k + t * ldk, (half *)((char *)k_cache + at), width);
            narrow(v + t * ldv, (half *)((char *)v_cache + at), width);
        } else {
            for (int64_t h = 0; h < heads; h++) {
                const int64_t to = at + h * head_bytes;
                quantize_head(k + t * ldk + h * head_dim, (uint8_t *)k_cache + to, head_dim);
                quantize_head(v + t * ldv + h * head_dim, (uint8_t *)v_cache + to, head_dim);
            }
        }
    }
}
