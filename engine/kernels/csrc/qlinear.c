/* y = x w^T + bias for block-quantized weights and float32 activations (built by engine/kernels/build.py).
 *
 * The weights keep their GGUF blocks of 32 inputs (the kinds in blocks.h: Q8_0 w = d q, Q4_0
 * w = d (q - 8), Q4_1, Q5_1 and Q4_K w = d q + m, Q6_K w = d (q - 32) with a d per 16 inputs), rearranged
 * once at load into panels of 16 output features as csrc/linear.c does with float32 weights:
 *
 *   Q8_0  panel p, block b: int8 q[32][16] (input-major), then float d[16]            576 bytes
 *   Q4_x  panel p, block b: uint8 q[32][8], byte j of input k holding output j in its low
 *         nibble and output j + 8 in its high nibble, then float d[16] (Q4_1: and m[16])
 *   Q5_1  Q4's nibbles (the low 4 bits), then uint8 h[8][8]: byte j of inputs 4G..4G+3, bit 2g
 *         the fifth bit of output j at input 4G + g, bit 2g + 1 output j + 8's; float d[16], m[16]
 *   Q6_K  Q4's nibbles, then uint8 h[16][8]: byte j of inputs 2P, 2P + 1, bits 4o..4o+1 the two
 *         high bits of output j at input 2P + o, bits 4o+2..4o+3 output j + 8's; float d[2][16]
 *   Q4_K  super-blocks: float D[16], M[16], then 8 blocks of Q4's nibbles and uint8 s[16], n[16]:
 *         a block's d = D s and m = M n are computed as it is read (blocks.h), as Q4_1 holds them
 *   Q6_KS super-blocks: float D[16], then 8 blocks of int8 q - 32 (laid out as Q8_0's q) and int8
 *         s[2][16]: d = D s
 *
 * A tile of up to 6 rows of x times one panel keeps 6 x 16 running sums in registers (AVX2; with
 * AVX-512, tiles of up to 16 rows and a panel in one register: the section further down). Within a
 * block the integer weights are widened to float and multiplied with x in float32; each block's
 * sum (Q6_K: each half's) is then scaled by d, and m (Q4_0: -8 d, Q6_K: -32 d) times the block's
 * sum of x is added, so the result equals the float32 product with the de-quantized weights up to
 * the order of the additions (and Q4_1/Q5_1's fused multiply-add).
 *
 * x [rows, in] (row stride x_row, rows contiguous); in a multiple of 32; bias [ceil(out / 16) * 16]
 * (zero-padded) or NULL; y [rows, out] contiguous.
 */
#include <stdint.h>
#include "rill_kernels.h"
#include <omp.h>
#include <stdlib.h>
#include "blocks.h"
#include "vec8.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* FEW_ROWS: up to this many rows widen the weights in registers once for all of them (AVX2:
 * rows_panel; AVX-512: one row, and from 2 rows its tiles, which widen each input once for all
 * rows, take less time; rill_qlinear_few_rows says which). WIDEN_ROWS: up to this many rows widen
 * them in registers once per tile of FEW_ROWS (AVX2: 7-12 rows as two rows_panel tiles; from 16 rows
 * de-quantizing first is as fast). CHUNK: more rows de-quantize this many blocks (8 KB of floats,
 * beside 32 rows' 16 KB of x: within L1) before their tiles run over all of them, so a tile loads
 * and stores its sums once per 128 inputs, not per 32 (figures: docs/benchmarks-history.md) */
#ifdef __AVX512F__
enum { FEW_ROWS = 1, WIDEN_ROWS = 1, CHUNK = 4 };
#else
enum { FEW_ROWS = 6, WIDEN_ROWS = 12, CHUNK = 4 };
#endif

/* the integer weight q of output j at input k of a block (the layouts above), one at a time: the
 * generic vectors' widening */
static inline __attribute__((always_inline)) int q_at(const uint8_t *blk, int k, int j, const int kind) {
    if (is_int8(kind)) return (int8_t)blk[k * 16 + j];
    const int low = j < 8 ? blk[k * 8 + j] & 15 : blk[k * 8 + j - 8] >> 4;
    if (kind == Q5_1) return low | ((blk[256 + (k / 4) * 8 + j % 8] >> (2 * (k % 4) + j / 8)) & 1) << 4;
    if (is_q6(kind)) return low | ((blk[256 + (k / 2) * 8 + j % 8] >> (4 * (k % 2) + 2 * (j / 8))) & 3) << 4;
    return low;
}

#ifdef __AVX2__
/* h's bit `from` of each lane moved to bit `to` (the bits around it move too, and are masked off) */
static inline __attribute__((always_inline)) __m256i move_bits(__m256i h, int from, int to) {
    return from < to ? _mm256_slli_epi32(h, to - from) : from > to ? _mm256_srli_epi32(h, from - to) : h;
}

/* Q5_1 and Q6_K: the 16 integer weights of input k, outputs 0-7 in i0 and 8-15 in i1: Q4's
 * nibbles (widened as widen's), each lane's bits above them moved into place from the byte of the
 * high plane that holds its output's (bit 4 of a Q5_1 weight, bits 4-5 of a Q6_K one) */
static inline __attribute__((always_inline)) void widen_high(const uint8_t *blk, int k, __m256i *i0, __m256i *i1,
                                                             const int kind) {
    const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + k * 8)));
    const __m256i low = _mm256_and_si256(q, _mm256_set1_epi32(15)), high = _mm256_srli_epi32(q, 4);
    const int q5 = kind == Q5_1, first = q5 ? 2 * (k % 4) : 4 * (k % 2);  /* output j's bit(s) in the byte */
    const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 256 + (q5 ? k / 4 : k / 2) * 8)));
    const __m256i mask = _mm256_set1_epi32(q5 ? 16 : 48);
    *i0 = _mm256_or_si256(low, _mm256_and_si256(move_bits(h, first, 4), mask));
    *i1 = _mm256_or_si256(high, _mm256_and_si256(move_bits(h, first + (q5 ? 1 : 2), 4), mask));
}
#endif

