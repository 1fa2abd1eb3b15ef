/* GGML block formats on the CPU, read in place: y = x @ W.T with float32 activations, and a
 * float32 dequantization. Built and loaded by ggml_cpu.py (cc -O3 -march=native -fopenmp).
 *
 * A weight is `scale * code + bias` with an integer code, a float scale per 16 or 32 weights
 * (fp16 in the file, times a 6- or 8-bit sub-scale for the K-quants) and, for some formats, a
 * float bias per 32 weights. Dequantization computes exactly that, as gguf-py does (the products
 * are exact in float32, so an FMA rounds them like gguf-py's separate multiply and add).
 *
 * The matmul never writes dequantized weights to memory:
 *   - one token (decode at batch 1), K-quants (AVX2): x held as a 24-bit fixed point per 256
 *     values (three int8 digits), integer products of codes and digits (vpmaddubsw), the
 *     integer sub-scales applied in integers (vpmaddwd), float once per 256 weights (gemv_k);
 *     Q6_K with AVX-512 BW + VNNI: two sub-blocks per instruction and vpdpwssd, same integers;
 *   - one token, other formats: codes widened from the packed bytes, sum(code * x) over each
 *     scale group in float32, times the scale once per group, plus bias * sum(x) once per 32;
 *   - several tokens: each row's weights are rebuilt in float32 registers and multiplied with up
 *     to 8 tokens (register tiles of R rows x TT tokens), so the decoding is paid once per tile;
 *   - more than MAX_TOKENS (prefill): panels of rows dequantized into an L2-sized float32 buffer
 *     and multiplied with every token there (axon_ggml_matmul_panels).
 * Every line of a block is prefetched a few row quads ahead. The float paths differ from
 * `F.linear(x, dequantize(W))` only in summation order, the integer one by at most max|x| * 2^-24
 * per product besides. Layouts: ggml_dequant.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "axon_kernels.h"
#include "k23_blocks.h"
#include "k_scales.h"
#include "work_shares.h"

enum { F32 = 0, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

#define INLINE static inline __attribute__((always_inline))

#define MAX_TOKENS 64 /* per call (ggml_cpu.py dequantizes for longer batches) */

/* How far ahead of each row's current block to prefetch: the same column a few row quads on,
 * at least PREFETCH_BYTES away. The weights stream from memory, and the out-of-order window
 * alone keeps too few misses in flight behind the arithmetic (a batch-1 Q8_0 product ran at a
 * third of the machine's copy bandwidth without prefetching). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 16384
#endif
INLINE int64_t prefetch_distance(int64_t row_bytes) {
    const int64_t quad = 4 * row_bytes;
    return quad * ((PREFETCH_BYTES + quad - 1) / quad);
}

/* Every cache line of the block at b, `ahead` bytes on: the hardware prefetcher alone left a
 * Q6_K product streamed from memory at 70 % of the bandwidth with one prefetch per block. */
INLINE void prefetch_block(const uint8_t *b, int bytes, int64_t ahead) {
    for (int line = 0; line < bytes; line += 64) __builtin_prefetch(b + ahead + line);
}

/* Eight float lanes: AVX2 with -march=native on x86, two NEON registers on arm64. */
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef int8_t s8x8 __attribute__((vector_size(8)));

INLINE float f16(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

INLINE f32x8 load8(const float *p) {
    f32x8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void store8(float *p, f32x8 v) { memcpy(p, &v, sizeof v); }

INLINE float sum8(f32x8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* Eight int8 codes at p as float lanes (GCC scalarizes __builtin_convertvector of bytes). */
INLINE f32x8 bytes8(const int8_t *p) {
#ifdef __AVX2__
    return (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    s8x8 bytes;
    memcpy(&bytes, p, 8);
    return __builtin_convertvector(__builtin_convertvector(bytes, i32x8), f32x8);
#endif
}

/* ---- the formats ------------------------------------------------------------------------ */

INLINE int block_size(int type) { return type == Q4_K || type == Q5_K || type == Q6_K || k23_is(type) ? 256 : 32; }

INLINE int block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q2_K: case Q3_K: return k23_bytes(type);
    case F32: return 128; /* float32 rows, handled as blocks of 32 */
    case Q4_K: return 144;
    case Q5_K: return 176;
    default: return 210; /* Q6_K */
    }
}

INLINE int has_bias(int type) { return type == Q4_1 || type == Q5_1 || type == Q4_K || type == Q5_K; }

/* Weights per scale: 16 for Q6_K, 32 for the others. */
INLINE int scale_group(int type) { return type == Q6_K ? 16 : 32; }

int axon_ggml_supported(int type) {
    switch (type) {
    case F32: case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case Q4_K: case Q5_K:
    case Q6_K: case Q2_K: case Q3_K:
        return 1;
    default: return 0;
    }
}

typedef struct {
    float scale[16] __attribute__((aligned(32))); /* per scale group */
    float bias[8] __attribute__((aligned(32)));   /* per 32: m (Q4_1, Q5_1), -(dmin * mn) (K) */
} Scales;

typedef uint8_t u8x8 __attribute__((vector_size(8)));

/* Eight bytes as float lanes. */
INLINE f32x8 u8_to_f32(const uint8_t *p) {
#ifdef __AVX2__
    return (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    u8x8 bytes;
    memcpy(&bytes, p, 8);
    return __builtin_convertvector(__builtin_convertvector(bytes, i32x8), f32x8);
#endif
}

/* The eight bytes of two words as float lanes, from registers rather than from the words just
 * stored to memory. */
INLINE f32x8 u8x8_to_f32(uint32_t lo, uint32_t hi) {
#ifdef __AVX2__
    return (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)hi, (int)lo)));
#else
    const uint32_t words[2] = {lo, hi};
    return u8_to_f32((const uint8_t *)words);
#endif
}

/* Q4_K / Q5_K: the eight 6-bit scales and mins of a super-block, unpacked four at a time in
 * 32-bit words (12 bytes: low 6 bits of scales 0-3 and mins 0-3, then the low nibbles of
 * scales 4-7 and mins 4-7 with their high 2 bits in the top bits of the first 8 bytes). */
INLINE void k_scale_codes(const uint8_t *b, uint32_t codes[4]) {
    uint32_t packed[3];
    memcpy(packed, b + 4, 12);
    const uint32_t low6 = 0x3F3F3F3Fu, low4 = 0x0F0F0F0Fu, low2 = 0x03030303u;
    codes[0] = packed[0] & low6;                                           /* scales 0-3 */
    codes[1] = (packed[2] & low4) | (((packed[0] >> 6) & low2) << 4);      /* scales 4-7 */
    codes[2] = packed[1] & low6;                                           /* mins 0-3 */
    codes[3] = ((packed[2] >> 4) & low4) | (((packed[1] >> 6) & low2) << 4); /* mins 4-7 */
}

INLINE void k_scales(const uint8_t *b, Scales *s) {
    uint32_t codes[4];
    k_scale_codes(b, codes);
    const float d = f16(b), dmin = f16(b + 2);
    store8(s->scale, d * u8x8_to_f32(codes[0], codes[1]));
    store8(s->bias, -(dmin * u8x8_to_f32(codes[2], codes[3])));
}

INLINE void block_scales(int type, const uint8_t *b, Scales *s) {
    switch (type) {
    case F32: break;
    case Q4_0: case Q5_0: case Q8_0: s->scale[0] = f16(b); break;
    case Q4_1: case Q5_1: s->scale[0] = f16(b); s->bias[0] = f16(b + 2); break;
    case Q4_K: case Q5_K: k_scales(b, s); break;
    default: { /* Q6_K: 16 int8 scales, one per 16 weights */
        const float d = f16(b + 208);
        store8(s->scale, d * bytes8((const int8_t *)b + 192));
        store8(s->scale + 8, d * bytes8((const int8_t *)b + 200));
    }
    }
}

#ifdef __AVX2__
/* 32 bytes: bit i of the little-endian uint32 at p, as 0 or `value` in byte i (Q5 high bits). */
INLINE __m256i spread_bits(const uint8_t *p, int8_t value) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i index = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                            0x0101010101010101, 0x0000000000000000);
    const __m256i mask = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)bits), index);
    bytes = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, mask), mask);
    return _mm256_and_si256(bytes, _mm256_set1_epi8(value));
}

