/* GGML weights times 8-bit activations (opt-in): y = x @ W.T where each token's x is first
 * quantized on its own, as llama.cpp does, and the products are integer dot products of the
 * weights' codes with the activations' int8 values. Built with the other C kernels into one
 * library (build.py); called by ggml_q8.py.
 *
 * Activations, per token, per block:
 *   - Q8_K for the K-quants (Q4_K, Q5_K, Q6_K): 256 values, a float scale d = max|x| / 127,
 *     int8 values round(x / d) (ties to even), and the sums of the values over each 16;
 *   - Q8_0 / Q8_1 for the legacy formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): 32 values, the same
 *     float scale and rounding, and s = d * sum(values) for the formats with a bias.
 * (llama.cpp stores the Q8_0 / Q8_1 scales in fp16; here they stay float32.)
 *
 * Weights: a panel of 8 rows is decoded per call into unsigned codes (Q8_0: signed) laid out
 * 4 values x 8 rows per 32 bytes, so one 256-bit vector holds 4 consecutive codes of each of
 * the 8 rows and one 32-bit broadcast of a token's 4 int8 values multiplies all of them
 * (VNNI dpbusd: 8 rows' 4-term dot products in one instruction; AVX2: maddubs + madd). A tile
 * is 2 panels (16 rows) x up to 6 tokens: every loaded weight vector serves 6 tokens, every
 * broadcast 16 rows. Threads take units of 16 rows, a contiguous share each, stolen from the
 * back by a thread done with its own (work_shares.h); decoding a panel prefetches the rows a
 * unit on (cold weights: the LM head at 16 tokens). Q8_0, Q4_K and Q6_K panels are decoded in
 * registers (decode_panel_q8_0, decode_panel_k: a block's 8 rows loaded, interleaved as they
 * lie, split into codes and stored once), the other formats row by row. The engine repacks
 * Q4_K and Q6_K once at load (axon_q8_pack, Q4_K_PANELS / Q6_K_PANELS below): 16 rows' codes
 * already interleaved, kept as bits, so a tile takes them apart in registers as it reads them
 * (up to PACKED_TOKENS tokens, one token included: no decode, and the one-token path reads one
 * stream per 16 rows, the next unit prefetched) or a unit is unpacked once into the common
 * panels (more tokens). The one-token path of the other formats skips the
 * panels: 8 rows at a time straight from the blocks (gemv_k, gemv_32), the same float steps, each
 * thread a contiguous share of the rows (stolen from the back by a thread done with its own:
 * work_shares.h); K-quant rows of up to 3072 values are read one after
 * the other (gemv_k_rows), legacy rows always 8 side by side.
 *
 * Per block of one row and one token, with exact integer sums isum and msum:
 *   K-quants: acc = fma(isum, d_w d_x, acc); acc = fma(-msum, dmin_w d_x, acc), where
 *             isum = sum_j(sc_j * sum(code * q)), msum = sum_i(mn_i * bsum_i), and for Q6_K
 *             (codes 0..63 for -32..31) mn = sc per 16 and dmin = 32 * d;
 *   legacy:   acc = fma(isum, d_w d_x, acc); acc = fma(bias_w, s_x, acc), bias = m (Q4_1,
 *             Q5_1), -8 d (Q4_0), -16 d (Q5_0), none (Q8_0).
 * The blocks go in order and each row and token has its own float lane, so a result is the
 * same bits in every tile shape, alone or in any batch, on every thread, and in the VNNI,
 * AVX2 and portable builds (the integer sums are exact; the float steps are the same IEEE
 * operations, fused where written fma and nowhere else).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "axon_kernels.h"
#include "k23_blocks.h"
#include "k_scales.h"
#include "work_shares.h"
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_VNNI 1
#endif

enum { F32 = 0, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
/* Not GGML types: Q4_K and Q6_K repacked at load (axon_q8_pack) into the tiles' units of 16
 * rows, 2 panels of 8 (rows past the end zero), which the tiles read where they lie. A unit's
 * block is one run of bytes, after the unit's previous block, and every 64 bytes of codes hold
 * the 2 panels' 32 side by side (one 512-bit load):
 *   codes, Q4_K_PANELS: [4][8 chunks][2 panels][8 rows][4] nibbles, low sub-block 2m, high 2m + 1;
 *     Q6_K_PANELS: the low 4 bits of chunks c and c + 32 as the nibbles of byte c [32][2][8][4],
 *     then the high 2 bits of chunks c, c + 16, c + 32, c + 48 as bits 0-1, 2-3, 4-5, 6-7 of
 *     byte c [16][2][8][4];
 *   the sub-block multipliers [subs][2][8] as bytes; Q4_K_PANELS: the mins [4 pairs][2][8][2]
 *     as bytes (Q6_K's pairs are its scales: taken from those);
 *   d [2][8] float32, then Q4_K_PANELS: dmin [2][8] (Q6_K: 32 d).
 * 2432 and 3392 bytes a block of 16 rows, against the GGUF's 16 x 144 and 16 x 210. */
enum { Q4_K_PANELS = 112, Q6_K_PANELS = 114 };
static int packed_from(int type) { return type == Q4_K_PANELS ? Q4_K : type == Q6_K_PANELS ? Q6_K : 0; }
#define PACKED_UNIT(PK) ((PK) == 1 ? 2432 : 3392) /* a unit's block; PK 1: Q4_K_PANELS, 2: Q6_K */
#define PACKED_SC(PK) ((PK) == 1 ? 2048 : 3072)   /* where its multipliers start */
#define PACKED_MN 2176                            /* Q4_K_PANELS: its mins */
#define PACKED_D(PK) ((PK) == 1 ? 2304 : 3328)    /* its d (Q4_K_PANELS: dmin 64 bytes on) */
static int pk_of(int type) { return type == Q4_K_PANELS ? 1 : 2; }

#define PANEL 8 /* rows per panel: one per 32-bit lane of a 256-bit vector */
#define UNIT 2  /* panels per unit of work: a broadcast activation serves 16 rows */
#define GEMV_ROWS 32 /* rows per unit of work for one token: an octet alone is ~0.3 us */
/* Legacy weights but Q8_0, up to this many tokens (a decode and its drafts to verify): 8 rows
 * straight from their blocks, as one token, each block's codes multiplied with every token's.
 * The panels cost a decode of every block into scratch first, which at a few tokens is the
 * matmul's largest part: SmolLM2's Q4_1 layers took 2x the one-token time at 2 tokens. */
#ifndef GEMV_TOKENS
#define GEMV_TOKENS 8
#endif
/* One token, K-quant rows of at most this many blocks are read one after the other, not 8 side
 * by side: 8 short interleaved streams left the hardware prefetcher retraining on every row.
 * Legacy rows go 8 side by side with the 8 rows' run prefetched as one line (gemv_32). */
#ifndef SEQ_BLOCKS_K
#define SEQ_BLOCKS_K 12 /* K-quants: up to 3072 wide (4096: 8 side by side were faster) */
#endif
#ifndef SEQ_PREFETCH
#define SEQ_PREFETCH 4096 /* bytes ahead of the walk, a straight line through the rows */
#endif
#ifndef PF32_AHEAD
#define PF32_AHEAD 12288 /* legacy, one token: bytes ahead of the rows (2-8, 24 KiB: slower) */
#endif
/* Every software prefetch of weights here brings its line into L2, not L1 (locality 2, x86's
 * prefetcht1): the lines come a unit or 16 KiB ahead, and brought into L1 they would push out
 * the lines the tiles are reading (the current unit, the activations). */
#define PREFETCH_L2(p) __builtin_prefetch((p), 0, 2)
#ifndef AHEAD_UNITS
#define AHEAD_UNITS 1 /* a panel decode prefetches this many units on (2, 4: no faster) */
#endif
#ifndef CHUNK_BYTES
#define CHUNK_BYTES (512 << 10) /* many tokens: a pass's int8 activations, at least 256 tokens */
#endif
#ifndef PACKED_TOKENS
#define PACKED_TOKENS 24 /* packed panels: up to this many tokens the tiles read them as they lie */
#endif
#if PACKED_TOKENS < 1
#error "one token always reads packed panels where they lie (run_work has no scratch panels then)"
#endif
/* The 512-bit tiles (two panels a vector, below): with AVX-512 VNNI, not on AMD: GCC 12.2 tells a
 * Zen 4 from native as znver3 (plus its AVX-512), later GCCs as znver4 (Zen 3 has no AVX-512, so
 * the znver3 test only catches a Zen 4). */
#if defined(Q8_VNNI) && defined(__AVX512BW__) && !defined(__znver3__) && !defined(__znver4__) && \
    !defined(__znver5__)
#define TILE_512 1
#endif
/* Tokens per tile: a loaded weight vector serves up to TILE tokens (4: Q8_0 ran ~1/3 slower). The
 * 512-bit tiles hold 8: their 3 x 8 accumulators fit the 32 registers, and 16 tokens (c16
 * decode) take two passes over a unit instead of three (faster at 8 and 16 tokens, same bits);
 * the 256-bit tiles keep 6. */
#ifdef TILE_512
#define TILE 8
#else
#define TILE 6
#endif
#define NOINLINE static __attribute__((noinline))
#define INLINE static inline __attribute__((always_inline))

static float f16(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

static int is_k(int type) { return type == Q4_K || type == Q5_K || type == Q6_K || k23_is(type) || packed_from(type); }

/* K-quants with a multiplier per 16 values (Q6_K, Q2_K, Q3_K; the others per 32). */
static int subs16(int type) { return type == Q6_K || k23_is(type); }

/* Values per weight block (0: not handled here), and the block's bytes. */
static int q8_block(int type) {
    switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return 32;
    case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: case Q4_K_PANELS: case Q6_K_PANELS: return 256;
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
    case Q2_K: case Q3_K: return k23_bytes(type);
    case Q4_K: return 144;
    case Q4_K_PANELS: case Q6_K_PANELS: return PACKED_UNIT(pk_of(type)); /* per 16 rows */
    case Q5_K: return 176;
    default: return 210; /* Q6_K */
    }
}

int axon_q8_supported(int type) { return q8_block(type) != 0; }

static size_t up64(size_t n) { return (n + 63) / 64 * 64; }

/* A buffer kept per thread between calls: a prefill step's activations are megabytes (malloc
 * would map and unmap them, page faults every call) and batch-1 decode calls once per layer. */
typedef struct {
    void *p;
    size_t size;
} Scratch;

static void *scratch_get(Scratch *s, size_t size) {
    if (s->size >= size) return s->p;
    free(s->p);
    s->size = up64(size);
    s->p = aligned_alloc(64, s->size);
    if (!s->p) s->size = 0;
    return s->p;
}

static __thread Scratch acts_scratch, panel_scratch;

/* ---- activations ------------------------------------------------------------------------ */

typedef struct {
    int8_t *q;      /* [tokens][cols] */
    uint8_t *qu;    /* legacy: [tokens][cols] q + 128, what VNNI multiplies Q8_0's signed codes by */
    float *d;       /* [tokens][cols / B] block scales */
    int16_t *bsums; /* Q8_K: [tokens][cols / 16] sums of q over each 16 */
    int16_t *b32;   /* Q8_K: [tokens][cols / 32] sums of q over each 32 (Q4_K / Q5_K's mins) */
    float *s;       /* Q8_1: [tokens][cols / 32] d * sum(q) */
} Acts;

static size_t acts_bytes(int k_quants, int64_t tokens, int64_t cols) {
    const size_t n = (size_t)(tokens * cols), blocks = n / (k_quants ? 256 : 32);
    return up64(n) + up64(4 * blocks) + (k_quants ? up64(n / 8) + up64(n / 16) : up64(n) + up64(4 * blocks));
}

/* Points acts' arrays into base (acts_bytes of room). */
static void acts_place(Acts *a, char *base, int k_quants, int64_t tokens, int64_t cols) {
    const size_t n = (size_t)(tokens * cols), blocks = n / (k_quants ? 256 : 32);
    a->q = (int8_t *)base, base += up64(n);
    a->d = (float *)base, base += up64(4 * blocks);
    a->bsums = k_quants ? (int16_t *)base : NULL;
    a->b32 = k_quants ? (int16_t *)(base + up64(n / 8)) : NULL;
    a->qu = k_quants ? NULL : (uint8_t *)base;
    a->s = k_quants ? NULL : (float *)(base + up64(n));
}

#ifndef __AVX2__
/* n values of x -> int8 q; returns the scale d (max|x| / 127, 0 for a zero block). */
static float quantize_block(const float *x, int n, int8_t *q) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < n; i++) q[i] = (int8_t)nearbyintf(x[i] * id);
    return d;
}
#endif

#ifdef __AVX2__
/* max |x| over n values (a multiple of 8): the same value as quantize_block's loop. */
static float amax_of(const float *x, int n) {
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(x + i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

/* 32 values of x times id as int8, rounded in the current mode (to even) as nearbyintf. */
static inline __m256i round32(const float *x, __m256 id) {
    __m256i v[4];
    for (int i = 0; i < 4; i++) v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), id));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* The sums of q's first 16 and last 16 values. */
static inline void sums16(__m256i q, int *first, int *second) {
    const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s, s), _mm256_hadd_epi32(s, s));
    *first = _mm256_cvtsi256_si32(h), *second = _mm256_extract_epi32(h, 4);
}
#endif

