/* The block kernels of two builds side by side (bench/qlinear_ab.py compiles this with the
 * sources of a git revision renamed *_a and those of the working tree): one shape, weights from
 * memory (30 different ones, as a model's layers), 40 alternations, medians in microseconds.
 * argv: out in rows threads kind int8(0/1); kind (0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_1, 4 Q6_K, 5 Q4_K,
 * 6 Q6_KS) or A:B, the revision's kind A against the working tree's B (the same weights' values:
 * Q4_1 against Q4_K, Q6_K against Q6_KS) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "blocks.h"

typedef int (*kernel)(const float *, int64_t, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t,
                      int, int);
int rill_qlinear(const float *, int64_t, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t, int, int);
int rill_qlinear_i8(const float *, int64_t, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t, int,
                    int);
int rill_qlinear_a(const float *, int64_t, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t, int,
                   int);
int rill_qlinear_i8_a(const float *, int64_t, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t, int,
                      int);

enum { LAYERS = 30, ROUNDS = 40, CALLS = 50 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* 30 layers of random weights of `kind` with sane float scales (random bytes as floats would be
 * NaNs and subnormals); the super-block kinds' heads 0.01, their integers random */
static void fill(uint8_t **weights, int64_t blocks, int kind) {
    const int64_t block = block_bytes(kind);
    for (int l = 0; l < LAYERS; l++) {
        weights[l] = malloc((size_t)(blocks * block));
        for (int64_t i = 0; i < blocks * block; i++) weights[l][i] = (uint8_t)rand();
        if (is_super(kind)) {
            for (int64_t s = 0; s < blocks / 8; s++)
                for (int j = 0; j < super_head_bytes(kind) / 4; j++) ((float *)(weights[l] + s * 8 * block))[j] = 0.01f;
            continue;
        }
        for (int64_t b = 0; b < blocks; b++) { /* the floats after each block's weights */
            float *scales = (float *)(weights[l] + b * block + scales_at(kind));
            for (int j = 0; j < 16 * (has_min(kind) || is_q6(kind) ? 2 : 1); j++) scales[j] = 0.01f;
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s out in rows threads kind int8\n", argv[0]);
        return 2;
    }
    const int64_t out = atoll(argv[1]), in = atoll(argv[2]), rows = atoll(argv[3]);
    const int threads = atoi(argv[4]), int8 = atoi(argv[6]);
    const char *colon = strchr(argv[5], ':');
    const int kinds[2] = {atoi(argv[5]), colon ? atoi(colon + 1) : atoi(argv[5])};
    const int64_t blocks = ((out + 15) / 16) * (in / 32);
    uint8_t *weights[2][LAYERS];
    fill(weights[0], blocks, kinds[0]);
    fill(weights[1], blocks, kinds[1]);
    float *x = malloc(sizeof(float) * (size_t)(rows * in)), *y = malloc(sizeof(float) * (size_t)(rows * out));
    for (int64_t i = 0; i < rows * in; i++) x[i] = (float)rand() / (float)RAND_MAX - 0.5f;
    const kernel builds[2] = {int8 ? rill_qlinear_i8_a : rill_qlinear_a, int8 ? rill_qlinear_i8 : rill_qlinear};
    double times[2][ROUNDS];
    for (int r = 0; r < ROUNDS; r++)
        for (int v = 0; v < 2; v++) {
            const double t0 = now();
            for (int c = 0; c < CALLS; c++)
                for (int l = 0; l < LAYERS; l++) builds[v](x, in, weights[v][l], NULL, y, rows, out, in, threads, kinds[v]);
            times[v][r] = (now() - t0) / (CALLS * LAYERS) * 1e6;
        }
    qsort(times[0], ROUNDS, sizeof(double), by_value);
    qsort(times[1], ROUNDS, sizeof(double), by_value);
    printf("%lld x %lld, %lld rows, %d threads: %.1f -> %.1f us (%.2fx)\n", (long long)out, (long long)in,
           (long long)rows, threads, times[0][ROUNDS / 2], times[1][ROUNDS / 2], times[1][ROUNDS / 2] / times[0][ROUNDS / 2]);
    return 0;
}
