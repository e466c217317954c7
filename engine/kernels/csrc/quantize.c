/* Quantizing at load (`--quantize q8_0|q4_0|q4_1` on a safetensors checkpoint): rows of a float32,
 * bfloat16 or float16 weight straight into ggml's blocks of 32, as a GGUF file holds them, with no
 * float32 copy of the tensor. The rounding is quantize.py's `quantize_blocks` (numpy, float32) step for
 * step, so both give the same bytes:
 *   Q8_0  d = max|w| / 127,            q = round-half-even(w / d) in [-127, 127]
 *   Q4_0  d = (the w of largest |w|) / -8, q = floor(w / d + 8.5) in [0, 15]
 *   Q4_1  d = (max - min) / 15, m = min,   q = floor((w - m) / d + 0.5) in [0, 15]
 * (`/ d` is a product with 1 / d; d and m stored as float16). Blocks: Q8_0 [d, 32 int8]; Q4_0
 * [d, 16 bytes]; Q4_1 [d, m, 16 bytes]; byte j holds weight j in its low nibble, j + 16 in its high.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "rill_kernels.h"
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

/* keeps a float32 product rounded on its own (no fused multiply-add with what follows), as numpy rounds it */
#define ROUNDED(v) __asm__("" : "+x"(v))

static inline float widen(const void *src, int64_t i, int dtype) {
    if (dtype == 1) {
        const uint32_t bits = (uint32_t)((const uint16_t *)src)[i] << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    if (dtype == 2) {
        _Float16 h;
        memcpy(&h, (const uint16_t *)src + i, 2);
        return (float)h;
    }
    return ((const float *)src)[i];
}

static inline uint16_t half(float f) {  /* float16 bits, rounded to nearest even as numpy rounds */
    const _Float16 h = (_Float16)f;
    uint16_t bits;
    memcpy(&bits, &h, 2);
    return bits;
}

static inline float inverse(float d) { return d != 0.0f ? 1.0f / d : 0.0f; }

static void block_q8_0(const float *w, uint8_t *out) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(w[j]));
    const float d = amax / 127.0f, id = inverse(d);
    const uint16_t h = half(d);
    memcpy(out, &h, 2);
    for (int j = 0; j < 32; j++) {
        float v = w[j] * id;
        ROUNDED(v);
        v = nearbyintf(v);
        out[2 + j] = (uint8_t)(int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
    }
}

static void nibbles(const float *w, float id, float low, float offset, uint8_t *out) {
    uint8_t q[32];
    for (int j = 0; j < 32; j++) {
        float v = (w[j] - low) * id;
        ROUNDED(v);
        v = floorf(v + offset);
        q[j] = (uint8_t)(v > 15.0f ? 15.0f : v < 0.0f ? 0.0f : v);
    }
    for (int j = 0; j < 16; j++) out[j] = (uint8_t)(q[j] | (q[j + 16] << 4));
}

static void block_q4_0(const float *w, uint8_t *out) {
    float amax = 0.0f, pick = 0.0f;
    for (int j = 0; j < 32; j++)
        if (fabsf(w[j]) > amax) {  /* the first of equal magnitudes, as numpy's argmax */
            amax = fabsf(w[j]);
            pick = w[j];
        }
    const float d = pick / -8.0f;
    const uint16_t h = half(d);
    memcpy(out, &h, 2);
    nibbles(w, inverse(d), 0.0f, 8.5f, out + 2);
}

static void block_q4_1(const float *w, uint8_t *out) {
    float low = w[0], high = w[0];
    for (int j = 1; j < 32; j++) {
        low = fminf(low, w[j]);
        high = fmaxf(high, w[j]);
    }
    const float d = (high - low) / 15.0f;
    const uint16_t hd = half(d), hm = half(low);
    memcpy(out, &hd, 2);
    memcpy(out + 2, &hm, 2);
    nibbles(w, inverse(d), low, 0.5f, out + 4);
}

#if defined(__AVX2__) && defined(__F16C__)
static inline __m256 widen8(const void *src, int64_t i, int dtype) {
    if (dtype == 1)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i))), 16));
    if (dtype == 2)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i)));
    return _mm256_loadu_ps((const float *)src + i);
}

/* block_q8_0 on eight lanes: the same max, product, round-half-even and clamp, so the same bytes */
static void block_q8_0_avx2(const void *src, int64_t i, int dtype, uint8_t *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 w[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        w[j] = widen8(src, i + 8 * j, dtype);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, w[j]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    const float d = _mm_cvtss_f32(m) / 127.0f, id = inverse(d);
    const uint16_t h = half(d);
    memcpy(out, &h, 2);
    const __m256 scale = _mm256_set1_ps(id), top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-127.0f);
    __m256i q[4];
    for (int j = 0; j < 4; j++) {
        const __m256 v = _mm256_round_ps(_mm256_mul_ps(w[j], scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, bottom), top));
    }
    /* int32 -> int8 through the lane-wise packs, then the lanes put back in order */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)(out + 2),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* floor((w - low) * id + offset) clamped to [0, 15] on eight lanes, two weights a byte as `nibbles` */
