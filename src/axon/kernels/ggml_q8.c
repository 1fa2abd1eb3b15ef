/* GGML weights times 8-bit activations (opt-in, batched steps): y = x @ W.T where each token's
 * x is first quantized on its own, as llama.cpp does, and the products are integer dot products
 * of the weights' codes with the activations' int8 values. Built with the other C kernels into
 * one library (build.py); called by ggml_q8.py.
 *
 * Activations, per token, per block:
 *   - Q8_K for the K-quants (Q4_K, Q5_K, Q6_K): 256 values, a float scale d = max|x| / 127,
 *     int8 values round(x / d) (ties to even), and the sums of the values over each 16;
 *   - Q8_0 / Q8_1 for the legacy formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): 32 values, the same
 *     float scale and rounding, and s = d * sum(values) for the formats with a bias.
 * (llama.cpp stores the Q8_0 / Q8_1 scales in fp16; here they stay float32.)
 *
 * Weights: each block is decoded once per call into unsigned codes (Q8_0: its signed codes),
 * integer sub-scales and float scales, for a group of GROUP rows at a time; every token of the
 * call is then multiplied with those rows, TILE tokens per call of the dot product (the codes and
 * sub-scales loaded once for all of them). Threads take groups of rows (dynamically). Per block
 * of one row and one token:
 *   K-quants: d_w * d_x * sum_j(sc_j * sum(code * q)) - dmin_w * d_x * sum_i(mn_i * bsum_i),
 *             where for Q6_K (codes 0..63 for -32..31) mn = sc per 16 and dmin = 32 * d;
 *   legacy:   d_w * d_x * sum(code * q) + bias_w * s_x, bias = m (Q4_1, Q5_1), -8 d (Q4_0),
 *             -16 d (Q5_0), none (Q8_0).
 * The integer sums are exact. One compiled function (noinline) computes every (row, token)
 * result over the row's blocks in order, so a token's result is the same bits whatever the
 * rest of the batch, the group or the thread it lands in.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

enum { F32 = 0, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

#define GROUP 8 /* rows decoded together: their codes stay in L1 / L2 for every token */
#define NOINLINE static __attribute__((noinline))

static float f16(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

static int is_k(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

/* Values per weight block (0: not handled here), and the block's bytes. */
static int q8_block(int type) {
    switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return 32;
    case Q4_K: case Q5_K: case Q6_K: return 256;
    default: return 0;
    }
}

static int q8_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    default: return 210; /* Q6_K */
    }
}

int axon_q8_supported(int type) { return q8_block(type) != 0; }

/* ---- activations ------------------------------------------------------------------------ */

/* n values of x -> int8 q; returns the scale d (max|x| / 127, 0 for a zero block). */
static float quantize_block(const float *x, int n, int8_t *q) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < n; i++) q[i] = (int8_t)nearbyintf(x[i] * id);
    return d;
}

typedef struct {
    int8_t *q;      /* [tokens][cols] */
    float *d;       /* [tokens][cols / B] block scales */
    int16_t *bsums; /* Q8_K: [tokens][cols / 16] sums of q over each 16 */
    float *s;       /* Q8_1: [tokens][cols / 32] d * sum(q) */
} Acts;

static void quantize_token_k(const float *x, int64_t cols, int8_t *q, float *d, int16_t *bsums) {
    for (int64_t k = 0; k < cols / 256; k++) {
        d[k] = quantize_block(x + 256 * k, 256, q + 256 * k);
        for (int i = 0; i < 16; i++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += q[256 * k + 16 * i + j];
            bsums[16 * k + i] = (int16_t)sum;
        }
    }
}

static void quantize_token_32(const float *x, int64_t cols, int8_t *q, float *d, float *s) {
    for (int64_t k = 0; k < cols / 32; k++) {
        d[k] = quantize_block(x + 32 * k, 32, q + 32 * k);
        int sum = 0;
        for (int j = 0; j < 32; j++) sum += q[32 * k + j];
        s[k] = d[k] * (float)sum;
    }
}

/* ---- decoded weight rows ---------------------------------------------------------------- */