/* Low nibbles of 16 bytes, then their high nibbles: the 32 codes of a Q4_0 / Q5_0 block. */
INLINE __m256i nibbles16(const uint8_t *p) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
    return _mm256_set_m128i(hi, lo);
}

/* Nibbles of 32 bytes: the low ones (shift 0) or the high ones (shift 4). */
INLINE __m256i nibbles32(const uint8_t *p, int shift) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_and_si256(_mm256_srli_epi16(bytes, shift), _mm256_set1_epi8(0x0F));
}
#endif

/* The integer codes of 32 weights as int8 (a weight is scale * code + bias): Q8_0's are read
 * in place, the others decoded into a register (AVX2) or a small buffer. Decoded codes stay in
 * the register: storing 32 bytes and reloading them 8 at a time stalls store forwarding. */
typedef struct {
    const int8_t *mem;
#ifdef __AVX2__
    __m256i reg;
#else
    int8_t buf[32];
#endif
} Codes;

/* Codes 8 * j .. 8 * j + 7 as float lanes. */
INLINE f32x8 codes8(int type, const Codes *c, int j) {
    if (type == F32) return load8((const float *)c->mem + 8 * j);
    if (type == Q8_0) return bytes8(c->mem + 8 * j);
#ifdef __AVX2__
    __m128i half = j < 2 ? _mm256_castsi256_si128(c->reg) : _mm256_extracti128_si256(c->reg, 1);
    if (j & 1) half = _mm_unpackhi_epi64(half, half);
    return (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(half));
#else
    return bytes8(c->buf + 8 * j);
#endif
}

/* Weights 32 * sub .. 32 * sub + 31 of a block. */
INLINE void codes32(int type, const uint8_t *b, int sub, Codes *c) {
    if (type == F32) { /* the weights themselves */
        c->mem = (const int8_t *)b;
        return;
    }
    if (type == Q8_0) {
        c->mem = (const int8_t *)(b + 2);
        return;
    }
#ifdef __AVX2__
    __m256i q;
    switch (type) {
    case Q4_0: q = _mm256_sub_epi8(nibbles16(b + 2), _mm256_set1_epi8(8)); break;
    case Q4_1: q = nibbles16(b + 4); break;
    case Q5_0:
        q = _mm256_or_si256(nibbles16(b + 6), spread_bits(b + 2, 16));
        q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
        break;
    case Q5_1: q = _mm256_or_si256(nibbles16(b + 8), spread_bits(b + 4, 16)); break;
    case Q4_K: q = nibbles32(b + 16 + 32 * (sub / 2), 4 * (sub & 1)); break;
    case Q5_K: {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, sub), _mm256_set1_epi8(1));
        q = _mm256_or_si256(nibbles32(b + 48 + 32 * (sub / 2), 4 * (sub & 1)),
                            _mm256_slli_epi16(bit, 4));
        break;
    }
    default: { /* Q6_K: 128 weights per half; part p of a half: nibbles of ql, 2 bits of qh */
        const int half = sub / 4, part = sub & 3;
        const __m256i lo = nibbles32(b + 64 * half + 32 * (part & 1), 4 * (part >> 1));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * part), _mm256_set1_epi8(3));
        q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    }
    }
    c->reg = q;
#else
    for (int i = 0; i < 32; i++) {
        const int e = 32 * sub + i, lo16 = i < 16, k = i & 15;
        int code;
        switch (type) {
        case Q4_0: code = (lo16 ? b[2 + k] & 0x0F : b[2 + k] >> 4) - 8; break;
        case Q4_1: code = lo16 ? b[4 + k] & 0x0F : b[4 + k] >> 4; break;
        case Q5_0: case Q5_1: {
            const uint8_t *qh = b + (type == Q5_0 ? 2 : 4), *qs = qh + 4;
            code = (lo16 ? qs[k] & 0x0F : qs[k] >> 4) | (((qh[i / 8] >> (i % 8)) & 1) << 4);
            code -= type == Q5_0 ? 16 : 0;
            break;
        }
        case Q4_K: code = (b[16 + 32 * (sub / 2) + i] >> (4 * (sub & 1))) & 0x0F; break;
        case Q5_K:
            code = ((b[48 + 32 * (sub / 2) + i] >> (4 * (sub & 1))) & 0x0F) |
                   (((b[16 + i] >> sub) & 1) << 4);
            break;
        default: {
            const int half = e / 128, part = (e / 32) & 3;
            const int lo = (b[64 * half + 32 * (part & 1) + i] >> (4 * (part >> 1))) & 0x0F;
            const int hi = (b[128 + 32 * half + i] >> (2 * part)) & 3;
            code = (lo | (hi << 4)) - 32;
        }
        }
        c->buf[i] = (int8_t)code;
    }
#endif
}

/* Weights 32 * sub + 8 * j .. + 7 in float32, exactly as gguf-py dequantizes them. */
INLINE f32x8 weights8(int type, const Codes *codes, const Scales *s, int sub, int j) {
    const f32x8 q = codes8(type, codes, j);
    if (type == F32) return q;
    const float scale = s->scale[type == Q6_K ? 2 * sub + j / 2 : sub];
    return has_bias(type) ? scale * q + s->bias[sub] : scale * q;
}

/* ---- the matmul ------------------------------------------------------------------------- */

/* ---- batch 1: sum(code * x) per scale group, straight from the packed bytes ------------- */

/* Eight bytes widened to int32 lanes. */
INLINE i32x8 widen_u8(const uint8_t *p) {
#ifdef __AVX2__
    return (i32x8)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    u8x8 bytes;
    memcpy(&bytes, p, 8);
    return __builtin_convertvector(bytes, i32x8);
#endif
}

INLINE f32x8 cvt(i32x8 v) { return __builtin_convertvector(v, f32x8); }

/* FIFTH_BITS[byte]: lane i holds 16 if bit i of byte is set (the fifth bit of eight Q5 codes). */
static i32x8 FIFTH_BITS[256];

__attribute__((constructor)) static void init_fifth_bits(void) {
    for (int byte = 0; byte < 256; byte++)
        for (int i = 0; i < 8; i++) FIFTH_BITS[byte][i] = ((byte >> i) & 1) << 4;
}

/* sum over the block of scale * code * x (the biases are added from sums of x, see gemv). Codes
 * are widened to 32-bit lanes eight bytes at a time, and a byte of two nibbles serves two
 * groups: at batch 1 every weight is decoded once per step, so fewer operations per weight is
 * what counts. Q4_0 / Q5_0 codes keep their +8 / +16 here (gemv_bias subtracts it). */
