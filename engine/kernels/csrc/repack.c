/* A GGUF tensor's raw rows -> the panels the block kernels read (csrc/qlinear.c's layout, or with
 * int8 csrc/qlinear_i8.c's; the kinds and their bytes in blocks.h), in one pass at load: each
 * panel's 16 rows (in `order`, llama.cpp's q/k rows put back) are decoded a GGUF block at a time
 * (32 weights, or a super-block of 256) into plain integers and float32 scales, which are then
 * written out as the kind's blocks of 32 inputs. engine/model/quant.py does the same in numpy
 * (its readers and panels_of_blocks: the reference, equal byte for byte).
 *
 * The scales are the float32 values gguf-py computes (and so transformers): float16 -> float32
 * exactly, and the K types' products d * scale, -(dmin * min) as single float32 operations (no
 * multiply-add: the build has no -ffast-math and nothing here adds to a product).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include "blocks.h"
#include "rill_kernels.h"
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#ifdef __SSSE3__
#include <tmmintrin.h>
#endif

/* ggml's type numbers (ggml.h) */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13,
       T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23 };

/* a GGUF type: weights and bytes of its block, the kernels' kind that holds it; 0 weights: not one */
typedef struct { int weights, bytes, kind; } gguf_type;

static inline __attribute__((always_inline)) gguf_type type_of(int type) {
    switch (type) {
        case T_Q8_0: return (gguf_type){32, 34, Q8_0};
        case T_Q4_0: return (gguf_type){32, 18, Q4_0};
        case T_Q4_1: return (gguf_type){32, 20, Q4_1};
        case T_Q5_0: return (gguf_type){32, 22, Q6_K};
        case T_Q5_1: return (gguf_type){32, 24, Q5_1};
        case T_Q3_K: return (gguf_type){256, 110, Q6_KS};
        case T_Q4_K: return (gguf_type){256, 144, Q4_K};
        case T_Q5_K: return (gguf_type){256, 176, Q5_1};
        case T_Q6_K: return (gguf_type){256, 210, Q6_KS};
        case T_IQ4_NL: return (gguf_type){32, 18, Q8_0};
        case T_IQ4_XS: return (gguf_type){256, 136, Q8_0};
        default: return (gguf_type){0, 0, 0};
    }
}

/* the kind whose blocks hold `type`'s: super-blocks only with float32 activations (the int8
 * layout holds Q4_1 and Q6_K blocks, the products D s (and M n) as their d (and m)) */
static inline __attribute__((always_inline)) int kind_of(int type, int int8) {
    const int kind = type_of(type).kind;
    return int8 && kind == Q4_K ? Q4_1 : int8 && kind == Q6_KS ? Q6_K : kind;
}

/* Q6_K's and Q3_K's scale of 16 weights i (of 16) as an integer: d = D s */
static inline int scale_q6(const uint8_t *src, int type, int i) {
    if (type == T_Q6_K) return (int8_t)src[192 + i];
    const uint8_t *scales = src + 96;
    const int low = i < 8 ? scales[i] & 15 : scales[i - 8] >> 4, high = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (low | high << 4) - 32;
}

