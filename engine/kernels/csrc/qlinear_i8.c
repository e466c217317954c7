/* y = x w^T + bias for block-quantized weights with int8 activations, as llama.cpp computes
 * them (built by engine/kernels/build.py). Lossy: each block of 32 inputs of a row of x is rounded to int8
 * with its own scale (dx = max |x| / 127), so the result differs from the float32 product by that
 * rounding (top-1 agreement and KL against float32: `python -m bench.divergence`).
 *
 * A block's dot product is then exact integer arithmetic: sum_k q_k xq_k, from which
 *   Q8_0: d dx sum(q xq)          Q4_0: d dx (sum(q xq) - 8 sum(xq))
 *   Q4_1, Q5_1: d dx sum(q xq) + m dx sum(xq)
 *   Q6_K: the same as Q4_0's per half of the block (inputs 0-15, 16-31), with its d and 32
 *
 * Weights: panels of 16 outputs as two halves of 8 (one 8-lane vector of int32 sums each); in a
 * half, 32-bit lane j holds 4 consecutive inputs of output j, as the byte dot products
 * (vpmaddubsw on AVX2, vpdpbusd with VNNI) want them:
 *   Q8_0  per block: half h, group g (inputs 4g..4g+3): int8 [8 outputs][4]     2 x 8 x 32 bytes
 *   Q4_x  per block: half h, vector v: byte [j][b] low nibble input 4v + b, high nibble 16 + 4v + b
 *                                                                                 2 x 4 x 32 bytes
 *   Q5_1  Q4's nibbles, then per half h: byte [j][b] bit v input 4v + b's fifth bit, bit 4 + v
 *         input 16 + 4v + b's                                                     2 x 32 bytes
 *   Q6_K  Q4's nibbles, then per half h, pair of vectors w: byte [j][b] bits 4o, 4o + 1 the high
 *         bits of input 4(2w + o) + b, bits 4o + 2, 4o + 3 input 16 + 4(2w + o) + b's  2 x 2 x 32 bytes
 *   then float d[16] (Q4_1, Q5_1: and m[16]; Q6_K: d[2][16]): the same bytes per block as
 *   csrc/qlinear.c's layout. The bits above the nibbles are put in place with shifts and masks
 *   before the dot products: their weights are bytes of 0..31 or 0..63 like Q4's 0..15.
 * x [rows, in] (row stride x_row); in a multiple of 32; bias [ceil(out / 16) * 16] or NULL.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include "rill_kernels.h"
#include <stdlib.h>
#include <string.h>
#include "blocks.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* one row of x -> xq [in] int8, its scale dx, sum(xq), dx sum(xq) and the sum of xq over inputs
 * 16-31 (xh, for Q6_K's halves) per block (ggml's rounding: nearest) */
static void quantize_row(const float *x, int64_t in, int8_t *xq, float *dx, int32_t *xs, float *dxs, int32_t *xh) {
    for (int64_t b = 0; b < in / 32; b++) {
        const float d = round_block(x + b * 32, xq + b * 32);
        int32_t sum = 0, high = 0;
        for (int k = 0; k < 32; k++) sum += xq[b * 32 + k];
        for (int k = 16; k < 32; k++) high += xq[b * 32 + k];
        dx[b] = d, xs[b] = sum, dxs[b] = d * (float)sum, xh[b] = high;
    }
}

/* The bytes of vector v (inputs 4v + b, low nibbles; 16 + 4v + b, high nibbles) of a Q5_1 or Q6_K
 * block's half, completed: lo, hi (each byte's nibble) |= the bits above it, from the 32 bytes h
 * of the high plane that hold them (Q5_1: the half's; Q6_K: those of its pair w = v / 2). The
 * 16-bit shifts bring no bit into bits 4-5 of a byte from the other byte. */
