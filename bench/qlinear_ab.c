/* The block kernels of two builds side by side (bench/qlinear_ab.py compiles this with the
 * sources of a git revision renamed *_a and those of the working tree): one shape, weights from
 * memory (30 different ones, as a model's layers; fewer of a large shape, 256 MB at least), 40
 * alternations (or argv's) of about 0.1 s a build (up to 50 passes over the layers: a large shape
 * takes fewer, so that it runs in seconds, not minutes),
 * medians in microseconds.
 * argv: out in rows threads kind int8(0/1) [alternations]; kind (0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_1,
 * 4 Q6_K, 5 Q4_K, 6 Q6_KS) or A:B, the revision's kind A against the working tree's B (the same weights' values:
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

enum { LAYERS = 30, ROUNDS = 40, MAX_CALLS = 50 };
#define ROUND_SECONDS 0.1 /* a build's share of one alternation */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* random bytes, 8 at a time (xorshift64: rand() a byte took minutes for the large shapes) */
static uint64_t next_random(uint64_t *state) {
    *state ^= *state << 13, *state ^= *state >> 7, *state ^= *state << 17;
    return *state;
}

/* layer l of random weights of `kind` with sane float scales (random bytes as floats would be NaNs
 * and subnormals); the super-block kinds' heads 0.01, their integers random */
static uint8_t *fill(int64_t blocks, int kind, uint64_t *state) {
    const int64_t block = block_bytes(kind), bytes = blocks * block;
    uint8_t *weights = malloc((size_t)((bytes + 7) / 8 * 8));
    for (int64_t i = 0; i < bytes; i += 8) {
        const uint64_t r = next_random(state);
        memcpy(weights + i, &r, 8);
    }
    if (is_super(kind)) {
        for (int64_t s = 0; s < blocks / 8; s++)
            for (int j = 0; j < super_head_bytes(kind) / 4; j++) ((float *)(weights + s * 8 * block))[j] = 0.01f;
        return weights;
    }
    for (int64_t b = 0; b < blocks; b++) { /* the floats after each block's weights */
        float *scales = (float *)(weights + b * block + scales_at(kind));
        for (int j = 0; j < 16 * (has_min(kind) || is_q6(kind) ? 2 : 1); j++) scales[j] = 0.01f;
    }
    return weights;
}

int main(int argc, char **argv) {
    if (argc != 7 && argc != 8) {
        fprintf(stderr, "usage: %s out in rows threads kind int8 [alternations]\n", argv[0]);
        return 2;
    }
    const int rounds = argc == 8 ? atoi(argv[7]) : ROUNDS;
    if (rounds < 1) {
        fprintf(stderr, "alternations: at least 1, given %s\n", argv[7]);
        return 2;
    }
    const int64_t out = atoll(argv[1]), in = atoll(argv[2]), rows = atoll(argv[3]);
    const int threads = atoi(argv[4]), int8 = atoi(argv[6]);
    const char *colon = strchr(argv[5], ':');
    const int kinds[2] = {atoi(argv[5]), colon ? atoi(colon + 1) : atoi(argv[5])};
    const int64_t blocks = ((out + 15) / 16) * (in / 32);
    /* enough layers that they do not fit the caches: 30, or fewer of a large shape (256 MB a build) */
    const int64_t layer_bytes = blocks * block_bytes(kinds[0]);
    const int64_t few = (256 << 20) / layer_bytes + 2;
    const int layers = few < LAYERS ? (int)few : LAYERS;
    /* the two builds' layers allocated in turn: the set allocated first read 1.08-1.11x slower at one
       row here (its memory, not its code: swapping the sets swapped the bias) */
    uint8_t *weights[2][LAYERS];
    uint64_t state[2] = {0x9E3779B97F4A7C15ull, 0x9E3779B97F4A7C15ull};
    for (int l = 0; l < layers; l++)
        for (int v = 0; v < 2; v++) weights[v][l] = fill(blocks, kinds[v], &state[v]);
    float *x = malloc(sizeof(float) * (size_t)(rows * in)), *y = malloc(sizeof(float) * (size_t)(rows * out));
    for (int64_t i = 0; i < rows * in; i++) x[i] = (float)rand() / (float)RAND_MAX - 0.5f;
    const kernel builds[2] = {int8 ? rill_qlinear_i8_a : rill_qlinear_a, int8 ? rill_qlinear_i8 : rill_qlinear};
    double *times[2] = {malloc(sizeof(double) * rounds), malloc(sizeof(double) * rounds)};
    const double t0 = now();
    for (int v = 0; v < 2; v++) /* a warm-up pass of each, the second timed for the number of passes */
        for (int l = 0; l < layers; l++) builds[v](x, in, weights[v][l], NULL, y, rows, out, in, threads, kinds[v]);
    const double pass = (now() - t0) / 2;
    const int CALLS = pass * MAX_CALLS <= ROUND_SECONDS ? MAX_CALLS : pass >= ROUND_SECONDS ? 1 : (int)(ROUND_SECONDS / pass);
    for (int r = 0; r < rounds; r++)
        for (int turn = 0; turn < 2; turn++) {
            const int v = turn ^ (r & 1); /* which goes first alternates too */
            const double t1 = now();
            for (int c = 0; c < CALLS; c++)
                for (int l = 0; l < layers; l++) builds[v](x, in, weights[v][l], NULL, y, rows, out, in, threads, kinds[v]);
            times[v][r] = (now() - t1) / (CALLS * layers) * 1e6;
        }
    qsort(times[0], rounds, sizeof(double), by_value);
    qsort(times[1], rounds, sizeof(double), by_value);
    printf("%lld x %lld, %lld rows, %d threads: %.1f -> %.1f us (%.2fx)\n", (long long)out, (long long)in,
           (long long)rows, threads, times[0][rounds / 2], times[1][rounds / 2], times[1][rounds / 2] / times[0][rounds / 2]);
    return 0;
}
