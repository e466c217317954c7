/* y = x w^T + bias for block-quantized weights and float32 activations (built by engine/kernels/build.py).
 *
 * The weights keep their GGUF blocks of 32 inputs (Q8_0: int8 q and a scale d, w = d q; Q4_0:
 * 4-bit q, w = d (q - 8); Q4_1: 4-bit q, a scale d and a minimum m, w = d q + m), rearranged once
 * at load into panels of 16 output features as csrc/linear.c does with float32 weights:
 *
 *   Q8_0  panel p, block b: int8 q[32][16] (input-major), then float d[16]            544 bytes
 *   Q4_x  panel p, block b: uint8 q[32][8], byte j of input k holding output j in its low
 *         nibble and output j + 8 in its high nibble, then float d[16] (Q4_1: and m[16])
 *
 * A tile of up to 6 rows of x times one panel keeps 6 x 16 running sums in registers (AVX2; with
 * AVX-512, tiles of up to 16 rows and a panel in one register: the section further down). Within a
 * block the integer weights are widened to float and multiplied with x in float32; each block's
 * sum is then scaled by d (and Q4_1 adds m times the block's sum of x), so the result equals the
 * float32 product with the de-quantized weights up to the order of the additions.
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

/* FEW_ROWS: up to this many rows widen the weights in registers, row by row (AVX-512: one row;
 * from 2 rows its tiles, which widen each input once for all rows, take less time). CHUNK: more rows
 * de-quantize this many blocks (8 KB of floats, beside 32 rows' 16 KB of x: within L1) before
 * their tiles run over all of them, so a tile loads and stores its sums once per 128 inputs, not
 * per 32: 0.83-0.91x the time of 3072 x 576 / 576 x 1536 at 24 and 32 rows (Q4_1, two threads) */
#ifdef __AVX512F__
enum { FEW_ROWS = 1, CHUNK = 4 };
#else
enum { FEW_ROWS = 3, CHUNK = 4 };
#endif

/* 16 weights of input k, as two vectors of 8 floats (outputs 0-7 and 8-15) */
static inline void widen_q8(const uint8_t *p, v8 *w0, v8 *w1) {
#ifdef __AVX2__
    const __m128i q = _mm_loadu_si128((const __m128i *)p);
    *w0 = (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    *w1 = (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
#else
    for (int j = 0; j < 8; j++) (*w0)[j] = (float)(int8_t)p[j], (*w1)[j] = (float)(int8_t)p[j + 8];
#endif
}

static inline void widen_q4(const uint8_t *p, v8 *w0, v8 *w1) {
#ifdef __AVX2__
    /* each byte widened to 32 bits once: its low nibble is output j, the rest (>> 4) output j + 8 */
    const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *w0 = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(15)));
    *w1 = (v8)_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
#else
    for (int j = 0; j < 8; j++) (*w0)[j] = (float)(p[j] & 15), (*w1)[j] = (float)(p[j] >> 4);
#endif
}

/* input k of a block: its 16 de-quantized weights, as the de-quantized model's are (the same
 * operations wherever the kernels de-quantize, so the same floats) */
typedef struct { v8 d0, d1, m0, m1; } block_scales;

static inline __attribute__((always_inline)) block_scales scales_of(const uint8_t *blk, const int kind) {
    const float *scales = (const float *)(blk + (kind == Q8_0 ? 32 * 16 : 32 * 8));
    block_scales s = {load8(scales), load8(scales + 8), {0}, {0}};
    if (kind == Q4_1) s.m0 = load8(scales + 16), s.m1 = load8(scales + 24);
    return s;
}