INLINE f32x8 block_dot(int type, const uint8_t *b, const float *x, const Scales *s) {
    f32x8 out = {0};
    switch (type) {
    case F32:
        for (int j = 0; j < 4; j++) out += load8((const float *)b + 8 * j) * load8(x + 8 * j);
        return out;
    case Q8_0:
        for (int j = 0; j < 4; j++) out += bytes8((const int8_t *)b + 2 + 8 * j) * load8(x + 8 * j);
        return s->scale[0] * out;
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
        const int qs = type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
        const uint8_t *qh = b + qs - 4; /* Q5: bit i of these 4 bytes is code i's fifth */
        for (int h = 0; h < 2; h++) {
            const i32x8 v = widen_u8(b + qs + 8 * h);
            i32x8 lo = v & 0x0F, hi = v >> 4;
            if (type == Q5_0 || type == Q5_1) {
                lo |= FIFTH_BITS[qh[h]];
                hi |= FIFTH_BITS[qh[h + 2]];
            }
            out += cvt(lo) * load8(x + 8 * h) + cvt(hi) * load8(x + 16 + 8 * h);
        }
        return s->scale[0] * out;
    }
    case Q4_K: case Q5_K: {
        const uint8_t *qs = b + (type == Q4_K ? 16 : 48);
        for (int g = 0; g < 4; g++) {
            f32x8 lo_sum = {0}, hi_sum = {0};
            for (int l = 0; l < 4; l++) {
                const i32x8 v = widen_u8(qs + 32 * g + 8 * l);
                i32x8 lo = v & 0x0F, hi = v >> 4;
                if (type == Q5_K) {
                    const i32x8 high = widen_u8(b + 16 + 8 * l);
                    lo |= ((high >> (2 * g)) & 1) << 4;
                    hi |= ((high >> (2 * g + 1)) & 1) << 4;
                }
                lo_sum += cvt(lo) * load8(x + 64 * g + 8 * l);
                hi_sum += cvt(hi) * load8(x + 64 * g + 32 + 8 * l);
            }
            out += s->scale[2 * g] * lo_sum + s->scale[2 * g + 1] * hi_sum;
        }
        return out;
    }
    default: { /* Q6_K, codes kept unsigned (32 too high: gemv subtracts 32 * scale * sum(x)) */
        f32x8 part_out[4] = {{0}}; /* one chain per part: a single one is latency-bound */
        for (int h = 0; h < 2; h++)
            for (int pair = 0; pair < 2; pair++) { /* weights 16 * pair .. + 15 of each part */
                i32x8 a[2], c[2], high[2];
                for (int i = 0; i < 2; i++) {
                    const int l = 2 * pair + i;
                    a[i] = widen_u8(b + 64 * h + 8 * l);
                    c[i] = widen_u8(b + 64 * h + 32 + 8 * l);
                    high[i] = widen_u8(b + 128 + 32 * h + 8 * l);
                }
                for (int part = 0; part < 4; part++) {
                    f32x8 sum = {0};
                    for (int i = 0; i < 2; i++) {
                        const i32x8 lo = part & 1 ? c[i] : a[i];
                        const i32x8 nibble = part < 2 ? lo & 0x0F : lo >> 4;
                        const i32x8 top = part < 3 ? (high[i] << (4 - 2 * part)) & 0x30
                                                   : (high[i] >> 2) & 0x30;
                        sum += cvt(nibble | top) * load8(x + 128 * h + 32 * part + 16 * pair + 8 * i);
                    }
                    part_out[part] += s->scale[8 * h + 2 * part + pair] * sum;
                }
            }
        return (part_out[0] + part_out[1]) + (part_out[2] + part_out[3]);
    }
    }
}

/* The bias of weights 32 * sub .. + 31 as gemv sees them: Q4_0 / Q5_0 codes are unsigned there
 * (8 and 16 too high), the formats with a bias have theirs. */
INLINE float gemv_bias(int type, const Scales *s, int sub) {
    switch (type) {
    case Q4_0: return -8.0f * s->scale[0];
    case Q5_0: return -16.0f * s->scale[0];
    default: return has_bias(type) ? s->bias[sub] : 0.0f;
    }
}

/* What batch 1 precomputes from its token once per call: sums of x over each 32 and each 16
 * weights (for the biases), and for the K-quants x as 24-bit integers (below). */
typedef struct {
    const float *xsum;    /* [cols / 32], then [cols / 16] */
    const int8_t *digits; /* [3][cols], or NULL */
    const float *dscale;  /* [cols / 256] */
    int64_t cols;
} Token;

#ifdef __AVX2__
/* Batch 1 for the K-quants with integer products. Each 256 values of x are held as
 * scale * (a * 65536 + b * 256 + c) with int8 "digits" a, b, c, |a * 65536 + b * 256 + c| below
 * 2^23: a 24-bit fixed point, as fine as float32's mantissa against the largest of the 256 (the
 * error of a product is at most weight * max|x| * 2^-24). Then `vpmaddubsw` multiplies 32 codes by
 * 32 digits in one instruction and `vpmaddwd` applies the integer sub-scales, so a weight costs
 * about a third of the float path's work, where decoding and converting codes to float made
 * Q4_K / Q6_K compute-bound. The integer sums are exact; float rounding happens once per 256. */
#define DIGITS_MAX (127 * 65536 + 127 * 256 + 127)

/* Eight int32 lanes (|v| < 2^23) as their three base-256 digits, each in [-128, 127]. */
INLINE void split_digits(__m256i q, __m256i *a, __m256i *b, __m256i *c) {
    const __m256i half = _mm256_set1_epi32(128), low = _mm256_set1_epi32(0xFF);
    *c = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(q, half), low), half);
    q = _mm256_srai_epi32(_mm256_sub_epi32(q, *c), 8); /* exact: q - c is a multiple of 256 */
    *b = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(q, half), low), half);
    *a = _mm256_srai_epi32(_mm256_sub_epi32(q, *b), 8);
}

/* 32 int32 lanes (four vectors, each in [-128, 127]) as 32 int8 in order. */
INLINE void store_bytes(int8_t *out, __m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(v0, v1), _mm256_packs_epi32(v2, v3));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undo the in-lane packs */
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(words, order));
}

static void token_digits(const float *x, int64_t cols, int8_t *digits, float *dscale) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i limit = _mm256_set1_epi32(DIGITS_MAX);
    for (int64_t k = 0; k < cols / 256; k++) {
        const float *xk = x + 256 * k;
        __m256 m = _mm256_setzero_ps(), sum = m;
        for (int i = 0; i < 256; i += 8) {
            const __m256 v = _mm256_loadu_ps(xk + i);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
            sum = _mm256_add_ps(sum, v); /* NaN or infinite when some x is */
        }
        const float mx = fmaxf(fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3])),
                               fmaxf(fmaxf(m[4], m[5]), fmaxf(m[6], m[7])));
        const __m256 inv = _mm256_set1_ps(mx > 0.0f ? (float)DIGITS_MAX / mx : 0.0f);
        dscale[k] = mx > 0.0f ? mx / (float)DIGITS_MAX : 0.0f;
        if (!isfinite(sum8((f32x8)sum))) dscale[k] = NAN; /* the products' NaN, as in float32 */
        for (int i = 0; i < 256; i += 32) {
            __m256i a[4], b[4], c[4];
            for (int j = 0; j < 4; j++) {
                __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xk + i + 8 * j), inv));
                q = _mm256_max_epi32(_mm256_min_epi32(q, limit), _mm256_sub_epi32(_mm256_setzero_si256(), limit));
                split_digits(q, &a[j], &b[j], &c[j]);
            }
            store_bytes(digits + 256 * k + i, a[0], a[1], a[2], a[3]);
            store_bytes(digits + cols + 256 * k + i, b[0], b[1], b[2], b[3]);
            store_bytes(digits + 2 * cols + 256 * k + i, c[0], c[1], c[2], c[3]);
        }
    }
}

/* The 32 unsigned codes of weights 32 * sub .. + 31 of a K-quant block (Q6_K's 32 too high). */
INLINE __m256i k_codes(int type, const uint8_t *b, int sub) {
    if (type == Q4_K) return nibbles32(b + 16 + 32 * (sub / 2), 4 * (sub & 1));
    if (type == Q5_K) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, sub), _mm256_set1_epi8(1));
        return _mm256_or_si256(nibbles32(b + 48 + 32 * (sub / 2), 4 * (sub & 1)),
                               _mm256_slli_epi16(bit, 4));
    }
    const int half = sub / 4, part = sub & 3;
    const __m256i lo = nibbles32(b + 64 * half + 32 * (part & 1), 4 * (part >> 1));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
    /* bits 2 * part and 2 * part + 1 of each byte of qh to bits 4 and 5: one shift, one mask */
    const __m256i hi = part == 2 ? qh
                       : part < 2 ? _mm256_slli_epi16(qh, 4 - 2 * part)
                                  : _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define K_SUMS_512 1
/* AVX-512 for Q6_K and Q4_K: two sub-blocks per instruction (sub-block 2j in the low 256 bits,
 * 2j + 1 in the high ones; Q6_K's low nibbles are 64 bytes in a row, Q4_K's two sub-blocks the
 * low and high nibbles of the same 32 bytes), and VNNI's vpdpwssd applying the sub-scales and
 * accumulating in one instruction. The integer sums are the AVX2 loop's (folded to its eight
 * lanes at the end), so the result is bit-identical. It pays most where decoding the codes is a
 * larger share of the work (Q6_K), even on Zen 4, which issues one 512-bit multiply per cycle
 * against two 256-bit ones; Q5_K is slower there, so it stays on the AVX2 loop. */
