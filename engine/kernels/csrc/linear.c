/* y = x w^T + bias, float32, for CPUs (built by engine/kernels/build.py): the nn.Linear layers of a float32
 * model on the CPU run here (EngineConfig packed_linears and linear_kernel, the defaults).
 *
 * The weight is rearranged once, at load, into panels of 16 output features: panel p holds
 * w[16p:16p+16, k] for k = 0..in-1, 16 floats per k, contiguous (the last panel padded with zeros).
 * A tile of up to 6 rows of x times one panel keeps its 6 x 16 outputs in 12 vector registers;
 * each step over k loads 16 weights (two vectors) and broadcasts one x value per row: 12 fused
 * multiply-adds per two loads. The panels stream through the cache in order, each read once per
 * 6 rows of x (against oneDNN's packed matmul: docs/benchmarks-history.md).
 *
 * Panels are handed to the threads `guided` (half of them first, then ever smaller shares): when
 * another thread takes one of the cores for a while (the event loop, a client on the same machine),
 * the thread that kept its core takes the rest instead of waiting for it at the end. The same in
 * qlinear.c and qlinear_i8.c (the schedules compared: docs/benchmarks-history.md).
 *
 * rill_linear16 takes the same panels in bfloat16 or float16 (a checkpoint's own weights, kept). A
 * bfloat16 panel holds each input's 16 weights interleaved, output j beside output 8 + j in one
 * 32-bit lane, so one load and a shift and a mask widen all 16 (rill_pack16 lays them out so).
 *
 * x [rows, in] (row stride x_row, each row contiguous); panels [ceil(out / 16), in, 16];
 * bias [ceil(out / 16) * 16] (zero-padded) or NULL; y [rows, out] contiguous.
 */
#include <stdint.h>
#include <string.h>
#include "rill_kernels.h"
#include "vec8.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* How a panel holds its weights: float32, or 16-bit values widened to float32 exactly as they
 * are loaded (a bfloat16 is a float32 whose low 16 bits are zero; every float16 is a float32), so
 * the products are the float32 model's and a one-row step reads half the bytes. */
enum { W_F32 = 0, W_BF16 = 1, W_F16 = 2 };

/* 16-bit weights ahead of the one- and two-row loops that are asked for, a cache line per two
 * inputs (the distances tried: docs/benchmarks-history.md) */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 1024
#endif

typedef uint32_t u32x8 __attribute__((vector_size(32)));

/* eight weights of a float32 or float16 panel at element offset `at`, as floats */
static inline __attribute__((always_inline)) v8 weights8(const void *panel, int64_t at, const int wt) {
    if (wt == W_F32) return load8((const float *)panel + at);
    const uint16_t *h = (const uint16_t *)panel + at;
#if defined(__F16C__)
    v8 f;
    const __m256 c = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
    memcpy(&f, &c, sizeof f);
    return f;
#else
    v8 f;
    for (int j = 0; j < 8; j++) {
        _Float16 v;
        memcpy(&v, h + j, sizeof v);
        f[j] = (float)v;
    }
    return f;
#endif
}

/* one input's 16 weights at element offset `at`: outputs 0-7 into lo, 8-15 into hi. A bfloat16
 * lane holds output j in its low half and 8 + j in its high half: the low half shifted up and the
 * high half masked are each exactly a float32. */
static inline __attribute__((always_inline)) void weights16(const void *panel, int64_t at, const int wt,
                                                            v8 *lo, v8 *hi) {
    if (wt != W_BF16) {
        *lo = weights8(panel, at, wt);
        *hi = weights8(panel, at + 8, wt);
        return;
    }
    u32x8 v;
    memcpy(&v, (const uint16_t *)panel + at, sizeof v);
    const u32x8 a = v << 16, b = v & 0xFFFF0000u;
    memcpy(lo, &a, sizeof a);
    memcpy(hi, &b, sizeof b);
}