static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static float half_at(const uint8_t *p) {  /* the float16 at p (little-endian) as float32, exactly */
    const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
    const uint32_t sign = (h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023;
    uint32_t bits = sign;
    if (exponent == 31) bits |= 0x7f800000 | mantissa << 13;
    else if (exponent) bits |= (exponent + 112) << 23 | mantissa << 13;
    else if (mantissa) {  /* subnormal: mantissa 2^-24, normalized */
        uint32_t m = mantissa, e = 113;
        while (!(m & 1024)) m <<= 1, e--;
        bits |= e << 23 | (m & 1023) << 13;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* 32 values packed as 16 bytes: value k < 16 the low nibble of byte k, k + 16 its high nibble */
static inline __attribute__((always_inline)) void nibbles(const uint8_t *packed, uint8_t *q) {
#ifdef __SSE2__
    const __m128i p = _mm_loadu_si128((const __m128i *)packed), low4 = _mm_set1_epi8(15);
    _mm_storeu_si128((__m128i *)q, _mm_and_si128(p, low4));
    _mm_storeu_si128((__m128i *)(q + 16), _mm_and_si128(_mm_srli_epi16(p, 4), low4));
#else
    for (int k = 0; k < 16; k++) q[k] = packed[k] & 15, q[k + 16] = packed[k] >> 4;
#endif
}

/* q[k] |= bit k of the little-endian uint32 at bits, moved to bit 4 (the fifth bits of Q5_0, Q5_1) */
static inline __attribute__((always_inline)) void fifth_bits(const uint8_t *bits, uint8_t *q) {
#ifdef __SSSE3__
    const __m128i select = _mm_set1_epi64x((long long)0x8040201008040201ULL), fifth = _mm_set1_epi8(16);
    for (int half = 0; half < 2; half++) {  /* byte k of 16: bit k % 8 of byte k / 8 of this half's two */
        const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(bits[2 * half] | bits[2 * half + 1] << 8),
                                                _mm_set_epi64x(0x0101010101010101LL, 0));
        const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(spread, select), select);
        __m128i *out = (__m128i *)(q + 16 * half);
        _mm_storeu_si128(out, _mm_or_si128(_mm_loadu_si128(out), _mm_and_si128(set, fifth)));
    }
#else
    for (int k = 0; k < 32; k++) q[k] |= ((bits[k / 8] >> (k % 8)) & 1) << 4;
#endif
}

/* the same nibbles as IQ4_NL's 16 int8 values (a table lookup per byte: pshufb where there is one) */
static inline __attribute__((always_inline)) void iq4_values(const uint8_t *packed, uint8_t *q) {
#ifdef __SSSE3__
    const __m128i table = _mm_loadu_si128((const __m128i *)IQ4_VALUES), p = _mm_loadu_si128((const __m128i *)packed);
    const __m128i low4 = _mm_set1_epi8(15);
    _mm_storeu_si128((__m128i *)q, _mm_shuffle_epi8(table, _mm_and_si128(p, low4)));
    _mm_storeu_si128((__m128i *)(q + 16), _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(p, 4), low4)));
#else
    for (int k = 0; k < 16; k++) q[k] = (uint8_t)IQ4_VALUES[packed[k] & 15], q[k + 16] = (uint8_t)IQ4_VALUES[packed[k] >> 4];
#endif
}