typedef struct {
    uint8_t *codes;  /* [GROUP][cols] unsigned codes (Q8_0: int8) */
    int16_t *scales; /* K: [GROUP][blocks][8][16] multipliers of sub-block j's pair sums */
    int16_t *mins;   /* K: [GROUP][blocks][16] multipliers of the 16 bsums */
    float *d;        /* [GROUP][blocks] */
    float *dmin;     /* [GROUP][blocks] K: dmin (Q6_K: 32 d); legacy: the bias per block */
} Rows;

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (llama.cpp's get_scale_min_k4). */
static void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63, *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* The 256 codes of a K-quant block, unsigned (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63). */
static void k_codes(int type, const uint8_t *b, uint8_t *codes) {
#ifdef __AVX2__
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    if (type == Q6_K) {
        for (int half = 0; half < 2; half++)
            for (int part = 0; part < 4; part++) {
                const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * half + 32 * (part & 1)));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
                const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (part >> 1)), low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * part), _mm256_set1_epi8(3));
                _mm256_storeu_si256((__m256i *)(codes + 128 * half + 32 * part),
                                    _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)));
            }
        return;
    }
    const uint8_t *qs = b + (type == Q4_K ? 16 : 48);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)); /* Q5_K's fifth bits */
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        if (type == Q5_K) {
            const __m256i blo = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one);
            const __m256i bhi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one);
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(blo, 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(bhi, 4));
        }
        _mm256_storeu_si256((__m256i *)(codes + 64 * c), lo);
        _mm256_storeu_si256((__m256i *)(codes + 64 * c + 32), hi);
    }
#else
    for (int e = 0; e < 256; e++) {
        const int sub = e / 32, i = e % 32;
        int code;
        if (type == Q4_K) {
            code = (b[16 + 32 * (sub / 2) + i] >> (4 * (sub & 1))) & 0x0F;
        } else if (type == Q5_K) {
            code = ((b[48 + 32 * (sub / 2) + i] >> (4 * (sub & 1))) & 0x0F) |
                   (((b[16 + i] >> sub) & 1) << 4);
        } else {
            const int half = e / 128, part = (e / 32) & 3;
            const int lo = (b[64 * half + 32 * (part & 1) + i] >> (4 * (part >> 1))) & 0x0F;
            code = lo | (((b[128 + 32 * half + i] >> (2 * part)) & 3) << 4);
        }
        codes[e] = (uint8_t)code;
    }
#endif
}

/* A K-quant block: codes, the per-sub-block multipliers, the bsum multipliers, d and dmin. */
static void decode_k(int type, const uint8_t *b, uint8_t *codes, int16_t *scales, int16_t *mins,
                     float *d, float *dmin) {
    k_codes(type, b, codes);
    if (type == Q6_K) {
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 16; i++) scales[16 * j + i] = sc[2 * j + i / 8];
        for (int i = 0; i < 16; i++) mins[i] = sc[i];
        *d = f16(b + 208);
        *dmin = 32.0f * *d; /* codes carry +32: subtract 32 * sc * bsum */
        return;
    }
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        for (int i = 0; i < 16; i++) scales[16 * j + i] = (int16_t)sc;
        mins[2 * j] = mins[2 * j + 1] = (int16_t)mn;
    }
    *d = f16(b), *dmin = f16(b + 2);
}

/* A legacy block: 32 codes (unsigned; Q8_0 signed), d, and the bias per block. */
static void decode_32(int type, const uint8_t *b, uint8_t *codes, float *d, float *bias) {
    *d = f16(b);
    if (type == Q8_0) {
        memcpy(codes, b + 2, 32);
        *bias = 0.0f;
        return;
    }
    const int qs = type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
    uint32_t qh = 0;
    if (type == Q5_0 || type == Q5_1) memcpy(&qh, b + qs - 4, 4);
#ifdef __AVX2__
    /* Low nibbles are codes 0-15, high nibbles 16-31; bit i of qh is code i's fifth bit. */
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(b + qs)), low4 = _mm_set1_epi8(0x0F);
    __m256i c = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4),
                                 _mm_and_si128(bytes, low4));
    const __m256i which = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                            0x0101010101010101, 0x0000000000000000);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)qh), which);
    const __m256i fifth = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    c = _mm256_or_si256(c, _mm256_and_si256(fifth, _mm256_set1_epi8(16)));
    _mm256_storeu_si256((__m256i *)codes, c);