/* Q8_K (the vector loop: per call, a long prefill's quantization showed at ~10 %). */
static void quantize_token_k(const float *x, int64_t cols, int8_t *q, float *d, int16_t *bsums,
                             int16_t *b32) {
    for (int64_t k = 0; k < cols / 256; k++) {
#ifdef __AVX2__
        d[k] = amax_of(x + 256 * k, 256) / 127.0f;
        const __m256 id = _mm256_set1_ps(d[k] > 0.0f ? 1.0f / d[k] : 0.0f);
        for (int j = 0; j < 8; j++) {
            const __m256i v = round32(x + 256 * k + 32 * j, id);
            _mm256_storeu_si256((__m256i *)(q + 256 * k + 32 * j), v);
            int first, second;
            sums16(v, &first, &second);
            bsums[16 * k + 2 * j] = (int16_t)first, bsums[16 * k + 2 * j + 1] = (int16_t)second;
            if (b32) b32[8 * k + j] = (int16_t)(first + second);
        }
#else
        d[k] = quantize_block(x + 256 * k, 256, q + 256 * k);
        for (int i = 0; i < 16; i++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += q[256 * k + 16 * i + j];
            bsums[16 * k + i] = (int16_t)sum;
        }
        for (int j = 0; j < 8 && b32; j++) b32[8 * k + j] = (int16_t)(bsums[16 * k + 2 * j] + bsums[16 * k + 2 * j + 1]);
#endif
    }
}

/* Q8_0 / Q8_1, and qu = q + 128 when asked (NULL: not). */
static void quantize_token_32(const float *x, int64_t cols, int8_t *q, float *d, float *s,
                              uint8_t *qu) {
    for (int64_t k = 0; k < cols / 32; k++) {
        int sum = 0;
#ifdef __AVX2__
        d[k] = amax_of(x + 32 * k, 32) / 127.0f;
        const __m256i v = round32(x + 32 * k, _mm256_set1_ps(d[k] > 0.0f ? 1.0f / d[k] : 0.0f));
        _mm256_storeu_si256((__m256i *)(q + 32 * k), v);
        if (qu) _mm256_storeu_si256((__m256i *)(qu + 32 * k), _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)));
        int first, second;
        sums16(v, &first, &second);
        sum = first + second;
#else
        d[k] = quantize_block(x + 32 * k, 32, q + 32 * k);
        for (int j = 0; j < 32; j++) sum += q[32 * k + j];
        for (int j = 0; j < 32 && qu; j++) qu[32 * k + j] = (uint8_t)(q[32 * k + j] ^ 0x80);
#endif
        s[k] = d[k] * (float)sum;
    }
}

/* Quantize every token for the activation formats the parts need. On the calling thread,
 * before the parallel region: it costs ~1 % of the products, and a barrier after it costs a
 * scheduler quantum whenever a thread is descheduled on a shared machine. */
static void quantize_tokens(const float *x, int64_t tokens, int64_t cols, Acts *k_acts,
                            Acts *acts32) {
    for (int64_t t = 0; t < tokens; t++) {
        if (k_acts->q)
            quantize_token_k(x + t * cols, cols, k_acts->q + t * cols, k_acts->d + t * (cols / 256),
                             k_acts->bsums + t * (cols / 16), k_acts->b32 + t * (cols / 32));
        if (acts32->q)
            quantize_token_32(x + t * cols, cols, acts32->q + t * cols, acts32->d + t * (cols / 32),
                              acts32->s + t * (cols / 32), acts32->qu + t * cols);
    }
}

/* ---- panels: 8 decoded rows --------------------------------------------------------------- */

typedef struct {
    uint8_t *codes;  /* [blocks][B / 4 chunks][8 rows][4]: chunk c is values 4c..4c+3 */
    int32_t *scales; /* K: [blocks][subs][8] multiplier of sub-block j (Q4/5_K 32 values, Q6_K 16) */
    int32_t *mins;   /* K: [blocks][8][8] int16 pairs, the multipliers of sums 2i and 2i + 1:
                      * Q4_K / Q5_K the 4 pairs of mins per 32, Q6_K 8 pairs of scales per 16 */
    float *d;        /* [blocks][8] */
    float *dmin;     /* [blocks][8] K: dmin (Q6_K: 32 d); legacy: the bias */
    int32_t *w128;   /* Q8_0: [blocks][8] 128 * sum(codes), VNNI's offset of q + 128 */
    const uint8_t *sc8, *mn8; /* packed: the multipliers as bytes, block 0 (codes, d, dmin too) */
    int64_t ahead;            /* packed: bytes from this unit to the next one this thread reads */
} Panel;

/* 8 rows of cols: codes 8 cols, scales 2 cols, mins, d, dmin, w128 cols each (at most). */
static size_t panel_bytes(int64_t cols) { return 14 * (size_t)cols + 6 * 64; }

static void panel_place(Panel *p, char *base, int64_t cols) {
    p->codes = (uint8_t *)base, base += up64(8 * (size_t)cols);
    p->scales = (int32_t *)base, base += up64(2 * (size_t)cols);
    p->mins = (int32_t *)base, base += up64((size_t)cols);
    p->d = (float *)base, base += up64((size_t)cols);
    p->dmin = (float *)base, base += up64((size_t)cols);
    p->w128 = (int32_t *)base;
    p->sc8 = p->mn8 = NULL;
}

/* Q4_K / Q5_K's 12 bytes of 6-bit scales and mins (at b + 4) as 16 bytes: the 8 sub-block
 * scales, then the 8 mins (llama.cpp's unpacking, word-wide: a dozen operations). */
static void k45_scales_mins(const uint8_t *b, uint32_t u[4]) {
    memcpy(u, b + 4, 12);
    const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303, mins_lo = u[1] & m6;
    u[3] = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4);
    u[1] = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);
    u[2] = mins_lo, u[0] &= m6;
}

/* The 256 codes of a K-quant block, unsigned (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63). */
static void k_codes(int type, const uint8_t *b, uint8_t *codes) {
    if (k23_is(type)) return k23_codes(type, b, codes);
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

/* A legacy block's scale d and bias per block (none for Q8_0). */
static float legacy_bias(int type, const uint8_t *b, float d) {
    return type == Q8_0 ? 0.0f : type == Q4_1 || type == Q5_1 ? f16(b + 2) : type == Q4_0 ? -8.0f * d : -16.0f * d;
}

#ifdef __AVX2__
/* A legacy block's 32 codes (unsigned; Q8_0 signed). */
static inline __m256i codes_32(int type, const uint8_t *b) {
    if (type == Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    const int qs = type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
    /* Low nibbles are codes 0-15, high nibbles 16-31; bit i of qh is code i's fifth bit. */
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(b + qs)), low4 = _mm_set1_epi8(0x0F);
    const __m256i c = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4),
                                       _mm_and_si128(bytes, low4));
    if (type != Q5_0 && type != Q5_1) return c;
    uint32_t qh;
    memcpy(&qh, b + qs - 4, 4);
    const __m256i which = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                            0x0101010101010101, 0x0000000000000000);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)qh), which);
    const __m256i fifth = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_or_si256(c, _mm256_and_si256(fifth, _mm256_set1_epi8(16)));
}
#endif

/* A legacy block: 32 codes (unsigned; Q8_0 signed), d, and the bias per block. */
static void decode_32(int type, const uint8_t *b, uint8_t *codes, float *d, float *bias) {
    *d = f16(b);
    *bias = legacy_bias(type, b, *d);
#ifdef __AVX2__
    _mm256_storeu_si256((__m256i *)codes, codes_32(type, b));
#else
    if (type == Q8_0) return (void)memcpy(codes, b + 2, 32);
    const int qs = type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
    uint32_t qh = 0;
    if (type == Q5_0 || type == Q5_1) memcpy(&qh, b + qs - 4, 4);
    for (int i = 0; i < 16; i++) {
        codes[i] = (uint8_t)((b[qs + i] & 0x0F) | (((qh >> i) & 1) << 4));
        codes[i + 16] = (uint8_t)((b[qs + i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
    }
#endif
}

static int32_t int16_pair(int lo, int hi) { return (int32_t)((uint16_t)lo | ((uint32_t)(uint16_t)hi << 16)); }

/* Row r's multipliers of K-quant block k (b): sub-block scales, bsum multipliers, d, dmin. */
static void k_block_scales(int type, const uint8_t *b, const Panel *p, int64_t k, int r) {
    if (k23_is(type)) {
        int8_t sc[16], mn[16];
        k23_multipliers(type, b, sc, mn);
        for (int i = 0; i < 16; i++) p->scales[(16 * k + i) * PANEL + r] = sc[i];
        for (int i = 0; i < 8; i++) p->mins[(8 * k + i) * PANEL + r] = int16_pair(mn[2 * i], mn[2 * i + 1]);
        p->d[PANEL * k + r] = f16(b + k23_d_at(type)), p->dmin[PANEL * k + r] = k23_dmin(type, b);
        return;
    }
    if (type == Q6_K) {
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int i = 0; i < 16; i++) p->scales[(16 * k + i) * PANEL + r] = sc[i];
        for (int i = 0; i < 8; i++) p->mins[(8 * k + i) * PANEL + r] = int16_pair(sc[2 * i], sc[2 * i + 1]);
        p->d[PANEL * k + r] = f16(b + 208);
        p->dmin[PANEL * k + r] = 32.0f * f16(b + 208); /* codes carry +32: subtract 32 sc bsum */
        return;
    }
    uint32_t u[4];
    k45_scales_mins(b, u);
    const uint8_t *sc = (const uint8_t *)u, *mn = sc + 8;
    for (int j = 0; j < 8; j++) p->scales[(8 * k + j) * PANEL + r] = sc[j];
    for (int i = 0; i < 4; i++) p->mins[(8 * k + i) * PANEL + r] = int16_pair(mn[2 * i], mn[2 * i + 1]);
    p->d[PANEL * k + r] = f16(b), p->dmin[PANEL * k + r] = f16(b + 2);
}

/* Row r of block k into codes (B values) and the panel's multipliers; a zero row past count. */
INLINE void decode_block(int type, const uint8_t *b, uint8_t *codes, const Panel *p, int64_t k,
                         int r) {
    if (!b) {
        memset(codes, 0, (size_t)q8_block(type));
        for (int i = 0; i < 16 && is_k(type); i++) p->scales[(16 * k + i) * PANEL + r] = 0;
        for (int i = 0; i < 8 && is_k(type); i++) p->mins[(8 * k + i) * PANEL + r] = 0;
        p->d[PANEL * k + r] = p->dmin[PANEL * k + r] = 0.0f, p->w128[PANEL * k + r] = 0;
        return;
    }
    if (is_k(type)) {
        k_codes(type, b, codes);
        k_block_scales(type, b, p, k, r);
        return;
    }
    decode_32(type, b, codes, p->d + PANEL * k + r, p->dmin + PANEL * k + r);
#ifndef __AVX2__ /* AVX2: decode_panel_q8_0 sums the 8 rows at once from their interleaved codes */
    int sum = 0;
    for (int i = 0; i < 32 && type == Q8_0; i++) sum += (int8_t)codes[i];
    p->w128[PANEL * k + r] = 128 * sum;
#endif
}

#ifdef __AVX2__
/* 8 rows' 32 codes (one vector each) -> the panel's 8 chunks: c[m] = dword m of every row. */
static inline void interleave_regs(const __m256i r[8], __m256i c[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* u[i + m]: dword m (low lane) and m + 4 of 4 rows */
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int m = 0; m < 4; m++) {
        c[m] = _mm256_permute2x128_si256(u[m], u[m + 4], 0x20);
        c[m + 4] = _mm256_permute2x128_si256(u[m], u[m + 4], 0x31);
    }
}

static inline void store_chunks(const __m256i r[8], uint8_t *out) {
    __m256i c[8];
    interleave_regs(r, c);
    for (int m = 0; m < 8; m++) _mm256_store_si256((__m256i *)(out + 32 * m), c[m]);
}
#endif

/* 8 rows' B codes each -> the panel layout: out chunk c = dword c of every row. */
static void interleave(const uint8_t (*rows)[256], int B, uint8_t *out) {
    for (int g = 0; g < B / 32; g++) {
#ifdef __AVX2__
        __m256i r[8];
        for (int i = 0; i < 8; i++) r[i] = _mm256_load_si256((const __m256i *)(rows[i] + 32 * g));
        store_chunks(r, out + 256 * g);
#else
        for (int c = 0; c < 8; c++)
            for (int i = 0; i < 8; i++) memcpy(out + 256 * g + 32 * c + 4 * i, rows[i] + 32 * g + 4 * c, 4);
#endif
    }
}

#ifdef __AVX2__

/* Every line of a block `ahead` rows on (a panel's next rows, see decode_panel). */
static inline void prefetch_block_ahead(const uint8_t *b, int bytes, int64_t ahead_bytes) {
    for (int line = 0; line < bytes; line += 64) PREFETCH_L2(b + ahead_bytes + line);
    PREFETCH_L2(b + ahead_bytes + bytes - 1);
}

/* Eight fp16 values, one per row, gathered in two 64-bit words and converted at once: a vector
 * load of eight 2-byte stores would wait for them to leave the store buffer (store forwarding
 * fails on a load wider than the stores), a stall that shows in a Q4_K panel's decode. */
typedef struct {
    uint64_t lo, hi; /* rows 0-3, 4-7: two named words stay in registers (an indexed pair did not) */
} Halves;

static inline void halves_put(Halves *h, int i, const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    if (i < 4)
        h->lo |= (uint64_t)v << (16 * i);
    else
        h->hi |= (uint64_t)v << (16 * (i - 4));
}

static inline __m256 halves_ps(const Halves *h) {
    return _mm256_cvtph_ps(_mm_set_epi64x((long long)h->hi, (long long)h->lo));
}

/* The panels below are decoded straight from the blocks, in registers: each block's 8 rows are
 * loaded, interleaved and stored once (the general path, decode_block + interleave, stores every
 * row's codes and multipliers one at a time and reads them back: half of a 16-token LM head's
 * time). Same codes and multipliers as the general path, so the same bits. */

/* Q8_0: 32 signed codes, d, and w128 summed from the interleaved chunks. */
static void decode_panel_q8_0(const uint8_t *w, int64_t row_bytes, int count, int64_t blocks,
                              const Panel *p, int64_t ahead) {
    const __m256i ones = _mm256_set1_epi8(1);
    for (int64_t k = 0; k < blocks; k++) {
        __m256i r[8], c[8];
        Halves d = {0, 0};
        for (int i = 0; i < PANEL; i++) {
            if (i >= count) {
                r[i] = _mm256_setzero_si256();
                continue;
            }
            const uint8_t *b = w + i * row_bytes + k * 34;
            if (ahead) PREFETCH_L2(b + ahead * row_bytes + 33);
            r[i] = _mm256_loadu_si256((const __m256i *)(b + 2));
            halves_put(&d, i, b);
        }
        interleave_regs(r, c);
        uint8_t *out = p->codes + k * 32 * PANEL;
        __m256i sum[4]; /* four chains: one would wait on each dpbusd's latency */
        for (int m = 0; m < 8; m++) {
            _mm256_store_si256((__m256i *)(out + 32 * m), c[m]);
            const __m256i zero_or_sum = m < 4 ? _mm256_setzero_si256() : sum[m % 4];
#ifdef Q8_VNNI
            sum[m % 4] = _mm256_dpbusd_epi32(zero_or_sum, ones, c[m]);
#else
            sum[m % 4] = _mm256_add_epi32(zero_or_sum, _mm256_madd_epi16(_mm256_maddubs_epi16(ones, c[m]), _mm256_set1_epi16(1)));
#endif
        }
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(sum[0], sum[1]), _mm256_add_epi32(sum[2], sum[3]));
        _mm256_store_si256((__m256i *)(p->w128 + PANEL * k), _mm256_slli_epi32(total, 7));
        _mm256_store_ps(p->d + PANEL * k, halves_ps(&d));
    }
}

/* 8 rows of 16 bytes -> t[m]: byte 2m of rows 0-7 (low 8 bytes), byte 2m + 1 (high 8 bytes). */
static inline void transpose_8x16(const __m128i r[8], __m128i t[8]) {
    __m128i a[8];
    for (int i = 0; i < 4; i++) {
        a[i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);     /* bytes 0-7 of a row pair */
        a[i + 4] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]); /* bytes 8-15 */
    }
    for (int h = 0; h < 2; h++) {
        const __m128i *A = a + 4 * h;
        const __m128i b0 = _mm_unpacklo_epi16(A[0], A[1]), b1 = _mm_unpackhi_epi16(A[0], A[1]);
        const __m128i b2 = _mm_unpacklo_epi16(A[2], A[3]), b3 = _mm_unpackhi_epi16(A[2], A[3]);
        t[4 * h] = _mm_unpacklo_epi32(b0, b2), t[4 * h + 1] = _mm_unpackhi_epi32(b0, b2);
        t[4 * h + 2] = _mm_unpacklo_epi32(b1, b3), t[4 * h + 3] = _mm_unpackhi_epi32(b1, b3);
    }
}