INLINE __m512i halves(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* The 64 codes of Q6_K sub-blocks 2j and 2j + 1, 32 too high, as k_codes. */
INLINE __m512i q6_codes64(const uint8_t *b, int j) {
    const int half = j / 2, high = j & 1;
    const __m512i ql = _mm512_loadu_si512((const void *)(b + 64 * half));
    const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(ql, 4 * high), _mm512_set1_epi8(0x0F));
    const __m256i qh32 = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
    const __m512i qh = _mm512_broadcast_i64x4(qh32);
    /* bits 2 * part, 2 * part + 1 of each byte to bits 4 and 5: parts 0 | 1, or 2 | 3 */
    const __m512i right = halves(_mm256_set1_epi64x(0), _mm256_set1_epi64x(2));
    const __m512i left = halves(_mm256_set1_epi64x(4), _mm256_set1_epi64x(2));
    const __m512i hi = high ? _mm512_srlv_epi64(qh, right) : _mm512_sllv_epi64(qh, left);
    return _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi8(0x30), 0xF8); /* lo | hi & 0x30 */
}

INLINE __m256i fold(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

/* The 64 codes of Q4_K sub-blocks 2j and 2j + 1: the low and high nibbles of the same 32 bytes. */
INLINE __m512i q4_codes64(const uint8_t *b, int j) {
    const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16 + 32 * j)));
    const __m512i shifts = halves(_mm256_set1_epi64x(0), _mm256_set1_epi64x(4));
    return _mm512_and_si512(_mm512_srlv_epi64(raw, shifts), _mm512_set1_epi8(0x0F));
}

/* k_digit_sums for Q6_K and Q4_K, two sub-blocks per 512-bit vector (see above). */
INLINE void digit_sums_512(int type, const uint8_t *b, __m256i sc, const int8_t *digits,
                           int64_t cols, __m256i *A, __m256i *B, __m256i *C) {
    const __m512i sc2 = _mm512_broadcast_i64x4(sc);
    __m512i a = _mm512_setzero_si512(), bb = a, c = a;
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m512i q = type == Q6_K ? q6_codes64(b, j) : q4_codes64(b, j);
        const int16_t even = (int16_t)((4 * j + 1) << 8 | 4 * j), odd = (int16_t)(even + 0x0202);
        const __m512i scale =
            _mm512_shuffle_epi8(sc2, halves(_mm256_set1_epi16(even), _mm256_set1_epi16(odd)));
        const int8_t *ds = digits + 64 * j;
        const __m512i da = _mm512_loadu_si512((const void *)ds);
        const __m512i db = _mm512_loadu_si512((const void *)(ds + cols));
        const __m512i dc = _mm512_loadu_si512((const void *)(ds + 2 * cols));
        a = _mm512_dpwssd_epi32(a, _mm512_maddubs_epi16(q, da), scale);
        bb = _mm512_dpwssd_epi32(bb, _mm512_maddubs_epi16(q, db), scale);
        c = _mm512_dpwssd_epi32(c, _mm512_maddubs_epi16(q, dc), scale);
    }
    *A = fold(a), *B = fold(bb), *C = fold(c);
}
#endif

/* A K-quant block's products with the three digits of its 256 x: A = sum(sub-scale * code * a),
 * B and C the same with b and c, in eight int32 lanes (lane i sums products i, i + 8, ...). */
INLINE void k_digit_sums(int type, const uint8_t *b, __m256i sc, const int8_t *digits,
                         int64_t cols, __m256i *A, __m256i *B, __m256i *C) {
    __m256i a = _mm256_setzero_si256(), bb = a, c = a;
#pragma GCC unroll 8
    for (int sub = 0; sub < 8; sub++) {
        const __m256i q = k_codes(type, b, sub);
        const __m256i scale =
            _mm256_shuffle_epi8(sc, _mm256_set1_epi16((int16_t)((2 * sub + 1) << 8 | 2 * sub)));
        const int8_t *ds = digits + 32 * sub;
        const __m256i da = _mm256_loadu_si256((const __m256i *)ds);
        const __m256i db = _mm256_loadu_si256((const __m256i *)(ds + cols));
        const __m256i dc = _mm256_loadu_si256((const __m256i *)(ds + 2 * cols));
        a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(q, da), scale));
        bb = _mm256_add_epi32(bb, _mm256_madd_epi16(_mm256_maddubs_epi16(q, db), scale));
        c = _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(q, dc), scale));
        /* Keep the sums in registers, added in order: GCC otherwise regroups the integer
         * additions into trees whose partial sums spill to the stack (1.3x slower). */
        __asm__("" : "+x"(a), "+x"(bb), "+x"(c));
    }
    *A = a, *B = bb, *C = c;
}

/* One token, one row of a K-quant: sum over each block of d * sub-scale * code * x in integers,
 * plus the biases (Q4_K / Q5_K: -dmin * min per 32; Q6_K: its codes' offset, -32 * d *
 * sub-scale per 16) on float sums of x. The sub-scales sit as int16 in `sc`, arranged so that
 * one in-lane shuffle spreads sub-block `sub`'s over its 32 products: the low 128 bits hold the
 * scales of the first 16 of each 32 weights, the high 128 bits those of the second 16 (for
 * Q4_K / Q5_K both are the same). The loop is bound by vector instructions (about four a
 * cycle, the 48 multiplies of a block on two pipes), so the scale unpacking stays in vector
 * registers and the float work per block is kept small. One row at a time: two interleaved
 * rows streamed from memory at half the speed. */
INLINE f32x8 gemv_k(int type, const uint8_t *w, int64_t blocks, int64_t ahead, const Token *token) {
    const int64_t cols = token->cols;
    const float *xsum = token->xsum, *xsum16 = xsum + cols / 32;
    const int bytes = block_bytes(type);
    f32x8 acc = {0}, bias = {0};
    for (int64_t k = 0; k < blocks; k++) {
        const uint8_t *b = w + k * bytes;
        prefetch_block(b, bytes, ahead);
        __m256i sc;
        f32x8 dd;
        if (type == Q6_K) { /* 16 int8 scales: even ones to the low lane, odd ones to the high */
            const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 192));
            sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
                raw, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
            const float d = f16(b + 208);
            const f32x8 per16 = bytes8((const int8_t *)b + 192) * load8(xsum16 + 16 * k) +
                                bytes8((const int8_t *)b + 200) * load8(xsum16 + 16 * k + 8);
            bias += (-32.0f * d) * per16;
            dd = (f32x8)_mm256_set1_ps(d * token->dscale[k]);
        } else {
            const __m128i raw = _mm_loadu_si128((const __m128i *)b);
            const __m128i codes = k_scales_vec(raw);
            sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(codes));
            const __m128 ds = _mm_mul_ps(_mm_cvtph_ps(raw), _mm_setr_ps(token->dscale[k], -1.0f, 0, 0));
            const f32x8 mins = (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(codes, codes)));
            bias += (f32x8)_mm256_broadcastss_ps(_mm_movehdup_ps(ds)) * (mins * load8(xsum + 8 * k));
            dd = (f32x8)_mm256_broadcastss_ps(ds);
        }
        __m256i A, B, C;
#ifdef K_SUMS_512
        if (type == Q6_K || type == Q4_K)
            digit_sums_512(type, b, sc, token->digits + 256 * k, cols, &A, &B, &C);
        else
#endif
            k_digit_sums(type, b, sc, token->digits + 256 * k, cols, &A, &B, &C);
        f32x8 sum;
        if (type == Q6_K)
            sum = cvt((i32x8)A) * 65536.0f + (cvt((i32x8)B) * 256.0f + cvt((i32x8)C));
        else /* a lane sums 32 products code * sub-scale * digit: |B| <= 32 * 31 * 63 * 128 < 2^23
              * (Q5_K; Q4_K's codes are smaller), so B * 256 + C fits in an int32; not Q6_K's */
            sum = cvt((i32x8)A) * 65536.0f + cvt((i32x8)_mm256_add_epi32(_mm256_slli_epi32(B, 8), C));
        acc += dd * sum;
    }
    return acc + bias; /* the caller sums the lanes, four rows at once */
}

/* The lane sums of four vectors: {sum8(v0), sum8(v1), sum8(v2), sum8(v3)} in five shuffles and
 * adds instead of four full reductions (a row of a 1024-wide matrix is only four blocks). */