static inline __attribute__((always_inline)) void dequant_input(const uint8_t *blk, int k, const block_scales *s,
                                                                v8 *w0, v8 *w1, const int kind) {
    if (kind == Q8_0) widen_q8(blk + k * 16, w0, w1);
    else widen_q4(blk + k * 8, w0, w1);
    if (kind == Q4_0) {
        *w0 -= 8.0f;
        *w1 -= 8.0f;
    }
#ifdef __FMA__
    if (kind == Q4_1) { /* one rounding, written out: GCC contracted it in some callers only */
        *w0 = (v8)_mm256_fmadd_ps((__m256)*w0, (__m256)s->d0, (__m256)s->m0);
        *w1 = (v8)_mm256_fmadd_ps((__m256)*w1, (__m256)s->d1, (__m256)s->m1);
        return;
    }
#endif
    *w0 *= s->d0;
    *w1 *= s->d1;
    if (kind == Q4_1) {
        *w0 += s->m0;
        *w1 += s->m1;
    }
}

/* one panel's block -> its float32 weights w[32][16] */
static inline __attribute__((always_inline)) void dequant_block(const uint8_t *blk, float *w, const int kind) {
    const block_scales s = scales_of(blk, kind);
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
     * set (8 rows, a 6 and a 2 tile: 0.94x the time) */
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

/* The last 1 or 2 rows of a chunk (rows % 6 of them) de-quantize its blocks into w as they go:
 * the same operations as dequant_block, and the same sums as block_tile's, but the widening,
 * whose multiply-adds are few, overlaps the tile's, whose sums alone wait on their latency */
static inline __attribute__((always_inline)) void lead_tile(const float *x, int64_t x_row, const uint8_t *blocks,
                                                            int64_t nb, float *w, float *acc, int64_t acc_row,
                                                            int first, const int MR, const int kind) {
    v8 a[2][2], c[2][2];
    tile_load(acc, acc_row, first, MR, a, c);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = blocks + b * block_bytes(kind);
        prefetch_ahead(blk, kind);
        const block_scales sc = scales_of(blk, kind);
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

/* one row of x times one panel, weights widened in registers: y[j] = sum over blocks of
 * d[j] (q x) + m[j] sum(x); four independent chains over k hide the latency of the additions */
static inline __attribute__((always_inline)) void row_panel(const float *x, const float *xsum, const uint8_t *panel,
                                                            int64_t blocks, float *acc, const int kind) {
    v8 y0 = {0}, y1 = {0};
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = panel + b * block_bytes(kind);
        prefetch_ahead(blk, kind);
        const float *xb = x + b * 32;
        v8 p0[4] = {{0}, {0}, {0}, {0}}, p1[4] = {{0}, {0}, {0}, {0}};
        for (int k = 0; k < 32; k += 4)
            for (int c = 0; c < 4; c++) {
                v8 w0, w1;
                if (kind == Q8_0) widen_q8(blk + (k + c) * 16, &w0, &w1);
                else widen_q4(blk + (k + c) * 8, &w0, &w1);
                const float xi = xb[k + c];
                const v8 xv = {xi, xi, xi, xi, xi, xi, xi, xi};
                p0[c] += xv * w0;
                p1[c] += xv * w1;
            }
        const float *scales = (const float *)(blk + (kind == Q8_0 ? 32 * 16 : 32 * 8));
        const v8 d0 = load8(scales), d1 = load8(scales + 8);
        y0 += d0 * ((p0[0] + p0[1]) + (p0[2] + p0[3]));
        y1 += d1 * ((p1[0] + p1[1]) + (p1[2] + p1[3]));
        if (kind != Q8_0) {
            const float xs = xsum[b];
            const v8 s = {xs, xs, xs, xs, xs, xs, xs, xs};
            const v8 m0 = kind == Q4_1 ? load8(scales + 16) : d0 * -8.0f, m1 = kind == Q4_1 ? load8(scales + 24) : d1 * -8.0f;
            y0 += m0 * s;
            y1 += m1 * s;
        }
    }
    store8(acc, y0);
    store8(acc + 8, y1);
}

#ifdef __AVX512F__
/* AVX-512: a panel's 16 outputs are one zmm register, so a tile of rows keeps one running sum per
 * row (up to WIDE_TILE rows, of 32 registers) and each input costs one multiply-add per row, whose
 * x is broadcast from memory inside the instruction (x packed once per call, input-major within
 * each tile: xp[k][MR]). Zen 5 host, Q4_1, SmolLM2's shapes: 0.56-0.71x the AVX2 tiles' time at 8
 * and 32 rows (bench.qlinear_ab). */
enum { WIDE_TILE = 16 };

/* input k of a block: its 16 integer weights as floats, in output order (Q4: byte j holds output j
 * in its low nibble and output j + 8 in its high one) */
static inline __attribute__((always_inline)) __m512 widen16(const uint8_t *blk, int k, const int kind) {
    if (kind == Q8_0) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + k * 16))));
    const __m128i b = _mm_loadl_epi64((const __m128i *)(blk + k * 8)), low4 = _mm_set1_epi8(15);
    const __m128i nibbles = _mm_unpacklo_epi64(_mm_and_si128(b, low4), _mm_and_si128(_mm_srli_epi16(b, 4), low4));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles));
}