#else
    for (int i = 0; i < 16; i++) {
        codes[i] = (uint8_t)((b[qs + i] & 0x0F) | (((qh >> i) & 1) << 4));
        codes[i + 16] = (uint8_t)((b[qs + i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
    }
#endif
    *bias = type == Q4_1 || type == Q5_1 ? f16(b + 2) : type == Q4_0 ? -8.0f * *d : -16.0f * *d;
}

/* Row r of the group (blocks of `type` at w) into `rows`. */
static void decode_row(int type, const uint8_t *w, int64_t blocks, const Rows *rows, int r,
                       int64_t cols) {
    const int B = q8_block(type), bytes = q8_bytes(type);
    for (int64_t k = 0; k < blocks; k++) {
        const uint8_t *b = w + k * bytes;
        uint8_t *codes = rows->codes + r * cols + k * B;
        float *d = rows->d + r * blocks + k, *dmin = rows->dmin + r * blocks + k;
        if (B == 256)
            decode_k(type, b, codes, rows->scales + (r * blocks + k) * 128,
                     rows->mins + (r * blocks + k) * 16, d, dmin);
        else
            decode_32(type, b, codes, d, dmin);
    }
}

/* ---- dot products of one row with TT tokens --------------------------------------------- */

/* The activations of one token as the dot products read them. */
typedef struct {
    const int8_t *q;
    const float *d;
    const void *sums; /* Q8_K: int16 bsums; Q8_1: float s */
} Token;

#ifdef __AVX2__
static inline float hsum8(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

/* K-quants, one row, TT tokens: per block, d_w d_x isum - dmin_w d_x msum into eight lanes. A
 * token's lanes see the same operations whatever TT: only loads of codes and scales are shared. */
#define DOT_K(name, TT)                                                                           \
    NOINLINE void name(const uint8_t *codes, const int16_t *scales, const int16_t *mins,          \
                       const float *d, const float *dmin, int64_t blocks, const Token *x,         \
                       float *y, int64_t ldy) {                                                   \
        __m256 acc[TT];                                                                           \
        for (int t = 0; t < TT; t++) acc[t] = _mm256_setzero_ps();                                \
        for (int64_t k = 0; k < blocks; k++) {                                                    \
            __m256i sum[TT];                                                                      \
            for (int t = 0; t < TT; t++) sum[t] = _mm256_setzero_si256();                         \
            for (int j = 0; j < 8; j++) {                                                         \
                const __m256i c = _mm256_load_si256((const __m256i *)(codes + 256 * k + 32 * j)); \
                const __m256i s = _mm256_load_si256((const __m256i *)(scales + 128 * k + 16 * j)); \
                for (int t = 0; t < TT; t++) {                                                    \
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(x[t].q + 256 * k + 32 * j)); \
                    sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(_mm256_maddubs_epi16(c, v), s)); \
                }                                                                                 \
            }                                                                                     \
            const __m256i mn = _mm256_load_si256((const __m256i *)(mins + 16 * k));               \
            for (int t = 0; t < TT; t++) {                                                        \
                const int16_t *bsums = (const int16_t *)x[t].sums + 16 * k;                       \
                const __m256i m = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)bsums), mn); \
                const float dx = x[t].d[k];                                                       \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_set1_ps(d[k] * dx), acc[t]); \
                acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(dmin[k] * dx), acc[t]); \
            }                                                                                     \
        }                                                                                         \
        for (int t = 0; t < TT; t++) y[t * ldy] = hsum8(acc[t]);                                  \
    }

/* The integer sums of codes * q over eight 32-wide blocks, one block per lane. */
static inline __m256i block_sums8(const uint8_t *codes, const int8_t *q, int is_signed) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i p[8];
    for (int b = 0; b < 8; b++) {
        const __m256i c = _mm256_load_si256((const __m256i *)(codes + 32 * b));
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * b));
        const __m256i u = is_signed ? _mm256_abs_epi8(c) : c;
        p[b] = _mm256_madd_epi16(_mm256_maddubs_epi16(u, is_signed ? _mm256_sign_epi8(v, c) : v), ones);
    }
    const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20),
                            _mm256_permute2x128_si256(h0, h1, 0x31));
}

/* The integer sum of codes * q over one 32-wide block. */
static inline int32_t block_sum(const uint8_t *codes, const int8_t *q, int is_signed) {
    const __m256i c = _mm256_load_si256((const __m256i *)codes);
    const __m256i v = _mm256_loadu_si256((const __m256i *)q);
    const __m256i u = is_signed ? _mm256_abs_epi8(c) : c;
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, is_signed ? _mm256_sign_epi8(v, c) : v),
                                        _mm256_set1_epi16(1));
    const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    const __m128i q2 = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
    return _mm_cvtsi128_si32(_mm_add_epi32(q2, _mm_shuffle_epi32(q2, 1)));
}

