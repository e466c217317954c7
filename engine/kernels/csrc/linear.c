/* y = x w^T + bias, float32, for CPUs (built by engine/kernels/build.py): the nn.Linear layers of a float32
 * model on the CPU run here (EngineConfig packed_linears and linear_kernel, the defaults).
 *
 * The weight is rearranged once, at load, into panels of 16 output features: panel p holds
 * w[16p:16p+16, k] for k = 0..in-1, 16 floats per k, contiguous (the last panel padded with zeros).
 * A tile of up to 6 rows of x times one panel keeps its 6 x 16 outputs in 12 vector registers;
 * each step over k loads 16 weights (two vectors) and broadcasts one x value per row: 12 fused
 * multiply-adds per two loads. The panels stream through the cache in order, each read once per
 * 6 rows of x. Measured here (2 cores, AVX2) against oneDNN's packed matmul, which is what the
 * engine used before: 1.2-2.7x on the decode steps' 1-64 rows, 0.9-1.3x on 128-512-row prefill.
 *
 * Panels are handed to the threads `guided` (half of them first, then ever smaller shares): when
 * another thread takes one of the cores for a while (the event loop, a client on the same machine),
 * the thread that kept its core takes the rest instead of waiting for it at the end. The same in
 * qlinear.c and qlinear_i8.c. Measured (engine alone, a process waking 1,000 times a second for
 * 50 us beside it): static 13.7 / 40.8 ms a step at 1 / 8 sequences, guided 11.2 / 35.8,
 * dynamic,1 15.7 / 42.9; over HTTP one client 46.7 -> 58.6 tok/s, eight 126.9 -> 142.5.
 *
 * x [rows, in] (row stride x_row, each row contiguous); panels [ceil(out / 16), in, 16];
 * bias [ceil(out / 16) * 16] (zero-padded) or NULL; y [rows, out] contiguous.
 */
#include <stdint.h>
#include "rill_kernels.h"
#include "vec8.h"

/* MR rows of x (a constant once inlined) times one panel; `cols` of its 16 outputs are real */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_row, const float *panel,
                                                       int64_t in, const float *bias, float *y, int64_t y_row,
                                                       int cols, const int MR) {
    v8 acc[6][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = (v8){0};
    for (int64_t k = 0; k < in; k++) {
        const v8 w0 = load8(panel + k * 16), w1 = load8(panel + k * 16 + 8);
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

void rill_linear(const float *x, int64_t x_row, const float *panels, const float *bias, float *y,
                 int64_t rows, int64_t out, int64_t in, int threads) {
    const int64_t num_panels = (out + 15) / 16;
    #pragma omp parallel for schedule(guided) num_threads(threads)
    for (int64_t p = 0; p < num_panels; p++) {
        const float *panel = panels + p * in * 16, *b = bias ? bias + p * 16 : 0;
        const int cols = out - p * 16 < 16 ? (int)(out - p * 16) : 16;
        float *yp = y + p * 16;
        int64_t m = 0;
        for (; m + 6 <= rows; m += 6) tile(x + m * x_row, x_row, panel, in, b, yp + m * out, out, cols, 6);
        const float *xm = x + m * x_row;
        float *ym = yp + m * out;
        switch (rows - m) {
            case 5: tile(xm, x_row, panel, in, b, ym, out, cols, 5); break;
            case 4: tile(xm, x_row, panel, in, b, ym, out, cols, 4); break;
            case 3: tile(xm, x_row, panel, in, b, ym, out, cols, 3); break;
            case 2: tile(xm, x_row, panel, in, b, ym, out, cols, 2); break;
            case 1: tile(xm, x_row, panel, in, b, ym, out, cols, 1); break;
            default: break;
        }
    }
}