INLINE __m128 sum8x4(f32x8 v0, f32x8 v1, f32x8 v2, f32x8 v3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps((__m256)v0, (__m256)v1),
                                    _mm256_hadd_ps((__m256)v2, (__m256)v3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

/* One token, R rows: `xsum` [cols / 32] holds the sums of x over each 32 weights, so a bias
 * costs one multiply-add per 32 weights instead of one per weight. */
INLINE void gemv(int type, const uint8_t *w, int64_t row_bytes, int64_t blocks, const float *x,
                 const Token *token, float *y, const int R) {
    const int64_t ahead = prefetch_distance(row_bytes);
    const float *xsum = token->xsum;
    const float *xsum16 = xsum + blocks * block_size(type) / 32; /* sums over each 16 */
    const int B = block_size(type), bytes = block_bytes(type);
    const int biased = has_bias(type) || type == Q4_0 || type == Q5_0;
    f32x8 acc[4];
    float bias_acc[4];
    for (int r = 0; r < R; r++) acc[r] = (f32x8){0}, bias_acc[r] = 0.0f;
    for (int64_t k = 0; k < blocks; k++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *b = w + r * row_bytes + k * bytes;
            prefetch_block(b, bytes, ahead);
            Scales s;
            block_scales(type, b, &s);
            acc[r] += block_dot(type, b, x + k * B, &s);
            if (type == Q4_K || type == Q5_K) /* eight biases, eight sums: one vector */
                acc[r] += load8(s.bias) * load8(xsum + 8 * k);
            else if (type == Q6_K) { /* -32 * scale per 16 weights, times their sum of x */
                const float *sums = xsum16 + 16 * k;
                acc[r] -= 32.0f * (load8(s.scale) * load8(sums) + load8(s.scale + 8) * load8(sums + 8));
            }
            else if (biased)
                bias_acc[r] += gemv_bias(type, &s, 0) * xsum[k];
        }
    }
    for (int r = 0; r < R; r++) y[r] = sum8(acc[r]) + bias_acc[r];
}

/* y[t, r] = x[t] . W[r] for R rows and TT tokens: each weight is rebuilt once in float32 and
 * used for the TT tokens. */
INLINE void tile(int type, const uint8_t *w, int64_t row_bytes, int64_t blocks, const float *x,
                 int64_t ldx, float *y, int64_t ldy, const int R, const int TT) {
    const int64_t ahead = prefetch_distance(row_bytes);
    const int B = block_size(type), bytes = block_bytes(type);
    f32x8 acc[4][8]; /* fixed sizes (R <= 4, TT <= 8): a variable-length array lives in memory */
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++) acc[r][t] = (f32x8){0};
    for (int64_t k = 0; k < blocks; k++) {
        Scales s[4];
        for (int r = 0; r < R; r++) {
            prefetch_block(w + r * row_bytes + k * bytes, bytes, ahead);
            block_scales(type, w + r * row_bytes + k * bytes, &s[r]);
        }
        for (int sub = 0; sub < B / 32; sub++) {
            Codes q[4];
            for (int r = 0; r < R; r++) codes32(type, w + r * row_bytes + k * bytes, sub, &q[r]);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                f32x8 wj[4];
                for (int r = 0; r < R; r++) wj[r] = weights8(type, &q[r], &s[r], sub, j);
                for (int t = 0; t < TT; t++) {
                    const f32x8 xv = load8(x + t * ldx + k * B + 32 * sub + 8 * j);
                    for (int r = 0; r < R; r++) acc[r][t] += wj[r] * xv;
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++) y[t * ldy + r] = sum8(acc[r][t]);
}

/* Rows [begin, end) for every token. Row quads outside, tokens inside, so that a quad's weights
 * come from memory once and stay in L1 for all its token tiles: 2 rows x 4 tokens, then the
 * last 1-3 tokens as 4 x 1 (gemv), 4 x 2 or 2 x 3. */
INLINE void rows_of(int type, const uint8_t *w, int64_t row_bytes, int64_t blocks, int64_t begin,
                    int64_t end, const float *x, const Token *token, int64_t ldx, int64_t tokens,
                    float *y, int64_t ldy) {
    const int64_t eights = tokens / 8 * 8, full = tokens / 4 * 4, rest = tokens - full;
    const int64_t ahead = prefetch_distance(row_bytes);
    (void)ahead;
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) {
        const uint8_t *wn = w + n * row_bytes;
        /* A row's weights decoded once for 8 tokens: decoding costs as much as 4-5 products. */
        for (int64_t t = 0; t < eights; t += 8)
            for (int r = 0; r < 4; r++)
                tile(type, wn + r * row_bytes, row_bytes, blocks, x + t * ldx, ldx,
                     y + t * ldy + n + r, ldy, 1, 8);
        for (int64_t t = eights; t < full; t += 4) {
            tile(type, wn, row_bytes, blocks, x + t * ldx, ldx, y + t * ldy + n, ldy, 2, 4);
            tile(type, wn + 2 * row_bytes, row_bytes, blocks, x + t * ldx, ldx,
                 y + t * ldy + n + 2, ldy, 2, 4);
        }
        const float *xt = x + full * ldx;
        float *yt = y + full * ldy + n;
#ifdef __AVX2__
        if (rest == 1 && token->digits && block_size(type) == 256) {
            f32x8 v[4];
            for (int r = 0; r < 4; r++) v[r] = gemv_k(type, wn + r * row_bytes, blocks, ahead, token);
            _mm_storeu_ps(yt, sum8x4(v[0], v[1], v[2], v[3]));
        } else
#endif
        if (rest == 1) { /* row by row: one sequential stream keeps the prefetchers ahead */
            for (int r = 0; r < 4; r++)
                gemv(type, wn + r * row_bytes, row_bytes, blocks, xt, token, yt + r, 1);
        } else if (rest == 2) {
            tile(type, wn, row_bytes, blocks, xt, ldx, yt, ldy, 4, 2);
        } else if (rest == 3) {
            tile(type, wn, row_bytes, blocks, xt, ldx, yt, ldy, 2, 3);
            tile(type, wn + 2 * row_bytes, row_bytes, blocks, xt, ldx, yt + 2, ldy, 2, 3);
        }
    }
    for (; n < end; n++) {
        const uint8_t *wn = w + n * row_bytes;
        for (int64_t t = 0; t < full; t += 4)
            tile(type, wn, row_bytes, blocks, x + t * ldx, ldx, y + t * ldy + n, ldy, 1, 4);
        for (int64_t t = full; t < tokens; t++)
            tile(type, wn, row_bytes, blocks, x + t * ldx, ldx, y + t * ldy + n, ldy, 1, 1);
    }
}

#define ROWS_KERNEL(name, TYPE)                                                                   \
    static void name(const uint8_t *w, int64_t row_bytes, int64_t blocks, int64_t begin,         \
                     int64_t end, const float *x, const Token *token, int64_t ldx, int64_t tokens, \
                     float *y, int64_t ldy) {                                                     \
        rows_of(TYPE, w, row_bytes, blocks, begin, end, x, token, ldx, tokens, y, ldy);          \
    }

ROWS_KERNEL(rows_q4_0, Q4_0)
ROWS_KERNEL(rows_q4_1, Q4_1)
ROWS_KERNEL(rows_q5_0, Q5_0)
ROWS_KERNEL(rows_q5_1, Q5_1)
ROWS_KERNEL(rows_q8_0, Q8_0)
ROWS_KERNEL(rows_q4_k, Q4_K)
ROWS_KERNEL(rows_q5_k, Q5_K)
ROWS_KERNEL(rows_q6_k, Q6_K)
ROWS_KERNEL(rows_f32, F32)

/* Q2_K / Q3_K, one token, one block: sum over its 256 weights (gguf-py's numbers, rebuilt in
 * registers) times x, in 4 x 8 lanes. */
INLINE f32x8 k23_block_dot(const int type, const uint8_t *b, const float *x) {
#ifdef __AVX2__
    float scale[16], min[16];
    k23_scales(type, b, scale, min);
    f32x8 part_sum[4] = {{0}};
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++) {
            const __m256i codes = k23_codes32(type, b, h, s);
            for (int part = 0; part < 4; part++) {
                const int e = 128 * h + 32 * s + 8 * part;
                const f32x8 w = (f32x8)k23_weights8(type, codes, part, scale, min, e / 16);
                part_sum[part] += w * load8(x + e);
            }
        }
    return (part_sum[0] + part_sum[1]) + (part_sum[2] + part_sum[3]);
#else
    float wk[256] __attribute__((aligned(32)));
    k23_dequant(type, b, wk);
    f32x8 sum = {0};
    for (int i = 0; i < 32; i++) sum += load8(wk + 8 * i) * load8(x + 8 * i);
    return sum;
#endif
}