#ifdef __AVX2__
static inline __attribute__((always_inline)) void high_bits(__m256i h, int v, __m256i *lo, __m256i *hi,
                                                            const int kind) {
    if (kind == Q5_1) {
        const __m256i bit = _mm256_set1_epi8(0x10);
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_slli_epi16(h, 4 - v), bit));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_srli_epi16(h, v), bit));
    } else {
        const __m256i bits = _mm256_set1_epi8(0x30);
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(v % 2 ? h : _mm256_slli_epi16(h, 4), bits));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(v % 2 ? _mm256_srli_epi16(h, 2) : _mm256_slli_epi16(h, 2), bits));
    }
}
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
static inline __attribute__((always_inline)) void high_bits16(__m512i h, int v, __m512i *lo, __m512i *hi,
                                                              const int kind) {
    if (kind == Q5_1) {
        const __m512i bit = _mm512_set1_epi8(0x10);
        *lo = _mm512_or_si512(*lo, _mm512_and_si512(_mm512_slli_epi16(h, 4 - v), bit));
        *hi = _mm512_or_si512(*hi, _mm512_and_si512(_mm512_srli_epi16(h, v), bit));
    } else {
        const __m512i bits = _mm512_set1_epi8(0x30);
        *lo = _mm512_or_si512(*lo, _mm512_and_si512(v % 2 ? h : _mm512_slli_epi16(h, 4), bits));
        *hi = _mm512_or_si512(*hi, _mm512_and_si512(v % 2 ? _mm512_srli_epi16(h, 2) : _mm512_slli_epi16(h, 2), bits));
    }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* AVX-512 VNNI: a panel's 16 outputs are one zmm register of int32 sums (its two halves' vectors
 * side by side), so each byte dot product covers the whole panel, and a tile keeps one integer and
 * one float sum per row for up to WIDE_TILE rows, of 32 registers. The rows are split evenly into
 * tiles; the panel's blocks stay in L1 for the tiles after the first. Bit for bit the sums of the
 * 8-lane path below (the same integers, scaled in the same order). */
enum { WIDE_TILE = 12 };


#define KEEP(v) __asm__("" : "+v"(v))  /* as below: no reassociation of a tile's sums */

/* four inputs of a row of xq, in every 32-bit lane */
static inline __m512i four16(const int8_t *xq) {
    int32_t v;
    memcpy(&v, xq, 4);
    return _mm512_set1_epi32(v);
}

/* the 32-byte vector at blk (outputs 0-7) and its other half's at blk + half (outputs 8-15) */
static inline __m512i both_halves(const uint8_t *blk, int64_t half) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)blk)),
                              _mm256_loadu_si256((const __m256i *)(blk + half)), 1);
}

/* R rows (xq from x, row r at x + r * in; its block scalars at r * blocks) times one panel ->
 * acc [R][16]. Q6_K keeps the sums of its two halves apart (t, t2: their d differ) */