/* MR rows of x (a constant once inlined) times one panel; `cols` of its 16 outputs are real. One or
 * two rows run two inputs at a time into two sets of sums (one set alone waits on each multiply-add
 * before the next), their 16-bit panel's lines asked for ahead. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_row, const void *panel,
                                                       int64_t in, const float *bias, float *y, int64_t y_row,
                                                       int cols, const int MR, const int wt, int from_y) {
    v8 acc[6][2], odd[2][2];
    for (int i = 0; i < MR; i++) {  /* from_y: go on from the sums y holds (16 columns), else from zero */
        acc[i][0] = from_y ? load8(y + i * y_row) : (v8){0};
        acc[i][1] = from_y ? load8(y + i * y_row + 8) : (v8){0};
    }
    for (int i = 0; i < 2; i++) odd[i][0] = odd[i][1] = (v8){0};
    int64_t k = 0;
    if (MR <= 2) {
        for (; k + 2 <= in; k += 2) {
            if (wt != W_F32) __builtin_prefetch((const uint16_t *)panel + k * 16 + PREFETCH_AHEAD, 0, 3);
            v8 w0, w1, u0, u1;
            weights16(panel, k * 16, wt, &w0, &w1);
            weights16(panel, k * 16 + 16, wt, &u0, &u1);
            for (int i = 0; i < MR; i++) {
                const float xi = x[i * x_row + k], xj = x[i * x_row + k + 1];
                const v8 xv = {xi, xi, xi, xi, xi, xi, xi, xi}, xw = {xj, xj, xj, xj, xj, xj, xj, xj};
                acc[i][0] += xv * w0;
                acc[i][1] += xv * w1;
                odd[i][0] += xw * u0;
                odd[i][1] += xw * u1;
            }
        }
        for (int i = 0; i < MR; i++) {
            acc[i][0] += odd[i][0];
            acc[i][1] += odd[i][1];
        }
    }
    for (; k < in; k++) {
        v8 w0, w1;
        weights16(panel, k * 16, wt, &w0, &w1);
        for (int i = 0; i < MR; i++) {
            const float xi = x[i * x_row + k];
            const v8 xv = {xi, xi, xi, xi, xi, xi, xi, xi};
            acc[i][0] += xv * w0;
            acc[i][1] += xv * w1;
        }
    }
    for (int i = 0; i < MR; i++) {
        if (bias) {
            acc[i][0] += load8(bias);
            acc[i][1] += load8(bias + 8);
        }
        if (cols == 16) {
            store8(y + i * y_row, acc[i][0]);
            store8(y + i * y_row + 8, acc[i][1]);
        } else {
            float t[16];
            store8(t, acc[i][0]);
            store8(t + 8, acc[i][1]);
            for (int j = 0; j < cols; j++) y[i * y_row + j] = t[j];
        }
    }
}

/* A few rows (a decode batch) take the inputs KC at a time: each tile of rows finds that stretch of
 * the panel (and of x) in L1 where the tile before it left it, so the panel comes from memory once. */
enum { KC = 256, BLOCK_ROWS = 64 };

/* one panel's outputs for `rows` rows over `in` inputs: tiles of 6 rows, then the rest */
static inline __attribute__((always_inline)) void tiles(const float *x, int64_t x_row, const void *panel,
                                                        const float *b, float *yp, int64_t y_row, int64_t rows,
                                                        int64_t in, int cols, const int wt, int from_y) {
    int64_t m = 0;
    for (; m + 6 <= rows; m += 6) tile(x + m * x_row, x_row, panel, in, b, yp + m * y_row, y_row, cols, 6, wt, from_y);
    const float *xm = x + m * x_row;
    float *ym = yp + m * y_row;
    switch (rows - m) {
        case 5: tile(xm, x_row, panel, in, b, ym, y_row, cols, 5, wt, from_y); break;
        case 4: tile(xm, x_row, panel, in, b, ym, y_row, cols, 4, wt, from_y); break;
        case 3: tile(xm, x_row, panel, in, b, ym, y_row, cols, 3, wt, from_y); break;
        case 2: tile(xm, x_row, panel, in, b, ym, y_row, cols, 2, wt, from_y); break;
        case 1: tile(xm, x_row, panel, in, b, ym, y_row, cols, 1, wt, from_y); break;
        default: break;
    }
}

static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t x_row, const void *panel,
                                                             const float *b, float *yp, int64_t rows, int64_t out,
                                                             int64_t in, int cols, const int wt) {
    if (rows <= 6 || rows > BLOCK_ROWS || in <= KC) {  /* one tile, or enough tiles to be bound by multiply-adds */
        tiles(x, x_row, panel, b, yp, out, rows, in, cols, wt, 0);
        return;
    }
    float acc[BLOCK_ROWS * 16] __attribute__((aligned(32)));
    const int64_t size = wt == W_F32 ? 4 : 2;
    for (int64_t k0 = 0; k0 < in; k0 += KC) {
        const int64_t kn = in - k0 < KC ? in - k0 : KC;
        tiles(x + k0, x_row, (const uint8_t *)panel + k0 * 16 * size, k0 + kn == in ? b : 0, acc, 16, rows, kn, 16,
              wt, k0 > 0);
    }
    for (int64_t i = 0; i < rows; i++) memcpy(yp + i * out, acc + i * 16, (size_t)cols * sizeof(float));
}