/* A K-quant block's multipliers for the panel's 8 rows from their 16 bytes each (Q4_K: the 8
 * scales then the 8 mins, unsigned; Q6_K: the 16 scales, signed), as k_block_scales writes them. */
static inline void k_panel_scales(int type, const __m128i r[8], const Panel *p, int64_t k) {
    __m128i t[8];
    transpose_8x16(r, t);
    const int subs = type == Q6_K ? 16 : 8, pairs = type == Q6_K ? 8 : 4, first = type == Q6_K ? 0 : 4;
    for (int j = 0; j < subs; j++) {
        const __m128i bytes = j & 1 ? _mm_srli_si128(t[j / 2], 8) : t[j / 2];
        const __m256i v = type == Q6_K ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
        _mm256_store_si256((__m256i *)(p->scales + (subs * k + j) * PANEL), v);
    }
    for (int i = 0; i < pairs; i++) { /* int16 pairs (multiplier 2i, 2i + 1) per row */
        const __m128i x = t[first + i], pair = _mm_unpacklo_epi8(x, _mm_srli_si128(x, 8));
        const __m256i v = type == Q6_K ? _mm256_cvtepi8_epi16(pair) : _mm256_cvtepu8_epi16(pair);
        _mm256_store_si256((__m256i *)(p->mins + (8 * k + i) * PANEL), v);
    }
}

/* Q2_K / Q3_K: the panel's 8 rows' 16 multipliers (sc) and mins (mn) per block, each row's as
 * 16 signed bytes, as k_block_scales writes them. */
static inline void k23_panel_scales(const __m128i sc[8], const __m128i mn[8], const Panel *p, int64_t k) {
    __m128i t[8], u[8];
    transpose_8x16(sc, t);
    transpose_8x16(mn, u);
    for (int j = 0; j < 16; j++) {
        const __m128i bytes = j & 1 ? _mm_srli_si128(t[j / 2], 8) : t[j / 2];
        _mm256_store_si256((__m256i *)(p->scales + (16 * k + j) * PANEL), _mm256_cvtepi8_epi32(bytes));
    }
    for (int i = 0; i < 8; i++) { /* int16 pairs (min 2i, 2i + 1) per row */
        const __m128i pair = _mm_unpacklo_epi8(u[i], _mm_srli_si128(u[i], 8));
        _mm256_store_si256((__m256i *)(p->mins + (8 * k + i) * PANEL), _mm256_cvtepi8_epi16(pair));
    }
}

/* Q2_K / Q3_K: 256 unsigned codes per row and block, taken apart where they lie (32 per row at
 * a time) and interleaved in registers, the multipliers, d and dmin. */
static void decode_panel_k23(int type, const uint8_t *w, int64_t row_bytes, int count, int64_t blocks,
                             const Panel *p, int64_t ahead) {
    const int bytes = q8_bytes(type);
    for (int64_t k = 0; k < blocks; k++) {
        const uint8_t *b[8];
        __m128i sc[8], mn[8];
        Halves dh = {0, 0}, mh = {0, 0}; /* fp16 d and (Q2_K) dmin */
        for (int i = 0; i < PANEL; i++) {
            b[i] = i < count ? w + i * row_bytes + k * bytes : NULL;
            sc[i] = mn[i] = _mm_setzero_si128();
            if (!b[i]) continue;
            if (ahead) prefetch_block_ahead(b[i], bytes, ahead * row_bytes);
            k23_multipliers_vec(type, b[i], sc + i, mn + i);
            halves_put(&dh, i, b[i] + k23_d_at(type));
            if (type == Q2_K) halves_put(&mh, i, b[i] + 82);
        }
        k23_panel_scales(sc, mn, p, k);
        const __m256 d = halves_ps(&dh);
        _mm256_store_ps(p->d + PANEL * k, d);
        _mm256_store_ps(p->dmin + PANEL * k, type == Q2_K ? halves_ps(&mh) : _mm256_mul_ps(d, _mm256_set1_ps(4.0f)));
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++) {
                __m256i r[8];
                for (int i = 0; i < PANEL; i++) r[i] = b[i] ? k23_codes32(type, b[i], h, s) : _mm256_setzero_si256();
                store_chunks(r, p->codes + k * 256 * PANEL + 256 * (4 * h + s));
            }
    }
}

/* Q4_K / Q6_K: 256 unsigned codes per row and block, the multipliers, d and dmin. */
static void decode_panel_k(int type, const uint8_t *w, int64_t row_bytes, int count, int64_t blocks,
                           const Panel *p, int64_t ahead) {
    const int bytes = q8_bytes(type);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t k = 0; k < blocks; k++) {
        const uint8_t *b[8];
        __m128i raw[8];
        Halves dh = {0, 0}, mh = {0, 0}; /* fp16 d and dmin */
        for (int i = 0; i < PANEL; i++) {
            b[i] = i < count ? w + i * row_bytes + k * bytes : NULL;
            raw[i] = _mm_setzero_si128();
            if (!b[i]) continue;
            if (ahead) prefetch_block_ahead(b[i], bytes, ahead * row_bytes);
            if (type == Q6_K) {
                raw[i] = _mm_loadu_si128((const __m128i *)(b[i] + 192));
                halves_put(&dh, i, b[i] + 208);
            } else {
                raw[i] = k_scales_vec(_mm_loadu_si128((const __m128i *)b[i]));
                halves_put(&dh, i, b[i]);
                halves_put(&mh, i, b[i] + 2);
            }
        }
        k_panel_scales(type, raw, p, k);
        const __m256 d = halves_ps(&dh);
        _mm256_store_ps(p->d + PANEL * k, d);
        _mm256_store_ps(p->dmin + PANEL * k, type == Q6_K ? _mm256_mul_ps(d, _mm256_set1_ps(32.0f)) : halves_ps(&mh));
        uint8_t *out = p->codes + k * 256 * PANEL;
        if (type == Q4_K) {
            for (int c = 0; c < 4; c++) { /* sub-blocks 2c (low nibbles) and 2c + 1 (high) */
                __m256i r[8], q[8]; /* the bytes interleaved as they lie, then split */
                for (int i = 0; i < PANEL; i++)
                    r[i] = b[i] ? _mm256_loadu_si256((const __m256i *)(b[i] + 16 + 32 * c)) : _mm256_setzero_si256();
                interleave_regs(r, q);
                for (int m = 0; m < 8; m++) {
                    _mm256_store_si256((__m256i *)(out + 256 * (2 * c) + 32 * m), _mm256_and_si256(q[m], low4));
                    _mm256_store_si256((__m256i *)(out + 256 * (2 * c + 1) + 32 * m),
                                       _mm256_and_si256(_mm256_srli_epi16(q[m], 4), low4));
                }
            }
            continue;
        }
        /* Q6_K: each half's low-bit and high-bit bytes are interleaved as they lie (the byte
         * order is the codes'), then its four groups of 32 codes are built on the chunks. */
        for (int half = 0; half < 2; half++) {
            __m256i ql[2][8], qh[8], r[8];
            for (int j = 0; j < 3; j++) {
                const int at = j < 2 ? 64 * half + 32 * j : 128 + 32 * half;
                for (int i = 0; i < PANEL; i++)
                    r[i] = b[i] ? _mm256_loadu_si256((const __m256i *)(b[i] + at)) : _mm256_setzero_si256();
                interleave_regs(r, j < 2 ? ql[j] : qh);
            }
            const __m256i high2 = _mm256_set1_epi8(0x30);
            for (int part = 0; part < 4; part++) {
                uint8_t *group = out + 256 * (4 * half + part);
                for (int m = 0; m < 8; m++) {
                    const __m256i q = ql[part & 1][m];
                    const __m256i lo = part < 2 ? _mm256_and_si256(q, low4) : _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
                    /* bits 2 * part, 2 * part + 1 of qh to bits 4 and 5 */
                    const __m256i hi = part == 2 ? qh[m]
                                       : part < 2 ? _mm256_slli_epi16(qh[m], 4 - 2 * part)
                                                  : _mm256_srli_epi16(qh[m], 2);
                    _mm256_store_si256((__m256i *)(group + 32 * m), _mm256_or_si256(lo, _mm256_and_si256(hi, high2)));
                }
            }
        }
    }
}
#endif

/* Rows [0, count) at w (row_bytes apart) into panel p, rows past count zero. Each block read is
 * matched by prefetches of the same block `ahead` rows on (0: none), the rows this thread will
 * likely decode next: 8 rows' blocks side by side are 8 short streams that the hardware
 * prefetcher does not follow, and without it decode_panel waited on memory for most of its
 * time (a cold 151936-row LM head at 16 tokens ran at a third of the L2-hot rate). */
NOINLINE void decode_panel(int type, const uint8_t *w, int64_t row_bytes, int count, int64_t blocks,
                           const Panel *p, int64_t ahead) {
#ifdef __AVX2__
    if (type == Q8_0) return decode_panel_q8_0(w, row_bytes, count, blocks, p, ahead);
    if (type == Q4_K || type == Q6_K) return decode_panel_k(type, w, row_bytes, count, blocks, p, ahead);
    if (k23_is(type)) return decode_panel_k23(type, w, row_bytes, count, blocks, p, ahead);
#endif
    const int B = q8_block(type), bytes = q8_bytes(type);
    uint8_t rows[PANEL][256] __attribute__((aligned(64)));
    for (int64_t k = 0; k < blocks; k++) {
        for (int r = 0; r < PANEL; r++) {
            const uint8_t *b = r < count ? w + r * row_bytes + k * bytes : NULL;
            /* Every line of the block ahead: its last byte's, and its first byte's on (blocks
             * under 64 bytes: at k = 0 only, as a row's blocks lie back to back). */
            for (int line = 0; ahead && b && line < bytes && (bytes >= 64 || k == 0); line += 64)
                PREFETCH_L2(b + ahead * row_bytes + line);
            if (ahead && b) PREFETCH_L2(b + ahead * row_bytes + bytes - 1);
            decode_block(type, b, rows[r], p, k, r);
        }
        interleave((const uint8_t(*)[256])rows, B, p->codes + k * B * PANEL);
    }
}

