/* What the block kernels (csrc/qlinear.c, qlinear_i8.c, qlinear_amx.c) share about the GGUF blocks
 * they compute from: the kinds, the bytes of one panel's block (its weights, then float scales d[16]
 * (Q6_K: d[2][16], one per 16 inputs), Q4_1/Q5_1: and m[16]), the prefetch of the block ahead,
 * where each thread's sums go and how a panel's sums reach y.
 *
 * The kinds of block, each holding 32 inputs of a panel's 16 outputs (w: one de-quantized weight):
 *   Q8_0  int8 q                                  w = d q                 576 bytes (1.125 per weight)
 *   Q4_0  4-bit q                                 w = d (q - 8)           320 bytes (0.625)
 *   Q4_1  4-bit q                                 w = d q + m             384 bytes (0.75)
 *   Q5_1  5-bit q: Q4's nibbles, then a plane of  w = d q + m             448 bytes (0.875)
 *         fifth bits (64 bytes)
 *   Q6_K  6-bit q: Q4's nibbles, then a plane of  w = d[k / 16] (q - 32)  512 bytes (1.0)
 *         two-bit highs (128 bytes)
 *   Q4_K  Q4_1's nibbles, then uint8 s[16] and    w = D s q + M n         288 bytes, and 128 per
 *         n[16]: a super-block's six-bit scales   (D s, M n: one float32  8 blocks (0.59)
 *         and minimums                            product each)
 *   Q6_KS int8 q - 32 (as Q8_0 holds its q),     w = D s[k / 16] q       544 bytes, and 64 per
 *         then int8 s[2][16]: a super-block's                             8 blocks (1.08)
 *         scale per 16 inputs
 * Q4_K and Q6_KS panels are super-blocks of 256 inputs: float D[16] (Q4_K: and M[16], M = -dmin,
 * so that M n is -(dmin n) exactly), then their 8 blocks; D s is the product Q4_1 and Q6_K hold
 * as their d, computed where it is used (the same floats): Q4_K 0.79x Q4_1's bytes for the same
 * weights. Q6_KS keeps its six-bit weights a byte each, 1.08x Q6_K's bytes: widening a byte takes
 * the instructions Q4's nibbles do, where Q6_K's two planes took twice as many, which bound a
 * one-row step on AVX2 (docs/benchmarks-history.md has the figures behind these comments).
 * GGUF's Q8_0, IQ4_NL and IQ4_XS are held as Q8_0; Q4_K as Q4_K; Q5_1 and Q5_K as Q5_1; Q6_K and
 * Q3_K (q + 32) as Q6_KS; Q5_0 (q + 16) as Q6_K; with int8 activations Q4_K as Q4_1 and Q6_KS as
 * Q6_K (engine/model/quant.py, csrc/repack.c). */
#ifndef RILL_BLOCKS_H
#define RILL_BLOCKS_H
#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q5_1 = 3, Q6_K = 4, Q4_K = 5, Q6_KS = 6, NUM_KINDS = 7 };
/* rill_lin's kind for the int8-activation kernel: INT8_KIND + the kind (engine/runner/native.py) */
enum { INT8_KIND = 16 };

/* CALL(K) with the kind K a constant, so that each kind's inner loops are compiled for it */
#define PER_KIND(kind, CALL)        \
    switch (kind) {                 \
        case Q8_0: CALL(Q8_0); break; \
        case Q4_0: CALL(Q4_0); break; \
        case Q4_1: CALL(Q4_1); break; \
        case Q5_1: CALL(Q5_1); break; \
        case Q4_K: CALL(Q4_K); break; \
        case Q6_KS: CALL(Q6_KS); break; \
        default: CALL(Q6_K); break;   \
    }