/* integer weights q as floats -> de-quantized, the same operations per lane as dequant_input (so the
 * same floats) */
static inline __attribute__((always_inline)) __m512 scale16(__m512 q, __m512 d, __m512 m, const int kind) {
    if (kind == Q8_0) return _mm512_mul_ps(q, d);
    if (kind == Q4_0) return _mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps(8.0f)), d);
    return _mm512_fmadd_ps(q, d, m);
}

#ifdef __AVX512VBMI__
/* With AVX512-VBMI a Q4 nibble reaches its output's 32-bit lane in one byte permutation (whose mask
 * zeroes the lane's other bytes) instead of widen16's unpack and widening: 0.85-0.88x the time at
 * one row, 0.75-0.78x at 2, 0.93-0.97x at 8. Up to BYTE_PERMUTE_ROWS rows: with more, the index
 * vectors and the rows' sums exceed the 32 registers (16 rows: 1.7-1.9x the time). */
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

/* MR rows (packed: xp[k * MR + i]) times the nb blocks of a chunk, added to the sums in acc
 * [MR][16] (zero at the first chunk). The first tile of a chunk de-quantizes its blocks in
 * registers as it goes (from_blocks), storing the floats into w when other tiles follow (keep);
 * those read w. Under 8 rows the odd inputs go to a second set of sums, added in at the end, so
 * that 8 or more multiply-adds are in flight. */