/* acc[t][r] += block k's weights wk[r] (R <= 2 rows, dequantized) times token t's x (TT <= 4):
 * each weight vector loaded once for TT tokens, each x vector once for R rows. */
INLINE void k23_tile(const float (*wk)[256], const int R, const float *x, int64_t ldx, const int TT,
                     f32x8 (*acc)[2]) {
    f32x8 sum[2][4];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++) sum[r][t] = acc[t][r];
    for (int i = 0; i < 32; i++) {
        f32x8 wv[2];
        for (int r = 0; r < R; r++) wv[r] = load8(wk[r] + 8 * i);
        for (int t = 0; t < TT; t++) {
            const f32x8 xv = load8(x + t * ldx + 8 * i);
            for (int r = 0; r < R; r++) sum[r][t] += wv[r] * xv;
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++) acc[t][r] = sum[r][t];
}

/* Rows n .. n + R - 1 (R <= 2) for every token: each block of the rows dequantized once into L1
 * and multiplied there with the tokens, 4 at a time. */
INLINE void k23_rows(const int type, const uint8_t *w, int64_t row_bytes, int64_t blocks, int64_t n,
                     const int R, const float *x, int64_t ldx, int64_t tokens, float *y, int64_t ldy) {
    const int bytes = block_bytes(type);
    const int64_t ahead = prefetch_distance(row_bytes); /* the same column, rows on */
    float wk[2][256] __attribute__((aligned(32)));
    f32x8 acc[MAX_TOKENS][2];
    for (int64_t t = 0; t < tokens; t++) acc[t][0] = acc[t][1] = (f32x8){0};
    for (int64_t k = 0; k < blocks; k++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *b = w + (n + r) * row_bytes + k * bytes;
            prefetch_block(b, bytes, ahead);
            k23_dequant(type, b, wk[r]);
        }
        const float *xk = x + 256 * k;
        int64_t t = 0;
        for (; t + 4 <= tokens; t += 4) k23_tile(wk, R, xk + t * ldx, ldx, 4, acc + t);
        for (; t < tokens; t++) k23_tile(wk, R, xk + t * ldx, ldx, 1, acc + t);
    }
    for (int64_t t = 0; t < tokens; t++)
        for (int r = 0; r < R; r++) y[t * ldy + n + r] = sum8(acc[t][r]);
}

/* Q2_K / Q3_K, rows [begin, end) for every token (k23_blocks.h): one token row by row, its
 * weights rebuilt in registers; more tokens two rows at a time through L1. Simpler than the
 * other formats' register tiles: these two are rarely more than a few matrices of a model. */
INLINE void rows_k23(const int type, const uint8_t *w, int64_t row_bytes, int64_t blocks,
                     int64_t begin, int64_t end, const float *x, int64_t ldx, int64_t tokens,
                     float *y, int64_t ldy) {
    if (tokens == 1) {
        const int bytes = block_bytes(type);
        const int64_t ahead = prefetch_distance(row_bytes);
        for (int64_t n = begin; n < end; n++) {
            f32x8 acc = {0};
            for (int64_t k = 0; k < blocks; k++) {
                prefetch_block(w + n * row_bytes + k * bytes, bytes, ahead);
                acc += k23_block_dot(type, w + n * row_bytes + k * bytes, x + 256 * k);
            }
            y[n] = sum8(acc);
        }
        return;
    }
    int64_t n = begin;
    for (; n + 2 <= end; n += 2) k23_rows(type, w, row_bytes, blocks, n, 2, x, ldx, tokens, y, ldy);
    if (n < end) k23_rows(type, w, row_bytes, blocks, n, 1, x, ldx, tokens, y, ldy);
}

#define ROWS_K23(name, TYPE)                                                                      \
    static void name(const uint8_t *w, int64_t row_bytes, int64_t blocks, int64_t begin,         \
                     int64_t end, const float *x, const Token *token, int64_t ldx, int64_t tokens, \
                     float *y, int64_t ldy) {                                                     \
        (void)token;                                                                              \
        rows_k23(TYPE, w, row_bytes, blocks, begin, end, x, ldx, tokens, y, ldy);                \
    }

ROWS_K23(rows_q2_k, Q2_K)
ROWS_K23(rows_q3_k, Q3_K)

typedef void (*rows_fn)(const uint8_t *, int64_t, int64_t, int64_t, int64_t, const float *,
                        const Token *, int64_t, int64_t, float *, int64_t);

static rows_fn rows_kernel(int type) {
    switch (type) {
    case Q4_0: return rows_q4_0;
    case Q4_1: return rows_q4_1;
    case Q5_0: return rows_q5_0;
    case Q5_1: return rows_q5_1;
    case Q8_0: return rows_q8_0;
    case Q4_K: return rows_q4_k;
    case Q5_K: return rows_q5_k;
    case Q6_K: return rows_q6_k;
    case Q2_K: return rows_q2_k;
    case Q3_K: return rows_q3_k;
    case F32: return rows_f32;
    default: return 0;
    }
}

/* One call of axon_ggml_matmul_parts as its units of work see it. */
typedef struct {
    int parts;
    const int *types;
    const uint8_t *const *ws;
    const int64_t *rows;
    int64_t cols;
    const float *x;
    const Token *token;
    int64_t tokens;
    float *y;
    int64_t ldy, quads;
} Quads;

#define UNIT_QUADS 8 /* row quads per unit of work (32 rows) */

/* Unit u: row quads [8u, 8u + 8) of all the parts together. */
static int run_quads(const void *ctx, int64_t u) {
    const Quads *c = ctx;
    const int64_t first = u * UNIT_QUADS, last = first + UNIT_QUADS < c->quads ? first + UNIT_QUADS : c->quads;
    int64_t part_first = 0, column = 0; /* the part's first quad, its first column */
    for (int p = 0; p < c->parts; p++) {
        const int64_t part_quads = (c->rows[p] + 3) / 4;
        const int64_t lo = first > part_first ? first : part_first;
        const int64_t hi = last < part_first + part_quads ? last : part_first + part_quads;
        if (lo < hi) {
            const int64_t blocks = c->cols / block_size(c->types[p]);
            const int64_t row_bytes = blocks * block_bytes(c->types[p]);
            const int64_t begin = (lo - part_first) * 4;
            const int64_t end = (hi - part_first) * 4 < c->rows[p] ? (hi - part_first) * 4 : c->rows[p];
            rows_kernel(c->types[p])(c->ws[p], row_bytes, blocks, begin, end, c->x, c->token, c->cols,
                                     c->tokens, c->y + column, c->ldy);
        }
        part_first += part_quads;
        column += c->rows[p];
    }
    return 1;
}

/* y [tokens, ldy] = x [tokens, cols] @ [W_0; W_1; ...].T for `parts` weights W_p [rows[p], cols]
 * in formats types[p] (a fused projection such as q, k, v, kept as separate GGUF tensors): part
 * p fills the columns after those of the parts before it. The row quads of all parts are split
 * across the threads in one parallel region, a contiguous share each, shares stolen from the back
 * by a thread done with its own (axon_run_shares). */
int axon_ggml_matmul_parts(int parts, const int *types, const uint8_t *const *ws,
                           const int64_t *rows, int64_t cols, const float *x, int64_t tokens,
                           float *y, int64_t ldy, int threads) {
    int64_t quads = 0;
    for (int p = 0; p < parts; p++) {
        if (!rows_kernel(types[p]) || cols % block_size(types[p])) return -1;
        quads += (rows[p] + 3) / 4;
    }
    if (tokens < 0 || tokens > MAX_TOKENS) return -1;
    if (tokens == 0) return 0; /* e.g. a chunked-prefill step where no sequence samples */
    /* Sums of x over each 32 and each 16 weights of the last token (the batch-1 biases). */
    float xsum[cols / 32 + cols / 16]; /* per 32, then per 16 */
    for (int64_t i = 0; i < cols / 16; i++) {
        const float *xi = x + (tokens - 1) * cols + 16 * i;
        xsum[cols / 32 + i] = sum8(load8(xi) + load8(xi + 8));
    }
    for (int64_t i = 0; i < cols / 32; i++) {
        const float *xi = x + (tokens - 1) * cols + 32 * i;
        xsum[i] = sum8(load8(xi) + load8(xi + 8) + load8(xi + 16) + load8(xi + 24));
    }
    Token token = {xsum, NULL, NULL, cols};
#ifdef __AVX2__
    int k_quants = 0;
    for (int p = 0; p < parts; p++) k_quants |= block_size(types[p]) == 256 && !k23_is(types[p]);
    const int64_t digit_bytes = k_quants && tokens % 4 == 1 ? 3 * cols : 1;
    int8_t digits[digit_bytes] __attribute__((aligned(64)));
    float dscale[cols / 256 + 1];
    if (digit_bytes > 1) {
        token_digits(x + (tokens - 1) * cols, cols, digits, dscale);
        token.digits = digits, token.dscale = dscale;
    }
#endif
    const Quads call = {parts, types, ws, rows, cols, x, &token, tokens, y, ldy, quads};
    run_shares((quads + UNIT_QUADS - 1) / UNIT_QUADS, threads < 1 ? 1 : threads, run_quads, &call);
    return 0;
}