static void nibbles_avx2(const __m256 w[4], float id, float low, float offset, uint8_t *out) {
    const __m256 scale = _mm256_set1_ps(id), base = _mm256_set1_ps(low), add = _mm256_set1_ps(offset);
    const __m256 top = _mm256_set1_ps(15.0f), zero = _mm256_setzero_ps();
    __m256i q[4];
    for (int j = 0; j < 4; j++) {
        const __m256 v = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(w[j], base), scale), add));
        q[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, zero), top));
    }
    /* weights 0-15 (q[0], q[1]) low nibbles, 16-31 (q[2], q[3]) high */
    const __m256i lo = _mm256_packs_epi32(q[0], q[1]), hi = _mm256_packs_epi32(q[2], q[3]);
    const __m256i both = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));  /* int16: lanes [0-3, 8-11 | 4-7, 12-15] */
    const __m256i ordered = _mm256_permute4x64_epi64(both, 0xD8);  /* int16 0..15 in order */
    const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(ordered), _mm256_extracti128_si256(ordered, 1));
    _mm_storeu_si128((__m128i *)out, bytes);
}

static void block_q4_avx2(const void *src, int64_t i, int dtype, int kind, uint8_t *out) {
    __m256 w[4], low = _mm256_set1_ps(INFINITY), high = _mm256_set1_ps(-INFINITY);
    float values[32];
    for (int j = 0; j < 4; j++) {
        w[j] = widen8(src, i + 8 * j, dtype);
        _mm256_storeu_ps(values + 8 * j, w[j]);
        low = _mm256_min_ps(low, w[j]);
        high = _mm256_max_ps(high, w[j]);
    }
    if (kind == 1) {
        float amax = 0.0f, pick = 0.0f;
        for (int j = 0; j < 32; j++)
            if (fabsf(values[j]) > amax) {
                amax = fabsf(values[j]);
                pick = values[j];
            }
        const float d = pick / -8.0f;
        const uint16_t h = half(d);
        memcpy(out, &h, 2);
        nibbles_avx2(w, inverse(d), 0.0f, 8.5f, out + 2);
        return;
    }
    float lows[8], highs[8];
    _mm256_storeu_ps(lows, low);
    _mm256_storeu_ps(highs, high);
    float lo = lows[0], hi = highs[0];
    for (int j = 1; j < 8; j++) {
        lo = lows[j] < lo ? lows[j] : lo;
        hi = highs[j] > hi ? highs[j] : hi;
    }
    const float d = (hi - lo) / 15.0f;
    const uint16_t hd = half(d), hm = half(lo);
    memcpy(out, &hd, 2);
    memcpy(out + 2, &hm, 2);
    nibbles_avx2(w, inverse(d), lo, 0.5f, out + 4);
}
#endif

/* w [rows, in] (in a multiple of 32; dtype 0 float32, 1 bfloat16, 2 float16) -> out [rows, in / 32 blocks]
 * of `kind` (0 Q8_0, 1 Q4_0, 2 Q4_1). Returns 0, or -1 for an unknown kind or width. */
int rill_quantize_rows(const void *w, int64_t rows, int64_t in, int dtype, int kind, uint8_t *out, int threads) {
    static const int64_t block_bytes[3] = {34, 18, 20};
    if (kind < 0 || kind > 2 || in % 32 || dtype < 0 || dtype > 2) return -1;
    const int64_t row_bytes = in / 32 * block_bytes[kind];
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        float block[32];
        for (int64_t b = 0; b < in / 32; b++) {
#if defined(__AVX2__) && defined(__F16C__)
            uint8_t *to = out + r * row_bytes + b * block_bytes[kind];
            if (kind == 0) block_q8_0_avx2(w, r * in + b * 32, dtype, to);
            else block_q4_avx2(w, r * in + b * 32, dtype, kind, to);
            continue;
#endif
            for (int j = 0; j < 32; j++) block[j] = widen(w, r * in + b * 32 + j, dtype);
            uint8_t *dst = out + r * row_bytes + b * block_bytes[kind];
            if (kind == 0) block_q8_0(block, dst);
            else if (kind == 1) block_q4_0(block, dst);
            else block_q4_1(block, dst);
        }
    }
    return 0;
}
