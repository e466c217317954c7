/* The AVX-512 intrinsics that csrc/qlinear.c and csrc/qlinear_i8.c use, emulated on AVX2 (a zmm as
 * two ymm halves; vpdpbusd and the byte permutation one lane at a time), so that their AVX-512
 * paths run on an AVX2 host: bench/avx512_check.py force-includes this (-include) into those two
 * files only. Their __AVX512*__ macros are defined here, after the system headers are in, so those
 * headers are not compiled as for an AVX-512 target. The tile sums' empty asm (KEEP) is dropped:
 * its register constraints do not take these structs. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
typedef struct { __m256 lo, hi; } E512;
typedef struct { __m256i lo, hi; } E512I;
#define __m512 E512
#define __m512i E512I
static inline E512 e_ps(__m256 lo, __m256 hi) { E512 r = {lo, hi}; return r; }
static inline E512I e_si(__m256i lo, __m256i hi) { E512I r = {lo, hi}; return r; }
static inline E512 e_add_ps(E512 a, E512 b) { return e_ps(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
static inline E512 e_sub_ps(E512 a, E512 b) { return e_ps(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
static inline E512 e_mul_ps(E512 a, E512 b) { return e_ps(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline E512 e_fmadd_ps(E512 a, E512 b, E512 c) { return e_ps(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)); }
static inline E512I e_and(E512I a, E512I b) { return e_si(_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)); }
static inline E512I e_or(E512I a, E512I b) { return e_si(_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)); }
static inline E512I e_xor(E512I a, E512I b) { return e_si(_mm256_xor_si256(a.lo, b.lo), _mm256_xor_si256(a.hi, b.hi)); }
static inline E512I e_sub_epi32(E512I a, E512I b) { return e_si(_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)); }
static inline E512 e_cvtepi32_ps(E512I a) { return e_ps(_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)); }
static inline E512I e_cvtepi8_epi32(__m128i x) { return e_si(_mm256_cvtepi8_epi32(x), _mm256_cvtepi8_epi32(_mm_srli_si128(x, 8))); }
static inline E512I e_cvtepu8_epi32(__m128i x) { return e_si(_mm256_cvtepu8_epi32(x), _mm256_cvtepu8_epi32(_mm_srli_si128(x, 8))); }
static inline E512I e_cast256(__m256i a) { return e_si(a, _mm256_setzero_si256()); }
static inline E512I e_insert(E512I a, __m256i b, int i) { if (i) a.hi = b; else a.lo = b; return a; }
static inline E512 e_loadu(const float *p) { return e_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void e_storeu(float *p, E512 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
static inline E512 e_set1_ps(float f) { return e_ps(_mm256_set1_ps(f), _mm256_set1_ps(f)); }
static inline E512I e_set1_epi32(int v) { return e_si(_mm256_set1_epi32(v), _mm256_set1_epi32(v)); }
static inline E512I e_set1_epi8(char v) { return e_si(_mm256_set1_epi8(v), _mm256_set1_epi8(v)); }
static inline E512I e_set_epi32(int e15, int e14, int e13, int e12, int e11, int e10, int e9, int e8, int e7, int e6,
                                int e5, int e4, int e3, int e2, int e1, int e0) {
    return e_si(_mm256_set_epi32(e7, e6, e5, e4, e3, e2, e1, e0), _mm256_set_epi32(e15, e14, e13, e12, e11, e10, e9, e8));
}
static inline E512 e_zero_ps(void) { return e_ps(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline E512I e_zero_si(void) { return e_si(_mm256_setzero_si256(), _mm256_setzero_si256()); }
static inline E512I e_slli16(E512I a, int n) { return e_si(_mm256_slli_epi16(a.lo, n), _mm256_slli_epi16(a.hi, n)); }
static inline E512I e_srli16(E512I a, int n) { return e_si(_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)); }
static inline E512I e_dpbusd(E512I acc, E512I u, E512I s) {  /* exact, one lane at a time */
    uint8_t ub[64]; int8_t sb[64]; int32_t a[16];
    memcpy(ub, &u, 64); memcpy(sb, &s, 64); memcpy(a, &acc, 64);
    for (int i = 0; i < 16; i++) for (int b = 0; b < 4; b++) a[i] += (int32_t)ub[4 * i + b] * (int32_t)sb[4 * i + b];
    E512I r; memcpy(&r, a, 64); return r;
}
static inline E512I e_permutexvar_epi8(uint64_t mask, E512I idx, E512I a) {
    uint8_t ib[64], ab[64], rb[64];
    memcpy(ib, &idx, 64); memcpy(ab, &a, 64);
    for (int i = 0; i < 64; i++) rb[i] = (mask >> i) & 1 ? ab[ib[i] & 63] : 0;
    E512I r; memcpy(&r, rb, 64); return r;
}
#define _mm512_add_ps e_add_ps
#define _mm512_sub_ps e_sub_ps
#define _mm512_mul_ps e_mul_ps
#define _mm512_fmadd_ps e_fmadd_ps
#define _mm512_and_si512 e_and
#define _mm512_or_si512 e_or
#define _mm512_xor_si512 e_xor
#define _mm512_sub_epi32 e_sub_epi32
#define _mm512_cvtepi32_ps e_cvtepi32_ps
#define _mm512_cvtepi8_epi32 e_cvtepi8_epi32
#define _mm512_cvtepu8_epi32 e_cvtepu8_epi32
#define _mm512_castsi256_si512 e_cast256
#define _mm512_inserti64x4 e_insert
#define _mm512_loadu_ps e_loadu
#define _mm512_load_ps e_loadu
#define _mm512_storeu_ps e_storeu
#define _mm512_store_ps e_storeu
#define _mm512_set1_ps e_set1_ps
#define _mm512_set1_epi32 e_set1_epi32
#define _mm512_set1_epi8 e_set1_epi8
#define _mm512_set_epi32 e_set_epi32
#define _mm512_setzero_ps e_zero_ps
#define _mm512_setzero_si512 e_zero_si
#define _mm512_slli_epi16 e_slli16
#define _mm512_srli_epi16 e_srli16
#define _mm512_dpbusd_epi32 e_dpbusd
#define _mm512_maskz_permutexvar_epi8 e_permutexvar_epi8
#define __asm__(...) ((void)0)
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VNNI__ 1
#ifdef RILL_EMULATE_VBMI
#define __AVX512VBMI__ 1
#endif