/* the 16 integer weights of input k as two vectors of 8 floats (outputs 0-7 and 8-15) */
static inline __attribute__((always_inline)) void widen(const uint8_t *blk, int k, v8 *w0, v8 *w1, const int kind) {
#ifdef __AVX2__
    if (is_int8(kind)) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + k * 16));
        *w0 = (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        *w1 = (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
    } else if (is_q4(kind)) {
        /* each byte widened to 32 bits once: its low nibble is output j, the rest (>> 4) output j + 8 */
        const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + k * 8)));
        *w0 = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(15)));
        *w1 = (v8)_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
    } else {
        __m256i i0, i1;
        widen_high(blk, k, &i0, &i1, kind);
        *w0 = (v8)_mm256_cvtepi32_ps(i0);
        *w1 = (v8)_mm256_cvtepi32_ps(i1);
    }
#else
    for (int j = 0; j < 8; j++) (*w0)[j] = (float)q_at(blk, k, j, kind), (*w1)[j] = (float)q_at(blk, k, j + 8, kind);
#endif
}

/* input k of a block: its 16 de-quantized weights, as the de-quantized model's are (the same
 * operations wherever the kernels de-quantize, so the same floats; Q4_1/Q5_1 with one rounding) */
typedef struct { v8 d0, d1, m0, m1, e0, e1; } block_scales;  /* e: Q6_K's d of inputs 16-31 */