/* ---- tiles: 1-2 panels x 1-6 tokens ------------------------------------------------------ */

/* The activations of one token as the tiles read them. */
typedef struct {
    const int8_t *q;
    const uint8_t *qu; /* legacy: q + 128 */
    const float *d;
    const void *sums;   /* Q8_K: int16 bsums; Q8_1: float s */
    const int16_t *b32; /* Q8_K: sums per 32 */
} Token;

typedef void (*tile_fn)(const Panel *, int64_t, const Token *, float *, int64_t, const int *);

#ifdef __AVX2__
static inline __m256i bcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* acc + per lane the sum of 4 products of unsigned codes with signed activations. */
static inline __m256i dot_u(__m256i acc, __m256i codes, __m256i q) {
#ifdef Q8_VNNI
    return _mm256_dpbusd_epi32(acc, codes, q);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, q), _mm256_set1_epi16(1)));
#endif
}

/* Q8_0's signed codes. VNNI: times the unsigned q + 128 (the caller subtracts 128 sum(codes));
 * AVX2: the signs moved onto q (maddubs would saturate (q + 128) * code pairs). */
static inline __m256i dot_s(__m256i acc, __m256i codes, __m256i q) {
#ifdef Q8_VNNI
    return _mm256_dpbusd_epi32(acc, q, codes);
#else
    const __m256i u = _mm256_abs_epi8(codes), v = _mm256_sign_epi8(q, codes);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1)));
#endif
}

/* acc + per lane a dot product of two int16 pairs. */
static inline __m256i dot_pairs(__m256i acc, __m256i a, __m256i b) {
#ifdef Q8_VNNI
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* Lanes [0, count) of v to y (count < 8: the rows past a part's end are not written). */
static inline void store_rows(__m256 v, float *y, int count) {
    if (count == PANEL) {
        _mm256_storeu_ps(y, v);
        return;
    }
    float lanes[PANEL];
    _mm256_storeu_ps(lanes, v);
    memcpy(y, lanes, sizeof(float) * (size_t)count);
}

#ifdef TILE_512
/* Two panels in one 512-bit vector (panel 0's 8 rows in the low half, panel 1's in the high):
 * the tiles of full units (16 rows) below. Every lane does the same integer and float steps as
 * in the 256-bit tiles, so the bits are the same. Zen 4 splits a 512-bit multiply in two, so it
 * keeps the 256-bit tiles; Intel's 512-bit VNNI does twice the work per instruction. */
INLINE __m512i pair_of(const void *lo, const void *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)lo)),
                              _mm256_load_si256((const __m256i *)hi), 1);
}

INLINE __m512 pair_ps(const float *lo, const float *hi) { return _mm512_castsi512_ps(pair_of(lo, hi)); }

INLINE __m512i bcast4_512(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

INLINE void store_pair(__m512 v, float *y, const int *count) {
    __m256 half[2] = {_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))};
    for (int g = 0; g < 2; g++) {
        float lanes[PANEL];
        if (count[g] == PANEL) {
            _mm256_storeu_ps(y + PANEL * g, half[g]);
            continue;
        }
        _mm256_storeu_ps(lanes, half[g]);
        memcpy(y + PANEL * g, lanes, sizeof(float) * (size_t)count[g]);
    }
}

/* Chunk c of sub-block j of block k of a packed unit (PK 1: Q4_K_PANELS, 2: Q6_K_PANELS), both
 * panels: the codes decode_panel would have stored. G says which bits hold them and must be a
 * constant (j need not be): Q4_K_PANELS the high nibbles (j odd), Q6_K_PANELS j / 4, the pair
 * of high bits (and from 2 on the high nibbles). */
INLINE __m512i packed_512(const Panel *pn, const int PK, int64_t k, int j, const int c, const int G) {
    const uint8_t *b = pn[0].codes + PACKED_UNIT(PK) * k;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    if (PK == 1) {
        const __m512i w = _mm512_load_si512((const void *)(b + 64 * (8 * (j / 2) + c)));
        return _mm512_and_si512(G ? _mm512_srli_epi16(w, 4) : w, low4);
    }
    const __m512i w = _mm512_load_si512((const void *)(b + 64 * (16 * (G % 2) + 4 * (j % 4) + c)));
    const __m512i h = _mm512_load_si512((const void *)(b + 2048 + 64 * (4 * (j % 4) + c)));
    const __m512i high = G == 0 ? _mm512_slli_epi16(h, 4) : G == 1 ? _mm512_slli_epi16(h, 2) : G == 2 ? h : _mm512_srli_epi16(h, 2);
    /* (low & 0x0F) | (high & 0x30) */
    return _mm512_ternarylogic_epi32(G < 2 ? w : _mm512_srli_epi16(w, 4), _mm512_and_si512(high, _mm512_set1_epi8(0x30)), low4, 0xE4);
}

/* Sub-block j's multipliers of block k, both panels (16 int32 lanes). */
INLINE __m512i scales_512(const Panel *pn, const int CS, const int PK, int64_t k, const int j) {
    if (!PK) {
        const int64_t at = (64 / CS * k + j) * PANEL;
        return pair_of(pn[0].scales + at, pn[1].scales + at);
    }
    const __m128i v = _mm_load_si128((const __m128i *)(pn[0].sc8 + PACKED_UNIT(PK) * k + 16 * j));
    return PK == 2 ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
}

/* Pair i of block k's multipliers of the activations' sums, both panels (32 int16 lanes). */
INLINE __m512i mins_512(const Panel *pn, const int PK, int64_t k, const int i) {
    if (!PK) return pair_of(pn[0].mins + (8 * k + i) * PANEL, pn[1].mins + (8 * k + i) * PANEL);
    if (PK == 1) return _mm512_cvtepu8_epi16(_mm256_load_si256((const __m256i *)(pn[0].mn8 + PACKED_UNIT(1) * k + 32 * i)));
    const uint8_t *sc = pn[0].sc8 + PACKED_UNIT(2) * k + 32 * i; /* Q6_K: scales 2i, 2i + 1 */
    const __m128i a = _mm_load_si128((const __m128i *)sc), b = _mm_load_si128((const __m128i *)(sc + 16));
    return _mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(a, b)), _mm_unpackhi_epi8(a, b), 1));
}

INLINE __m512 d_512(const Panel *pn, const int PK, int64_t k) {
    if (!PK) return pair_ps(pn[0].d + PANEL * k, pn[1].d + PANEL * k);
    return _mm512_load_ps(pn[0].d + PACKED_UNIT(PK) / 4 * k);
}

INLINE __m512 dmin_512(const Panel *pn, const int PK, int64_t k) {
    if (!PK) return pair_ps(pn[0].dmin + PANEL * k, pn[1].dmin + PANEL * k);
    if (PK == 2) return _mm512_mul_ps(d_512(pn, PK, k), _mm512_set1_ps(32.0f));
    return _mm512_load_ps(pn[0].dmin + PACKED_UNIT(PK) / 4 * k);
}

/* Sub-block j of block k of two panels x T tokens into isum (tile_k512's inner steps; G: see
 * packed_512). */
INLINE void sub_512(const Panel *pn, const int T, const int CS, const int PK, int64_t k, int j,
                    const int G, const Token *x, __m512i isum[TILE]) {
    __m512i p[TILE];
    for (int t = 0; t < T; t++) p[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int c = 0; c < CS; c++) {
        const int64_t chunk = 64 * k + CS * j + c;
        const __m512i w = PK ? packed_512(pn, PK, k, j, c, G) : pair_of(pn[0].codes + 32 * chunk, pn[1].codes + 32 * chunk);
        if (PK && 64 * (CS * j + c) < PACKED_UNIT(PK)) /* line CS j + c of the next unit's block k */
            PREFETCH_L2(pn[0].codes + pn[0].ahead + PACKED_UNIT(PK) * k + 64 * (CS * j + c));
        for (int t = 0; t < T; t++) p[t] = _mm512_dpbusd_epi32(p[t], w, bcast4_512(x[t].q + 4 * chunk));
    }
    const __m512i sc = scales_512(pn, CS, PK, k, j);
    for (int t = 0; t < T; t++) isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(p[t], sc));
}

/* K-quants, two panels x T tokens (tile_k's steps; PK: packed, 1 Q4_K_PANELS, 2 Q6_K_PANELS). */
INLINE void tile_k512(const Panel *pn, const int T, const int CS, const int PK, int64_t blocks,
                      const Token *x, float *y, int64_t ldy, const int *count) {
    const int subs = 64 / CS;
    __m512 acc[TILE];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        __m512i isum[TILE];
        for (int t = 0; t < T; t++) isum[t] = _mm512_setzero_si512();
        if (PK == 1) { /* which bits hold the codes is a constant, the loops are not unrolled */
#pragma GCC unroll 1
            for (int m = 0; m < 4; m++) sub_512(pn, T, CS, PK, k, 2 * m, 0, x, isum), sub_512(pn, T, CS, PK, k, 2 * m + 1, 1, x, isum);
        } else if (PK == 2) {
#pragma GCC unroll 4
            for (int G = 0; G < 4; G++)
#pragma GCC unroll 1
                for (int j = 4 * G; j < 4 * G + 4; j++) sub_512(pn, T, CS, PK, k, j, G, x, isum);
        } else {
            for (int j = 0; j < subs; j++) sub_512(pn, T, CS, PK, k, j, 0, x, isum);
        }
        const __m512 d = d_512(pn, PK, k), dmin = dmin_512(pn, PK, k);
        __m512i mins[8]; /* once per block (Q6_K_PANELS' are shuffled from its scales) */
        for (int i = 0; i < subs / 2; i++) mins[i] = mins_512(pn, PK, k, i);
        for (int t = 0; t < T; t++) {
            const int16_t *sums = CS == 8 ? x[t].b32 + 8 * k : (const int16_t *)x[t].sums + 16 * k;
            const __m512 dx = _mm512_set1_ps(x[t].d[k]);
            __m512i msum = _mm512_setzero_si512();
            for (int i = 0; i < subs / 2; i++) msum = _mm512_dpwssd_epi32(msum, mins[i], bcast4_512(sums + 2 * i));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(d, dx), acc[t]);
            acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, dx), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) store_pair(acc[t], y + t * ldy, count);
}

/* Legacy formats, two panels x T tokens (tile_32's steps). */
INLINE void tile_32_512(const Panel *pn, const int T, const int SIGNED, int64_t blocks,
                        const Token *x, float *y, int64_t ldy, const int *count) {
    __m512 acc[TILE];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        __m512i p[TILE];
        for (int t = 0; t < T; t++) p[t] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++) {
            const int64_t chunk = 8 * k + c;
            const __m512i w = pair_of(pn[0].codes + 32 * chunk, pn[1].codes + 32 * chunk);
            for (int t = 0; t < T; t++)
                p[t] = SIGNED ? _mm512_dpbusd_epi32(p[t], bcast4_512(x[t].qu + 4 * chunk), w)
                              : _mm512_dpbusd_epi32(p[t], w, bcast4_512(x[t].q + 4 * chunk));
        }
        const __m512 d = pair_ps(pn[0].d + PANEL * k, pn[1].d + PANEL * k);
        const __m512i w128 = SIGNED ? pair_of(pn[0].w128 + PANEL * k, pn[1].w128 + PANEL * k) : _mm512_setzero_si512();
        const __m512 bias = SIGNED ? _mm512_setzero_ps() : pair_ps(pn[0].dmin + PANEL * k, pn[1].dmin + PANEL * k);
        for (int t = 0; t < T; t++) {
            const __m512 dx = _mm512_set1_ps(x[t].d[k]), sx = _mm512_set1_ps(((const float *)x[t].sums)[k]);
            const __m512i isum = SIGNED ? _mm512_sub_epi32(p[t], w128) : p[t];
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, dx), acc[t]);
            if (!SIGNED) acc[t] = _mm512_fmadd_ps(bias, sx, acc[t]);
        }
    }
    for (int t = 0; t < T; t++) store_pair(acc[t], y + t * ldy, count);
}
#endif

/* Chunk c of sub-block j of block k of packed panel p (PK 1: Q4_K_PANELS, 2: Q6_K_PANELS): the
 * codes decode_panel would have stored (G: see packed_512). */
INLINE __m256i packed_256(const Panel *p, const int PK, int64_t k, int j, const int c, const int G) {
    const uint8_t *b = p->codes + PACKED_UNIT(PK) * k;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if (PK == 1) {
        const __m256i w = _mm256_load_si256((const __m256i *)(b + 64 * (8 * (j / 2) + c)));
        return _mm256_and_si256(G ? _mm256_srli_epi16(w, 4) : w, low4);
    }
    const __m256i w = _mm256_load_si256((const __m256i *)(b + 64 * (16 * (G % 2) + 4 * (j % 4) + c)));
    const __m256i h = _mm256_load_si256((const __m256i *)(b + 2048 + 64 * (4 * (j % 4) + c)));
    const __m256i high = G == 0 ? _mm256_slli_epi16(h, 4) : G == 1 ? _mm256_slli_epi16(h, 2) : G == 2 ? h : _mm256_srli_epi16(h, 2);
    const __m256i low = _mm256_and_si256(G < 2 ? w : _mm256_srli_epi16(w, 4), low4);
    return _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
}