static inline __attribute__((always_inline)) void wide_tile(const float *xp, const uint8_t *chunk, float *w,
                                                            float *acc, int first, int64_t nb, const int MR,
                                                            const int from_blocks, int keep, const int kind) {
    const int S = MR < 8 ? 2 : 1;
    __m512 a[WIDE_TILE], c[WIDE_TILE];
    for (int i = 0; i < MR; i++) {
        a[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + i * 16);
        c[i] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = chunk + b * block_bytes(kind);
        const float *scales = (const float *)(blk + (kind == Q8_0 ? 32 * 16 : 32 * 8));
        __m512 d = _mm512_setzero_ps(), m = d;
        if (from_blocks) {
            prefetch_ahead(blk, kind);
            d = _mm512_loadu_ps(scales);
            if (kind == Q4_1) m = _mm512_loadu_ps(scales + 16);
        }
        for (int k4 = 0; k4 < 32; k4 += 4) {
            const int by4 = from_blocks && kind != Q8_0 && BYTE_PERMUTE && MR <= BYTE_PERMUTE_ROWS;
            const __m512i nibbles = by4 ? nibbles4(blk, k4) : _mm512_setzero_si512();
            for (int g = 0; g < 4; g++) {
                const int k = k4 + g, s = S == 2 ? g % 2 : 0;
                float *wk = w + b * 512 + k * 16;
                __m512 wv;
                if (from_blocks) {
                    wv = scale16(by4 ? _mm512_cvtepi32_ps(q4_lanes(nibbles, g)) : widen16(blk, k, kind), d, m, kind);
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

/* row_panel on zmm registers, four chains of sums over k: each input's weights widened (widen16),
 * or with VBMI four inputs' nibbles from one 32-byte load, each input's permuted into its lanes */
static inline __attribute__((always_inline)) void row_panel16(const float *x, const float *xsum,
                                                              const uint8_t *panel, int64_t blocks, float *acc,
                                                              const int kind) {
    __m512 y = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = panel + b * block_bytes(kind);
        prefetch_ahead(blk, kind);
        const float *xb = x + b * 32;
        __m512 p[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int k = 0; k < 32; k += 4) {
            const __m512i nibbles = kind != Q8_0 && BYTE_PERMUTE ? nibbles4(blk, k) : _mm512_setzero_si512();
            for (int c = 0; c < 4; c += 2) {
                __m512 w0, w1;
                if (kind != Q8_0 && BYTE_PERMUTE) {
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
        const float *scales = (const float *)(blk + (kind == Q8_0 ? 32 * 16 : 32 * 8));
        const __m512 d = _mm512_loadu_ps(scales);
        y = _mm512_fmadd_ps(d, _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])), y);
        if (kind != Q8_0) {
            const __m512 m = kind == Q4_1 ? _mm512_loadu_ps(scales + 16) : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
            y = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[b]), y);
        }
    }
    _mm512_storeu_ps(acc, y);
}

/* the tiles: rows split as evenly as they go into tiles of at most WIDE_TILE rows (blocks.h) */
static inline int64_t wide_tiles(int64_t rows) { return num_tiles(rows, WIDE_TILE); }
static inline int64_t wide_start(int64_t rows, int64_t t) { return tile_start(rows, WIDE_TILE, t); }

/* inputs [k0, k1) of x [rows, in] -> xp: each tile's rows input-major, xp[start * in + k * MR + i] =
 * x[start + i][k]. Written in order (the tile's rows read side by side): row by row, each write went
 * to another cache line; and by ranges of inputs in the threads: serial, the packing of 32 rows took
 * 4% of a 32-sequence step while the other thread waited (0.87-0.99x the time at 16 and 32 rows).
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
 * they go, and the panels pass over one set at a time (each panel de-quantized again per set): with
 * x read from L3 for every panel, 512 rows ran at 0.92-0.98x the speed of this (960 x 576 to
 * 576 x 1536, Q4_1, bench/qlinear_ab.c, a prompt's chunk of the embedded SmolLM2). */
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
        const uint8_t *chunk = panel + b0 * block_bytes(kind);
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t start = wide_start(rows, t), mr = wide_start(rows, t + 1) - start;
            const float *xt = xp + start * in + b0 * 32 * mr;
            float *at = acc + start * 16;
            const int first = b0 == 0, keep = tiles > 1;
            switch (mr) {
#define WIDE_CASE(n)                                                    \
    case n:                                                             \
        if (t == 0) wide_tile(xt, chunk, w, at, first, nb, n, 1, keep, kind); \
        else wide_tile(xt, chunk, w, at, first, nb, n, 0, 0, kind);     \
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

/* rows of x times one panel: a few rows widen the weights in registers, row by row (the panel
 * stays in L1); more rows de-quantize each block once into floats and reuse it for all rows */
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t x_row, const float *xsum,
                                                             const uint8_t *panel, int64_t blocks, int64_t rows,
                                                             float *acc, float *w, const int kind) {
    if (rows <= FEW_ROWS) {
#ifdef __AVX512F__
        for (int64_t r = 0; r < rows; r++) row_panel16(x + r * x_row, xsum + r * blocks, panel, blocks, acc + r * 16, kind);
#else
        for (int64_t r = 0; r < rows; r++) row_panel(x + r * x_row, xsum + r * blocks, panel, blocks, acc + r * 16, kind);
#endif
        return;
    }
    /* the last 1 or 2 rows (rows % 6) de-quantize each chunk as they go, the others take its floats */
    const int64_t lead = rows % 6 == 1 || rows % 6 == 2 ? rows % 6 : 0, tiled = rows - lead;
    for (int64_t b0 = 0; b0 < blocks; b0 += CHUNK) {
        const int64_t nb = blocks - b0 < CHUNK ? blocks - b0 : CHUNK, kn = nb * 32;
        const float *xb = x + b0 * 32;
        const uint8_t *chunk = panel + b0 * block_bytes(kind);
        if (lead == 1) lead_tile(xb + tiled * x_row, x_row, chunk, nb, w, acc + tiled * 16, 16, b0 == 0, 1, kind);
        else if (lead == 2) lead_tile(xb + tiled * x_row, x_row, chunk, nb, w, acc + tiled * 16, 16, b0 == 0, 2, kind);
        else
            for (int64_t b = 0; b < nb; b++) {
                prefetch_ahead(chunk + b * block_bytes(kind), kind);
                dequant_block(chunk + b * block_bytes(kind), w + b * 512, kind);
            }
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
                if (kind == Q8_0) panel_rows_wide(xp + r0 * in, panel, blocks, r1 - r0, in, acc, w, Q8_0);
                else if (kind == Q4_0) panel_rows_wide(xp + r0 * in, panel, blocks, r1 - r0, in, acc, w, Q4_0);
                else panel_rows_wide(xp + r0 * in, panel, blocks, r1 - r0, in, acc, w, Q4_1);
                store_panel(acc, bias, y + r0 * out, r1 - r0, out, p);
            }
        }
#endif
        #pragma omp for schedule(guided)
        for (int64_t p = 0; p < (sets == 1 ? num_panels : 0); p++) {
            /* the kind as a constant here: the region is outlined before qlinear is inlined into
               each of its callers, so a kind passed in would stay a variable in every inner loop */
            const uint8_t *panel = panels + p * panel_bytes;
#ifdef __AVX512F__
            if (xp) {
                if (kind == Q8_0) panel_rows_wide(xp, panel, blocks, rows, in, acc, w, Q8_0);
                else if (kind == Q4_0) panel_rows_wide(xp, panel, blocks, rows, in, acc, w, Q4_0);
                else panel_rows_wide(xp, panel, blocks, rows, in, acc, w, Q4_1);
                store_panel(acc, bias, y, rows, out, p);
                continue;
            }
#endif
            if (kind == Q8_0) panel_rows(x, x_row, xsum, panel, blocks, rows, acc, w, Q8_0);
            else if (kind == Q4_0) panel_rows(x, x_row, xsum, panel, blocks, rows, acc, w, Q4_0);
            else panel_rows(x, x_row, xsum, panel, blocks, rows, acc, w, Q4_1);
            store_panel(acc, bias, y, rows, out, p);
        }
    }
}

