/* Q2_K and Q3_K blocks, shared by ggml_cpu.c (float32 activations) and ggml_q8.c (8-bit
 * activations). Included by each kernel file (each also compiles alone in the tests).
 *
 * 256 weights a block in 16 sub-blocks of 16 (ggml's block_q2_K / block_q3_K):
 *   Q2_K, 84 bytes: scales[16] (sub-block j: low nibble its multiplier sc, high nibble its min
 *     mn), qs[64], d, dmin (fp16); weight = d sc * q - dmin mn, q in 0..3;
 *   Q3_K, 110 bytes: hmask[32], qs[64], scales[12] (16 packed 6-bit values, 32 too high), d
 *     (fp16); weight = d (sc - 32) * (q - 4), q in 0..7.
 * Weight e = 128 h + 32 s + l (half h, shift s < 4, l < 32) has bits 2s, 2s + 1 of qs[32 h + l]
 * as its low two, and (Q3_K) bit 4 h + s of hmask[l] as its third; it is in sub-block e / 16.
 *
 * Both fit the 8-bit kernels' K-quant form d * sc * q - dmin * mn with unsigned codes, mn per 16
 * values: Q3_K's mn is its signed multiplier and dmin = 4 d (the codes carry +4), as Q6_K's is
 * with dmin = 32 d. Every product in the dequantization is exact in float32 (an 11-bit d times a
 * multiplier of at most 6 bits times a code of at most 3), so gguf-py's numbers come out whether
 * or not the compiler fuses the last multiply-add. */
#ifndef AXON_K23_BLOCKS_H
#define AXON_K23_BLOCKS_H

#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

enum { K23_Q2_K = 10, K23_Q3_K = 11 };

static inline int k23_is(int type) { return type == K23_Q2_K || type == K23_Q3_K; }

static inline int k23_bytes(int type) { return type == K23_Q2_K ? 84 : 110; }

static inline float k23_f16(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* Where d lies, and dmin's factor of d (0: dmin is the fp16 after d). */
static inline int k23_d_at(int type) { return type == K23_Q2_K ? 80 : 108; }
static inline float k23_dmin_of_d(int type) { return type == K23_Q2_K ? 0.0f : 4.0f; }

static inline float k23_dmin(int type, const uint8_t *b) {
    return type == K23_Q2_K ? k23_f16(b + 82) : 4.0f * k23_f16(b + 108);
}

/* The 16 multipliers sc and mins mn of the sub-blocks (Q3_K: mn = sc, signed). */
static inline void k23_multipliers(int type, const uint8_t *b, int8_t sc[16], int8_t mn[16]) {
    if (type == K23_Q2_K) {
        for (int j = 0; j < 16; j++) sc[j] = (int8_t)(b[j] & 0x0F), mn[j] = (int8_t)(b[j] >> 4);
        return;
    }
    const uint8_t *s = b + 96; /* low 4 bits: nibbles of bytes 0-7; high 2: bytes 8-11 */
    for (int j = 0; j < 16; j++) {
        const int low = j < 8 ? s[j] & 0x0F : s[j - 8] >> 4, high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        sc[j] = mn[j] = (int8_t)((low | (high << 4)) - 32);
    }
}

#ifdef __AVX2__
/* Codes 128 h + 32 s .. + 31 (sub-blocks 8 h + 2 s and 8 h + 2 s + 1), unsigned, from where they
 * lie. */
static inline __m256i k23_codes32(int type, const uint8_t *b, int h, int s) {
    const __m256i qs = _mm256_loadu_si256((const __m256i *)(b + (type == K23_Q2_K ? 16 : 32) + 32 * h));
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * s), _mm256_set1_epi8(3));
    if (type == K23_Q2_K) return low;
    const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
    const __m256i third = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + s), _mm256_set1_epi8(1));
    return _mm256_or_si256(low, _mm256_slli_epi16(third, 2));
}

/* The 16 multipliers (Q3_K signed, Q2_K 0..15) and mins (Q3_K: the multipliers again) as bytes,
 * built in registers: a scalar unpacking stored and reloaded as one vector waits on store
 * forwarding. */