/* Panel p's sub-block j multipliers of block k (8 int32 lanes). */
INLINE __m256i scales_256(const Panel *p, const int CS, const int PK, int64_t k, const int j) {
    if (!PK) return _mm256_load_si256((const __m256i *)(p->scales + (64 / CS * k + j) * PANEL));
    const __m128i v = _mm_loadl_epi64((const __m128i *)(p->sc8 + PACKED_UNIT(PK) * k + 16 * j));
    return PK == 2 ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
}

/* Panel p's pair i of block k's multipliers of the activations' sums (16 int16 lanes). */
INLINE __m256i mins_256(const Panel *p, const int PK, int64_t k, const int i) {
    if (!PK) return _mm256_load_si256((const __m256i *)(p->mins + (8 * k + i) * PANEL));
    if (PK == 1) return _mm256_cvtepu8_epi16(_mm_load_si128((const __m128i *)(p->mn8 + PACKED_UNIT(1) * k + 32 * i)));
    const uint8_t *sc = p->sc8 + PACKED_UNIT(2) * k + 32 * i; /* Q6_K: scales 2i, 2i + 1 */
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)sc), _mm_loadl_epi64((const __m128i *)(sc + 16))));
}

INLINE __m256 d_256(const Panel *p, const int PK, int64_t k) {
    return _mm256_load_ps(p->d + (PK ? PACKED_UNIT(PK) / 4 : PANEL) * k);
}

INLINE __m256 dmin_256(const Panel *p, const int PK, int64_t k) {
    if (PK == 2) return _mm256_mul_ps(d_256(p, PK, k), _mm256_set1_ps(32.0f));
    return _mm256_load_ps(p->dmin + (PK ? PACKED_UNIT(PK) / 4 : PANEL) * k);
}

/* Sub-block j of K-quant block k (CS chunks of 4) into isum, NG panels x T tokens (PK: packed,
 * the codes taken apart here and the multipliers widened from bytes). */
INLINE void k_sub(const Panel *pn, const int NG, const int T, const int CS, const int PK, int64_t k,
                  int j, const int G, const Token *x, __m256i isum[UNIT][TILE]) {
    __m256i p[UNIT][TILE];
    for (int g = 0; g < NG; g++)
        for (int t = 0; t < T; t++) p[g][t] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < CS; c++) {
        const int64_t chunk = 64 * k + CS * j + c;
        __m256i w[UNIT];
        for (int g = 0; g < NG; g++)
            w[g] = PK ? packed_256(pn + g, PK, k, j, c, G) : _mm256_load_si256((const __m256i *)(pn[g].codes + 32 * chunk));
        if (PK && 64 * (CS * j + c) < PACKED_UNIT(PK)) /* line CS j + c of the next unit's block k */
            PREFETCH_L2(pn[0].codes + pn[0].ahead + PACKED_UNIT(PK) * k + 64 * (CS * j + c));
        for (int t = 0; t < T; t++) {
            const __m256i v = bcast4(x[t].q + 4 * chunk);
            for (int g = 0; g < NG; g++) p[g][t] = dot_u(p[g][t], w[g], v);
        }
    }
    for (int g = 0; g < NG; g++) {
        const __m256i sc = scales_256(pn + g, CS, PK, k, j);
        for (int t = 0; t < T; t++) isum[g][t] = _mm256_add_epi32(isum[g][t], _mm256_mullo_epi32(p[g][t], sc));
    }
}

/* The integer sums of K-quant block k, sub-block by sub-block. */
INLINE void k_isums(const Panel *pn, const int NG, const int T, const int CS, const int PK,
                    int64_t k, const Token *x, __m256i isum[UNIT][TILE]) {
    if (PK == 1) { /* which bits hold the codes is a constant, the loops are not unrolled */
#pragma GCC unroll 1
        for (int m = 0; m < 4; m++) k_sub(pn, NG, T, CS, PK, k, 2 * m, 0, x, isum), k_sub(pn, NG, T, CS, PK, k, 2 * m + 1, 1, x, isum);
    } else if (PK == 2) {
#pragma GCC unroll 4
        for (int G = 0; G < 4; G++)
#pragma GCC unroll 1
            for (int j = 4 * G; j < 4 * G + 4; j++) k_sub(pn, NG, T, CS, PK, k, j, G, x, isum);
    } else {
        for (int j = 0; j < 64 / CS; j++) k_sub(pn, NG, T, CS, PK, k, j, 0, x, isum);
    }
}

/* K-quants: NG panels x T tokens, every block (CS: chunks per sub-block, 8 or Q6_K's 4; PK:
 * Q4_K_PANELS). */
INLINE void tile_k(const Panel *pn, const int NG, const int T, const int CS, const int PK,
                   int64_t blocks, const Token *x, float *y, int64_t ldy, const int *count) {
#ifdef TILE_512
    if (NG == 2) return tile_k512(pn, T, CS, PK, blocks, x, y, ldy, count);
#endif
    __m256 acc[UNIT][TILE];
    for (int g = 0; g < NG; g++)
        for (int t = 0; t < T; t++) acc[g][t] = _mm256_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        __m256i isum[UNIT][TILE];
        for (int g = 0; g < NG; g++)
            for (int t = 0; t < T; t++) isum[g][t] = _mm256_setzero_si256();
        k_isums(pn, NG, T, CS, PK, k, x, isum);
        for (int t = 0; t < T; t++) {
            /* Q4_K / Q5_K: mins per 32 times sums per 32; Q6_K: scales per 16 times sums per 16 */
            const int16_t *sums = CS == 8 ? x[t].b32 + 8 * k : (const int16_t *)x[t].sums + 16 * k;
            const __m256 dx = _mm256_set1_ps(x[t].d[k]);
            for (int g = 0; g < NG; g++) {
                __m256i msum = _mm256_setzero_si256();
                for (int i = 0; i < (CS == 8 ? 4 : 8); i++) msum = dot_pairs(msum, mins_256(pn + g, PK, k, i), bcast4(sums + 2 * i));
                const __m256 dd = _mm256_mul_ps(d_256(pn + g, PK, k), dx);
                const __m256 dm = _mm256_mul_ps(dmin_256(pn + g, PK, k), dx);
                acc[g][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[g][t]), dd, acc[g][t]);
                acc[g][t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), dm, acc[g][t]);
            }
        }
    }
    for (int g = 0; g < NG; g++)
        for (int t = 0; t < T; t++) store_rows(acc[g][t], y + t * ldy + PANEL * g, count[g]);
}

/* Legacy formats: NG panels x T tokens, every 32-value block. */
INLINE void tile_32(const Panel *pn, const int NG, const int T, const int SIGNED, int64_t blocks,
                    const Token *x, float *y, int64_t ldy, const int *count) {
#ifdef TILE_512
    if (NG == 2) return tile_32_512(pn, T, SIGNED, blocks, x, y, ldy, count);
#endif
    __m256 acc[UNIT][TILE];
    for (int g = 0; g < NG; g++)
        for (int t = 0; t < T; t++) acc[g][t] = _mm256_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        __m256i p[UNIT][TILE];
        for (int g = 0; g < NG; g++)
            for (int t = 0; t < T; t++) p[g][t] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const int64_t chunk = 8 * k + c;
            __m256i w[UNIT];
            for (int g = 0; g < NG; g++) w[g] = _mm256_load_si256((const __m256i *)(pn[g].codes + 32 * chunk));
            for (int t = 0; t < T; t++) {
#ifdef Q8_VNNI
                const __m256i v = SIGNED ? bcast4(x[t].qu + 4 * chunk) : bcast4(x[t].q + 4 * chunk);
#else
                const __m256i v = bcast4(x[t].q + 4 * chunk);
#endif
                for (int g = 0; g < NG; g++) p[g][t] = SIGNED ? dot_s(p[g][t], w[g], v) : dot_u(p[g][t], w[g], v);
            }
        }
        for (int t = 0; t < T; t++) {
            const __m256 dx = _mm256_set1_ps(x[t].d[k]), sx = _mm256_set1_ps(((const float *)x[t].sums)[k]);
            for (int g = 0; g < NG; g++) {
                __m256i isum = p[g][t];
#ifdef Q8_VNNI
                if (SIGNED) isum = _mm256_sub_epi32(isum, _mm256_load_si256((const __m256i *)(pn[g].w128 + PANEL * k)));
#endif
                const __m256 dd = _mm256_mul_ps(_mm256_load_ps(pn[g].d + PANEL * k), dx);
                acc[g][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dd, acc[g][t]);
                if (!SIGNED) acc[g][t] = _mm256_fmadd_ps(_mm256_load_ps(pn[g].dmin + PANEL * k), sx, acc[g][t]);
            }
        }
    }
    for (int g = 0; g < NG; g++)
        for (int t = 0; t < T; t++) store_rows(acc[g][t], y + t * ldy + PANEL * g, count[g]);
}
#else /* portable: each (row, token) on its own, the same steps as the vector lanes */
static float row_k(const Panel *pn, int r, int CS, int64_t blocks, const Token *x) {
    const int subs = 64 / CS;
    const int16_t *sums = CS == 8 ? x->b32 : (const int16_t *)x->sums;
    const int per_block = CS == 8 ? 8 : 16;
    float acc = 0.0f;
    for (int64_t k = 0; k < blocks; k++) {
        int32_t isum = 0, msum = 0;
        for (int j = 0; j < subs; j++) {
            int32_t dot = 0;
            for (int64_t e = 4 * (64 * k + CS * j); e < 4 * (64 * k + CS * (j + 1)); e++)
                dot += pn->codes[32 * (e / 4) + 4 * r + e % 4] * x->q[e];
            isum += dot * pn->scales[(subs * k + j) * PANEL + r];
        }
        for (int i = 0; i < per_block / 2; i++) {
            const int32_t pair = pn->mins[(8 * k + i) * PANEL + r];
            const int16_t *s2 = sums + per_block * k + 2 * i;
            msum += (int16_t)(pair & 0xFFFF) * s2[0] + (int16_t)(pair >> 16) * s2[1];
        }
        acc = fmaf((float)isum, pn->d[PANEL * k + r] * x->d[k], acc);
        acc = fmaf(-(float)msum, pn->dmin[PANEL * k + r] * x->d[k], acc);
    }
    return acc;
}

static float row_32(const Panel *pn, int r, int SIGNED, int64_t blocks, const Token *x) {
    float acc = 0.0f;
    for (int64_t k = 0; k < blocks; k++) {
        int32_t isum = 0;
        for (int64_t e = 32 * k; e < 32 * (k + 1); e++) {
            const uint8_t code = pn->codes[32 * (e / 4) + 4 * r + e % 4];
            isum += (SIGNED ? (int8_t)code : code) * x->q[e];
        }
        acc = fmaf((float)isum, pn->d[PANEL * k + r] * x->d[k], acc);
        if (!SIGNED) acc = fmaf(pn->dmin[PANEL * k + r], ((const float *)x->sums)[k], acc);
    }
    return acc;
}

static void tile_k(const Panel *pn, int NG, int T, int CS, int PK, int64_t blocks, const Token *x,
                   float *y, int64_t ldy, const int *count) {
    (void)PK; /* portable: run_unit unpacks packed panels into the common layout */
    for (int g = 0; g < NG; g++)
        for (int r = 0; r < count[g]; r++)
            for (int t = 0; t < T; t++) y[t * ldy + PANEL * g + r] = row_k(pn + g, r, CS, blocks, x + t);
}

static void tile_32(const Panel *pn, int NG, int T, int SIGNED, int64_t blocks, const Token *x,
                    float *y, int64_t ldy, const int *count) {
    for (int g = 0; g < NG; g++)
        for (int r = 0; r < count[g]; r++)
            for (int t = 0; t < T; t++) y[t * ldy + PANEL * g + r] = row_32(pn + g, r, SIGNED, blocks, x + t);
}
#endif

/* One compiled tile per kind (K 32-value sub-blocks, Q6_K's 16, Q8_0, biased legacy), panel
 * count and token count: the loops unroll and the accumulators stay in registers. */