/* 8 bytes at p as floats: unsigned (Q4_K's), or int8 (Q6_KS's) */
static inline __attribute__((always_inline)) v8 bytes8(const uint8_t *p, const int kind) {
#ifdef __AVX2__
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return (v8)_mm256_cvtepi32_ps(kind == Q6_KS ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
    v8 v;
    for (int j = 0; j < 8; j++) v[j] = kind == Q6_KS ? (float)(int8_t)p[j] : (float)p[j];
    return v;
#endif
}

/* block b's scales (blk: the block itself); a super-block's d (and m) the products of its floats and
 * the block's integers, the floats repack.c computes for Q4_1 (Q6_K) */
static inline __attribute__((always_inline)) block_scales scales_of(const uint8_t *panel, int64_t b, const uint8_t *blk,
                                                                    const int kind) {
    if (is_super(kind)) {
        const float *head = super_head(panel, b, kind);
        const uint8_t *s = blk + scales_at(kind);
        const v8 h0 = load8(head), h1 = load8(head + 8);
        if (kind == Q6_KS)
            return (block_scales){h0 * bytes8(s, kind), h1 * bytes8(s + 8, kind), {0}, {0},
                                  h0 * bytes8(s + 16, kind), h1 * bytes8(s + 24, kind)};
        return (block_scales){h0 * bytes8(s, kind), h1 * bytes8(s + 8, kind),
                              load8(head + 16) * bytes8(s + 16, kind), load8(head + 24) * bytes8(s + 24, kind), {0}, {0}};
    }
    const float *scales = (const float *)(blk + scales_at(kind));
    block_scales s = {load8(scales), load8(scales + 8), {0}, {0}, {0}, {0}};
    if (has_min(kind)) s.m0 = load8(scales + 16), s.m1 = load8(scales + 24);
    if (is_q6(kind)) s.e0 = load8(scales + 16), s.e1 = load8(scales + 24);
    return s;
}

static inline __attribute__((always_inline)) void dequant_input(const uint8_t *blk, int k, const block_scales *s,
                                                                v8 *w0, v8 *w1, const int kind) {
    widen(blk, k, w0, w1, kind);
    if (q_offset(kind)) {
        *w0 -= (float)q_offset(kind);
        *w1 -= (float)q_offset(kind);
    }
#ifdef __FMA__
    if (has_min(kind)) { /* one rounding, written out: GCC contracted it in some callers only */
        *w0 = (v8)_mm256_fmadd_ps((__m256)*w0, (__m256)s->d0, (__m256)s->m0);
        *w1 = (v8)_mm256_fmadd_ps((__m256)*w1, (__m256)s->d1, (__m256)s->m1);
        return;
    }
#endif
    const int second = is_q6(kind) && k >= 16;
    *w0 *= second ? s->e0 : s->d0;
    *w1 *= second ? s->e1 : s->d1;
    if (has_min(kind)) {
        *w0 += s->m0;
        *w1 += s->m1;
    }
}

/* a panel's block b -> its float32 weights w[32][16] */
static inline __attribute__((always_inline)) void dequant_block(const uint8_t *panel, int64_t b, float *w, const int kind) {
    const uint8_t *blk = block_at(panel, b, kind);
    prefetch_ahead(blk, kind);
    const block_scales s = scales_of(panel, b, blk, kind);
    for (int k = 0; k < 32; k++) {
        v8 w0, w1;
        dequant_input(blk, k, &s, &w0, &w1, kind);
        store8(w + k * 16, w0);
        store8(w + k * 16 + 8, w1);
    }
}

/* A tile's running sums: a [MR][2] (zero at the first block, else loaded from acc) and, for 1 or 2
 * rows, a second set c for the odd inputs, added in at the end; one input k's multiply-adds */
static inline __attribute__((always_inline)) void tile_load(const float *acc, int64_t acc_row, int first, const int MR,
                                                            v8 a[][2], v8 c[][2]) {
    for (int i = 0; i < MR; i++) {
        if (first) a[i][0] = a[i][1] = (v8){0};
        else a[i][0] = load8(acc + i * acc_row), a[i][1] = load8(acc + i * acc_row + 8);
        c[i][0] = c[i][1] = (v8){0};
    }
}

static inline __attribute__((always_inline)) void tile_input(const float *x, int64_t x_row, int64_t k, v8 w0, v8 w1,
                                                             const int MR, v8 sums[][2]) {
    for (int i = 0; i < MR; i++) {
        const float xi = x[i * x_row + k];
        const v8 xv = {xi, xi, xi, xi, xi, xi, xi, xi};
        sums[i][0] += xv * w0;
        sums[i][1] += xv * w1;
    }
}

static inline __attribute__((always_inline)) void tile_store(float *acc, int64_t acc_row, const int MR, const int S,
                                                             v8 a[][2], v8 c[][2]) {
    for (int i = 0; i < MR && S == 2; i++) a[i][0] += c[i][0], a[i][1] += c[i][1];
    for (int i = 0; i < MR; i++) {
        store8(acc + i * acc_row, a[i][0]);
        store8(acc + i * acc_row + 8, a[i][1]);
    }
}

/* MR rows of x times kn inputs of float weights w[kn][16], added to the running sums in acc
 * ([MR][16] floats, row stride acc_row; zero at the first block). The empty asm keeps each input's
 * two weight vectors in registers: without it GCC folded them into every row's multiply-add at 4
 * and 5 rows, loading them again for each row (13 loads for 8 multiply-adds) */
static inline __attribute__((always_inline)) void block_tile(const float *x, int64_t x_row, const float *w,
                                                             float *acc, int64_t acc_row, int first, int64_t kn, const int MR) {
    /* 1 or 2 rows: 4 sums cannot hide the multiply-add's latency, so odd inputs go to a second
     * set */
    const int S = MR <= 2 ? 2 : 1;
    v8 a[6][2], c[6][2];
    tile_load(acc, acc_row, first, MR, a, c);
    for (int64_t k0 = 0; k0 < kn; k0 += S)
        for (int s = 0; s < S; s++) {
            const int64_t k = k0 + s;
            v8 w0 = load8(w + k * 16), w1 = load8(w + k * 16 + 8);
#ifdef __AVX__ /* a v8 fits one register only with AVX: without it the constraint cannot be met */
            __asm__("" : "+x"(w0), "+x"(w1));
#endif
            tile_input(x, x_row, k, w0, w1, MR, s ? c : a);
        }
    tile_store(acc, acc_row, MR, S, a, c);
}

/* The last 1 or 2 rows of a chunk (rows % 6 of them; its blocks b0.. of the panel) de-quantize
 * its blocks into w as they go: the same operations as dequant_block, and the same sums as
 * block_tile's, but the widening, whose multiply-adds are few, overlaps the tile's, whose sums
 * alone wait on their latency */
static inline __attribute__((always_inline)) void lead_tile(const float *x, int64_t x_row, const uint8_t *panel,
                                                            int64_t b0, int64_t nb, float *w, float *acc, int64_t acc_row,
                                                            int first, const int MR, const int kind) {
    v8 a[2][2], c[2][2];
    tile_load(acc, acc_row, first, MR, a, c);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = block_at(panel, b0 + b, kind);
        prefetch_ahead(blk, kind);
        const block_scales sc = scales_of(panel, b0 + b, blk, kind);
        for (int k0 = 0; k0 < 32; k0 += 2)
            for (int s = 0; s < 2; s++) {
                const int k = k0 + s;
                v8 w0, w1;
                dequant_input(blk, k, &sc, &w0, &w1, kind);
                float *wk = w + b * 512 + k * 16;
                store8(wk, w0);
                store8(wk + 8, w1);
                tile_input(x, x_row, b * 32 + k, w0, w1, MR, s ? c : a);
            }
    }
    tile_store(acc, acc_row, MR, 2, a, c);
}

