/* Q4_K / Q5_K scale unpacking in vector registers, shared by ggml_cpu.c and ggml_q8.c. Included
 * by each kernel file (each also compiles alone in the tests). */
#ifndef AXON_K_SCALES_H
#define AXON_K_SCALES_H

#ifdef __AVX2__
#include <immintrin.h>

/* A Q4_K / Q5_K block's eight 6-bit sub-scales (bytes 0-7) and eight 6-bit mins (bytes 8-15),
 * unpacked from `raw`, the block's first 16 bytes (d, dmin, then the 12 packed bytes at offset
 * 4), without leaving the registers. Unpacking in scalars and reading the 16 bytes back as a
 * vector waits on store forwarding (four 4-byte stores into one 16-byte load), a stall that can
 * dominate a one-token GEMV. */
static inline __m128i k_scales_vec(__m128i raw) {
    const __m128i lo = _mm_shuffle_epi8(raw, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m128i hi = _mm_shuffle_epi8(raw, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
    const __m128i low = _mm_and_si128(lo, _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0));
    const __m128i high4 = _mm_and_si128(_mm_srli_epi16(lo, 4), _mm_setr_epi32(0, 0, 0, 0x0F0F0F0F));
    const __m128i top2 = _mm_and_si128(_mm_srli_epi16(hi, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(_mm_or_si128(low, high4), top2);
}
#endif

#endif