#define TILE_FNS(NG, T)                                                                           \
    NOINLINE void k8_##NG##_##T(const Panel *pn, int64_t blocks, const Token *x, float *y,       \
                                int64_t ldy, const int *count) {                                  \
        tile_k(pn, NG, T, 8, 0, blocks, x, y, ldy, count);                                        \
    }                                                                                             \
    NOINLINE void k4_##NG##_##T(const Panel *pn, int64_t blocks, const Token *x, float *y,       \
                                int64_t ldy, const int *count) {                                  \
        tile_k(pn, NG, T, 4, 0, blocks, x, y, ldy, count);                                        \
    }                                                                                             \
    NOINLINE void p4_##NG##_##T(const Panel *pn, int64_t blocks, const Token *x, float *y,       \
                                int64_t ldy, const int *count) {                                  \
        tile_k(pn, NG, T, 8, 1, blocks, x, y, ldy, count);                                        \
    }                                                                                             \
    NOINLINE void p6_##NG##_##T(const Panel *pn, int64_t blocks, const Token *x, float *y,       \
                                int64_t ldy, const int *count) {                                  \
        tile_k(pn, NG, T, 4, 2, blocks, x, y, ldy, count);                                        \
    }                                                                                             \
    NOINLINE void s_##NG##_##T(const Panel *pn, int64_t blocks, const Token *x, float *y,        \
                               int64_t ldy, const int *count) {                                   \
        tile_32(pn, NG, T, 1, blocks, x, y, ldy, count);                                          \
    }                                                                                             \
    NOINLINE void b_##NG##_##T(const Panel *pn, int64_t blocks, const Token *x, float *y,        \
                               int64_t ldy, const int *count) {                                   \
        tile_32(pn, NG, T, 0, blocks, x, y, ldy, count);                                          \
    }
TILE_FNS(1, 1) TILE_FNS(1, 2) TILE_FNS(1, 3) TILE_FNS(1, 4) TILE_FNS(1, 5) TILE_FNS(1, 6)
TILE_FNS(2, 1) TILE_FNS(2, 2) TILE_FNS(2, 3) TILE_FNS(2, 4) TILE_FNS(2, 5) TILE_FNS(2, 6)
#if TILE == 8
TILE_FNS(1, 7) TILE_FNS(1, 8) TILE_FNS(2, 7) TILE_FNS(2, 8)
#define TILE_ROW(K, NG) {K##_##NG##_1, K##_##NG##_2, K##_##NG##_3, K##_##NG##_4, K##_##NG##_5, \
                         K##_##NG##_6, K##_##NG##_7, K##_##NG##_8}
#else
#define TILE_ROW(K, NG) {K##_##NG##_1, K##_##NG##_2, K##_##NG##_3, K##_##NG##_4, K##_##NG##_5, \
                         K##_##NG##_6}
#endif

enum { KIND_K8, KIND_K4, KIND_SIGNED, KIND_BIASED, KIND_P4, KIND_P6 };
static const tile_fn TILES[6][UNIT][TILE] = {
    {TILE_ROW(k8, 1), TILE_ROW(k8, 2)}, {TILE_ROW(k4, 1), TILE_ROW(k4, 2)},
    {TILE_ROW(s, 1), TILE_ROW(s, 2)},   {TILE_ROW(b, 1), TILE_ROW(b, 2)},
    {TILE_ROW(p4, 1), TILE_ROW(p4, 2)}, {TILE_ROW(p6, 1), TILE_ROW(p6, 2)},
};

static int kind_of(int type) {
    if (packed_from(type)) return type == Q4_K_PANELS ? KIND_P4 : KIND_P6; /* read in place */
    return subs16(type) ? KIND_K4 : is_k(type) ? KIND_K8 : type == Q8_0 ? KIND_SIGNED : KIND_BIASED;
}

/* ---- one token: 8 rows at a time straight from the weight blocks ------------------------- */
#ifdef __AVX2__
/* One token is no reuse for a decoded panel: each row's block is multiplied where it lies into
 * 8-lane partial sums, which reduce8 turns into one exact sum per row, lane = row: then the
 * same float steps as the tiles. */

/* lane r = the sum of v[r]'s lanes (exact: integers). */
static inline __m256i reduce8(const __m256i v[PANEL]) {
    const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}

/* int16 j of each 128-bit half of v, in all 8 int16 of that half. */
static inline __m256i pick16(__m256i v, int j) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)(((2 * j + 1) << 8) | (2 * j))));
}

/* Q4_K / Q5_K block b times the token's block (q: 8 x 32 values; b32: its sums per 32): the
 * partial sums of isum and msum. */
static inline void row_k45(int type, const uint8_t *b, const __m256i *q, __m256i b32,
                           __m256i *isum, __m256i *msum) {
    const __m128i packed = k_scales_vec(_mm_loadu_si128((const __m128i *)b));
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(packed));
    *msum = _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8)), b32);
    const uint8_t *qs = b + (type == Q4_K ? 16 : 48);
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)); /* Q5_K's fifth bits */
    __m256i sum = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        if (type == Q5_K) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
        }
        sum = dot_pairs(sum, _mm256_maddubs_epi16(lo, q[2 * c]), pick16(scales, 2 * c));
        sum = dot_pairs(sum, _mm256_maddubs_epi16(hi, q[2 * c + 1]), pick16(scales, 2 * c + 1));
    }
    *isum = sum;
}

/* Q6_K block b times the token's block (q: 8 x 32 values; bsums: its 16 sums per 16). */
static inline void row_k6(const uint8_t *b, const __m256i *q, __m256i bsums, __m256i *isum,
                          __m256i *msum) {
    const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
    *msum = _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc), bsums);
    /* Scales 0, 2, .., 14 in the low half, 1, 3, .., 15 in the high: 32 codes i take scale 2i
     * on their first 16 (maddubs' low half) and 2i + 1 on their last 16. */
    const __m128i odd_even = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i split = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, odd_even));
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(3);
    __m256i sum = _mm256_setzero_si256();
    for (int half = 0; half < 2; half++) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
        for (int part = 0; part < 4; part++) {
            const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * half + 32 * (part & 1)));
            const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (part >> 1)), low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * part), low2);
            const __m256i codes = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
            sum = dot_pairs(sum, _mm256_maddubs_epi16(codes, q[4 * half + part]), pick16(split, 4 * half + part));
        }
    }
    *isum = sum;
}

/* Q2_K / Q3_K block b times the token's block: row_k6's steps with 2- and 3-bit codes, and the
 * mins apart from the multipliers (Q3_K: the same). */
static inline void row_k23(const int type, const uint8_t *b, const __m256i *q, __m256i bsums,
                           __m256i *isum, __m256i *msum) {
    __m128i sc, mn;
    k23_multipliers_vec(type, b, &sc, &mn);
    *msum = _mm256_madd_epi16(_mm256_cvtepi8_epi16(mn), bsums);
    const __m128i odd_even = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i split = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, odd_even));
    __m256i sum = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++) {
            const __m256i products = _mm256_maddubs_epi16(k23_codes32(type, b, h, s), q[4 * h + s]);
            sum = dot_pairs(sum, products, pick16(split, 4 * h + s));
        }
    *isum = sum;
}

/* A K-quant block times the token's block (bsums: its 16 sums per 16): the partial sums of
 * isum and msum. */
static inline void row_kq(const int type, const uint8_t *b, const __m256i *q, __m256i bsums,
                          __m256i *isum, __m256i *msum) {
    if (type == Q6_K)
        row_k6(b, q, bsums, isum, msum);
    else if (k23_is(type))
        row_k23(type, b, q, bsums, isum, msum);
    else
        row_k45(type, b, q, _mm256_madd_epi16(bsums, _mm256_set1_epi16(1)), isum, msum);
}

/* Where a K-quant block's fp16 d lies, and dmin's factor of d (0: dmin is the fp16 after d). */
static inline int k_d_at(int type) { return type == Q6_K ? 208 : k23_is(type) ? k23_d_at(type) : 0; }
static inline float k_dmin_of_d(int type) { return type == Q6_K ? 32.0f : k23_is(type) ? k23_dmin_of_d(type) : 0.0f; }

/* Every cache line of the block at b, the same column a few octets on (>= 16 KiB ahead): one
 * token does little arithmetic per byte, and the out-of-order window alone keeps too few
 * misses in flight (ggml_cpu.c's batch-1 loops measured the same). */
static inline void prefetch_ahead(const uint8_t *b, int bytes, int64_t row_bytes) {
    const int64_t octet = PANEL * row_bytes, ahead = octet * ((16384 + octet - 1) / octet);
    for (int line = 0; line < bytes; line += 64) PREFETCH_L2(b + ahead + line);
}

/* The fp16 at offset `at` of each row's block, as 8 floats (exact). */
static inline __m256 f16_lanes(const uint8_t *const *b, int at) {
    uint16_t h[PANEL];
    for (int r = 0; r < PANEL; r++) memcpy(h + r, b[r] + at, 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* K-quant rows [0, count) at w, one token: y[r] for r < count. */
INLINE void gemv_k(const int type, const uint8_t *w, int64_t row_bytes, int count, int64_t blocks,
                   const Token *x, float *y) {
    const int bytes = q8_bytes(type);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        __m256i q[8], isum[PANEL], msum[PANEL];
        for (int i = 0; i < 8; i++) q[i] = _mm256_loadu_si256((const __m256i *)(x->q + 256 * k + 32 * i));
        const __m256i bsums = _mm256_loadu_si256((const __m256i *)((const int16_t *)x->sums + 16 * k));
        const uint8_t *b[PANEL];
        for (int r = 0; r < PANEL; r++) {
            b[r] = w + (r < count ? r : count - 1) * row_bytes + k * bytes;
            prefetch_ahead(b[r], bytes, row_bytes);
            row_kq(type, b[r], q, bsums, isum + r, msum + r);
        }
        const __m256 d = f16_lanes(b, k_d_at(type));
        const __m256 dmin = k_dmin_of_d(type) ? _mm256_mul_ps(d, _mm256_set1_ps(k_dmin_of_d(type)))
                                              : f16_lanes(b, k_d_at(type) + 2);
        const __m256 dx = _mm256_set1_ps(x->d[k]);
        const __m256 dd = _mm256_mul_ps(d, dx), dm = _mm256_mul_ps(dmin, dx);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(isum)), dd, acc);
        acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(reduce8(msum)), dm, acc);
    }
    store_rows(acc, y, count);
}

/* gemv_k for rows of at most SEQ_BLOCKS_K blocks: each row's blocks in one sequential run, their
 * partial sums kept (exact integers), then the same float steps block by block, lane = row. */
INLINE void gemv_k_rows(const int type, const uint8_t *w, int64_t row_bytes, int count,
                        int64_t blocks, const Token *x, float *y) {
    const int bytes = q8_bytes(type);
    __m256i isum[SEQ_BLOCKS_K][PANEL], msum[SEQ_BLOCKS_K][PANEL];
    /* fp16 d and dmin, taken on the walk: gathered afterwards from 8 rows they cost ~10 %. */
    uint16_t dh[SEQ_BLOCKS_K][PANEL] = {{0}}, mh[SEQ_BLOCKS_K][PANEL] = {{0}};
    for (int r = 0; r < PANEL; r++)
        for (int64_t k = 0; k < blocks; k++) {
            const uint8_t *b = w + r * row_bytes + k * bytes;
            if (r >= count) {
                isum[k][r] = msum[k][r] = _mm256_setzero_si256();
                continue;
            }
            for (int line = 0; SEQ_PREFETCH && line < bytes; line += 64) PREFETCH_L2(b + SEQ_PREFETCH + line);
            memcpy(&dh[k][r], b + k_d_at(type), 2);
            if (!k_dmin_of_d(type)) memcpy(&mh[k][r], b + k_d_at(type) + 2, 2);
            __m256i q[8];
            for (int i = 0; i < 8; i++) q[i] = _mm256_loadu_si256((const __m256i *)(x->q + 256 * k + 32 * i));
            const __m256i bsums = _mm256_loadu_si256((const __m256i *)((const int16_t *)x->sums + 16 * k));
            row_kq(type, b, q, bsums, &isum[k][r], &msum[k][r]);
        }
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh[k]));
        const __m256 dmin = k_dmin_of_d(type) ? _mm256_mul_ps(d, _mm256_set1_ps(k_dmin_of_d(type)))
                                              : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mh[k]));
        const __m256 dx = _mm256_set1_ps(x->d[k]);
        const __m256 dd = _mm256_mul_ps(d, dx), dm = _mm256_mul_ps(dmin, dx);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(isum[k])), dd, acc);
        acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(reduce8(msum[k])), dm, acc);
    }
    store_rows(acc, y, count);
}

/* The integer sum of a legacy block's codes times q (8 partial lanes); qu = q + 128. */
static inline __m256i row_32(int type, const uint8_t *b, __m256i q, __m256i qu) {
    const __m256i codes = codes_32(type, b), zero = _mm256_setzero_si256();
    if (type != Q8_0) return dot_u(zero, codes, q);
    (void)qu;
#ifdef Q8_VNNI
    /* The signs moved onto q (finite activations: |q| <= 127): one dpbusd, not two and a sub. */
    return _mm256_dpbusd_epi32(zero, _mm256_abs_epi8(codes), _mm256_sign_epi8(q, codes));
#else
    return dot_s(zero, codes, q);
#endif
}