static inline __attribute__((always_inline)) void wide_tile(const int8_t *xq, const float *dx, const float *dxs,
                                                            const int32_t *xs, const int32_t *xh,
                                                            const uint8_t *panel, int64_t blocks, int64_t in,
                                                            float *acc, int fetch, const int R, const int kind) {
    const int offset = kind == Q8_0 ? 128 : q_offset(kind);
    const __m512i low = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    __m512 y[WIDE_TILE];
    for (int r = 0; r < R; r++) y[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = panel + b * block_bytes(kind);
        if (fetch) prefetch_ahead(blk, kind);
        const float *scales = (const float *)(blk + scales_at(kind));
        const int8_t *xb = xq + b * 32;
        __m512i t[WIDE_TILE], t2[WIDE_TILE];
        for (int r = 0; r < R; r++) t[r] = t2[r] = _mm512_setzero_si512();
        if (kind == Q8_0) {
            for (int g = 0; g < 8; g++) {  /* q + 128, unsigned: the sums are corrected by 128 sum(xq) */
                const __m512i u = _mm512_xor_si512(both_halves(blk + g * 32, 256), flip);
                for (int r = 0; r < R; r++) {
                    t[r] = _mm512_dpbusd_epi32(t[r], u, four16(xb + r * in + 4 * g));
                    KEEP(t[r]);
                }
            }
        } else {
            for (int v = 0; v < 4; v++) {  /* vector v: inputs 4v..4v+3 (low nibbles) and 16 + 4v.. (high) */
                const __m512i p = both_halves(blk + v * 32, 128);
                __m512i lo = _mm512_and_si512(p, low), hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
                if (kind == Q5_1) high_bits16(both_halves(blk + 256, 32), v, &lo, &hi, kind);
                if (kind == Q6_K) high_bits16(both_halves(blk + 256 + (v / 2) * 32, 64), v, &lo, &hi, kind);
                for (int r = 0; r < R; r++) {
                    const int8_t *xr = xb + r * in;
                    if (kind == Q6_K) {
                        t[r] = _mm512_dpbusd_epi32(t[r], lo, four16(xr + 4 * v));
                        t2[r] = _mm512_dpbusd_epi32(t2[r], hi, four16(xr + 16 + 4 * v));
                        KEEP(t2[r]);
                    } else {
                        t[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(t[r], lo, four16(xr + 4 * v)), hi,
                                                   four16(xr + 16 + 4 * v));
                    }
                    KEEP(t[r]);
                }
            }
        }
        const __m512 d = _mm512_loadu_ps(scales);
        for (int r = 0; r < R; r++) {  /* y += float(s - offset xs) (d dx)  (Q4_1, Q5_1: then y += m (dx xs)) */
            const int64_t rb = r * blocks + b;
            const __m512 rdx = _mm512_set1_ps(dx[rb]);
            if (kind == Q6_K) {  /* each half: its sum less 32 times its sum of xq */
                const __m512i s = _mm512_sub_epi32(t[r], _mm512_set1_epi32(offset * (xs[rb] - xh[rb])));
                const __m512i s2 = _mm512_sub_epi32(t2[r], _mm512_set1_epi32(offset * xh[rb]));
                y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, rdx), y[r]);
                y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2), _mm512_mul_ps(_mm512_loadu_ps(scales + 16), rdx), y[r]);
                continue;
            }
            __m512i s = t[r];
            if (offset) s = _mm512_sub_epi32(s, _mm512_set1_epi32(offset * xs[rb]));
            y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, rdx), y[r]);
            if (has_min(kind)) y[r] = _mm512_fmadd_ps(_mm512_loadu_ps(scales + 16), _mm512_set1_ps(dxs[rb]), y[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(acc + r * 16, y[r]);
}

/* rows per tile: Q6_K's two integer sums per row take more registers (up to 8 rows: 24 of 32) */
static inline int64_t most_rows(const int kind) { return kind == Q6_K ? 8 : WIDE_TILE; }

/* all rows times one panel: acc [rows][16], in even tiles of up to most_rows rows */
static inline __attribute__((always_inline)) void panel_rows(const int8_t *xq, const float *dx, const float *dxs,
                                                             const int32_t *xs, const int32_t *xh,
                                                             const uint8_t *panel, int64_t blocks, int64_t rows,
                                                             int64_t in, float *acc, const int kind) {
    for (int64_t t = 0; t < num_tiles(rows, most_rows(kind)); t++) {
        const int64_t start = tile_start(rows, most_rows(kind), t), o = start * blocks;
        const int8_t *x = xq + start * in;
        float *a = acc + start * 16;
        switch (tile_start(rows, most_rows(kind), t + 1) - start) {
#define WIDE_CASE(n) \
    case n: wide_tile(x, dx + o, dxs + o, xs + o, xh + o, panel, blocks, in, a, t == 0, n, kind); break;
            WIDE_CASE(1) WIDE_CASE(2) WIDE_CASE(3) WIDE_CASE(4) WIDE_CASE(5) WIDE_CASE(6) WIDE_CASE(7) WIDE_CASE(8)
            WIDE_CASE(9) WIDE_CASE(10) WIDE_CASE(11) WIDE_CASE(12)
#undef WIDE_CASE
            default: break;  /* every tile has 1 to most_rows rows */
        }
    }
}
#elif defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#define HAVE_VNNI 1
#elif defined(__AVXVNNI__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#define HAVE_VNNI 1
#endif

#ifdef HAVE_VNNI
enum { Q8_OFFSET = 128 };
#else
enum { Q8_OFFSET = 0 };
#endif

/* v as it is here, in a register: GCC would otherwise reassociate a tile's integer sums over all
 * its rows and groups, keeping dozens of products live at once (spilled to the stack) */
#define KEEP(v) __asm__("" : "+x"(v))

/* A tile: TILE_ROWS rows times both halves of a panel, so each broadcast of a row's inputs serves
 * two byte dot products and each widened weight vector serves TILE_ROWS rows: 12 int16/int32 sums
 * and 6 float ones, in registers: faster than per-row sums kept in memory and than tiles of 2 or 4
 * rows (docs/benchmarks-history.md). */
enum { TILE_ROWS = 3 };

/* four inputs of a row of xq, in every 32-bit lane */
static inline __m256i four(const int8_t *xq) {
    int32_t v;
    memcpy(&v, xq, 4);
    return _mm256_set1_epi32(v);
}

/* s[r][h] = the 8 int32 sums sum_k w[j][k] xq[r][k] of half h of one panel block (before the
 * offset corrections), for the R rows of a tile (row r's xq at x + r * in); Q6_K: over inputs 0-15,
 * and s2 over 16-31. Each weight vector is loaded and widened once for the tile, then serves every
 * row: Q4 as 0..15 (low, high nibbles), Q5_1 and Q6_K as 0..31 and 0..63 (high_bits); Q8 with VNNI
 * as q + 128 (unsigned; the sums are corrected by 128 sum(xq)); Q8 on AVX2 as |q|, q's sign moving
 * onto x (vpmaddubsw takes unsigned times signed). */
static inline __attribute__((always_inline)) void dot_tile(const uint8_t *blk, const int8_t *x, int64_t in,
                                                           __m256i s[TILE_ROWS][2], __m256i s2[TILE_ROWS][2],
                                                           const int R, const int kind) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (kind == Q5_1 || kind == Q6_K) {
        const __m256i low = _mm256_set1_epi8(15);
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++) s[r][h] = s2[r][h] = _mm256_setzero_si256();
        for (int w = 0; w < 2; w++) {  /* two vectors at a time: 4 (Q6_K: 2) products of at most 63 x 127
                                          in each 16-bit sum stay under 2^15 */
#ifndef HAVE_VNNI
            __m256i t[TILE_ROWS][2], t2[TILE_ROWS][2];
            for (int r = 0; r < R; r++)
                for (int h = 0; h < 2; h++) t[r][h] = t2[r][h] = _mm256_setzero_si256();
#endif
            for (int v = 2 * w; v < 2 * w + 2; v++) {
                __m256i lo[2], hi[2];
                for (int h = 0; h < 2; h++) {
                    const __m256i p = _mm256_loadu_si256((const __m256i *)(blk + h * 128 + v * 32));
                    lo[h] = _mm256_and_si256(p, low), hi[h] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
                    const uint8_t *plane = blk + 256 + (kind == Q5_1 ? h * 32 : h * 64 + w * 32);
                    high_bits(_mm256_loadu_si256((const __m256i *)plane), v, &lo[h], &hi[h], kind);
                }
                for (int r = 0; r < R; r++) {
                    const __m256i a = four(x + r * in + 4 * v), b = four(x + r * in + 16 + 4 * v);
                    for (int h = 0; h < 2; h++) {
#ifdef HAVE_VNNI
                        if (kind == Q6_K) {
                            s[r][h] = DPBUSD(s[r][h], lo[h], a);
                            s2[r][h] = DPBUSD(s2[r][h], hi[h], b);
                            KEEP(s2[r][h]);
                        } else {
                            s[r][h] = DPBUSD(DPBUSD(s[r][h], lo[h], a), hi[h], b);
                        }
                        KEEP(s[r][h]);
#else
                        if (kind == Q6_K) {
                            t[r][h] = _mm256_add_epi16(t[r][h], _mm256_maddubs_epi16(lo[h], a));
                            t2[r][h] = _mm256_add_epi16(t2[r][h], _mm256_maddubs_epi16(hi[h], b));
                            KEEP(t2[r][h]);
                        } else {
                            t[r][h] = _mm256_add_epi16(t[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], a),
                                                                                 _mm256_maddubs_epi16(hi[h], b)));
                        }
                        KEEP(t[r][h]);
#endif
                    }
                }
            }