/* y [tokens, ldy] (columns 0 .. rows-1) = x [tokens, cols] @ W.T, W [rows, cols] in `type`. */
int axon_ggml_matmul(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x,
                     int64_t tokens, float *y, int64_t ldy, int threads) {
    return axon_ggml_matmul_parts(1, &type, &w, &rows, cols, x, tokens, y, ldy, threads);
}

/* ---- dequantization ---------------------------------------------------------------------- */

/* Blocks [first, last) of W (rows back to back) into out [(last - first) * block_size] float32,
 * one loop per format so that the decoders inline with constants. */
static void dequant_blocks(int type, const uint8_t *w, int64_t first, int64_t last, float *out) {
    const int B = block_size(type), bytes = block_bytes(type);
    switch (type) {
#define DEQUANT_CASE(T)                                                                           \
    case T:                                                                                       \
        for (int64_t k = first; k < last; k++) {                                                 \
            const uint8_t *b = w + k * bytes;                                                    \
            float *o = out + (k - first) * B;                                                    \
            Scales s;                                                                             \
            Codes q;                                                                              \
            block_scales(T, b, &s);                                                               \
            for (int sub = 0; sub < block_size(T) / 32; sub++) {                                 \
                codes32(T, b, sub, &q);                                                           \
                for (int j = 0; j < 4; j++)                                                       \
                    store8(o + 32 * sub + 8 * j, weights8(T, &q, &s, sub, j));                    \
            }                                                                                     \
        }                                                                                         \
        break;
        DEQUANT_CASE(Q4_0)
        DEQUANT_CASE(Q4_1)
        DEQUANT_CASE(Q5_0)
        DEQUANT_CASE(Q5_1)
        DEQUANT_CASE(Q8_0)
        DEQUANT_CASE(Q4_K)
        DEQUANT_CASE(Q5_K)
        DEQUANT_CASE(Q6_K)
        DEQUANT_CASE(F32)
#undef DEQUANT_CASE
    case Q2_K: case Q3_K:
        for (int64_t k = first; k < last; k++) k23_dequant(type, w + k * bytes, out + (k - first) * B);
        break;
    }
}

/* out [rows, cols] float32 = W [rows, cols] in `type`. */
int axon_ggml_dequant(int type, const uint8_t *w, int64_t rows, int64_t cols, float *out,
                      int threads) {
    if (!axon_ggml_supported(type) || cols % block_size(type)) return -1;
    const int64_t blocks = rows * (cols / block_size(type));
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        const int64_t id = omp_get_thread_num(), count = omp_get_num_threads();
#else
        const int64_t id = 0, count = 1;
#endif
        const int64_t first = blocks * id / count, last = blocks * (id + 1) / count;
        dequant_blocks(type, w, first, last, out + first * block_size(type));
    }
    return 0;
}

/* ---- long batches (prefill): dequantized panels against every token ---------------------- */

/* Past MAX_TOKENS a weight serves enough tokens that decoding it once beats decoding it per
 * register tile: a thread dequantizes a panel of rows (panel_bytes() of float32, sized to stay in
 * its L2) and multiplies it with every token before the next panel, so the float32 weights never
 * go to DRAM and the decoding is paid once per weight per call. The panel is stored by groups of
 * VL rows, column-major within a group ([group][col][VL]): the register tile is TG groups x TT
 * tokens of outer products, one vector of VL rows' weights at column k times token t's x[k]
 * broadcast, accumulated along the columns. Nothing is reduced at the end (a lane is one row of
 * one token's output), the weights are one sequential stream, and each broadcast serves TG
 * vectors, so it keeps the FMA units busier than a row-major tile of dot products (4 rows x 6
 * tokens, reduced at the end). */
#if defined(__AVX512F__)
typedef float vfloat __attribute__((vector_size(64)));
#define TG 4 /* 24 accumulators + 4 weights + 1 x of the 32 zmm registers: 64 rows x 6 tokens */
#define TT 6
#else
typedef float vfloat __attribute__((vector_size(32)));
#define TG 2 /* 8 accumulators + 2 weights + 1 x of 16 ymm registers */
#define TT 4
#endif
#define VL ((int)(sizeof(vfloat) / sizeof(float)))
/* Columns summed in registers before they are added to a row's total: two levels, so that the
 * rounding error grows with KB + cols / KB, not with cols (one chain per output lane otherwise:
 * 4-6x the error of the row-major tile's 16 partial sums). */
#define KB 64

INLINE vfloat loadv(const float *p) {
    vfloat v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* y[t * ldy + VL g + r] = x[t] . row VL g + r of the panel, for G <= TG groups (cols x VL floats
 * each, from w) and T <= TT tokens; the last group's first `last` rows only. */
INLINE void panel_tile(const float *w, int64_t cols, const float *x, int64_t ldx, float *y,
                       int64_t ldy, const int G, const int T, int last) {
    vfloat acc[TG][TT], total[TG][TT];
    for (int g = 0; g < G; g++)
        for (int t = 0; t < T; t++) total[g][t] = (vfloat){0};
    for (int64_t k0 = 0; k0 < cols; k0 += KB) {
        for (int g = 0; g < G; g++)
            for (int t = 0; t < T; t++) acc[g][t] = (vfloat){0};
        const int64_t k1 = k0 + KB < cols ? k0 + KB : cols;
        for (int64_t k = k0; k < k1; k++) {
            vfloat wv[TG];
            for (int g = 0; g < G; g++) wv[g] = loadv(w + (g * cols + k) * VL);
            for (int t = 0; t < T; t++) {
                const float xk = x[t * ldx + k];
                for (int g = 0; g < G; g++) acc[g][t] += wv[g] * xk;
            }
        }
        for (int g = 0; g < G; g++)
            for (int t = 0; t < T; t++) {
                __asm__("" : "+m"(total[g][t])); /* kept in memory: the registers hold acc */
                total[g][t] += acc[g][t];
            }
    }
    for (int t = 0; t < T; t++)
        for (int g = 0; g < G; g++) {
            float *out = y + t * ldy + VL * g;
            if (g < G - 1 || last == VL) {
                memcpy(out, &total[g][t], sizeof(vfloat));
                continue;
            }
            float lanes[VL];
            memcpy(lanes, &total[g][t], sizeof lanes);
            memcpy(out, lanes, sizeof(float) * (size_t)last);
        }
}

/* One instance per (G, T) with constant loop bounds. */
#define PANEL_TILES(G)                                                                            \
    static void panel_tiles_##G(const float *w, int64_t cols, const float *x, int64_t ldx,       \
                                float *y, int64_t ldy, int T, int last) {                         \
        switch (T) {                                                                              \
        case 1: panel_tile(w, cols, x, ldx, y, ldy, G, 1, last); break;                           \
        case 2: panel_tile(w, cols, x, ldx, y, ldy, G, TT < 2 ? TT : 2, last); break;             \
        case 3: panel_tile(w, cols, x, ldx, y, ldy, G, TT < 3 ? TT : 3, last); break;             \
        case 4: panel_tile(w, cols, x, ldx, y, ldy, G, TT < 4 ? TT : 4, last); break;             \
        case 5: panel_tile(w, cols, x, ldx, y, ldy, G, TT < 5 ? TT : 5, last); break;             \
        default: panel_tile(w, cols, x, ldx, y, ldy, G, TT, last); break;                        \
        }                                                                                         \
    }