/* 1 to 6 rows of x times one panel, each input's weights widened in registers once for all the rows:
 * y[j] = sum over blocks (Q6_K: halves of blocks, each with its d) of d[j] (q x) + m[j] sum(x)
 * (Q4_0: m = -8 d, Q6_K: -32 d). xsum: each row's sums of x per block (Q6_K: per 16 inputs). A
 * speculative step's verification (the last token and k guesses of one sequence) and a few decodes
 * side by side take 2 to 6 rows: row by row, each row would widen every weight again. Independent
 * chains of sums over the inputs hide the multiply-add's latency: four
 * at one row, two (even and odd inputs) up to 3 rows, one from 4: 8 to 12 running sums, within the
 * 16 registers beside w0, w1 and x. */
static inline __attribute__((always_inline)) void rows_panel(const float *x, int64_t x_row, const float *xsum,
                                                             const uint8_t *panel, int64_t blocks, float *acc,
                                                             const int MR, const int kind) {
    const int parts = scale_parts(kind), span = 32 / parts, S = MR == 1 ? 4 : MR <= 3 ? 2 : 1;
    v8 y[6][2];
    for (int i = 0; i < MR; i++) y[i][0] = y[i][1] = (v8){0};
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = block_at(panel, b, kind);
        prefetch_ahead(blk, kind);
        const float *xb = x + b * 32;
        const block_scales sc = scales_of(panel, b, blk, kind);  /* once for both parts of a 6-bit block */
        for (int part = 0; part < parts; part++) {
            v8 p[4][6][2];
            for (int s = 0; s < S; s++)
                for (int i = 0; i < MR; i++) p[s][i][0] = p[s][i][1] = (v8){0};
            for (int k0 = part * span; k0 < (part + 1) * span; k0 += S)
                for (int s = 0; s < S; s++) {
                    v8 w0, w1;
                    widen(blk, k0 + s, &w0, &w1, kind);
                    tile_input(xb, x_row, k0 + s, w0, w1, MR, p[s]);
                }
            const v8 d0 = part ? sc.e0 : sc.d0, d1 = part ? sc.e1 : sc.d1;
            for (int i = 0; i < MR; i++) {
                const v8 q0 = S == 4 ? (p[0][i][0] + p[1][i][0]) + (p[2][i][0] + p[3][i][0])
                            : S == 2 ? p[0][i][0] + p[1][i][0] : p[0][i][0];
                const v8 q1 = S == 4 ? (p[0][i][1] + p[1][i][1]) + (p[2][i][1] + p[3][i][1])
                            : S == 2 ? p[0][i][1] + p[1][i][1] : p[0][i][1];
                y[i][0] += d0 * q0;
                y[i][1] += d1 * q1;
                if (needs_xsum(kind)) {
                    const float xs = xsum[i * blocks * parts + b * parts + part];
                    const v8 sv = {xs, xs, xs, xs, xs, xs, xs, xs};
                    const v8 m0 = has_min(kind) ? sc.m0 : d0 * (float)-q_offset(kind);
                    const v8 m1 = has_min(kind) ? sc.m1 : d1 * (float)-q_offset(kind);
                    y[i][0] += m0 * sv;
                    y[i][1] += m1 * sv;
                }
            }
        }
    }
    for (int i = 0; i < MR; i++) {
        store8(acc + i * 16, y[i][0]);
        store8(acc + i * 16 + 8, y[i][1]);
    }
}

#ifdef __AVX512F__
/* AVX-512: a panel's 16 outputs are one zmm register, so a tile of rows keeps one running sum per
 * row (up to WIDE_TILE rows, of 32 registers) and each input costs one multiply-add per row, whose
 * x is broadcast from memory inside the instruction (x packed once per call, input-major within
 * each tile: xp[k][MR]), fewer instructions per input than the AVX2 tiles. */
enum { WIDE_TILE = 16 };

/* input k of a block: its 16 integer weights as floats, in output order (Q4: byte j holds output j
 * in its low nibble and output j + 8 in its high one) */
static inline __attribute__((always_inline)) __m512 widen16(const uint8_t *blk, int k, const int kind) {
    if (is_int8(kind)) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + k * 16))));
    if (!is_q4(kind)) {  /* Q5_1, Q6_K: AVX2's two halves side by side */
        __m256i i0, i1;
        widen_high(blk, k, &i0, &i1, kind);
        return _mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(i0), i1, 1));
    }
    const __m128i b = _mm_loadl_epi64((const __m128i *)(blk + k * 8)), low4 = _mm_set1_epi8(15);
    const __m128i nibbles = _mm_unpacklo_epi64(_mm_and_si128(b, low4), _mm_and_si128(_mm_srli_epi16(b, 4), low4));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles));
}

/* integer weights q as floats -> de-quantized, the same operations per lane as dequant_input (so the
 * same floats); d: Q6_K's of the half that input is in */
static inline __attribute__((always_inline)) __m512 scale16(__m512 q, __m512 d, __m512 m, const int kind) {
    if (has_min(kind)) return _mm512_fmadd_ps(q, d, m);
    if (q_offset(kind)) return _mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps((float)q_offset(kind))), d);
    return _mm512_mul_ps(q, d);
}

