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
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

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

/* out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * (w, or 1 + w with unit_offset); rows may be
 * strided (ldx, ldo floats apart), each row's `dim` values contiguous. */
void axon_rms_norm(const float *x, int64_t ldx, const float *w, float *out, int64_t ldo,
                   int64_t rows, int64_t dim, float eps, int unit_offset) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *o = out + r * ldo;
        const float inv = 1.0f / sqrtf(dot(xr, xr, dim) / (float)dim + eps);
        int64_t i;
        if (unit_offset)
            for (i = 0; i < dim; i++) o[i] = (xr[i] * inv) * (1.0f + w[i]);
        else
            for (i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

/* Rotary embedding (neox / rotate-half layout) in place on the first `rotary_dim` channels of
 * every head: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, angle = position * inv_freq[i].
 * Token t's heads start at x + t * ldx, head_dim floats apart. */
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
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * ldx + h * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = v[i], x2 = v[i + half];
                v[i] = x1 * cos_t[i] - x2 * sin_t[i];
                v[i + half] = x2 * cos_t[i] + x1 * sin_t[i];
            }
        }
    }
}


/* One decode query per sequence over its cached keys, read in place from the paged cache.
 *   q        [batch, heads, head_dim], rows ldq floats apart; query head h reads KV head
 *            h / (heads / kv_heads)
 *   k/v      [slots, kv_heads, head_dim] caches
 *   slots    [batch, width] cache slot of each context position (padding beyond its length)
 *   lens     [batch] context lengths; a window > 0 keeps the last `window` positions
 *   softcap  > 0: scores = tanh(scores / softcap) * softcap
 *   out      [batch, heads, head_dim]
 * `scratch` holds threads * width floats of scores. */
void axon_paged_decode_attention(const float *q, int64_t ldq, const float *k_cache,
                                 const float *v_cache,
                                 const int64_t *slots, int64_t width, const int64_t *lens,
                                 int64_t batch, int64_t heads, int64_t kv_heads,
                                 int64_t head_dim, float scale, float softcap, int64_t window,
                                 float *out, float *scratch, int threads) {
    const int64_t group = heads / kv_heads, pairs = batch * heads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t pair = 0; pair < pairs; pair++) {
#ifdef _OPENMP
        float *scores = scratch + (int64_t)omp_get_thread_num() * width;
#else
        float *scores = scratch;
#endif
        const int64_t b = pair / heads, h = pair % heads, kv = h / group;
        const int64_t len = lens[b], start = window > 0 && len > window ? len - window : 0;
        const float *qh = q + b * ldq + h * head_dim;
        float *o = out + pair * head_dim;
        float top = -INFINITY;
        for (int64_t p = start; p < len; p++) {
            const float *kp = k_cache + (slots[b * width + p] * kv_heads + kv) * head_dim;
            float s = dot(qh, kp, head_dim) * scale;
            if (softcap > 0.0f) s = tanhf(s / softcap) * softcap;
            scores[p] = s;
            top = s > top ? s : top;
        }
        float total = 0.0f;
        for (int64_t p = start; p < len; p++) total += scores[p] = expf(scores[p] - top);
        const float norm = 1.0f / total;
        memset(o, 0, head_dim * sizeof(float));
        for (int64_t p = start; p < len; p++) {
            const float *vp = v_cache + (slots[b * width + p] * kv_heads + kv) * head_dim;
            const float weight = scores[p] * norm;
            for (int64_t i = 0; i < head_dim; i++) o[i] += weight * vp[i];
        }
    }
}

/* ---- gated activations -------------------------------------------------------------------- */

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

/* mask ? a : b, lane by lane (C has no vector ternary). */
static inline f32x8 select8(i32x8 mask, f32x8 a, f32x8 b) {
    return (f32x8)(((i32x8)a & mask) | ((i32x8)b & ~mask));
}

/* exp(x) in float32 to about 1 ulp, eight lanes at a time in plain vector arithmetic (libm's
 * expf is a call per element): 2^n * exp(r) with r = x - n ln2 (ln2 in two parts), exp(r) by
 * Cephes' expf polynomial, 2^n built in the exponent bits. */
static inline f32x8 exp8(f32x8 x) {
    const f32x8 lo = (f32x8){0} - 87.0f, hi = (f32x8){0} + 88.0f;
    x = select8(x < lo, lo, x);
    x = select8(x > hi, hi, x);
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const f32x8 n = (x * 1.44269504088896341f + shifter) - shifter;
    f32x8 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    f32x8 p = (f32x8){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const i32x8 bits = (__builtin_convertvector(n, i32x8) + 127) << 23;
    return p * (f32x8)bits;
}

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

/* k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t]; rows of `width` floats, k / v token
 * rows ldk / ldv floats apart. */
void axon_cache_write(const float *k, int64_t ldk, const float *v, int64_t ldv,
                      const int64_t *slots, int64_t tokens, int64_t width, float *k_cache,
                      float *v_cache) {
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(k_cache + slots[t] * width, k + t * ldk, width * sizeof(float));
        memcpy(v_cache + slots[t] * width, v + t * ldv, width * sizeof(float));
    }
}

/* ---- greedy sampling ---------------------------------------------------------------------- */

/* out[r] = the first index of the largest value of row r (rows ld floats apart), as torch's
 * argmax: a NaN counts as larger than everything, so the first NaN wins. One vector pass for
 * the maximum (and whether a NaN is present), then a scan for its first position. */
void axon_argmax_rows(const float *x, int64_t ld, int64_t rows, int64_t cols, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * ld;
        f32x8 best = (f32x8){0} - INFINITY;
        i32x8 nan = {0};
        int64_t i = 0;
        for (; i + 8 <= cols; i += 8) {
            f32x8 v;
            memcpy(&v, row + i, sizeof v);
            nan |= v != v;
            best = select8(v > best, v, best);
        }
        float top = -INFINITY;
        int has_nan = 0;
        for (int l = 0; l < 8; l++) {
            top = best[l] > top ? best[l] : top;
            has_nan |= nan[l] != 0;
        }
        for (; i < cols; i++) {
            has_nan |= row[i] != row[i];
            top = row[i] > top ? row[i] : top;
        }
        int64_t index = 0;
        for (i = 0; i < cols; i++)
            if (has_nan ? row[i] != row[i] : row[i] == top) break;
        out[r] = i < cols ? i : index;
    }
}