/* Legacy formats, one row, TT tokens: eight blocks at a time, lane b holding block b's
 * d_w d_x isum (+ bias_w s_x); blocks past a multiple of eight one by one. */
#define DOT_32(name, TT, SIGNED, BIASED)                                                          \
    NOINLINE void name(const uint8_t *codes, const float *d, const float *bias, int64_t blocks,   \
                       const Token *x, float *y, int64_t ldy) {                                   \
        for (int t = 0; t < TT; t++) {                                                            \
            const float *xs = (const float *)x[t].sums;                                           \
            __m256 acc = _mm256_setzero_ps();                                                     \
            int64_t k = 0;                                                                        \
            for (; k + 8 <= blocks; k += 8) {                                                     \
                const __m256i sums = block_sums8(codes + 32 * k, x[t].q + 32 * k, SIGNED);        \
                const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(d + k), _mm256_loadu_ps(x[t].d + k)); \
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);                      \
                if (BIASED) acc = _mm256_fmadd_ps(_mm256_loadu_ps(bias + k), _mm256_loadu_ps(xs + k), acc); \
            }                                                                                     \
            float total = hsum8(acc);                                                             \
            for (; k < blocks; k++) {                                                             \
                const float isum = (float)block_sum(codes + 32 * k, x[t].q + 32 * k, SIGNED);    \
                total = fmaf(isum, d[k] * x[t].d[k], total); /* fmaf: the same rounding in */     \
                if (BIASED) total = fmaf(bias[k], xs[k], total); /* every TT's copy */            \
            }                                                                                     \
            y[t * ldy] = total;                                                                   \
        }                                                                                         \
    }
#else /* portable: one token at a time, the same function for every TT */
static void dot_k_one(const uint8_t *codes, const int16_t *scales, const int16_t *mins,
                      const float *d, const float *dmin, int64_t blocks, const Token *x, float *y) {
    const int16_t *bsums = (const int16_t *)x->sums;
    float acc = 0.0f;
    for (int64_t k = 0; k < blocks; k++) {
        int32_t sum = 0, msum = 0;
        for (int i = 0; i < 256; i++) {
            const int scale = scales[128 * k + 16 * (i / 32) + 8 * (i % 32 / 16)];
            sum += codes[256 * k + i] * x->q[256 * k + i] * scale;
        }
        for (int i = 0; i < 16; i++) msum += bsums[16 * k + i] * mins[16 * k + i];
        acc += (float)sum * (d[k] * x->d[k]) - (float)msum * (dmin[k] * x->d[k]);
    }
    *y = acc;
}

static void dot_32_one(int is_signed, const uint8_t *codes, const float *d, const float *bias,
                       int64_t blocks, const Token *x, float *y) {
    float total = 0.0f, tail = 0.0f;
    for (int64_t k = 0; k < blocks; k++) {
        int32_t sum = 0;
        for (int i = 0; i < 32; i++)
            sum += (is_signed ? (int8_t)codes[32 * k + i] : codes[32 * k + i]) * x->q[32 * k + i];
        total += (float)sum * (d[k] * x->d[k]);
        if (!is_signed) tail += bias[k] * ((const float *)x->sums)[k];
    }
    *y = total + tail;
}

#define DOT_K(name, TT)                                                                           \
    NOINLINE void name(const uint8_t *codes, const int16_t *scales, const int16_t *mins,          \
                       const float *d, const float *dmin, int64_t blocks, const Token *x,         \
                       float *y, int64_t ldy) {                                                   \
        for (int t = 0; t < TT; t++) dot_k_one(codes, scales, mins, d, dmin, blocks, x + t, y + t * ldy); \
    }
#define DOT_32(name, TT, SIGNED, BIASED)                                                          \
    NOINLINE void name(const uint8_t *codes, const float *d, const float *bias, int64_t blocks,   \
                       const Token *x, float *y, int64_t ldy) {                                   \
        for (int t = 0; t < TT; t++) dot_32_one(SIGNED, codes, d, bias, blocks, x + t, y + t * ldy); \
    }
#endif