#ifdef __AVX512VBMI__
/* With AVX512-VBMI a Q4 nibble reaches its output's 32-bit lane in one byte permutation (whose mask
 * zeroes the lane's other bytes) instead of widen16's unpack and widening. Up to BYTE_PERMUTE_ROWS
 * rows: with more, the index vectors and the rows' sums exceed the 32 registers. */
enum { BYTE_PERMUTE = 1, BYTE_PERMUTE_ROWS = 8 };
/* Q4 weights of four inputs k4..k4+3 (32 bytes): their low nibbles in bytes 0-31 and high ones in
 * 32-63, input g's at 8g (outputs 0-7) and 32 + 8g (outputs 8-15) */
static inline __attribute__((always_inline)) __m512i nibbles4(const uint8_t *blk, int k4) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + k4 * 8)), low4 = _mm256_set1_epi8(15);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, low4)),
                              _mm256_and_si256(_mm256_srli_epi16(q, 4), low4), 1);
}

/* input k4 + g of those four: its 16 nibbles, each in the low byte of its output's 32-bit lane */
static inline __attribute__((always_inline)) __m512i q4_lanes(__m512i nibbles, int g) {
    const int lo = 8 * g, hi = 32 + 8 * g;
    const __m512i index = _mm512_set_epi32(hi + 7, hi + 6, hi + 5, hi + 4, hi + 3, hi + 2, hi + 1, hi,
                                           lo + 7, lo + 6, lo + 5, lo + 4, lo + 3, lo + 2, lo + 1, lo);
    return _mm512_maskz_permutexvar_epi8(0x1111111111111111ULL, index, nibbles);
}

#else /* without it each input is widened on its own (widen16); these two are never called then */
enum { BYTE_PERMUTE = 0, BYTE_PERMUTE_ROWS = 0 };
static inline __m512i nibbles4(const uint8_t *blk, int k4) { (void)blk, (void)k4; return _mm512_setzero_si512(); }
static inline __m512i q4_lanes(__m512i nibbles, int g) { (void)g; return nibbles; }
#endif

/* MR rows (packed: xp[k * MR + i]) times the nb blocks of a chunk (the panel's b0..), added to the sums in acc
 * [MR][16] (zero at the first chunk). The first tile of a chunk de-quantizes its blocks in
 * registers as it goes (from_blocks), storing the floats into w when other tiles follow (keep);
 * those read w. Under 8 rows the odd inputs go to a second set of sums, added in at the end, so
 * that 8 or more multiply-adds are in flight. */
static inline __attribute__((always_inline)) void wide_tile(const float *xp, const uint8_t *panel, int64_t b0, float *w,
                                                            float *acc, int first, int64_t nb, const int MR,
                                                            const int from_blocks, int keep, const int kind) {
    const int S = MR < 8 ? 2 : 1;
    __m512 a[WIDE_TILE], c[WIDE_TILE];
    for (int i = 0; i < MR; i++) {
        a[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + i * 16);
        c[i] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = block_at(panel, b0 + b, kind);
        __m512 d = _mm512_setzero_ps(), m = d, e = d;  /* e: Q6_K's d of inputs 16-31 */
        if (from_blocks) {
            prefetch_ahead(blk, kind);
            scales16(panel, b0 + b, blk, &d, &m, &e, kind);
        }
        for (int k4 = 0; k4 < 32; k4 += 4) {
            const int by4 = from_blocks && is_q4(kind) && BYTE_PERMUTE && MR <= BYTE_PERMUTE_ROWS;
            const __m512i nibbles = by4 ? nibbles4(blk, k4) : _mm512_setzero_si512();
            for (int g = 0; g < 4; g++) {
                const int k = k4 + g, s = S == 2 ? g % 2 : 0;
                float *wk = w + b * 512 + k * 16;
                __m512 wv;
                if (from_blocks) {
                    wv = scale16(by4 ? _mm512_cvtepi32_ps(q4_lanes(nibbles, g)) : widen16(blk, k, kind),
                                 is_q6(kind) && k >= 16 ? e : d, m, kind);
                    if (keep) _mm512_store_ps(wk, wv);
                } else {
                    wv = _mm512_load_ps(wk);
                }
                const float *xk = xp + (b * 32 + k) * MR;
                for (int i = 0; i < MR; i++) {
                    if (s) c[i] = _mm512_fmadd_ps(_mm512_set1_ps(xk[i]), wv, c[i]);
                    else a[i] = _mm512_fmadd_ps(_mm512_set1_ps(xk[i]), wv, a[i]);
                }
            }
        }
    }
    for (int i = 0; i < MR; i++) _mm512_storeu_ps(acc + i * 16, S == 2 ? _mm512_add_ps(a[i], c[i]) : a[i]);
}

/* rows_panel's one row on zmm registers, four chains of sums over k: each input's weights widened (widen16),
 * or with VBMI four inputs' nibbles from one 32-byte load, each input's permuted into its lanes */