/* the kinds kept in super-blocks of 256 inputs, and the 6-bit ones */
static inline int is_super(int kind) { return kind == Q4_K || kind == Q6_KS; }
static inline int is_q6(int kind) { return kind == Q6_K || kind == Q6_KS; }
/* the kinds whose weights are int8 values, one byte each (input-major, q[32][16]) */
static inline int is_int8(int kind) { return kind == Q8_0 || kind == Q6_KS; }
/* a super-block: its floats (SUPER_HEAD bytes), then 8 blocks of SUPER_STRIDE bytes each */
static inline int64_t super_head_bytes(int kind) { return kind == Q4_K ? 128 : 64; }
static inline int64_t super_stride(int kind) { return kind == Q4_K ? 32 * 8 + 32 : 32 * 16 + 32; }
/* bytes of a panel per block of 32 inputs (a super-block's over its 8 blocks) */
static inline int64_t block_bytes(int kind) {
    if (is_super(kind)) return super_stride(kind) + super_head_bytes(kind) / 8;
    return kind == Q8_0 ? 32 * 16 + 64 : kind == Q4_0 ? 32 * 8 + 64 : kind == Q4_1 ? 32 * 8 + 128
         : kind == Q5_1 ? 32 * 8 + 64 + 128 : 32 * 8 + 128 + 128;
}
/* where a block's scales start: after its weights (Q4_K: its bytes s and n, Q6_KS: s) */
static inline int64_t scales_at(int kind) {
    return is_int8(kind) ? 32 * 16 : kind == Q5_1 ? 32 * 8 + 64 : kind == Q6_K ? 32 * 8 + 128 : 32 * 8;
}
/* block b of a panel */
static inline __attribute__((always_inline)) const uint8_t *block_at(const uint8_t *panel, int64_t b, const int kind) {
    if (is_super(kind)) return panel + (b >> 3) * 8 * block_bytes(kind) + super_head_bytes(kind) + (b & 7) * super_stride(kind);
    return panel + b * block_bytes(kind);
}
/* the floats of block b's super-block: D[16] (Q4_K: then M[16]) */
static inline __attribute__((always_inline)) const float *super_head(const uint8_t *panel, int64_t b, const int kind) {
    return (const float *)(panel + (b >> 3) * 8 * block_bytes(kind));
}
/* the 4-bit kinds, whose weights are nibbles only */
static inline int is_q4(int kind) { return kind == Q4_0 || kind == Q4_1 || kind == Q4_K; }
/* the kinds with a minimum m per output */
static inline int has_min(int kind) { return kind == Q4_1 || kind == Q5_1 || kind == Q4_K; }
/* the offset taken off q: w = d (q - offset) (Q6_KS holds q - 32) */
static inline int q_offset(int kind) { return kind == Q4_0 ? 8 : kind == Q6_K ? 32 : 0; }
/* the kinds whose sums need each row's sum of x per block: m sum(x), or -offset d sum(x) */
static inline int needs_xsum(int kind) { return has_min(kind) || q_offset(kind); }
/* scales per output in a block: the 6-bit kinds' are per 16 inputs */
static inline int scale_parts(int kind) { return is_q6(kind) ? 2 : 1; }

/* The panel's block PREFETCH_BLOCKS ahead, asked for while this one is computed: at one row the
 * widening takes about as long as reading the weights, and without it the two took turns (the
 * hardware prefetcher alone left each thread waiting at every block). Into every cache level (T0),
 * not non-temporal: on Intel NTA's lines bypass L2 and halved the one-row read rate. */
enum { PREFETCH_BLOCKS = 8, PREFETCH_T0 = 3 /* __builtin_prefetch's locality: every cache level */ };
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *blk, const int kind) {
    /* super-blocks: PREFETCH_BLOCKS is one, so this is the same block of the next one, and past
       it the head of the one after (asked for by its block 7) */
    const int64_t extra = is_super(kind) ? super_head_bytes(kind) : 0;
    for (int64_t o = 0; o < block_bytes(kind) + extra; o += 64)
        __builtin_prefetch(blk + PREFETCH_BLOCKS * block_bytes(kind) + o, 0, PREFETCH_T0);
}