/* Q4_K's and Q5_K's six-bit scale and minimum of sub-block j from their 12 bytes */
static inline void scale_min_k4(const uint8_t *s, int j, int *scale, int *minimum) {
    if (j < 4) {
        *scale = s[j] & 63, *minimum = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        *minimum = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

/* One GGUF block of `type` -> its weights as the kind holds them: q[weights] (the integer q: int8
 * bytes for Q8_0, else 0..63), d[weights / 16] (a scale per 16 weights: both of a block of 32 the
 * same unless Q6_K) and m[weights / 32] (Q4_1, Q5_1) */
static inline __attribute__((always_inline)) void decode(const uint8_t *src, const int type, uint8_t *q, float *d,
                                                         float *m) {
    switch (type) {
        case T_Q8_0:
            d[0] = d[1] = half_at(src);
            memcpy(q, src + 2, 32);
            break;
        case T_Q4_0:
        case T_Q4_1: {
            const int at = type == T_Q4_1 ? 4 : 2;
            d[0] = d[1] = half_at(src);
            if (type == T_Q4_1) m[0] = half_at(src + 2);
            nibbles(src + at, q);
            break;
        }
        case T_Q5_0:
        case T_Q5_1: {  /* the fifth bits as a little-endian uint32: bit k is weight k's */
            const int at = type == T_Q5_1 ? 4 : 2;
            d[0] = d[1] = half_at(src);
            if (type == T_Q5_1) m[0] = half_at(src + 2);
            nibbles(src + at + 4, q);
            fifth_bits(src + at, q);
            if (type == T_Q5_0)  /* as Q6_K: q + 16 */
                for (int k = 0; k < 32; k++) q[k] += 16;
            break;
        }
        case T_IQ4_NL:
            d[0] = d[1] = half_at(src);
            iq4_values(src + 2, q);
            break;
        case T_Q4_K:
        case T_Q5_K: {  /* sub-block j: nibbles j % 2 of bytes 32 (j / 2).. ; Q5_K: bit j of its byte e of qh */
            const float dall = half_at(src), dmin = half_at(src + 2);
            const uint8_t *qs = src + (type == T_Q5_K ? 48 : 16), *qh = src + 16;
            for (int j = 0; j < 8; j++) {
                int scale, minimum;
                scale_min_k4(src + 4, j, &scale, &minimum);
                d[2 * j] = d[2 * j + 1] = dall * (float)scale;
                m[j] = -(dmin * (float)minimum);
                const uint8_t *bytes = qs + (j / 2) * 32;
                for (int e = 0; e < 32; e++) {
                    int v = j % 2 ? bytes[e] >> 4 : bytes[e] & 15;
                    if (type == T_Q5_K) v |= ((qh[e] >> j) & 1) << 4;
                    q[j * 32 + e] = (uint8_t)v;
                }
            }
            break;
        }
        case T_Q6_K: {  /* weight 128 h + 64 s + 32 t + c: nibble s of ql[64 h + 32 t + c], bits 2 (2s + t) of qh[32 h + c] */
            const float dall = half_at(src + 208);
            for (int i = 0; i < 16; i++) d[i] = dall * (float)(int8_t)src[192 + i];
            for (int h = 0; h < 2; h++)
                for (int t = 0; t < 2; t++)
                    for (int c = 0; c < 32; c++) {
                        const int low = src[h * 64 + t * 32 + c], high = src[128 + h * 32 + c];
                        q[h * 128 + t * 32 + c] = (uint8_t)((low & 15) | ((high >> (2 * t)) & 3) << 4);
                        q[h * 128 + 64 + t * 32 + c] = (uint8_t)((low >> 4) | ((high >> (2 * t + 4)) & 3) << 4);
                    }
            break;
        }
        case T_Q3_K: {  /* weight 128 h + 32 s + c: bits 2s of qs[32 h + c], third bit e / 32 of hmask[c] (set: no -4) */
            const float dall = half_at(src + 108);
            const uint8_t *scales = src + 96;
            for (int i = 0; i < 16; i++) {
                d[i] = dall * (float)scale_q6(src, T_Q3_K, i);
            }
            for (int h = 0; h < 2; h++)
                for (int s = 0; s < 4; s++)
                    for (int c = 0; c < 32; c++) {
                        const int twos = (src[32 + h * 32 + c] >> (2 * s)) & 3, third = (src[c] >> (4 * h + s)) & 1;
                        q[h * 128 + s * 32 + c] = (uint8_t)(twos + 28 + 4 * third);  /* q + 32 */
                    }
            break;
        }
        case T_IQ4_XS: {  /* sub-block i: scale (4 bits of byte 4 + i / 2) | (2 bits of the uint16 at 2) << 4, less 32 */
            const float dall = half_at(src);
            const uint32_t high = (uint32_t)src[2] | (uint32_t)src[3] << 8;
            for (int i = 0; i < 8; i++) {
                const int scale = ((src[4 + i / 2] >> (4 * (i % 2))) & 15) | ((high >> (2 * i)) & 3) << 4;
                d[2 * i] = d[2 * i + 1] = dall * (float)(scale - 32);
                iq4_values(src + 8 + i * 16, q + i * 32);
            }
            break;
        }
        default: break;
    }
}

/* Bytes moved as little-endian words (x86, and the ARM hosts): 4 or 8 weights at a time, each in
 * its byte, so that one shift and mask serve them all (no bit crosses into the next byte once
 * masked) */
static inline uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
enum { STRIDE = 256 };  /* bytes between two rows' q in repack_panel (the most weights in a GGUF block) */
#define LOW4 0x0f0f0f0f0f0f0f0fULL
#define BIT0 0x0101010101010101ULL
#define BITS01 0x0303030303030303ULL

/* q [16 rows][32 inputs] (row stride STRIDE) -> qt [32 inputs][16 rows] */
static inline __attribute__((always_inline)) void transpose(const uint8_t *q, uint8_t *qt) {
#ifdef __SSE2__
    for (int half = 0; half < 2; half++) {  /* inputs 16 half .. 16 half + 15: four rounds of interleaving */
        __m128i r[16], t[16];
        for (int i = 0; i < 16; i++) r[i] = _mm_loadu_si128((const __m128i *)(q + i * STRIDE + 16 * half));
        for (int i = 0; i < 8; i++) {  /* rows 2i, 2i + 1: t[2i] columns 0-7, t[2i + 1] 8-15 */
            t[2 * i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
        }
        for (int i = 0; i < 4; i++)  /* rows 4i..4i+3: r[4i + c] columns 4c..4c+3 */
            for (int h = 0; h < 2; h++) {
                r[4 * i + 2 * h] = _mm_unpacklo_epi16(t[4 * i + h], t[4 * i + 2 + h]);
                r[4 * i + 2 * h + 1] = _mm_unpackhi_epi16(t[4 * i + h], t[4 * i + 2 + h]);
            }
        for (int g = 0; g < 2; g++)  /* rows 8g..8g+7: t[8g + c] columns 2c, 2c + 1 */
            for (int c = 0; c < 4; c++) {
                t[8 * g + 2 * c] = _mm_unpacklo_epi32(r[8 * g + c], r[8 * g + 4 + c]);
                t[8 * g + 2 * c + 1] = _mm_unpackhi_epi32(r[8 * g + c], r[8 * g + 4 + c]);
            }
        for (int c = 0; c < 8; c++) {  /* all 16 rows of columns 2c and 2c + 1 */
            _mm_storeu_si128((__m128i *)(qt + (16 * half + 2 * c) * 16), _mm_unpacklo_epi64(t[c], t[8 + c]));
            _mm_storeu_si128((__m128i *)(qt + (16 * half + 2 * c + 1) * 16), _mm_unpackhi_epi64(t[c], t[8 + c]));
        }
    }
#else
    for (int k = 0; k < 32; k++)
        for (int o = 0; o < 16; o++) qt[k * 16 + o] = q[o * STRIDE + k];
#endif
}

/* The block of 32 inputs at q (16 rows, STRIDE apart) -> the kind's weights at dst, in csrc/qlinear.c's
 * layout: input-major, from its transpose */
static inline __attribute__((always_inline)) void write_float(const uint8_t *q, uint8_t *dst, const int kind) {
    uint8_t qt[32 * 16];
    transpose(q, qt);
    if (kind == Q8_0) {  /* input k, output o */
        memcpy(dst, qt, sizeof qt);
        return;
    }
    if (kind == Q6_KS) {  /* input k, output o: q - 32 as int8 */
        for (int i = 0; i < 32 * 16; i++) dst[i] = (uint8_t)(qt[i] - 32);
        return;
    }
    for (int k = 0; k < 32; k++)  /* input k, output j | output j + 8 in the high nibble */
        put64(dst + k * 8, (get64(qt + k * 16) & LOW4) | (get64(qt + k * 16 + 8) & LOW4) << 4);
    if (kind == Q5_1)  /* inputs 4G + g, output j: bit 2g output j's fifth bit, 2g + 1 output j + 8's */
        for (int G = 0; G < 8; G++) {
            uint64_t bits = 0;
            for (int g = 0; g < 4; g++) {
                const uint8_t *row = qt + (4 * G + g) * 16;
                bits |= (get64(row) >> 4 & BIT0) << (2 * g) | (get64(row + 8) >> 4 & BIT0) << (2 * g + 1);
            }
            put64(dst + 256 + G * 8, bits);
        }
    if (is_q6(kind))  /* inputs 2P + o, output j: bits 4o output j's high bits, 4o + 2 output j + 8's */
        for (int P = 0; P < 16; P++) {
            uint64_t bits = 0;
            for (int o = 0; o < 2; o++) {
                const uint8_t *row = qt + (2 * P + o) * 16;
                bits |= (get64(row) >> 4 & BITS01) << (4 * o) | (get64(row + 8) >> 4 & BITS01) << (4 * o + 2);
            }
            put64(dst + 256 + P * 8, bits);
        }
}

/* The same block in csrc/qlinear_i8.c's layout: each output's 4 consecutive inputs are 4 bytes of its
 * row, so words of 4 move straight from q */
static inline __attribute__((always_inline)) void write_int8(const uint8_t *q, uint8_t *dst, const int kind) {
#define Q4(o, i) get32(q + (o) * STRIDE + 4 * (i))  /* output o's inputs 4i..4i+3 */
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 8; j++) {
            const int o = 8 * h + j;
            if (kind == Q8_0) {  /* half h, group g (inputs 4g..4g+3), output j */
                for (int g = 0; g < 8; g++) put32(dst + h * 256 + g * 32 + j * 4, Q4(o, g));
                continue;
            }
            for (int v = 0; v < 4; v++)  /* half h, vector v, output j: low nibbles inputs 4v.., high 16 + 4v.. */
                put32(dst + h * 128 + v * 32 + j * 4, (Q4(o, v) & (uint32_t)LOW4) | (Q4(o, 4 + v) & (uint32_t)LOW4) << 4);
            uint32_t bits = 0;
            if (kind == Q5_1) {  /* half h, output j: bit v input 4v + b's fifth bit, 4 + v input 16 + 4v + b's */
                for (int v = 0; v < 4; v++)
                    bits |= (Q4(o, v) >> 4 & (uint32_t)BIT0) << v | (Q4(o, 4 + v) >> 4 & (uint32_t)BIT0) << (4 + v);
                put32(dst + 256 + h * 32 + j * 4, bits);
            }
            if (kind == Q6_K)  /* half h, pair w, output j: bits 4s + 2i the high bits of input 16i + 4(2w + s) + b */
                for (int w = 0; w < 2; w++) {
                    bits = 0;
                    for (int i = 0; i < 2; i++)
                        for (int s = 0; s < 2; s++)
                            bits |= (Q4(o, 4 * i + 2 * w + s) >> 4 & (uint32_t)BITS01) << (4 * s + 2 * i);
                    put32(dst + 256 + h * 64 + w * 32 + j * 4, bits);
                }
        }
#undef Q4
}

/* One panel: each chunk of its 16 rows (a GGUF block's inputs: 32, or a super-block's 256) decoded,
 * then written as the kind's blocks of 32 inputs. rows: the panel's source rows, -1 past the last
 * output: zeros (q, d and m), as the numpy reference pads them. */
static inline __attribute__((always_inline)) void repack_panel(const uint8_t *raw, int64_t row_bytes,
                                                               const int64_t rows[16], int64_t in, uint8_t *panel,
                                                               const int type, const int int8) {
    const gguf_type t = type_of(type);
    const int kind = kind_of(type, int8);
    uint8_t q[16 * STRIDE];
    float d[16 * STRIDE / 16], m[16 * STRIDE / 32], scales[32];
    const int64_t blocks = t.weights / 32, bytes = block_bytes(kind);
    const size_t scale_bytes = sizeof(float) * (kind == Q6_K || has_min(kind) ? 32 : 16);
    for (int64_t c = 0; c < in / t.weights; c++) {
        for (int j = 0; j < 16; j++) {
            if (rows[j] < 0) {
                memset(q + j * STRIDE, 0, STRIDE);
                for (int i = 0; i < STRIDE / 16; i++) d[j * (STRIDE / 16) + i] = 0.0f;
                for (int i = 0; i < STRIDE / 32; i++) m[j * (STRIDE / 32) + i] = 0.0f;
            } else {
                decode(raw + rows[j] * row_bytes + c * t.bytes, type, q + j * STRIDE, d + j * (STRIDE / 16),
                       m + j * (STRIDE / 32));
            }
        }
        if (is_super(kind)) {  /* the super-block's floats (Q4_K: D = d, M = -dmin; Q6_KS: D = d), then its
                                  blocks with their integers (Q4_K: six-bit s and n, Q6_KS: int8 s per 16) */
            uint8_t *head = panel + c * 8 * bytes;
            float dm[32];
            for (int j = 0; j < 16; j++) {
                dm[j] = dm[16 + j] = 0.0f;
                if (rows[j] < 0) continue;
                const uint8_t *src = raw + rows[j] * row_bytes + c * t.bytes;
                if (type == T_Q4_K) dm[j] = half_at(src), dm[16 + j] = -half_at(src + 2);
                else dm[j] = half_at(src + (type == T_Q6_K ? 208 : 108));
            }
            memcpy(head, dm, (size_t)super_head_bytes(kind));
            for (int64_t b = 0; b < blocks; b++) {
                uint8_t *dst = head + super_head_bytes(kind) + b * super_stride(kind);
                write_float(q + b * 32, dst, kind);
                for (int j = 0; j < 16; j++) {
                    const uint8_t *src = rows[j] < 0 ? NULL : raw + rows[j] * row_bytes + c * t.bytes;
                    int scale = 0, minimum = 0;
                    if (src && kind == Q4_K) scale_min_k4(src + 4, (int)b, &scale, &minimum);
                    if (src && kind == Q6_KS) scale = scale_q6(src, type, 2 * (int)b), minimum = scale_q6(src, type, 2 * (int)b + 1);
                    dst[scales_at(kind) + j] = (uint8_t)scale;  /* Q6_KS: s[0][j], then s[1][j] (int8) */
                    dst[scales_at(kind) + 16 + j] = (uint8_t)minimum;
                }
            }
            continue;
        }
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *dst = panel + (c * blocks + b) * bytes;
            if (int8) write_int8(q + b * 32, dst, kind);
            else write_float(q + b * 32, dst, kind);
            for (int j = 0; j < 16; j++) {
                scales[j] = d[j * (STRIDE / 16) + 2 * b];
                if (kind == Q6_K) scales[16 + j] = d[j * (STRIDE / 16) + 2 * b + 1];
                if (has_min(kind)) scales[16 + j] = m[j * (STRIDE / 32) + b];
            }
            memcpy(dst + scales_at(kind), scales, scale_bytes);
        }
    }
}

/* raw [rows of the file, row_bytes] of ggml type `type` -> panels [ceil(out / 16), in / 32 * block
 * bytes] of its kind (kind_of), output r being the file's row order[r] (order NULL: row r); int8:
 * csrc/qlinear_i8.c's layout. Returns 0, or -2 for a type it does not read or a row of other bytes */
int rill_repack(const uint8_t *raw, int64_t row_bytes, const int64_t *order, int64_t out, int64_t in, int type,
                int int8, uint8_t *panels, int threads) {
    const gguf_type t = type_of(type);
    if (!t.weights || in % t.weights || row_bytes != in / t.weights * t.bytes || out <= 0) return -2;
    const int64_t num_panels = (out + 15) / 16, panel_bytes = in / 32 * block_bytes(kind_of(type, int8));
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 4)
    for (int64_t p = 0; p < num_panels; p++) {
        int64_t rows[16];
        for (int j = 0; j < 16; j++) rows[j] = p * 16 + j < out ? (order ? order[p * 16 + j] : p * 16 + j) : -1;
        uint8_t *panel = panels + p * panel_bytes;
        switch (type) {  /* the type a constant in each copy of the loops */
#define PANEL(T)                                                      \
    case T:                                                           \
        if (int8) repack_panel(raw, row_bytes, rows, in, panel, T, 1); \
        else repack_panel(raw, row_bytes, rows, in, panel, T, 0);     \
        break;
            PANEL(T_Q8_0) PANEL(T_Q4_0) PANEL(T_Q4_1) PANEL(T_Q5_0) PANEL(T_Q5_1) PANEL(T_Q3_K) PANEL(T_Q4_K)
            PANEL(T_Q5_K) PANEL(T_Q6_K) PANEL(T_IQ4_NL) PANEL(T_IQ4_XS)
#undef PANEL
            default: break;
        }
    }
    return 0;
}