static inline __attribute__((always_inline)) void row_panel16(const float *x, const float *xsum,
                                                              const uint8_t *panel, int64_t blocks, float *acc,
                                                              const int kind) {
    const int parts = scale_parts(kind), span = 32 / parts;
    __m512 y = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = block_at(panel, b, kind);
        prefetch_ahead(blk, kind);
        const float *xb = x + b * 32;
        for (int part = 0; part < parts; part++) {
            __m512 p[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int k = part * span; k < (part + 1) * span; k += 4) {
                const __m512i nibbles = is_q4(kind) && BYTE_PERMUTE ? nibbles4(blk, k) : _mm512_setzero_si512();
                for (int c = 0; c < 4; c += 2) {
                    __m512 w0, w1;
                    if (is_q4(kind) && BYTE_PERMUTE) {
                        w0 = _mm512_cvtepi32_ps(q4_lanes(nibbles, c));
                        w1 = _mm512_cvtepi32_ps(q4_lanes(nibbles, c + 1));
                    } else {
                        w0 = widen16(blk, k + c, kind);
                        w1 = widen16(blk, k + c + 1, kind);
                    }
                    p[c] = _mm512_fmadd_ps(_mm512_set1_ps(xb[k + c]), w0, p[c]);
                    p[c + 1] = _mm512_fmadd_ps(_mm512_set1_ps(xb[k + c + 1]), w1, p[c + 1]);
                }
            }
            __m512 d = _mm512_setzero_ps(), m = d, e = d;
            scales16(panel, b, blk, &d, &m, &e, kind);
            if (part) d = e;
            y = _mm512_fmadd_ps(d, _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])), y);
            if (needs_xsum(kind)) {
                if (!has_min(kind)) m = _mm512_mul_ps(d, _mm512_set1_ps((float)-q_offset(kind)));
                y = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[b * parts + part]), y);
            }
        }
    }
    _mm512_storeu_ps(acc, y);
}

/* the tiles: rows split as evenly as they go into tiles of at most WIDE_TILE rows (blocks.h) */
static inline int64_t wide_tiles(int64_t rows) { return num_tiles(rows, WIDE_TILE); }
static inline int64_t wide_start(int64_t rows, int64_t t) { return tile_start(rows, WIDE_TILE, t); }

/* inputs [k0, k1) of x [rows, in] -> xp: each tile's rows input-major, xp[start * in + k * MR + i] =
 * x[start + i][k]. Written in order (the tile's rows read side by side): row by row, each write went
 * to another cache line; and by ranges of inputs in the threads, so that neither thread waits while
 * the other packs.
 * Fewer than PACK_IN_THREADS rows are packed before the threads start: their barrier cost more. */
enum { PACK_INPUTS = 64, PACK_IN_THREADS = 8 };
static void pack_rows(const float *x, int64_t x_row, int64_t rows, int64_t in, float *xp, int64_t k0, int64_t k1) {
    for (int64_t t = 0; t < wide_tiles(rows); t++) {
        const int64_t start = wide_start(rows, t), mr = wide_start(rows, t + 1) - start;
        const float *src = x + start * x_row;
        float *dst = xp + start * in;
        for (int64_t k = k0; k < k1; k++)
            for (int64_t i = 0; i < mr; i++) dst[k * mr + i] = src[i * x_row + k];
    }
}

/* More rows than ROW_SET_BYTES of packed x (a share of L2) go in sets of rows, split as evenly as
 * they go, and the panels pass over one set at a time (each panel de-quantized again per set), so
 * that x is read from L2, not from L3 for every panel. */
enum { ROW_SET_BYTES = 384 * 1024 };
static inline int64_t set_rows(int64_t in) { return ROW_SET_BYTES / 4 / in < 16 ? 16 : ROW_SET_BYTES / 4 / in; }
static inline int64_t row_sets(int64_t rows, int64_t in) { return num_tiles(rows, set_rows(in)); }
static inline int64_t set_start(int64_t rows, int64_t in, int64_t set) { return tile_start(rows, set_rows(in), set); }

static inline __attribute__((always_inline)) void panel_rows_wide(const float *xp, const uint8_t *panel,
                                                                  int64_t blocks, int64_t rows, int64_t in,
                                                                  float *acc, float *w, const int kind) {
    /* one tile keeps its sums in registers over the whole panel; more share each chunk's floats */
    const int64_t tiles = wide_tiles(rows), chunk_blocks = tiles == 1 ? blocks : CHUNK;
    for (int64_t b0 = 0; b0 < blocks; b0 += chunk_blocks) {
        const int64_t nb = blocks - b0 < chunk_blocks ? blocks - b0 : chunk_blocks;
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t start = wide_start(rows, t), mr = wide_start(rows, t + 1) - start;
            const float *xt = xp + start * in + b0 * 32 * mr;
            float *at = acc + start * 16;
            const int first = b0 == 0, keep = tiles > 1;
            switch (mr) {
#define WIDE_CASE(n)                                                    \
    case n:                                                             \
        if (t == 0) wide_tile(xt, panel, b0, w, at, first, nb, n, 1, keep, kind); \
        else wide_tile(xt, panel, b0, w, at, first, nb, n, 0, 0, kind);     \
        break;
                WIDE_CASE(2) WIDE_CASE(3) WIDE_CASE(4) WIDE_CASE(5) WIDE_CASE(6) WIDE_CASE(7) WIDE_CASE(8) WIDE_CASE(9) WIDE_CASE(10)
                WIDE_CASE(11) WIDE_CASE(12) WIDE_CASE(13) WIDE_CASE(14) WIDE_CASE(15) WIDE_CASE(16)
#undef WIDE_CASE
                default: break; /* FEW_ROWS < rows: every tile has 2 to WIDE_TILE rows */
            }
        }
    }
}
#endif