/* kind: 0 Q8_0, 1 Q4_0, 2 Q4_1 (the layouts above); returns 0, or -1 when out of memory */
int rill_qlinear(const float *x, int64_t x_row, const uint8_t *panels, const float *bias, float *y,
                 int64_t rows, int64_t out, int64_t in, int threads, int kind) {
    const int64_t blocks = in / 32;
    if (rows <= 0) return 0;
    /* the Q4 kinds' offsets need each row's sum of x per block, on the row-by-row path only */
    const int64_t sums = kind != Q8_0 && rows <= FEW_ROWS ? (rows * blocks + 15) / 16 * 16 : 0;
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
        for (int64_t b = 0; b < blocks; b++) {
            float s = 0;
            for (int k = 0; k < 32; k++) s += x[r * x_row + b * 32 + k];
            xsum[r * blocks + b] = s;
        }
    if (kind == Q8_0) qlinear(x, x_row, xsum, xp, panels, bias, y, rows, out, in, threads, acc, Q8_0);
    else if (kind == Q4_0) qlinear(x, x_row, xsum, xp, panels, bias, y, rows, out, in, threads, acc, Q4_0);
    else qlinear(x, x_row, xsum, xp, panels, bias, y, rows, out, in, threads, acc, Q4_1);
    free(buffer);
    return 0;
}

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