PANEL_TILES(1)
PANEL_TILES(2)
#if TG > 2
PANEL_TILES(3)
PANEL_TILES(4)
#endif
typedef void (*panel_tiles_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t,
                               int, int);
static const panel_tiles_fn PANEL_TILE_FNS[TG] = {
    panel_tiles_1, panel_tiles_2,
#if TG > 2
    panel_tiles_3, panel_tiles_4,
#endif
};

/* A panel's bytes: 3/8 of a core's L2 (192 KiB where the C library does not say). Each token
 * tile's activations are read once per panel, from L3 at 512 tokens (2 MiB of them): the larger
 * the panel, the more row groups share that read, up to where the panel and the activations no
 * longer both fit in L2. */
static int64_t panel_bytes(void) {
#ifdef PANEL_BYTES
    return PANEL_BYTES;
#else
    static int64_t bytes; /* every thread computes the same value */
    if (!bytes) {
        long l2 = 0;
#ifdef _SC_LEVEL2_CACHE_SIZE
        l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
        bytes = l2 > 0 ? (int64_t)l2 / 8 * 3 : 192 << 10;
        if (bytes < (96 << 10)) bytes = 96 << 10;
        if (bytes > (3 << 20)) bytes = 3 << 20;
    }
    return bytes;
#endif
}

/* Rows first .. first + n - 1 (n <= VL) of W dequantized into `group` column-major ([cols][VL],
 * rows past n zero), through `rows` ([VL][cols] scratch): one gather per column, where storing
 * each float to its place in turn took a tenth of a 512-token prefill. */
#if defined(__AVX512F__)
/* dst[c * 16 + r] = src[r * ld + c] for a 16 x 16 block: three rounds of shuffles (pairs of
 * rows, then quads, then 128-bit lanes), 64 shuffles for 256 floats where a gather per column
 * cost about a cycle a float. */
static inline void transpose16(const float *src, int64_t ld, float *dst) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * ld);
    for (int i = 0; i < 8; i++) { /* lane L: rows 2i, 2i + 1 of columns 4L + (0, 1 | 2, 3) */
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + m], lane L: rows 4i .. 4i + 3 of column 4L + m */
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int m = 0; m < 4; m++) { /* column 4L + m: lane L of r[m], r[4 + m], r[8 + m], r[12 + m] */
        const __m512 s0 = _mm512_shuffle_f32x4(r[m], r[4 + m], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512 s1 = _mm512_shuffle_f32x4(r[m], r[4 + m], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512 s2 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512 s3 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], _MM_SHUFFLE(3, 2, 3, 2));
        _mm512_storeu_ps(dst + m * 16, _mm512_shuffle_f32x4(s0, s2, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm512_storeu_ps(dst + (4 + m) * 16, _mm512_shuffle_f32x4(s0, s2, _MM_SHUFFLE(3, 1, 3, 1)));
        _mm512_storeu_ps(dst + (8 + m) * 16, _mm512_shuffle_f32x4(s1, s3, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm512_storeu_ps(dst + (12 + m) * 16, _mm512_shuffle_f32x4(s1, s3, _MM_SHUFFLE(3, 1, 3, 1)));
    }
}
#endif

static void panel_group(int type, const uint8_t *w, int64_t blocks, int64_t cols, int64_t first,
                        int n, float *rows, float *group) {
    for (int r = 0; r < VL; r++) {
        if (r < n) dequant_blocks(type, w, (first + r) * blocks, (first + r + 1) * blocks, rows + r * cols);
        else memset(rows + r * cols, 0, sizeof(float) * (size_t)cols);
    }
#if defined(__AVX512F__) /* cols: whole GGML blocks, a multiple of 16 */
    for (int64_t k = 0; k < cols; k += 16) transpose16(rows + k, cols, group + k * VL);
#elif defined(__AVX2__)
    const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)cols));
    for (int64_t k = 0; k < cols; k++) _mm256_storeu_ps(group + k * VL, _mm256_i32gather_ps(rows + k, at, 4));
#else
    for (int64_t k = 0; k < cols; k++)
        for (int r = 0; r < VL; r++) group[k * VL + r] = rows[r * cols + k];
#endif
}

/* Rows [begin, end) of W (`type`, cols wide) for every token, through `panel` (its groups of VL
 * rows column-major; `rows`: VL x cols floats of scratch): tokens outside, row groups inside, so
 * that a token tile's x stays in L1 for the whole panel. */
static void panel_rows(int type, const uint8_t *w, int64_t cols, int64_t begin, int64_t end,
                       const float *x, int64_t tokens, float *y, int64_t ldy, float *panel,
                       float *rows_buf) {
    const int64_t blocks = cols / block_size(type), rows = end - begin;
    const int64_t groups = (rows + VL - 1) / VL;
    for (int64_t g = 0; g < groups; g++) {
        const int n = rows - VL * g < VL ? (int)(rows - VL * g) : VL;
        panel_group(type, w, blocks, cols, begin + VL * g, n, rows_buf, panel + g * cols * VL);
    }
    const int last_rows = (int)(rows - (groups - 1) * VL);
    for (int64_t t = 0; t < tokens; t += TT) {
        const int T = tokens - t < TT ? (int)(tokens - t) : TT;
        const float *xt = x + t * cols;
        float *yt = y + t * ldy + begin;
        for (int64_t g = 0; g < groups; g += TG) {
            const int G = groups - g < TG ? (int)(groups - g) : TG;
            const int last = g + G == groups ? last_rows : VL;
            PANEL_TILE_FNS[G - 1](panel + g * cols * VL, cols, xt, cols, yt + VL * g, ldy, T, last);
        }
    }
}

/* Each thread's panel buffer, kept across calls (OpenMP reuses its threads), or NULL. */
static _Thread_local float *panel_buffer;
static _Thread_local int64_t panel_capacity; /* floats */

static float *panel_of(int64_t floats) {
    if (panel_capacity < floats) {
        free(panel_buffer);
        panel_buffer = aligned_alloc(64, (size_t)(floats * 4 + 63) / 64 * 64);
        panel_capacity = panel_buffer ? floats : 0;
    }
    return panel_buffer;
}

/* Rows a panel holds at `cols` columns (whole register tiles: a multiple of TG x VL). */
int64_t axon_ggml_panel_rows(int64_t cols) {
    const int64_t rows = panel_bytes() / (4 * (cols > 0 ? cols : 1)) / (TG * VL) * (TG * VL);
    return rows < TG * VL ? TG * VL : rows;
}

/* As axon_ggml_matmul_parts, for any number of tokens (meant for more than MAX_TOKENS): panels
 * are handed out to the threads one at a time, so a thread that loses its core to another
 * process holds up at most one panel. Returns -2 when a panel buffer cannot be allocated. */
int axon_ggml_matmul_panels(int parts, const int *types, const uint8_t *const *ws,
                            const int64_t *rows, int64_t cols, const float *x, int64_t tokens,
                            float *y, int64_t ldy, int threads) {
    for (int p = 0; p < parts; p++)
        if (!axon_ggml_supported(types[p]) || cols % block_size(types[p])) return -1;
    if (tokens <= 0) return tokens < 0 ? -1 : 0;
    const int64_t panel_rows_n = axon_ggml_panel_rows(cols);
    int64_t panels = 0;
    for (int p = 0; p < parts; p++) panels += (rows[p] + panel_rows_n - 1) / panel_rows_n;
    int failed = 0;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        /* the panel (panel_rows_n, whole groups of VL rows), then VL rows of scratch */
        float *panel_buf = panel_of((panel_rows_n + VL) * cols);
        failed = !panel_buf;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < panels; i++) {
            int p = 0;
            int64_t panel = i, column = 0;
            while (panel >= (rows[p] + panel_rows_n - 1) / panel_rows_n) {
                panel -= (rows[p] + panel_rows_n - 1) / panel_rows_n;
                column += rows[p++];
            }
            const int64_t begin = panel * panel_rows_n;
            const int64_t end = begin + panel_rows_n < rows[p] ? begin + panel_rows_n : rows[p];
            if (panel_buf)
                panel_rows(types[p], ws[p], cols, begin, end, x, tokens, y + column, ldy, panel_buf,
                           panel_buf + panel_rows_n * cols);
        }
    }
    return failed ? -2 : 0;
}