/* Legacy rows [0, count) at w, one token: y[r] for r < count. */
INLINE void gemv_32(const int type, const uint8_t *w, int64_t row_bytes, int count, int64_t blocks,
                    const Token *x, float *y) {
    const int bytes = q8_bytes(type);
    /* The 8 rows lie in one run of 8 row_bytes: prefetched as one stream, PF32_AHEAD bytes on,
     * the run's lines in step with the blocks (one prefetch per line, not per block and row). */
    const int64_t run = PANEL * row_bytes, step = PANEL * bytes;
    const uint8_t *pf = w + PF32_AHEAD;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(x->q + 32 * k));
        const __m256i qu = _mm256_loadu_si256((const __m256i *)(x->qu + 32 * k));
        for (int64_t at = (k * step + 63) & ~(int64_t)63; at < (k + 1) * step && at < run; at += 64)
            PREFETCH_L2(pf + at);
        __m256i isum[PANEL];
        const uint8_t *b[PANEL];
        for (int r = 0; r < PANEL; r++) {
            b[r] = w + (r < count ? r : count - 1) * row_bytes + k * bytes;
            isum[r] = row_32(type, b[r], q, qu);
        }
        const __m256 d = f16_lanes(b, 0);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(isum)), _mm256_mul_ps(d, _mm256_set1_ps(x->d[k])), acc);
        if (type == Q8_0) continue;
        /* legacy_bias's steps, lane by lane */
        const __m256 bias = type == Q4_1 || type == Q5_1 ? f16_lanes(b, 2)
                                                         : _mm256_mul_ps(_mm256_set1_ps(type == Q4_0 ? -8.0f : -16.0f), d);
        acc = _mm256_fmadd_ps(bias, _mm256_set1_ps(((const float *)x->sums)[k]), acc);
    }
    store_rows(acc, y, count);
}

/* gemv_32 for tokens [0, T), T <= GEMV_TOKENS, of the legacy types with unsigned codes (Q8_0's
 * panels are a plain copy, faster at 2-8 tokens): a block's 8 rows decoded once for all tokens,
 * and per (row, token) gemv_32's steps in its order, so a row's bits do not depend on T. */
INLINE void gemv_32_tokens(const int type, const uint8_t *w, int64_t row_bytes, int count,
                           int64_t blocks, const Token *x, int T, float *y, int64_t ldy) {
    const int bytes = q8_bytes(type);
    const int64_t run = PANEL * row_bytes, step = PANEL * bytes;
    const uint8_t *pf = w + PF32_AHEAD;
    __m256 acc[GEMV_TOKENS];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        for (int64_t at = (k * step + 63) & ~(int64_t)63; at < (k + 1) * step && at < run; at += 64)
            PREFETCH_L2(pf + at);
        __m256i codes[PANEL];
        const uint8_t *b[PANEL];
        for (int r = 0; r < PANEL; r++) {
            b[r] = w + (r < count ? r : count - 1) * row_bytes + k * bytes;
            codes[r] = codes_32(type, b[r]);
        }
        const __m256 d = f16_lanes(b, 0);
        const __m256 bias = type == Q4_1 || type == Q5_1 ? f16_lanes(b, 2)
                                                         : _mm256_mul_ps(_mm256_set1_ps(type == Q4_0 ? -8.0f : -16.0f), d);
        for (int t = 0; t < T; t++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(x[t].q + 32 * k));
            __m256i isum[PANEL];
            for (int r = 0; r < PANEL; r++) isum[r] = dot_u(_mm256_setzero_si256(), codes[r], q);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(isum)), _mm256_mul_ps(d, _mm256_set1_ps(x[t].d[k])), acc[t]);
            acc[t] = _mm256_fmadd_ps(bias, _mm256_set1_ps(((const float *)x[t].sums)[k]), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) store_rows(acc[t], y + t * ldy, count);
}

/* One compiled loop per type: the per-block branches on the type fold away. Short K-quant rows
 * one after the other, long ones (each a long stream) 8 side by side: no buffer of partial sums. */
#define GEMV_FN(T, body)                                                                          \
    NOINLINE void gemv_##T(const uint8_t *w, int64_t row_bytes, int count, int64_t blocks,       \
                           const Token *x, float *y) {                                            \
        if (blocks <= SEQ_BLOCKS_K)                                                                \
            body##_rows(T, w, row_bytes, count, blocks, x, y);                                    \
        else                                                                                      \
            body(T, w, row_bytes, count, blocks, x, y);                                           \
    }
GEMV_FN(Q4_K, gemv_k) GEMV_FN(Q5_K, gemv_k) GEMV_FN(Q6_K, gemv_k) GEMV_FN(Q2_K, gemv_k) GEMV_FN(Q3_K, gemv_k)
/* Legacy rows of any length 8 side by side: row after row with their sums kept is slower, from
 * memory and from cache. */
#define GEMV32_FN(T)                                                                              \
    NOINLINE void gemv_##T(const uint8_t *w, int64_t row_bytes, int count, int64_t blocks,       \
                           const Token *x, float *y) {                                            \
        gemv_32(T, w, row_bytes, count, blocks, x, y);                                            \
    }
GEMV32_FN(Q4_0) GEMV32_FN(Q4_1) GEMV32_FN(Q5_0) GEMV32_FN(Q5_1) GEMV32_FN(Q8_0)
#define GEMV32_TOKENS_FN(T)                                                                       \
    NOINLINE void gemv_tokens_##T(const uint8_t *w, int64_t row_bytes, int count, int64_t blocks, \
                                  const Token *x, int tokens, float *y, int64_t ldy) {            \
        gemv_32_tokens(T, w, row_bytes, count, blocks, x, tokens, y, ldy);                        \
    }
GEMV32_TOKENS_FN(Q4_0) GEMV32_TOKENS_FN(Q4_1) GEMV32_TOKENS_FN(Q5_0) GEMV32_TOKENS_FN(Q5_1)

typedef void (*gemv_tokens_fn)(const uint8_t *, int64_t, int, int64_t, const Token *, int, float *, int64_t);
static gemv_tokens_fn gemv_tokens_of(int type) {
    switch (type) {
    case Q4_0: return gemv_tokens_Q4_0;
    case Q4_1: return gemv_tokens_Q4_1;
    case Q5_0: return gemv_tokens_Q5_0;
    default: return gemv_tokens_Q5_1; /* axon_q8_matmul_parts sends no other type here */
    }
}

typedef void (*gemv_fn)(const uint8_t *, int64_t, int, int64_t, const Token *, float *);
static gemv_fn gemv_of(int type) {
    switch (type) {
    case Q4_K: return gemv_Q4_K;
    case Q5_K: return gemv_Q5_K;
    case Q6_K: return gemv_Q6_K;
    case Q2_K: return gemv_Q2_K;
    case Q3_K: return gemv_Q3_K;
    case Q4_0: return gemv_Q4_0;
    case Q4_1: return gemv_Q4_1;
    case Q5_0: return gemv_Q5_0;
    case Q5_1: return gemv_Q5_1;
    default: return gemv_Q8_0;
    }
}
#endif

/* ---- the matmul ------------------------------------------------------------------------- */

typedef struct {
    const int *types;
    const uint8_t *const *ws;
    const int64_t *rows;
    int64_t cols, tokens, ldy;
    int64_t ahead; /* rows between a panel and the one its decode prefetches (decode_panel) */
    int64_t units, chunk; /* many tokens: units of 16 rows, tokens per pass over them */
    int straight; /* tokens read the weights where they lie, GEMV_ROWS a unit (gemv, gemv_tokens) */
    const Acts *k_acts, *acts32;
    float *y;
} Call;

/* The token's activations in the layout of type's part. */
INLINE Token token_of(const Call *c, int type, int64_t t) {
    const Acts *acts = is_k(type) ? c->k_acts : c->acts32;
    const int64_t blocks = c->cols / q8_block(type);
    Token x = {acts->q + t * c->cols, acts->qu ? acts->qu + t * c->cols : NULL, acts->d + t * blocks,
               is_k(type) ? (const void *)(acts->bsums + t * (c->cols / 16)) : (const void *)(acts->s + t * blocks),
               is_k(type) ? acts->b32 + t * (c->cols / 32) : NULL};
    return x;
}

/* ---- Q4_K and Q6_K repacked into units ------------------------------------------------- */

/* The 2 panels of the unit of packed weight w whose first row is n0 (a multiple of 16), where
 * they lie: block 0's codes, multipliers and scales of each; blocks are PACKED_UNIT apart. */
static void packed_unit(int type, const uint8_t *w, int64_t blocks, int64_t n0, Panel pn[UNIT]) {
    const int PK = pk_of(type);
    uint8_t *base = (uint8_t *)w + n0 / (UNIT * PANEL) * blocks * PACKED_UNIT(PK);
    for (int g = 0; g < UNIT; g++) {
        pn[g].codes = base + 32 * g, pn[g].sc8 = base + PACKED_SC(PK) + 8 * g;
        pn[g].mn8 = PK == 1 ? base + PACKED_MN + 16 * g : NULL;
        pn[g].d = (float *)(base + PACKED_D(PK)) + PANEL * g;
        pn[g].dmin = PK == 1 ? pn[g].d + 2 * PANEL : NULL;
        pn[g].ahead = 0;
    }
}

/* Where code e (0..31: 8 rows x 4) of chunk ch of block k of panel g lies in a packed unit's
 * block: the byte (*at) and the bit its low 4 bits start at (*shift); Q6_K_PANELS' high 2 bits
 * in *at_high from bit *shift_high. */
static void packed_place(int PK, int g, int ch, int e, int *at, int *shift, int *at_high, int *shift_high) {
    if (PK == 1) {
        *at = 64 * (8 * (ch / 16) + ch % 8) + 32 * g + e, *shift = 4 * ((ch / 8) & 1);
        return;
    }
    *at = 64 * (ch % 32) + 32 * g + e, *shift = ch < 32 ? 0 : 4;
    *at_high = 2048 + 64 * (ch % 16) + 32 * g + e, *shift_high = 2 * (ch / 16);
}

/* Q4_K or Q6_K rows w [rows][cols / 256 blocks] -> out (64-byte aligned), the packed type:
 * (rows + 15) / 16 units of cols / 256 * PACKED_UNIT bytes. Each panel is decoded as the tiles would
 * decode it, then stored as bits and bytes: the same codes and multipliers, so the products are
 * the same bits. Returns 0, -1 for another type, a width that is not whole blocks or an unaligned
 * out, -2 out of memory. */
int axon_q8_pack(int type, const uint8_t *w, int64_t rows, int64_t cols, uint8_t *out) {
    const int packed = type == Q4_K ? Q4_K_PANELS : type == Q6_K ? Q6_K_PANELS : 0, PK = pk_of(packed);
    if (!packed || cols <= 0 || cols % 256 || rows < 0 || (uintptr_t)out % 64) return -1;
    const int64_t blocks = cols / 256, row_bytes = blocks * q8_bytes(type);
    const int subs = PK == 1 ? 8 : 16;
    char *base = aligned_alloc(64, panel_bytes(cols));
    if (!base) return -2;
    Panel p;
    panel_place(&p, base, cols);
    memset(out, 0, (size_t)((rows + 15) / 16 * blocks * PACKED_UNIT(PK)));
    for (int64_t n0 = 0; n0 < rows; n0 += UNIT * PANEL)
        for (int g = 0; g < UNIT; g++) {
            const int64_t first = n0 + PANEL * g;
            const int count = (int)(rows - first < PANEL ? (rows > first ? rows - first : 0) : PANEL);
            decode_panel(type, w + first * row_bytes, row_bytes, count, blocks, &p, 0);
            for (int64_t k = 0; k < blocks; k++) {
                uint8_t *b = out + (n0 / (UNIT * PANEL) * blocks + k) * PACKED_UNIT(PK);
                for (int ch = 0; ch < 64; ch++)
                    for (int e = 0; e < 32; e++) {
                        const uint8_t code = p.codes[32 * (64 * k + ch) + e];
                        int at, shift, at_high = 0, shift_high = 0;
                        packed_place(PK, g, ch, e, &at, &shift, &at_high, &shift_high);
                        b[at] |= (uint8_t)((code & 15) << shift);
                        if (PK == 2) b[at_high] |= (uint8_t)((code >> 4) << shift_high);
                    }
                float *d = (float *)(b + PACKED_D(PK)) + PANEL * g;
                for (int r = 0; r < PANEL; r++) {
                    for (int j = 0; j < subs; j++) b[PACKED_SC(PK) + 16 * j + 8 * g + r] = (uint8_t)p.scales[(subs * k + j) * PANEL + r];
                    for (int i = 0; i < 4 && PK == 1; i++) {
                        const int32_t pair = p.mins[(8 * k + i) * PANEL + r];
                        b[PACKED_MN + 32 * i + 16 * g + 2 * r] = (uint8_t)pair, b[PACKED_MN + 32 * i + 16 * g + 2 * r + 1] = (uint8_t)(pair >> 16);
                    }
                    d[r] = p.d[PANEL * k + r];
                    if (PK == 1) d[2 * PANEL + r] = p.dmin[PANEL * k + r];
                }
            }
        }
    free(base);
    return 0;
}

/* A packed panel s (from packed_unit) into the common layout p, for the common tiles: the
 * portable build's way, and with many tokens (more than PACKED_TOKENS), where taking the bits
 * apart in every tile cost more than doing it once. */
#ifdef __AVX2__
INLINE void unpack_codes(const Panel *s, const int PK, int64_t blocks, uint8_t *codes) {
    for (int64_t k = 0; k < blocks; k++)
#pragma GCC unroll 64
        for (int ch = 0; ch < 64; ch++) {
            if (64 * ch < PACKED_UNIT(PK)) /* line ch of the next unit's block k */
                PREFETCH_L2(s->codes + s->ahead + PACKED_UNIT(PK) * k + 64 * ch);
            const int CS = PK == 1 ? 8 : 4, j = ch / CS, G = PK == 1 ? j & 1 : j / 4; /* unrolled */
            _mm256_store_si256((__m256i *)(codes + 32 * (64 * k + ch)), packed_256(s, PK, k, j, ch % CS, G));
        }
}

