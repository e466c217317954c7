/* The peak multiply-add rates of this CPU's AVX2 routes for a block kernel's products, on every
 * thread, in registers only (no memory): what bounds a prefill or a batched step before any data
 * moves. Built and run by bench/peak_rates.py.
 *
 *   float32   vfmadd231ps: 8 products a register, 10 chains (the latency of 4-5 cycles hidden)
 *   int8      vpmaddubsw (32 unsigned x signed byte products, pairs summed to 16 bits), vpmaddwd by
 *             ones (pairs to 32 bits), vpaddd: llama.cpp's route on AVX2 for int8 activations
 *   int16     vpmaddwd (16 products, pairs summed to 32 bits), vpaddd
 *
 *   widen     the exact one-row 4-bit route: rill's Q4 panel layout (byte j of input k holds output j
 *             and output j + 8), vpmovzxbd, a mask and a shift, two vcvtdq2ps and two multiply-adds
 *             per 16 weights, 8 running sums, the weights read from L2: what bounds the one-row step
 *             of a Q4 block file where reads do not, in billions of weights a second
 *
 * A float32 activation's 24-bit significand needs three int8 pieces or two int16 pieces (scaled by
 * a block's exponent) for products as exact as float32's, so the exact integer routes run at a third
 * and a half of these rates. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>

enum { CHAINS_F32 = 10, CHAINS_INT = 4 };

static double float32_rate(long iters) {
    float sink = 0;
    const double t = omp_get_wtime();
    #pragma omp parallel reduction(+ : sink)
    {
        __m256 a[CHAINS_F32], x = _mm256_set1_ps(1.0001f), y = _mm256_set1_ps(0.9999f);
        for (int i = 0; i < CHAINS_F32; i++) a[i] = _mm256_set1_ps((float)i);
        for (long n = 0; n < iters; n++) {
            for (int i = 0; i < CHAINS_F32; i++) a[i] = _mm256_fmadd_ps(x, a[i], y);
            __asm__("" : "+x"(x));
        }
        for (int i = 1; i < CHAINS_F32; i++) a[0] = _mm256_add_ps(a[0], a[i]);
        sink += a[0][0];
    }
    const double seconds = omp_get_wtime() - t;
    if (sink == 1234.5f) puts("");  /* the sums are used */
    return (double)omp_get_max_threads() * iters * CHAINS_F32 * 8 / seconds / 1e9;
}

/* bytes: 1 for the int8 route (32 products a step), 2 for the int16 one (16) */
static double integer_rate(long iters, int bytes) {
    int sink = 0;
    const double t = omp_get_wtime();
    #pragma omp parallel reduction(+ : sink)
    {
        __m256i acc[CHAINS_INT], w[CHAINS_INT], x = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
        for (int i = 0; i < CHAINS_INT; i++) acc[i] = _mm256_set1_epi32(i), w[i] = _mm256_set1_epi8((char)(7 + i));
        for (long n = 0; n < iters; n++) {
            for (int i = 0; i < CHAINS_INT; i++) /* each chain its own weights: nothing to share */
                acc[i] = _mm256_add_epi32(acc[i], bytes == 1 ? _mm256_madd_epi16(_mm256_maddubs_epi16(w[i], x), ones)
                                                             : _mm256_madd_epi16(w[i], x));
            for (int i = 0; i < CHAINS_INT; i++) __asm__("" : "+x"(w[i]));
            __asm__("" : "+x"(x));
        }
        for (int i = 1; i < CHAINS_INT; i++) acc[0] = _mm256_add_epi32(acc[0], acc[i]);
        sink += _mm256_extract_epi32(acc[0], 0);
    }
    const double seconds = omp_get_wtime() - t;
    if (sink == 12345) puts("");
    return (double)omp_get_max_threads() * iters * CHAINS_INT * (32 / bytes) / seconds / 1e9;
}

/* one row of x against 4-bit panels of 16 outputs, WIDEN_BYTES of nibbles per thread (in L2) read
 * over and over: billions of weights widened and multiplied a second, every thread */
enum { WIDEN_BYTES = 128 * 1024, WIDEN_INPUTS = WIDEN_BYTES / 8 };

static double widen_rate(long iters) {
    float sink = 0;
    const long passes = iters / WIDEN_INPUTS > 0 ? iters / WIDEN_INPUTS : 1;
    double seconds = 0;
    #pragma omp parallel reduction(+ : sink) reduction(max : seconds)
    {
        uint8_t *q = aligned_alloc(64, WIDEN_BYTES);
        float *x = aligned_alloc(64, WIDEN_INPUTS * sizeof(float));
        for (long i = 0; i < WIDEN_BYTES; i++) q[i] = (uint8_t)(i * 37 + 11);
        for (long k = 0; k < WIDEN_INPUTS; k++) x[k] = 1.0f / (float)(k + 1);
        __m256 y[4][2];
        for (int s = 0; s < 4; s++) y[s][0] = y[s][1] = _mm256_setzero_ps();
        const __m256i fifteen = _mm256_set1_epi32(15);
        #pragma omp barrier
        const double t = omp_get_wtime();
        for (long pass = 0; pass < passes; pass++)
            for (long k = 0; k < WIDEN_INPUTS; k += 4)
                for (int s = 0; s < 4; s++) { /* four chains over consecutive inputs, as rill's one-row tile */
                    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + (k + s) * 8)));
                    const __m256 xv = _mm256_broadcast_ss(x + k + s);
                    y[s][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, fifteen)), xv, y[s][0]);
                    y[s][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), xv, y[s][1]);
                }
        seconds = omp_get_wtime() - t;
        for (int s = 1; s < 4; s++) y[0][0] = _mm256_add_ps(_mm256_add_ps(y[0][0], y[s][0]), y[s][1]);
        sink += _mm256_add_ps(y[0][0], y[0][1])[0];
        free(q);
        free(x);
    }
    if (sink == 1234.5f) puts("");
    return (double)omp_get_max_threads() * passes * WIDEN_INPUTS * 16 / seconds / 1e9;
}

int main(int argc, char **argv) {
    const long iters = argc > 1 ? atol(argv[1]) : 300000000L;
    #pragma omp parallel
    { __asm__(""); }  /* the threads started before anything is timed */
    const double f32 = float32_rate(iters), i8 = integer_rate(iters, 1), i16 = integer_rate(iters, 2);
    const double widened = widen_rate(iters);
    printf("threads %d\n", omp_get_max_threads());
    printf("float32 multiply-add: %.1f GMAC/s\n", f32);
    printf("int8 (vpmaddubsw, llama.cpp's, one piece): %.1f GMAC/s; exact in three pieces: %.1f (%.2fx float32)\n", i8,
           i8 / 3, i8 / 3 / f32);
    printf("int16 (vpmaddwd, one piece): %.1f GMAC/s; exact in two pieces: %.1f (%.2fx float32)\n", i16, i16 / 2,
           i16 / 2 / f32);
    printf("one-row 4-bit widening (vpmovzxbd, mask/shift, vcvtdq2ps, multiply-add; weights in L2): %.1f G weights/s\n",
           widened);
    return 0;
}