#define TILE 4 /* tokens per dot-product call: codes and scales loaded once for all four */
DOT_K(dot_k1, 1)
DOT_K(dot_k2, 2)
DOT_K(dot_k3, 3)
DOT_K(dot_k4, 4)
DOT_32(dot_s1, 1, 1, 0)
DOT_32(dot_s2, 2, 1, 0)
DOT_32(dot_s3, 3, 1, 0)
DOT_32(dot_s4, 4, 1, 0)
DOT_32(dot_b1, 1, 0, 1)
DOT_32(dot_b2, 2, 0, 1)
DOT_32(dot_b3, 3, 0, 1)
DOT_32(dot_b4, 4, 0, 1)

typedef void (*dot_k_fn)(const uint8_t *, const int16_t *, const int16_t *, const float *,
                         const float *, int64_t, const Token *, float *, int64_t);
typedef void (*dot_32_fn)(const uint8_t *, const float *, const float *, int64_t, const Token *,
                          float *, int64_t);
static const dot_k_fn DOT_K_FNS[TILE] = {dot_k1, dot_k2, dot_k3, dot_k4};
static const dot_32_fn DOT_SIGNED_FNS[TILE] = {dot_s1, dot_s2, dot_s3, dot_s4};
static const dot_32_fn DOT_BIASED_FNS[TILE] = {dot_b1, dot_b2, dot_b3, dot_b4};

/* ---- the matmul ------------------------------------------------------------------------- */

/* y [t][n0 + r] for rows [n0, n0 + count) of one part and every token: the rows decoded once,
 * then multiplied with TILE tokens at a time. */
static void group_rows(int type, const uint8_t *w, int64_t n0, int count, int64_t cols,
                       const Rows *rows, const Acts *acts, int64_t tokens, float *y, int64_t ldy) {
    const int B = q8_block(type);
    const int64_t blocks = cols / B, row_bytes = blocks * q8_bytes(type);
    for (int r = 0; r < count; r++) decode_row(type, w + (n0 + r) * row_bytes, blocks, rows, r, cols);
    for (int64_t t0 = 0; t0 < tokens; t0 += TILE) {
        const int tt = (int)(tokens - t0 < TILE ? tokens - t0 : TILE);
        Token x[TILE];
        for (int t = 0; t < tt; t++) {
            x[t].q = acts->q + (t0 + t) * cols;
            x[t].d = acts->d + (t0 + t) * blocks;
            x[t].sums = B == 256 ? (const void *)(acts->bsums + (t0 + t) * (cols / 16))
                                 : (const void *)(acts->s + (t0 + t) * blocks);
        }
        for (int r = 0; r < count; r++) {
            /* Row r of the next group, fetched while this one multiplies: the hardware
             * prefetcher idles through the products, and at 4 tokens a Q8_0 product stalled
             * on memory most of the time when the next group's bytes were first read cold. */
            if (t0 == 0)
                for (int64_t line = 0; line < row_bytes; line += 64)
                    __builtin_prefetch(w + (n0 + GROUP + r) * row_bytes + line);
            const uint8_t *codes = rows->codes + r * cols;
            const float *d = rows->d + r * blocks, *dmin = rows->dmin + r * blocks;
            float *out = y + t0 * ldy + n0 + r;
            if (B == 256)
                DOT_K_FNS[tt - 1](codes, rows->scales + r * blocks * 128,
                                  rows->mins + r * blocks * 16, d, dmin, blocks, x, out, ldy);
            else
                (type == Q8_0 ? DOT_SIGNED_FNS : DOT_BIASED_FNS)[tt - 1](codes, d, dmin, blocks, x,
                                                                        out, ldy);
        }
    }
}

static int alloc_acts(Acts *acts, int k_quants, int64_t tokens, int64_t cols) {
    const int64_t B = k_quants ? 256 : 32;
    acts->q = malloc((size_t)(tokens * cols));
    acts->d = malloc(sizeof(float) * (size_t)(tokens * cols / B));
    acts->bsums = k_quants ? malloc(sizeof(int16_t) * (size_t)(tokens * cols / 16)) : NULL;
    acts->s = k_quants ? NULL : malloc(sizeof(float) * (size_t)(tokens * cols / 32));
    return acts->q && acts->d && (k_quants ? acts->bsums != NULL : acts->s != NULL);
}

static void free_acts(Acts *acts) {
    free(acts->q), free(acts->d), free(acts->bsums), free(acts->s);
}