#ifndef __AVX512F__
/* up to FEW_ROWS rows of x times one panel, widened in registers (rows_panel, n a constant) */
static inline __attribute__((always_inline)) void widen_tile(const float *x, int64_t x_row, const float *xsum,
                                                             const uint8_t *panel, int64_t blocks, int64_t n,
                                                             float *acc, const int kind) {
    switch (n) {
        case 1: rows_panel(x, x_row, xsum, panel, blocks, acc, 1, kind); break;
        case 2: rows_panel(x, x_row, xsum, panel, blocks, acc, 2, kind); break;
        case 3: rows_panel(x, x_row, xsum, panel, blocks, acc, 3, kind); break;
        case 4: rows_panel(x, x_row, xsum, panel, blocks, acc, 4, kind); break;
        case 5: rows_panel(x, x_row, xsum, panel, blocks, acc, 5, kind); break;
        default: rows_panel(x, x_row, xsum, panel, blocks, acc, 6, kind); break;
    }
}
#endif

/* rows of x times one panel: a few rows widen the weights in registers (the panel
 * stays in L1); more rows de-quantize each block once into floats and reuse it for all rows */
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t x_row, const float *xsum,
                                                             const uint8_t *panel, int64_t blocks, int64_t rows,
                                                             float *acc, float *w, const int kind) {
    if (rows <= WIDEN_ROWS) {
#ifdef __AVX512F__
        for (int64_t r = 0; r < rows; r++)
            row_panel16(x + r * x_row, xsum + r * blocks * scale_parts(kind), panel, blocks, acc + r * 16, kind);
#else
        for (int64_t m = 0; m < rows; m += FEW_ROWS)  /* tiles of FEW_ROWS, each widening the weights again */
            widen_tile(x + m * x_row, x_row, xsum + m * blocks * scale_parts(kind), panel, blocks,
                       rows - m < FEW_ROWS ? rows - m : FEW_ROWS, acc + m * 16, kind);
#endif
        return;
    }
    /* the last 1 or 2 rows (rows % 6) de-quantize each chunk as they go, the others take its floats */
    const int64_t lead = rows % 6 == 1 || rows % 6 == 2 ? rows % 6 : 0, tiled = rows - lead;
    for (int64_t b0 = 0; b0 < blocks; b0 += CHUNK) {
        const int64_t nb = blocks - b0 < CHUNK ? blocks - b0 : CHUNK, kn = nb * 32;
        const float *xb = x + b0 * 32;
        if (lead == 1) lead_tile(xb + tiled * x_row, x_row, panel, b0, nb, w, acc + tiled * 16, 16, b0 == 0, 1, kind);
        else if (lead == 2) lead_tile(xb + tiled * x_row, x_row, panel, b0, nb, w, acc + tiled * 16, 16, b0 == 0, 2, kind);
        else
            for (int64_t b = 0; b < nb; b++) dequant_block(panel, b0 + b, w + b * 512, kind);
        int64_t m = 0;
        for (; m + 6 <= tiled; m += 6) block_tile(xb + m * x_row, x_row, w, acc + m * 16, 16, b0 == 0, kn, 6);
        const float *xm = xb + m * x_row;
        float *am = acc + m * 16;
        switch (tiled - m) {
            case 5: block_tile(xm, x_row, w, am, 16, b0 == 0, kn, 5); break;
            case 4: block_tile(xm, x_row, w, am, 16, b0 == 0, kn, 4); break;
            case 3: block_tile(xm, x_row, w, am, 16, b0 == 0, kn, 3); break;
            case 2: block_tile(xm, x_row, w, am, 16, b0 == 0, kn, 2); break;
            case 1: block_tile(xm, x_row, w, am, 16, b0 == 0, kn, 1); break;
            default: break;
        }
    }
}