/* Floats between two threads' sums (16 per row for one panel's outputs, then a cache line of
 * gap), from a 64-byte aligned buffer: no cache line holds two threads' sums, which packed back to
 * back made the threads write into the same lines for every panel. */
static inline int64_t acc_stride(int64_t rows) { return 16 * rows + 16; }

/* rows split as evenly as they go into tiles of at most `most` rows; tile t starts at row
 * tile_start(rows, most, t) (the AVX-512 tiles of both kernels) */
static inline int64_t num_tiles(int64_t rows, int64_t most) { return (rows + most - 1) / most; }
static inline int64_t tile_start(int64_t rows, int64_t most, int64_t t) {
    const int64_t n = num_tiles(rows, most), base = rows / n, extra = rows % n;
    return t * base + (t < extra ? t : extra);
}

/* 32 inputs rounded to int8 with their scale d = max |x| / 127, as ggml rounds (nearest): q = x / d.
 * The int8 kernel's activations, and the rounding the head screen of csrc/decode_layer.c bounds. */
static inline float round_block(const float *xb, int8_t *q) {
    float amax = 0;
    for (int k = 0; k < 32; k++) {  /* as fmaxf (a NaN is passed over), but in vectors */
        const float a = fabsf(xb[k]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int k = 0; k < 32; k++) {
        const int v = (int)nearbyintf(xb[k] * id);
        q[k] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
    }
    return d;
}

#ifdef __AVX512F__
/* block b's d and m (Q6_K: e, the d of inputs 16-31), as qlinear.c's scales_of computes them, in one
 * register each (the float32 kernel's AVX-512 tiles and the AMX kernel) */
static inline __attribute__((always_inline)) void scales16(const uint8_t *panel, int64_t b, const uint8_t *blk,
                                                           __m512 *d, __m512 *m, __m512 *e, const int kind) {
    if (is_super(kind)) {
        const float *head = super_head(panel, b, kind);
        const __m128i s0 = _mm_loadu_si128((const __m128i *)(blk + scales_at(kind)));
        const __m128i s1 = _mm_loadu_si128((const __m128i *)(blk + scales_at(kind) + 16));
        if (kind == Q6_KS) {
            *d = _mm512_mul_ps(_mm512_loadu_ps(head), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s0)));
            *e = _mm512_mul_ps(_mm512_loadu_ps(head), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s1)));
            return;
        }
        *d = _mm512_mul_ps(_mm512_loadu_ps(head), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(s0)));
        *m = _mm512_mul_ps(_mm512_loadu_ps(head + 16), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(s1)));
        return;
    }
    const float *scales = (const float *)(blk + scales_at(kind));
    *d = _mm512_loadu_ps(scales);
    if (has_min(kind)) *m = _mm512_loadu_ps(scales + 16);
    if (is_q6(kind)) *e = _mm512_loadu_ps(scales + 16);
}

#endif

/* panel p's sums acc [rows][16] (+ bias) into its columns of y [rows, out]; a full panel a row per
 * zmm store (AVX-512) rather than 16 scalar stores, the same sums */
static inline void store_panel(const float *acc, const float *bias, float *y, int64_t rows, int64_t out, int64_t p) {
    const int cols = out - p * 16 < 16 ? (int)(out - p * 16) : 16;
#ifdef __AVX512F__
    if (cols == 16) {
        const __m512 b = bias ? _mm512_loadu_ps(bias + p * 16) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; r++) _mm512_storeu_ps(y + r * out + p * 16, _mm512_add_ps(_mm512_loadu_ps(acc + r * 16), b));
        return;
    }
#endif
    for (int64_t r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++) y[r * out + p * 16 + j] = acc[r * 16 + j] + (bias ? bias[p * 16 + j] : 0.0f);
}

#endif