INLINE void unpack_rest(const Panel *s, const int PK, int64_t blocks, const Panel *p) {
    const int subs = PK == 1 ? 8 : 16;
    for (int64_t k = 0; k < blocks; k++) {
        for (int j = 0; j < subs; j++) _mm256_store_si256((__m256i *)(p->scales + (subs * k + j) * PANEL), scales_256(s, 64 / subs, PK, k, j));
        for (int i = 0; i < subs / 2; i++) _mm256_store_si256((__m256i *)(p->mins + (8 * k + i) * PANEL), mins_256(s, PK, k, i));
        _mm256_store_ps(p->d + PANEL * k, d_256(s, PK, k));
        _mm256_store_ps(p->dmin + PANEL * k, dmin_256(s, PK, k));
    }
}

static void unpack_panel(int type, const Panel *s, int g, int64_t blocks, const Panel *p) {
    (void)g;
    if (type == Q4_K_PANELS) {
        unpack_codes(s, 1, blocks, p->codes);
        unpack_rest(s, 1, blocks, p);
    } else {
        unpack_codes(s, 2, blocks, p->codes);
        unpack_rest(s, 2, blocks, p);
    }
}
#else
static void unpack_panel(int type, const Panel *s, int g, int64_t blocks, const Panel *p) {
    const int PK = pk_of(type), subs = PK == 1 ? 8 : 16;
    for (int64_t k = 0; k < blocks; k++) {
        const uint8_t *b = s->codes - 32 * g + PACKED_UNIT(PK) * k;
        for (int ch = 0; ch < 64; ch++)
            for (int e = 0; e < 32; e++) {
                int at, shift, at_high = 0, shift_high = 0;
                packed_place(PK, g, ch, e, &at, &shift, &at_high, &shift_high);
                int code = (b[at] >> shift) & 15;
                if (PK == 2) code |= ((b[at_high] >> shift_high) & 3) << 4;
                p->codes[32 * (64 * k + ch) + e] = (uint8_t)code;
            }
        const float *d = (const float *)(b + PACKED_D(PK)) + PANEL * g;
        for (int r = 0; r < PANEL; r++) {
            const uint8_t *sc = b + PACKED_SC(PK) + 8 * g + r;
            for (int j = 0; j < subs; j++) p->scales[(subs * k + j) * PANEL + r] = PK == 2 ? (int8_t)sc[16 * j] : sc[16 * j];
            for (int i = 0; i < subs / 2; i++) {
                const uint8_t *mn = b + PACKED_MN + 32 * i + 16 * g + 2 * r;
                p->mins[(8 * k + i) * PANEL + r] = PK == 1 ? int16_pair(mn[0], mn[1]) : int16_pair((int8_t)sc[32 * i], (int8_t)sc[32 * i + 16]);
            }
            p->d[PANEL * k + r] = d[r], p->dmin[PANEL * k + r] = PK == 1 ? d[2 * PANEL + r] : d[r] * 32.0f;
        }
    }
}
#endif

/* Rows [n0, n0 + 16) of part p (fewer at its end), output columns from `column`: the rows
 * decoded into two panels once (packed: read where they lie), then every token, TILE at a time. */
static void run_unit(const Call *c, int p, int64_t n0, int64_t column, Panel *pn, int64_t t_begin,
                     int64_t t_end) {
    const int type = c->types[p], B = q8_block(type);
    const int64_t blocks = c->cols / B, row_bytes = blocks * q8_bytes(type);
    int count[UNIT], panels = 0, kind = kind_of(type);
#ifdef __AVX2__
    const int unpack = packed_from(type) && t_end - t_begin > PACKED_TOKENS;
#else
    const int unpack = 1; /* the portable tiles read the common layout only */
#endif
    Panel packed[UNIT];
    if (packed_from(type)) {
        if (unpack) kind = kind_of(packed_from(type));
        packed_unit(type, c->ws[p], blocks, n0, unpack ? packed : pn);
        /* the next unit this thread reads, the one after it (its share is contiguous) */
        if (n0 + 2 * UNIT * PANEL <= c->rows[p]) (unpack ? packed : pn)[0].ahead = blocks * PACKED_UNIT(pk_of(type));
    }
    for (; panels < UNIT && n0 + PANEL * panels < c->rows[p]; panels++) {
        const int64_t first = n0 + PANEL * panels, left = c->rows[p] - first;
        count[panels] = (int)(left < PANEL ? left : PANEL);
        /* Units go out one at a time to `threads` threads: this one's next is ~threads on. */
        const int64_t ahead = first + c->ahead + PANEL <= c->rows[p] ? c->ahead : 0;
        if (packed_from(type)) {
            if (unpack) unpack_panel(type, packed + panels, panels, blocks, pn + panels);
            continue;
        }
        decode_panel(type, c->ws[p] + first * row_bytes, row_bytes, count[panels], blocks, pn + panels, ahead);
    }
    /* tokens in passes of at most TILE, evened out (12 as 6 + 6, not 8 + 4) */
    int64_t passes = (t_end - t_begin + TILE - 1) / TILE;
    for (int64_t t0 = t_begin, tt; t0 < t_end; t0 += tt, passes--) {
        tt = (t_end - t0 + passes - 1) / passes;
        Token x[TILE];
        for (int t = 0; t < tt; t++) x[t] = token_of(c, type, t0 + t);
        TILES[kind][panels - 1][tt - 1](pn, blocks, x, c->y + t0 * c->ldy + column + n0, c->ldy, count);
    }
}

/* Unit u of the call (units of rows_per rows, a part's last one shorter): its part, first
 * row and output column. */
static int unit_of(const Call *c, int64_t rows_per, int64_t u, int64_t *n0, int64_t *column) {
    int p = 0;
    *column = 0;
    while (u >= (c->rows[p] + rows_per - 1) / rows_per)
        u -= (c->rows[p] + rows_per - 1) / rows_per, *column += c->rows[p], p++;
    *n0 = u * rows_per;
    return p;
}

/* Work item u of a call: one token (AVX2): 32 rows straight from their blocks; else 16 rows
 * decoded into this thread's panels and one pass of tokens (units in a row per pass). Returns 0
 * when the panels' memory ran out. */
static int run_work(const Call *c, int64_t u) {
    int64_t n0, column;
#ifdef __AVX2__
    if (c->tokens > 1 && c->straight) {
        const int p = unit_of(c, GEMV_ROWS, u, &n0, &column), type = c->types[p];
        const int64_t blocks = c->cols / q8_block(type), row_bytes = blocks * q8_bytes(type);
        Token x[GEMV_TOKENS];
        for (int t = 0; t < c->tokens; t++) x[t] = token_of(c, type, t);
        for (int64_t r0 = n0; r0 < n0 + GEMV_ROWS && r0 < c->rows[p]; r0 += PANEL) {
            const int count = (int)(c->rows[p] - r0 < PANEL ? c->rows[p] - r0 : PANEL);
            gemv_tokens_of(type)(c->ws[p] + r0 * row_bytes, row_bytes, count, blocks, x, (int)c->tokens,
                                 c->y + column + r0, c->ldy);
        }
        return 1;
    }
    if (c->tokens == 1) {
        const int p = unit_of(c, GEMV_ROWS, u, &n0, &column), type = c->types[p];
        if (packed_from(type)) { /* the tiles, one token, over the panels where they lie */
            Panel pn[UNIT];
            for (int64_t r0 = n0; r0 < n0 + GEMV_ROWS && r0 < c->rows[p]; r0 += UNIT * PANEL)
                run_unit(c, p, r0, column, pn, 0, 1);
            return 1;
        }
        const int64_t blocks = c->cols / q8_block(type), row_bytes = blocks * q8_bytes(type);
        const Token x = token_of(c, type, 0);
        for (int64_t r0 = n0; r0 < n0 + GEMV_ROWS && r0 < c->rows[p]; r0 += PANEL) {
            const int count = (int)(c->rows[p] - r0 < PANEL ? c->rows[p] - r0 : PANEL);
            gemv_of(type)(c->ws[p] + r0 * row_bytes, row_bytes, count, blocks, &x, c->y + column + r0);
        }
        return 1;
    }
#endif
    char *base = scratch_get(&panel_scratch, UNIT * panel_bytes(c->cols));
    if (!base) return 0;
    Panel pn[UNIT];
    for (int g = 0; g < UNIT; g++) panel_place(pn + g, base + g * panel_bytes(c->cols), c->cols);
    const int p = unit_of(c, UNIT * PANEL, u % c->units, &n0, &column);
    const int64_t t_begin = u / c->units * c->chunk;
    run_unit(c, p, n0, column, pn, t_begin, c->tokens < t_begin + c->chunk ? c->tokens : t_begin + c->chunk);
    return 1;
}

static int run_call(const void *call, int64_t u) { return run_work((const Call *)call, u); }

#define KEEP_ACTS_BYTES (32 << 20) /* larger activations are allocated per call, not kept */

/* The quantized activations of the call, in this thread's kept buffer, or in a new one (*owned,
 * for the caller to free) past KEEP_ACTS_BYTES. Returns 0 when memory ran out. */
static int prepare_acts(const float *x, int64_t tokens, int64_t cols, int need_k, int need_32,
                        Acts *k_acts, Acts *acts32, void **owned) {
    const size_t k_size = need_k ? acts_bytes(1, tokens, cols) : 0;
    const size_t size = k_size + (need_32 ? acts_bytes(0, tokens, cols) : 0);
    *owned = NULL;
    if (size == 0) return 1; /* no parts */
    char *base = size <= KEEP_ACTS_BYTES ? scratch_get(&acts_scratch, size) : aligned_alloc(64, up64(size));
    *owned = size <= KEEP_ACTS_BYTES ? NULL : base;
    if (!base) return 0;
    if (need_k) acts_place(k_acts, base, 1, tokens, cols);
    if (need_32) acts_place(acts32, base + k_size, 0, tokens, cols);
    quantize_tokens(x, tokens, cols, k_acts, acts32);
    return 1;
}

/* y [tokens, ldy] = x [tokens, cols] @ [W_0; W_1; ...].T with 8-bit activations, part p in
 * types[p] filling the columns after the parts before it (as axon_ggml_matmul_parts). Returns
 * 0, -1 for an unsupported type or width, -2 when memory runs out. */
int axon_q8_matmul_parts(int parts, const int *types, const uint8_t *const *ws,
                         const int64_t *rows, int64_t cols, const float *x, int64_t tokens,
                         float *y, int64_t ldy, int threads) {
    int need_k = 0, need_32 = 0, any_q8_0 = 0;
    for (int p = 0; p < parts; p++) {
        if (!axon_q8_supported(types[p]) || cols % q8_block(types[p])) return -1;
        if (packed_from(types[p]) && (uintptr_t)ws[p] % 64) return -1; /* aligned loads */
        need_k |= is_k(types[p]), need_32 |= !is_k(types[p]), any_q8_0 |= types[p] == Q8_0;
    }
#ifdef __AVX2__
    const int straight = tokens == 1 || (tokens <= GEMV_TOKENS && !need_k && !any_q8_0);
#else
    const int straight = 0;
#endif
    const int64_t rows_per = straight ? GEMV_ROWS : UNIT * PANEL;
    int64_t units = 0;
    for (int p = 0; p < parts; p++) units += (rows[p] + rows_per - 1) / rows_per;
    if (tokens < 0) return -1;
    if (tokens == 0) return 0;
    Acts k_acts = {0}, acts32 = {0};
    void *owned;
    if (!prepare_acts(x, tokens, cols, need_k, need_32, &k_acts, &acts32, &owned)) return -2;
    if (threads < 1) threads = 1;
    /* Many tokens go over the rows in passes of `chunk`, so that a pass's activations stay in
     * L2 while every unit's tiles sweep them (a 2048-token prefill swept 2 MB from L3 per 16
     * rows); each pass decodes the panels again, ~5 % of a 256-token pass. */
    const int64_t chunk = straight ? tokens : (CHUNK_BYTES / cols > 256 ? CHUNK_BYTES / cols : 256) / TILE * TILE;
    /* A thread's next unit is the adjacent one (its share's front): decoding a panel prefetches
     * the rows AHEAD_UNITS units on. */
    const Call call = {types, ws, rows, cols, tokens, ldy, UNIT * PANEL * AHEAD_UNITS,
                       units, chunk, straight, &k_acts, &acts32, y};
    if (tokens > 1) units *= (tokens + chunk - 1) / chunk;
    /* A memory stream: each thread walks one contiguous share of the units (handed out in turn
     * they would break the prefetcher's streams every 32 rows at one token) and steals from the
     * back of the others' when its own is done,
     * so a descheduled thread holds up no more than the unit it is in. */
    const int failed = !run_shares(units, threads, run_call, &call);
    free(owned);
    return failed ? -2 : 0;
}

/* Test hook: token x [cols] quantized as Q8_K (k = 1) or Q8_0 (k = 0): q, d, and bsums (Q8_K)
 * or s (Q8_0). */
void axon_q8_quantize(const float *x, int64_t cols, int k, int8_t *q, float *d, void *sums) {
    if (k)
        quantize_token_k(x, cols, q, d, (int16_t *)sums, NULL);
    else
        quantize_token_32(x, cols, q, d, (float *)sums, NULL);
}