/* acc: acc_stride(rows) floats per thread, for one panel's outputs of every row */
static inline __attribute__((always_inline)) void qlinear(const float *x, int64_t x_row, const float *xsum,
                                                          float *xp, const uint8_t *panels, const float *bias,
                                                          float *y, int64_t rows, int64_t out, int64_t in,
                                                          int threads, float *acc_all, const int kind) {
    const int64_t num_panels = (out + 15) / 16, blocks = in / 32, panel_bytes = blocks * block_bytes(kind);
#ifndef __AVX512F__
    (void)xp; /* NULL: the wide tiles are AVX-512's */
#endif
    #pragma omp parallel num_threads(threads)
    {
        float w[CHUNK * 32 * 16] __attribute__((aligned(64)));
        float *acc = acc_all + (size_t)omp_get_thread_num() * (size_t)acc_stride(rows);
        int64_t sets = 1;  /* sets of rows (AVX-512's wide tiles): more than one take the loops below */
#ifdef __AVX512F__
        sets = xp ? row_sets(rows, in) : 1;
        if (xp && rows >= PACK_IN_THREADS) {  /* every panel reads all of xp: the loop's barrier waits for it */
            #pragma omp for schedule(static)
            for (int64_t k0 = 0; k0 < in; k0 += PACK_INPUTS)
                for (int64_t set = 0; set < sets; set++) { /* each set packed as its own rows */
                    const int64_t r0 = set_start(rows, in, set), r1 = set_start(rows, in, set + 1);
                    pack_rows(x + r0 * x_row, x_row, r1 - r0, in, xp + r0 * in, k0, k0 + PACK_INPUTS < in ? k0 + PACK_INPUTS : in);
                }
        }
        for (int64_t set = 0; set < (sets > 1 ? sets : 0); set++) {  /* the threads go on to the next set unwaited */
            const int64_t r0 = set_start(rows, in, set), r1 = set_start(rows, in, set + 1);
            #pragma omp for schedule(guided) nowait
            for (int64_t p = 0; p < num_panels; p++) {
                const uint8_t *panel = panels + p * panel_bytes;
#define SET_ROWS(K) panel_rows_wide(xp + r0 * in, panel, blocks, r1 - r0, in, acc, w, K)
                PER_KIND(kind, SET_ROWS)
#undef SET_ROWS
                store_panel(acc, bias, y + r0 * out, r1 - r0, out, p);
            }
        }
#endif
        #pragma omp for schedule(guided)
        for (int64_t p = 0; p < (sets == 1 ? num_panels : 0); p++) {
            /* the kind as a constant here (PER_KIND): the region is outlined before qlinear is inlined
               into each of its callers, so a kind passed in would stay a variable in every inner loop */
            const uint8_t *panel = panels + p * panel_bytes;
#ifdef __AVX512F__
            if (xp) {
#define WIDE_ROWS(K) panel_rows_wide(xp, panel, blocks, rows, in, acc, w, K)
                PER_KIND(kind, WIDE_ROWS)
#undef WIDE_ROWS
                store_panel(acc, bias, y, rows, out, p);
                continue;
            }
#endif
#define ROWS(K) panel_rows(x, x_row, xsum, panel, blocks, rows, acc, w, K)
            PER_KIND(kind, ROWS)
#undef ROWS
            store_panel(acc, bias, y, rows, out, p);
        }
    }
}

/* kind: 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_1, 4 Q6_K, 5 Q4_K, 6 Q6_KS (the layouts above, blocks.h);
 * returns 0, -1 when out of memory, -2 for another kind (or super-blocks with inputs not a multiple
 * of 256) */
int rill_qlinear(const float *x, int64_t x_row, const uint8_t *panels, const float *bias, float *y,
                 int64_t rows, int64_t out, int64_t in, int threads, int kind) {
    const int64_t blocks = in / 32;
    if (kind < 0 || kind >= NUM_KINDS || (is_super(kind) && in % 256)) return -2;
    if (rows <= 0) return 0;
    const int tiles = rill_qlinear_amx(x, x_row, panels, bias, y, rows, out, in, threads, kind);
    if (tiles != -3) return tiles;
    /* the offsets and minimums need each row's sum of x per block (Q6_K: per 16 inputs), on the
     * row-by-row path only (not Q8_0's or Q6_KS's weights, which are their values) */
    const int parts = scale_parts(kind), span = 32 / parts;
    const int64_t sums = needs_xsum(kind) && rows <= WIDEN_ROWS ? (rows * blocks * parts + 15) / 16 * 16 : 0;
    /* AVX-512: more rows than FEW_ROWS take the wide tiles, on x packed once for all panels */
#ifdef __AVX512F__
    const int64_t packed = rows > FEW_ROWS ? (rows * in + 15) / 16 * 16 : 0;
#else
    const int64_t packed = 0;
#endif
    float *buffer = aligned_alloc(64, sizeof(float) * (size_t)(sums + packed + (int64_t)threads * acc_stride(rows)));
    if (!buffer) return -1;
    float *xsum = buffer, *xp = packed ? buffer + sums : NULL, *acc = buffer + sums + packed;
#ifdef __AVX512F__
    if (xp && rows < PACK_IN_THREADS) pack_rows(x, x_row, rows, in, xp, 0, in);
#endif
    for (int64_t r = 0; r < (sums ? rows : 0); r++)
        for (int64_t i = 0; i < blocks * parts; i++) {
            float s = 0;
            for (int k = 0; k < span; k++) s += x[r * x_row + i * span + k];
            xsum[r * blocks * parts + i] = s;
        }
#define ALL(K) qlinear(x, x_row, xsum, xp, panels, bias, y, rows, out, in, threads, acc, K)
    PER_KIND(kind, ALL)
#undef ALL
    free(buffer);
    return 0;
}

/* up to how many rows this build widens the weights in registers (engine/runner/native.py computes
 * a Q8_0 head whole up to there rather than screening it) */
int rill_qlinear_few_rows(void) { return FEW_ROWS; }
int rill_qlinear_widen_rows(void) { return WIDEN_ROWS; }

/* the vector width this build's float32 block tiles use, for the start-up log: 512 with AVX-512
 * (-march=native on a CPU that has it), 256 with AVX2, else 0 (GCC's generic vectors) */
int rill_qlinear_vector_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 0;
#endif
}