static inline void k23_multipliers_vec(int type, const uint8_t *b, __m128i *sc, __m128i *mn) {
    if (type == K23_Q2_K) {
        const __m128i v = _mm_loadu_si128((const __m128i *)b), low4 = _mm_set1_epi8(0x0F);
        *sc = _mm_and_si128(v, low4);
        *mn = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
        return;
    }
    uint32_t aux[3];
    memcpy(aux, b + 96, 12);
    const uint32_t m4 = 0x0f0f0f0f, m2 = 0x03030303, hi = aux[2];
    const __m128i v = _mm_setr_epi32((int)((aux[0] & m4) | ((hi & m2) << 4)),
                                     (int)((aux[1] & m4) | (((hi >> 2) & m2) << 4)),
                                     (int)(((aux[0] >> 4) & m4) | (((hi >> 4) & m2) << 4)),
                                     (int)(((aux[1] >> 4) & m4) | (((hi >> 6) & m2) << 4)));
    *sc = *mn = _mm_sub_epi8(v, _mm_set1_epi8(32));
}

/* The 256 codes, unsigned (Q2_K 0..3, Q3_K 0..7). */
static inline void k23_codes(int type, const uint8_t *b, uint8_t codes[256]) {
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            _mm256_storeu_si256((__m256i *)(codes + 128 * h + 32 * s), k23_codes32(type, b, h, s));
}

/* The block's float32 scale d sc and (Q2_K) min dmin mn of each sub-block. */
static inline void k23_scales(int type, const uint8_t *b, float scale[16], float min[16]) {
    __m128i sc8, mn8;
    k23_multipliers_vec(type, b, &sc8, &mn8);
    const __m256 d = _mm256_set1_ps(k23_f16(b + k23_d_at(type)));
    const __m256 dmin = _mm256_set1_ps(type == K23_Q2_K ? k23_f16(b + 82) : 0.0f);
    for (int half = 0; half < 2; half++) {
        const __m128i at = half ? _mm_unpackhi_epi64(sc8, sc8) : sc8, mt = half ? _mm_unpackhi_epi64(mn8, mn8) : mn8;
        _mm256_storeu_ps(scale + 8 * half, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(at))));
        _mm256_storeu_ps(min + 8 * half, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(mt))));
    }
}

/* Weights 8 part .. + 7 of the 32 whose codes are `codes` (k23_codes32 of h, s), in float32:
 * scale * q - min (the product exact, one rounding) or, Q3_K, scale * (q - 4). */
static inline __m256 k23_weights8(int type, __m256i codes, int part, const float *scale,
                                  const float *min, int sub) {
    __m128i half = part < 2 ? _mm256_castsi256_si128(codes) : _mm256_extracti128_si256(codes, 1);
    if (part & 1) half = _mm_unpackhi_epi64(half, half);
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(half)), sv = _mm256_broadcast_ss(scale + sub);
    if (type == K23_Q2_K) return _mm256_fmsub_ps(sv, q, _mm256_broadcast_ss(min + sub));
    return _mm256_mul_ps(sv, _mm256_sub_ps(q, _mm256_set1_ps(4.0f)));
}

/* The block's 256 weights in float32, gguf-py's numbers. */
static inline void k23_dequant(int type, const uint8_t *b, float out[256]) {
    float scale[16], min[16];
    k23_scales(type, b, scale, min);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++) {
            const __m256i codes = k23_codes32(type, b, h, s);
            for (int part = 0; part < 4; part++) /* 2 parts a sub-block */
                _mm256_storeu_ps(out + 128 * h + 32 * s + 8 * part,
                                 k23_weights8(type, codes, part, scale, min, 8 * h + 2 * s + part / 2));
        }
}
#else
/* The 256 codes, unsigned (Q2_K 0..3, Q3_K 0..7). */
static inline void k23_codes(int type, const uint8_t *b, uint8_t codes[256]) {
    const uint8_t *qs = b + (type == K23_Q2_K ? 16 : 32);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) {
                int q = (qs[32 * h + l] >> (2 * s)) & 3;
                if (type == K23_Q3_K) q |= ((b[l] >> (4 * h + s)) & 1) << 2;
                codes[128 * h + 32 * s + l] = (uint8_t)q;
            }
}

/* The block's 256 weights in float32, gguf-py's numbers. */
static inline void k23_dequant(int type, const uint8_t *b, float out[256]) {
    int8_t sc[16], mn[16];
    uint8_t codes[256];
    k23_multipliers(type, b, sc, mn);
    k23_codes(type, b, codes);
    const float d = k23_f16(b + k23_d_at(type)), dmin = type == K23_Q2_K ? k23_f16(b + 82) : 0.0f;
    for (int j = 0; j < 16; j++) {
        const float scale = d * (float)sc[j], min = dmin * (float)mn[j];
        for (int i = 0; i < 16; i++) {
            const int e = 16 * j + i;
            out[e] = type == K23_Q2_K ? scale * (float)codes[e] - min : scale * (float)(codes[e] - 4);
        }
    }
}

#endif

#endif