#ifndef HAVE_VNNI
            for (int r = 0; r < R; r++)
                for (int h = 0; h < 2; h++) {
                    s[r][h] = _mm256_add_epi32(s[r][h], _mm256_madd_epi16(t[r][h], ones));
                    if (kind == Q6_K) s2[r][h] = _mm256_add_epi32(s2[r][h], _mm256_madd_epi16(t2[r][h], ones));
                }
#endif
        }
        return;
    }
    if (kind == Q8_0) {
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++) s[r][h] = _mm256_setzero_si256();
        for (int g = 0; g < 8; g++) {
            __m256i w[2], u[2];
            for (int h = 0; h < 2; h++) {
                w[h] = _mm256_loadu_si256((const __m256i *)(blk + h * 256 + g * 32));
#ifdef HAVE_VNNI
                u[h] = _mm256_xor_si256(w[h], _mm256_set1_epi8((char)0x80));
#else
                u[h] = _mm256_abs_epi8(w[h]);  /* products of at most 127 x 127, two per int16 */
#endif
            }
            for (int r = 0; r < R; r++) {
                const __m256i xr = four(x + r * in + 4 * g);
                for (int h = 0; h < 2; h++) {
#ifdef HAVE_VNNI
                    s[r][h] = DPBUSD(s[r][h], u[h], xr);
#else
                    s[r][h] = _mm256_add_epi32(s[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(u[h], _mm256_sign_epi8(xr, w[h])), ones));
#endif
                    KEEP(s[r][h]);
                }
            }
        }
        return;
    }
    const __m256i low = _mm256_set1_epi8(15);
    __m256i t[TILE_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) t[r][h] = _mm256_setzero_si256();
    for (int v = 0; v < 4; v++) {  /* vector v: inputs 4v..4v+3 (low nibbles) and 16 + 4v.. (high) */
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; h++) {
            const __m256i p = _mm256_loadu_si256((const __m256i *)(blk + h * 128 + v * 32));
            lo[h] = _mm256_and_si256(p, low), hi[h] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
        }
        for (int r = 0; r < R; r++) {
            const __m256i a = four(x + r * in + 4 * v), b = four(x + r * in + 16 + 4 * v);
            for (int h = 0; h < 2; h++) {
#ifdef HAVE_VNNI
                t[r][h] = DPBUSD(DPBUSD(t[r][h], lo[h], a), hi[h], b);
#else  /* each int16 holds two products of at most 15 x 127; 8 of them sum to under 2^15 */
                t[r][h] = _mm256_add_epi16(t[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], a),
                                                                     _mm256_maddubs_epi16(hi[h], b)));