/* every panel's tiles. The parallel region is outlined before this is inlined into its callers, so
 * `wt` is a variable inside it: each type is named as a constant below, one specialized copy each. */
static void panels_times(const float *x, int64_t x_row, const void *panels, const float *bias, float *y,
                         int64_t rows, int64_t out, int64_t in, int threads, const int wt) {
    const int64_t num_panels = (out + 15) / 16, size = wt == W_F32 ? 4 : 2;
    #pragma omp parallel for schedule(guided) num_threads(threads)
    for (int64_t p = 0; p < num_panels; p++) {
        const void *panel = (const uint8_t *)panels + p * in * 16 * size;
        const float *b = bias ? bias + p * 16 : 0;
        const int cols = out - p * 16 < 16 ? (int)(out - p * 16) : 16;
        float *yp = y + p * 16;
        if (wt == W_BF16) panel_rows(x, x_row, panel, b, yp, rows, out, in, cols, W_BF16);
        else if (wt == W_F16) panel_rows(x, x_row, panel, b, yp, rows, out, in, cols, W_F16);
        else panel_rows(x, x_row, panel, b, yp, rows, out, in, cols, W_F32);
    }
}

void rill_linear(const float *x, int64_t x_row, const float *panels, const float *bias, float *y,
                 int64_t rows, int64_t out, int64_t in, int threads) {
    panels_times(x, x_row, panels, bias, y, rows, out, in, threads, W_F32);
}

void rill_linear16(const float *x, int64_t x_row, const uint16_t *panels, const float *bias, float *y,
                   int64_t rows, int64_t out, int64_t in, int threads, int half) {
    if (half) panels_times(x, x_row, panels, bias, y, rows, out, in, threads, W_F16);
    else panels_times(x, x_row, panels, bias, y, rows, out, in, threads, W_BF16);
}

/* w [out, in] of 16-bit values (rows in `order`, or NULL: as they are) -> the panels rill_linear16
 * reads, [ceil(out / 16), in, 16], the last panel's missing outputs zero; with `interleave` (bfloat16)
 * each input's 16 values in the order 0, 8, 1, 9, ..., 7, 15. A full panel goes 8 inputs at a time:
 * its 16 rows' 8 values each, two 8 x 8 transposes (SSE2), 16 values per input. */
#if defined(__SSE2__)
#include <emmintrin.h>
/* 8 rows of 8 values -> r[k]: value k of each row (pairs, then pairs of pairs, then halves interleaved) */
static inline void transpose8x8(__m128i r[8]) {
    __m128i a[8], b[8];
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        b[4 * i] = _mm_unpacklo_epi32(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm_unpackhi_epi32(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm_unpacklo_epi32(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm_unpackhi_epi32(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {  /* r[k] = inputs k of the 8 rows */
        r[2 * i] = _mm_unpacklo_epi64(b[i], b[4 + i]);
        r[2 * i + 1] = _mm_unpackhi_epi64(b[i], b[4 + i]);
    }
}
#endif

void rill_pack16(const uint16_t *w, int64_t out, int64_t in, const int64_t *order, uint16_t *panels, int threads,
                 int interleave) {
    const int64_t num_panels = (out + 15) / 16;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < num_panels; p++) {
        uint16_t *dst = panels + p * in * 16;
        const uint16_t *src[16];
        int real = 0;
        for (int j = 0; j < 16; j++) {
            const int64_t o = p * 16 + j;
            src[j] = o < out ? w + (order ? order[o] : o) * in : 0;
            real += o < out;
        }
        int64_t k = 0;
#if defined(__SSE2__)
        if (real == 16)
            for (; k + 8 <= in; k += 8) {
                __m128i lo[8], hi[8];
                for (int j = 0; j < 8; j++) {
                    lo[j] = _mm_loadu_si128((const __m128i *)(src[j] + k));
                    hi[j] = _mm_loadu_si128((const __m128i *)(src[8 + j] + k));
                }
                transpose8x8(lo);
                transpose8x8(hi);
                for (int i = 0; i < 8; i++) {
                    const __m128i a = interleave ? _mm_unpacklo_epi16(lo[i], hi[i]) : lo[i];
                    const __m128i b = interleave ? _mm_unpackhi_epi16(lo[i], hi[i]) : hi[i];
                    _mm_storeu_si128((__m128i *)(dst + (k + i) * 16), a);
                    _mm_storeu_si128((__m128i *)(dst + (k + i) * 16 + 8), b);
                }
            }
#endif
        for (; k < in; k++)
            for (int j = 0; j < 16; j++) dst[k * 16 + (interleave ? j % 8 * 2 + j / 8 : j)] = src[j] ? src[j][k] : 0;
    }
}
