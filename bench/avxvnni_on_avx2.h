/* AVX-VNNI's 256-bit vpdpbusd emulated on AVX2 for csrc/qlinear_i8.c's VNNI tiles (bench/avx512_check.py
 * --vnni256, with -D__AVXVNNI__): exact while the unsigned bytes stay under 128 (the Q4, Q5_1 and Q6_K
 * weights; Q8_0's q + 128 would saturate vpmaddubsw, so that kind is left out there). */
#include <immintrin.h>
static inline __m256i emulated_dpbusd(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#define _mm256_dpbusd_avx_epi32(a, u, s) emulated_dpbusd((a), (u), (s))