#endif
                KEEP(t[r][h]);
            }
        }
    }
#ifdef HAVE_VNNI
    (void)ones;
#endif
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) {
#ifdef HAVE_VNNI
            s[r][h] = t[r][h];
#else
            s[r][h] = _mm256_madd_epi16(t[r][h], ones);
#endif
        }
}

/* a tile of R rows (up to TILE_ROWS) times one panel: acc [R][16] float sums, staying in
 * registers over all blocks, each block's sums scaled in as
 *   y += float(s - offset xs) (d dx)  (Q4_1, Q5_1: then y += m (dx xs); Q6_K: per half)
 * `fetch`: the first tile of the panel asks for the blocks ahead (the later ones find them in cache) */
static inline __attribute__((always_inline)) void tile_rows(const int8_t *xq, const float *dx, const float *dxs,
                                                            const int32_t *xs, const int32_t *xh,
                                                            const uint8_t *panel, int64_t blocks, int64_t in,
                                                            float *acc, int fetch, const int R, const int kind) {
    const int offset = kind == Q8_0 ? Q8_OFFSET : q_offset(kind);
    __m256 y[TILE_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) y[r][h] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = panel + b * block_bytes(kind);
        if (fetch) prefetch_ahead(blk, kind);
        const float *scales = (const float *)(blk + scales_at(kind));
        __m256i s[TILE_ROWS][2], s2[TILE_ROWS][2];
        dot_tile(blk, xq + b * 32, in, s, s2, R, kind);
        for (int r = 0; r < R; r++) {  /* row r's block scalars, then both halves */
            const int64_t rb = r * blocks + b;
            /* Q6_K: the offset of inputs 0-15 here, of 16-31 below */
            const __m256i off = _mm256_set1_epi32(offset * (kind == Q6_K ? xs[rb] - xh[rb] : xs[rb]));
            const __m256 rdx = _mm256_set1_ps(dx[rb]), rdxs = _mm256_set1_ps(dxs[rb]);
            for (int h = 0; h < 2; h++) {
                if (offset) s[r][h] = _mm256_sub_epi32(s[r][h], off);
                const __m256 d = _mm256_loadu_ps(scales + h * 8);
                y[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h]), _mm256_mul_ps(d, rdx), y[r][h]);
                if (has_min(kind)) y[r][h] = _mm256_fmadd_ps(_mm256_loadu_ps(scales + 16 + h * 8), rdxs, y[r][h]);
                if (kind == Q6_K) {
                    const __m256i high = _mm256_sub_epi32(s2[r][h], _mm256_set1_epi32(offset * xh[rb]));
                    const __m256 e = _mm256_loadu_ps(scales + 16 + h * 8);
                    y[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(high), _mm256_mul_ps(e, rdx), y[r][h]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(acc + r * 16 + h * 8, y[r][h]);
}

/* all rows times one panel: acc [rows][16], in tiles of TILE_ROWS rows (the last one 1-2); Q6_K in
 * tiles of 2, whose two sets of sums (inputs 0-15, 16-31) fit the registers better */
static inline __attribute__((always_inline)) void panel_rows(const int8_t *xq, const float *dx, const float *dxs,
                                                             const int32_t *xs, const int32_t *xh,
                                                             const uint8_t *panel, int64_t blocks, int64_t rows,
                                                             int64_t in, float *acc, const int kind) {
    const int most = kind == Q6_K ? 2 : TILE_ROWS;
    for (int64_t r = 0; r < rows; r += most) {
        const int64_t o = r * blocks;
        const int8_t *x = xq + r * in;
        float *a = acc + r * 16;
        const int64_t left = rows - r;
        if (left == 1) tile_rows(x, dx + o, dxs + o, xs + o, xh + o, panel, blocks, in, a, r == 0, 1, kind);
        else if (left == 2 || most == 2) tile_rows(x, dx + o, dxs + o, xs + o, xh + o, panel, blocks, in, a, r == 0, 2, kind);
        else tile_rows(x, dx + o, dxs + o, xs + o, xh + o, panel, blocks, in, a, r == 0, TILE_ROWS, kind);
    }
}
#else
/* the integer weight of output o at input k of a block (the layouts above), less its offset */
static inline int q_at(const uint8_t *blk, int o, int k, const int kind) {
    const int half = o / 8, j = o % 8, v = (k % 16) / 4, b = k % 4, second = k >= 16;
    if (kind == Q8_0) return (int8_t)blk[half * 256 + (k / 4) * 32 + j * 4 + b];
    const uint8_t byte = blk[half * 128 + v * 32 + j * 4 + b];
    int q = second ? byte >> 4 : byte & 15;
    if (kind == Q5_1) q |= ((blk[256 + half * 32 + j * 4 + b] >> (v + 4 * second)) & 1) << 4;
    if (kind == Q6_K) q |= ((blk[256 + half * 64 + (v / 2) * 32 + j * 4 + b] >> (4 * (v % 2) + 2 * second)) & 3) << 4;
    return q - q_offset(kind);
}

/* portable: the same sums, one output at a time (each half of a Q6_K block with its d) */
static inline void panel_rows(const int8_t *xq, const float *dx, const float *dxs, const int32_t *xs,
                              const int32_t *xh, const uint8_t *panel, int64_t blocks, int64_t rows, int64_t in,
                              float *acc, const int kind) {
    (void)xs, (void)xh;  /* the offsets are taken off each weight here */
    const int parts = scale_parts(kind), span = 32 / parts;
    for (int64_t r = 0; r < rows; r++)
        for (int j = 0; j < 16; j++) acc[r * 16 + j] = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = panel + b * block_bytes(kind);
        const float *scales = (const float *)(blk + scales_at(kind));
        for (int64_t r = 0; r < rows; r++) {
            const int64_t rb = r * (in / 32) + b;
            const int8_t *x = xq + r * in + b * 32;
            for (int o = 0; o < 16; o++) {
                for (int part = 0; part < parts; part++) {
                    int32_t s = 0;
                    for (int k = part * span; k < (part + 1) * span; k++) s += q_at(blk, o, k, kind) * x[k];
                    acc[r * 16 + o] += scales[16 * part + o] * dx[rb] * (float)s;
                }
                if (has_min(kind)) acc[r * 16 + o] += scales[16 + o] * dxs[rb];
            }
        }
    }
}
#endif

static inline __attribute__((always_inline)) void qlinear_i8(const float *x, int64_t x_row, const uint8_t *panels,
                                                             const float *bias, float *y, int64_t rows, int64_t out,
                                                             int64_t in, int threads, int8_t *xq, float *dx,
                                                             float *dxs, int32_t *xs, int32_t *xh, float *acc_all,
                                                             const int kind) {
    const int64_t num_panels = (out + 15) / 16, blocks = in / 32, panel_bytes = blocks * block_bytes(kind);
    /* a few rows are rounded here: in the threads, one would wait at the barrier for the other */
    const int serial = rows <= 4;
    for (int64_t r = 0; r < (serial ? rows : 0); r++)
        quantize_row(x + r * x_row, in, xq + r * in, dx + r * blocks, xs + r * blocks, dxs + r * blocks, xh + r * blocks);
    #pragma omp parallel num_threads(threads)
    {
        if (!serial) {
            #pragma omp for schedule(guided)
            for (int64_t r = 0; r < rows; r++)
                quantize_row(x + r * x_row, in, xq + r * in, dx + r * blocks, xs + r * blocks, dxs + r * blocks,
                             xh + r * blocks);
        }
        float *acc = acc_all + (size_t)omp_get_thread_num() * (size_t)acc_stride(rows);
        #pragma omp for schedule(guided)
        for (int64_t p = 0; p < num_panels; p++) {
            /* the kind as a constant here (see csrc/qlinear.c) */
            const uint8_t *panel = panels + p * panel_bytes;
#define ROWS(K) panel_rows(xq, dx, dxs, xs, xh, panel, blocks, rows, in, acc, K)
            PER_KIND(kind, ROWS)
#undef ROWS
            store_panel(acc, bias, y, rows, out, p);
        }
    }
}

/* kind: 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_1, 4 Q6_K (the layouts above); returns 0, -1 when out of
 * memory, -2 for another kind */
int rill_qlinear_i8(const float *x, int64_t x_row, const uint8_t *panels, const float *bias, float *y,
                    int64_t rows, int64_t out, int64_t in, int threads, int kind) {
    if (kind < 0 || kind >= NUM_KINDS || is_super(kind)) return -2;  /* held as Q4_1 / Q6_K with int8 */
    if (rows <= 0) return 0;
    const int64_t blocks = in / 32;
    /* per thread: acc_stride(rows) sums (blocks.h); per row: xq, dx, dxs, xs, xh (64-byte aligned) */
    const size_t sums = sizeof(float) * (size_t)acc_stride(rows) * threads;
    char *buffer = aligned_alloc(64, (sums + (size_t)rows * ((size_t)in + 16 * (size_t)blocks) + 63) / 64 * 64);
    if (!buffer) return -1;
    float *acc = (float *)buffer, *dx = (float *)(buffer + sums);
    float *dxs = dx + rows * blocks;
    int32_t *xs = (int32_t *)(dxs + rows * blocks), *xh = xs + rows * blocks;
    int8_t *xq = (int8_t *)(xh + rows * blocks);
#define ALL(K) qlinear_i8(x, x_row, panels, bias, y, rows, out, in, threads, xq, dx, dxs, xs, xh, acc, K)
    PER_KIND(kind, ALL)
#undef ALL
    free(buffer);
    return 0;
}
