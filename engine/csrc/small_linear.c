/* y = x w^T + bias for a few rows of x, float32, for CPUs (built by engine/cpu.py).
 *
 * A decode step of a few sequences multiplies a handful of rows by every weight of the model:
 * the time goes into reading the weights from memory. oneDNN's packed matmul reaches about half
 * the machine's read bandwidth there (2 cores, AVX2: 6-11 GB/s against 18); this reads each weight
 * row once, four rows at a time in the layout nn.Linear keeps them, and multiplies them with up
 * to three rows of x held in registers (12 vector accumulators), so it streams at 10-19 GB/s.
 * Above about 16 rows of x, oneDNN's blocked kernel is faster and the engine uses it.
 *
 * x [rows, in] (row stride x_row, contiguous rows), w [out, in] contiguous, bias [out] or NULL,
 * y [rows, out] contiguous.
 */
#include <stdint.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum8(v8 a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* MR rows of x against NR rows of w (MR <= 3, NR <= 4, both constants once inlined) */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_row, const float *w, int64_t in,
                                                       const float *bias, float *y, int64_t y_row,
                                                       const int MR, const int NR) {
    v8 acc[3][4];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = (v8){0};
    int64_t k = 0;
    for (; k + 8 <= in; k += 8) {
        v8 wv[4];
        for (int j = 0; j < NR; j++) wv[j] = load8(w + j * in + k);
        for (int i = 0; i < MR; i++) {
            const v8 xv = load8(x + i * x_row + k);
            for (int j = 0; j < NR; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            float s = sum8(acc[i][j]);
            for (int64_t t = k; t < in; t++) s += x[i * x_row + t] * w[j * in + t];
            y[i * y_row + j] = bias ? s + bias[j] : s;
        }
}

/* every row of x against NR rows of w */
static inline __attribute__((always_inline)) void columns(const float *x, int64_t x_row, const float *w,
                                                          int64_t in, const float *bias, float *y, int64_t rows,
                                                          int64_t out, const int NR) {
    int64_t m = 0;
    for (; m + 3 <= rows; m += 3) tile(x + m * x_row, x_row, w, in, bias, y + m * out, out, 3, NR);
    if (rows - m == 2) tile(x + m * x_row, x_row, w, in, bias, y + m * out, out, 2, NR);
    else if (rows - m == 1) tile(x + m * x_row, x_row, w, in, bias, y + m * out, out, 1, NR);
}

void rill_small_linear(const float *x, int64_t x_row, const float *w, const float *bias, float *y,
                       int64_t rows, int64_t out, int64_t in, int threads) {
    const int64_t blocks = (out + 3) / 4;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n = b * 4;
        const float *wb = w + n * in, *bb = bias ? bias + n : 0;
        if (out - n >= 4) {
            columns(x, x_row, wb, in, bb, y + n, rows, out, 4);
        } else {
            for (int64_t j = n; j < out; j++)
                columns(x, x_row, w + j * in, in, bias ? bias + j : 0, y + j, rows, out, 1);
        }
    }
}