static int alloc_rows(Rows *rows, int64_t cols) {
    const size_t n = (size_t)(GROUP * cols), blocks = (size_t)(GROUP * cols / 32);
    /* aligned_alloc wants a multiple of the alignment; codes and scales are (cols % 32 == 0) */
    rows->codes = aligned_alloc(64, n);
    rows->scales = aligned_alloc(64, sizeof(int16_t) * n / 2); /* K: 128 per 256 values */
    rows->mins = aligned_alloc(64, (sizeof(int16_t) * n / 16 + 63) / 64 * 64);
    rows->d = malloc(sizeof(float) * blocks);
    rows->dmin = malloc(sizeof(float) * blocks);
    return rows->codes && rows->scales && rows->mins && rows->d && rows->dmin;
}

static void free_rows(Rows *rows) {
    free(rows->codes), free(rows->scales), free(rows->mins), free(rows->d), free(rows->dmin);
}

/* Quantize every token for the activation formats the parts need. On one thread, before the
 * parallel region: it costs ~1 % of the products, and a barrier after it cost a scheduler
 * quantum whenever a thread was descheduled on a shared machine. */
static void quantize_tokens(const float *x, int64_t tokens, int64_t cols, Acts *k_acts,
                            Acts *acts32) {
    for (int64_t t = 0; t < tokens; t++) {
        if (k_acts->q)
            quantize_token_k(x + t * cols, cols, k_acts->q + t * cols, k_acts->d + t * (cols / 256),
                             k_acts->bsums + t * (cols / 16));
        if (acts32->q)
            quantize_token_32(x + t * cols, cols, acts32->q + t * cols, acts32->d + t * (cols / 32),
                              acts32->s + t * (cols / 32));
    }
}

/* y [tokens, ldy] = x [tokens, cols] @ [W_0; W_1; ...].T with 8-bit activations, part p in
 * types[p] filling the columns after the parts before it (as axon_ggml_matmul_parts). Returns
 * 0, -1 for an unsupported type or width, -2 when memory runs out. */
int axon_q8_matmul_parts(int parts, const int *types, const uint8_t *const *ws,
                         const int64_t *rows, int64_t cols, const float *x, int64_t tokens,
                         float *y, int64_t ldy, int threads) {
    int need_k = 0, need_32 = 0;
    int64_t groups = 0;
    for (int p = 0; p < parts; p++) {
        if (!axon_q8_supported(types[p]) || cols % q8_block(types[p])) return -1;
        need_k |= is_k(types[p]), need_32 |= !is_k(types[p]);
        groups += (rows[p] + GROUP - 1) / GROUP;
    }
    if (tokens < 0) return -1;
    if (tokens == 0) return 0;
    Acts k_acts = {0}, acts32 = {0};
    int ok = (!need_k || alloc_acts(&k_acts, 1, tokens, cols)) &&
             (!need_32 || alloc_acts(&acts32, 0, tokens, cols));
    if (ok) quantize_tokens(x, tokens, cols, &k_acts, &acts32);
    if (threads < 1) threads = 1;
    int failed = !ok; /* out of memory somewhere: the call returns -2 */
#pragma omp parallel num_threads(threads) if (threads > 1 && ok)
    {
        Rows scratch = {0};
        const int mine = ok && alloc_rows(&scratch, cols);
        if (!mine) {
#pragma omp atomic write
            failed = 1;
        }
        /* Dynamic: on a shared machine a descheduled thread's static share held up the rest. */
#pragma omp for schedule(dynamic, 4) nowait
        for (int64_t g = 0; g < groups; g++) {
            if (!mine) continue;
            int64_t first = 0, column = 0;
            int p = 0;
            while (g - first >= (rows[p] + GROUP - 1) / GROUP)
                first += (rows[p] + GROUP - 1) / GROUP, column += rows[p], p++;
            const int64_t n0 = (g - first) * GROUP;
            const int count = (int)(rows[p] - n0 < GROUP ? rows[p] - n0 : GROUP);
            group_rows(types[p], ws[p], n0, count, cols, &scratch, is_k(types[p]) ? &k_acts : &acts32,
                       tokens, y + column, ldy);
        }
        free_rows(&scratch); /* also what a failed allocation got */
    }
    free_acts(&k_acts), free_acts(&acts32);
    return failed ? -2 : 0;
}

/* Test hook: token x [cols] quantized as Q8_K (k = 1) or Q8_0 (k = 0): q, d, and bsums (Q8_K)
 * or s (Q8_0). */
void axon_q8_quantize(const float *x, int64_t cols, int k, int8_t *q, float *d, void *sums) {
    if (k)
        quantize_token_k(x, cols, q, d, (int16_t *)sums);
    else
        quantize_token_32(x, cols, q, d, (float *)sums);
}
