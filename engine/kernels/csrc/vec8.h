/* Eight floats in GCC's vector types (ymm registers where there are) for the kernels, and e^x on
 * them for the softmax of csrc/decode_attention.c and the SiLU of csrc/decode_layer.c. */
#ifndef RILL_VEC8_H
#define RILL_VEC8_H
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
static inline v8 load8(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }
static inline void store8(float *p, v8 x) { memcpy(p, &x, sizeof x); }

/* e^x on eight lanes, within 2e-7 relative of expf (libm's expf is a call per element), x
   clamped to [-87, 88] (e^-87 ~ 1.6e-38 is still a normal float, e^88 ~ 1.7e38 still finite; NaN
   stays NaN): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7. Adding and
   taking away 1.5 * 2^23 rounds to the nearest integer (even on ties) for |x log2 e| < 2^22. */
#define RILL_DEFINE_EXP(name, V, VI) /* also exp16 on 16 lanes, in csrc/decode_attention.c */ \
    static inline V name(V x) {                                                       \
        const V floor = (V){0} - 87.0f, ceiling = (V){0} + 88.0f;                     \
        const VI low = x < floor, high = x > ceiling;                                 \
        x = (V)(((VI)x & ~low) | ((VI)floor & low));                                  \
        x = (V)(((VI)x & ~high) | ((VI)ceiling & high));                              \
        const V n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;                    \
        const V r = (x - n * 0.693145752f) - n * 1.42860677e-6f; /* ln2 in two parts */ \
        V p = r - r + 1.0f / 5040.0f;                                                 \
        p = p * r + 1.0f / 720.0f;                                                    \
        p = p * r + 1.0f / 120.0f;                                                    \
        p = p * r + 1.0f / 24.0f;                                                     \
        p = p * r + 1.0f / 6.0f;                                                      \
        p = p * r + 0.5f;                                                             \
        p = p * r + 1.0f;                                                             \
        p = p * r + 1.0f;                                                             \
        const VI bits = (__builtin_convertvector(n, VI) + 127) << 23; /* 2^n */       \
        return p * (V)bits;                                                           \
    }
RILL_DEFINE_EXP(exp8, v8, v8i)

#endif
