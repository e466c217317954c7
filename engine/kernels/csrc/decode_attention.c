/* Decode attention on the paged KV cache, float32, for CPUs (built by engine/kernels/build.py).
 *
 * One query token per sequence; each sequence is one task (or, when sequences are few, each range
 * of its positions, merged after, and for contexts too short for that each (sequence, KV head)
 * pair): it reads its keys and values straight from their cache slots, a tile of positions at a
 * time, each position's row once for all heads, with an online softmax. No gathered copy of the
 * context and no mask tensor, unlike the torch path in attention.py, which computes the same
 * thing with index_select + scaled_dot_product_attention.
 *
 * Layouts (element strides; the last dimension of every tensor is contiguous):
 *   q        query of token t, head qh at q + t * q_tok + qh * q_head, head_dim floats
 *   index    [B] the token row of each sequence's query (and of its output)
 *   k, v     [num_slots, kv_heads, head_dim] the layer's cache
 *   slots    [B, max_ctx] cache slot of each context position (row-major, 0-padded)
 *   lens     [B] context length of each sequence, its new token included
 *   out      [num_tokens, heads, head_dim] contiguous; rows not in index are left alone
 * window > 0: only the last `window` positions are visible. softcap > 0: scores pass through
 * softcap * tanh(score / softcap) (Gemma 2). Query head qh uses KV head qh / (heads / kv_heads).
 *
 * A shared prefix (a system prompt, a chat's earlier turns: the prefix cache gives the sequences
 * the same slots) is read once for all the sequences that share it: a first pass takes, per group
 * and KV head, every member's query heads against each tile of the shared positions (a small
 * matrix product over a transposed tile), and leaves each query head's softmax state (max, sum,
 * weighted values); the second pass goes on from that state over each sequence's own positions.
 * Alone, each of 32 sequences would stream the prefix's K and V rows through the caches again.
 */
#include <math.h>
#include <stdint.h>
#include "rill_kernels.h"
#include <stdlib.h>
#include <string.h>
#include "vec8.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define TILE 32
#define MIN_SHARED 64 /* positions in common before sequences share a first pass */
#define MAX_GROUP 64  /* sequences in one first pass at most (its state lives on the stack) */
#define MIN_RANGE 64  /* positions a range of one sequence's context has at least, when split */
#define MAX_RANGES 8

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    /* sixteen lanes in two independent chains: vectorizes without -ffast-math */
    float acc[16] = {0};
    int d = 0;
    for (; d + 16 <= n; d += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[d + j] * b[d + j];
    for (int j = 0; j < 8; j++) acc[j] += acc[j + 8];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

/* s[i] = scale * (q . (kr[i] + off)) for the tile's n positions. With AVX2 and D a multiple of 8 up
   to 128: q stays in registers, four positions' products are summed lane-wise and reduced together
   (one dot and its reduction per position and head took most of a 32-sequence step's attention) */
static inline void tile_scores(const float *q, const float *const *kr, int64_t off, int n, int D, float scale,
                               float *s) {
    int i = 0;
#ifdef __AVX2__
    if (D % 8 == 0 && D <= 128) {
        const int nv = D / 8;
        __m256 qv[16];
        for (int c = 0; c < nv; c++) qv[c] = _mm256_loadu_ps(q + 8 * c);
        for (; i + 4 <= n; i += 4) {
            const float *k0 = kr[i] + off, *k1 = kr[i + 1] + off, *k2 = kr[i + 2] + off, *k3 = kr[i + 3] + off;
            __m256 a0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k0)), a1 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k1));
            __m256 a2 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k2)), a3 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k3));
            for (int c = 1; c < nv; c++) {
                a0 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k0 + 8 * c), a0);
                a1 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k1 + 8 * c), a1);
                a2 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k2 + 8 * c), a2);
                a3 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k3 + 8 * c), a3);
            }
            /* lanes of a0..a3 summed: hadd pairs them, then the two 128-bit halves */
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(s + i, _mm_mul_ps(sum, _mm_set1_ps(scale)));
        }
    }
#endif
    for (; i < n; i++) s[i] = dot(q, kr[i] + off, D) * scale;
}

/* Scores of one tile through the optional softcap, then the online softmax's update of each
   query head's max m, sum l and weighted values acc: s[j * TILE + i] becomes the weight. */
static inline void softmax_tile(float *s, int nq, int n, float *m, float *l, float *acc, int D, float softcap) {
    if (softcap > 0.0f) {
        for (int j = 0; j < nq; j++)
            for (int i = 0; i < n; i++) s[j * TILE + i] = softcap * tanhf(s[j * TILE + i] / softcap);
    }
    for (int j = 0; j < nq; j++) {
        float *sj = s + j * TILE, top = m[j];
        for (int i = 0; i < n; i++) top = sj[i] > top ? sj[i] : top;
        const float rescale = expf(m[j] - top); /* 0 on the first tile (m = -inf) */
        float sum = 0.0f;
        const int n8 = (n + 7) & ~7; /* TILE is a multiple of 8: the padding is the tile's, unused */
        for (int i = n; i < n8; i++) sj[i] = top;
        for (int i = 0; i < n8; i += 8) store8(sj + i, exp8(load8(sj + i) - top));
        for (int i = 0; i < n; i++) sum += sj[i];
        l[j] = l[j] * rescale + sum;
        m[j] = top;
        float *aj = acc + j * D;
        for (int d = 0; d < D; d++) aj[d] *= rescale;
    }
}

/* acc[0..D) += p[i] * (vr[i] + off)[0..D) over the tile's n positions, in order: with D a
   multiple of 64 (or 32), 64 (32) of the sums stay in registers over the whole tile (the values of
   a position were otherwise multiplied into sums loaded and stored again for every position; with
   32, its 4 chains wait on the multiply-add's latency) */
static inline void weigh_values(float *acc, const float *p, const float *const *vr, int64_t off, int n, int D) {
    if (D % 64 == 0) { /* 64 sums in 8 registers: 8 chains of multiply-adds, enough to hide their latency */
        for (int d0 = 0; d0 < D; d0 += 64) {
            float *a = acc + d0;
            v8 c[8];
            for (int u = 0; u < 8; u++) c[u] = load8(a + 8 * u);
            for (int i = 0; i < n; i++) {
                const float *vh = vr[i] + off + d0;
                for (int u = 0; u < 8; u++) c[u] += p[i] * load8(vh + 8 * u);
            }
            for (int u = 0; u < 8; u++) store8(a + 8 * u, c[u]);
        }
        return;
    }
    if (D % 32 == 0) {
        for (int d0 = 0; d0 < D; d0 += 32) {
            float *a = acc + d0;
            v8 c0 = load8(a), c1 = load8(a + 8), c2 = load8(a + 16), c3 = load8(a + 24);
            for (int i = 0; i < n; i++) {
                const float *vh = vr[i] + off + d0;
                c0 += p[i] * load8(vh), c1 += p[i] * load8(vh + 8), c2 += p[i] * load8(vh + 16), c3 += p[i] * load8(vh + 24);
            }
            store8(a, c0), store8(a + 8, c1), store8(a + 16, c2), store8(a + 24, c3);
        }
        return;
    }
    for (int i = 0; i < n; i++) {
        const float *restrict vh = vr[i] + off;
        for (int d = 0; d < D; d++) acc[d] += p[i] * vh[d];
    }
}

/* one query head's softmax state as the passes hand it on: max, sum, then its D weighted values */
static inline void save_state(float *st, float m, float l, const float *acc, int D) {
    st[0] = m, st[1] = l;
    memcpy(st + 2, acc, sizeof(float) * D);
}

/* the first context position a sequence's own pass reads: past the shared pass and the window */
static inline int64_t own_start(int64_t len, int64_t shared, int64_t window) {
    const int64_t lo = window > 0 && len > window ? len - window : 0;
    return lo > shared ? lo : shared;
}

/* The first pass over positions [0, shared) that the group's members share (their slots are
   the leader's): for KV head h, the query heads of every member at once, as a matrix product:
   the queries are transposed once (qt[d][j], padded to QB), and each block of PB positions by QB
   queries keeps its scores in registers. Leaves each member's state in `state` (see
   rill_decode_attention). */
enum { PB = 4 };
static inline __attribute__((always_inline)) void shared_range(
        const float *q, int64_t q_tok, int64_t q_head, const int64_t *index, const int *members, int num_members,
        const float *k, const float *v, const int64_t *slots, int64_t lo, int64_t hi, float *state, int heads,
        int kv_heads, int h, int head_dim, float scale, float softcap, const int QV) {
    const int QB = 8 * QV; /* queries per block: 8 (one vector) for a few, else 16 */
    const int groups = heads / kv_heads, D = head_dim, nq = num_members * groups;
    const int nqp = (nq + QB - 1) / QB * QB;
    const int64_t row_width = (int64_t)kv_heads * D;
    /* scores position-major, s[i][j]: a block's sums are stored as they are, and the softmax runs
       on 8 queries at once (query-major, each score was taken out of its vector one by one) */
    float m[nqp], l[nqp], acc[nqp * D], s[TILE * nqp], qt[D * nqp];
    const float *kr[TILE], *vr[TILE];
    for (int j = 0; j < nqp; j++) {
        const float *qv = j < nq ? q + index[members[j / groups]] * q_tok + (int64_t)(h * groups + j % groups) * q_head : NULL;
        for (int d = 0; d < D; d++) qt[d * nqp + j] = qv ? qv[d] : 0.0f;
    }
    for (int j = 0; j < nqp; j++) m[j] = -INFINITY, l[j] = 0.0f;
    for (int i = 0; i < nqp * D; i++) acc[i] = 0.0f;
    for (int64_t t0 = lo; t0 < hi; t0 += TILE) {
        const int n = (int)(hi - t0 < TILE ? hi - t0 : TILE);
        for (int i = 0; i < TILE; i++) { /* past n: position t0 again, its scores unused */
            kr[i] = k + slots[t0 + (i < n ? i : 0)] * row_width + (int64_t)h * D;
            vr[i] = v + slots[t0 + (i < n ? i : 0)] * row_width + (int64_t)h * D;
        }
        const int64_t next = t0 + TILE, next_n = hi - next < TILE ? hi - next : TILE; /* the next tile's */
        for (int i0 = 0; i0 < n; i0 += PB) {
            /* this head's slice of the next tile's rows (rows 8 KB apart on a 1.7B: no hardware
               prefetcher follows them), a few positions per block of scores */
            for (int i = i0; i < i0 + PB && i < next_n; i++) {
                const int64_t at = slots[next + i] * row_width + (int64_t)h * D;
                for (int64_t b = 0; b < (int64_t)D * (int64_t)sizeof(float); b += 64) /* 3: every cache level (T0) */
                    __builtin_prefetch((const char *)(k + at) + b, 0, 3), __builtin_prefetch((const char *)(v + at) + b, 0, 3);
            }
            const float *k0 = kr[i0], *k1 = kr[i0 + 1], *k2 = kr[i0 + 2], *k3 = kr[i0 + 3];
            for (int j0 = 0; j0 < nqp; j0 += QB) {
                v8 a[PB][2] = {{{0}, {0}}, {{0}, {0}}, {{0}, {0}}, {{0}, {0}}};
                for (int d = 0; d < D; d++)
                    for (int u = 0; u < QV; u++) {
                        const v8 qd = load8(qt + d * nqp + j0 + 8 * u);
                        a[0][u] += k0[d] * qd, a[1][u] += k1[d] * qd, a[2][u] += k2[d] * qd, a[3][u] += k3[d] * qd;
                    }
                for (int p = 0; p < PB; p++)
                    for (int u = 0; u < QV; u++) store8(s + (i0 + p) * nqp + j0 + 8 * u, a[p][u] * scale);
            }
        }
        if (softcap > 0.0f)
            for (int i = 0; i < n * nqp; i++) s[i] = softcap * tanhf(s[i] / softcap);
        for (int j0 = 0; j0 < nqp; j0 += 8) { /* the online softmax, 8 queries at a time */
            v8 top = load8(m + j0);
            for (int i = 0; i < n; i++) {
                const v8 si = load8(s + i * nqp + j0);
                const v8i above = si > top;
                top = (v8)(((v8i)si & above) | ((v8i)top & ~above));
            }
            /* the first tile: m is -inf, so rescale is ~0 (exp8 clamps -inf to -87) times acc 0, l 0 */
            const v8 rescale = exp8(load8(m + j0) - top);
            v8 sum = {0};
            for (int i = 0; i < n; i++) {
                const v8 w = exp8(load8(s + i * nqp + j0) - top);
                store8(s + i * nqp + j0, w);
                sum += w;
            }
            store8(l + j0, load8(l + j0) * rescale + sum);
            store8(m + j0, top);
            for (int jj = 0; jj < 8; jj++)
                for (int d = 0; d < D; d++) acc[(j0 + jj) * D + d] *= rescale[jj];
        }
        for (int j = 0; j < nq; j++) { /* acc[j] += sum over the tile's positions of weight * values */
            float p[TILE];
            for (int i = 0; i < n; i++) p[i] = s[i * nqp + j];
            weigh_values(acc + j * D, p, vr, 0, n, D);
        }
    }
    for (int j = 0; j < nq; j++) {
        save_state(state + ((int64_t)members[j / groups] * heads + h * groups + j % groups) * (D + 2), m[j], l[j],
                   acc + j * D, D);
    }
}

static void shared_task(const float *q, int64_t q_tok, int64_t q_head, const int64_t *index, const int *members,
                        int num_members, const float *k, const float *v, const int64_t *slots, int64_t lo, int64_t hi,
                        float *state, int heads, int kv_heads, int h, int head_dim, float scale, float softcap) {
    if (num_members * (heads / kv_heads) <= 8)
        shared_range(q, q_tok, q_head, index, members, num_members, k, v, slots, lo, hi, state, heads, kv_heads, h,
                     head_dim, scale, softcap, 1);
    else
        shared_range(q, q_tok, q_head, index, members, num_members, k, v, slots, lo, hi, state, heads, kv_heads, h,
                     head_dim, scale, softcap, 2);
}

/* a task's query heads at its end: their softmax states into `part` (for merge_parts), or else
   their outputs (weighted values over sum) */
static inline void finish_heads(float *part, float *out, int64_t row, int heads, int qh0, int nq, const float *m,
                                const float *l, const float *acc, int D) {
    for (int j = 0; j < nq; j++) {
        if (part) {
            save_state(part + (int64_t)(qh0 + j) * (D + 2), m[j], l[j], acc + j * D, D);
            continue;
        }
        float *o = out + (row * heads + qh0 + j) * (int64_t)D;
        const float inv = 1.0f / l[j];
        for (int d = 0; d < D; d++) o[d] = acc[j * D + d] * inv;
    }
}

/* KV heads [h0, h1) of one sequence, positions [lo, len): reads each position's cache row once,
   for all those heads. `state` (or NULL): where the shared pass left each head. `part` (or NULL):
   leave each query head's softmax state there (max, sum, weighted values; by query head, as
   `state`) for merge_parts instead of writing its output. */
static void one_task(const float *q, int64_t q_tok, int64_t q_head, int64_t row,
                     const float *k, const float *v, const int64_t *slots, int64_t lo, int64_t len,
                     const float *state, float *part, float *out, int heads, int kv_heads, int h0, int h1,
                     int head_dim, float scale, float softcap) {
    const int groups = heads / kv_heads, D = head_dim;
    const int qh0 = h0 * groups, nq = (h1 - h0) * groups; /* the query heads of this task */
    float m[nq], l[nq], acc[nq * D], s[nq * TILE];
    const float *qj[nq], *vr[TILE]; /* each query head's vector, each position's values */
    int64_t kv_off[nq]; /* where its KV head sits in a cache row */
    for (int j = 0; j < nq; j++) {
        const float *st = state ? state + (int64_t)(qh0 + j) * (D + 2) : NULL; /* max, sum, values */
        m[j] = st ? st[0] : -INFINITY;
        l[j] = st ? st[1] : 0.0f;
        for (int d = 0; d < D; d++) acc[j * D + d] = st ? st[2 + d] : 0.0f;
        qj[j] = q + row * q_tok + (int64_t)(qh0 + j) * q_head;
        kv_off[j] = (int64_t)((qh0 + j) / groups) * D;
    }
    for (int64_t t0 = lo; t0 < len; t0 += TILE) {
        const int n = (int)(len - t0 < TILE ? len - t0 : TILE);
        const float *kr[TILE];
        for (int i = 0; i < n; i++) kr[i] = k + slots[t0 + i] * kv_heads * D; /* each position's row */
        for (int j = 0; j < nq; j++) tile_scores(qj[j], kr, kv_off[j], n, D, scale, s + j * TILE);
        softmax_tile(s, nq, n, m, l, acc, D, softcap);
        for (int i = 0; i < n; i++) vr[i] = v + slots[t0 + i] * kv_heads * D; /* each position's row */
        for (int j = 0; j < nq; j++) weigh_values(acc + j * D, s + j * TILE, vr, kv_off[j], n, D);
    }
    finish_heads(part, out, row, heads, qh0, nq, m, l, acc, D);
}

#ifdef __AVX512F__
/* With AVX-512 and head_dim a multiple of 16 up to 128: one_task's work on zmm registers. A tile's
   scores 16 positions at a time per query head (each position's products over the head's lanes,
   then the 16 positions' sums together by a transposing tree), the softmax on 16 lanes, and each KV
   head's query heads' weighted values in registers over the tile (a position's value row loaded
   once for them). The next tile's key and value rows, or the next task's first, are prefetched while
   this one runs, only the KV heads the task reads of them (a task per KV head that read every
   head's was much slower): the cache of 32 sequences outgrows the L3
   cache between layers, and decode attention otherwise waited on memory. */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i_ __attribute__((vector_size(64)));

RILL_DEFINE_EXP(exp16, v16f, v16i_) /* exp8 on 16 lanes (vec8.h) */

/* lane i = the sum of v[i]'s 16 lanes */
static inline __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* lane 4k + e of d holds v[4e + k]'s sum */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, d);
}

static inline __attribute__((always_inline)) void one_task16_nv(
    const float *q, int64_t q_tok, int64_t q_head, int64_t row, const float *k, const float *v, const int64_t *slots,
    int64_t lo, int64_t len, const float *state, float *part, float *out, int heads, int kv_heads, int h0, int h1,
    float scale, float softcap, const int64_t *next_slots, int64_t next_lo, int64_t next_len, int next_h0,
    const int nv) {
    const int groups = heads / kv_heads, D = 16 * nv;
    const int qh0 = h0 * groups, nq = (h1 - h0) * groups;
    const int64_t width = (int64_t)kv_heads * D;
    const int64_t pf_bytes = (int64_t)(h1 - h0) * D * (int64_t)sizeof(float); /* a row's KV heads of this task */
    float m[nq], l[nq], s[nq * TILE] __attribute__((aligned(64)));
    float acc[nq * D] __attribute__((aligned(64)));
    for (int j = 0; j < nq; j++) {
        const float *st = state ? state + (int64_t)(qh0 + j) * (D + 2) : NULL;
        m[j] = st ? st[0] : -INFINITY;
        l[j] = st ? st[1] : 0.0f;
        for (int d = 0; d < D; d++) acc[j * D + d] = st ? st[2 + d] : 0.0f;
    }
    for (int64_t t0 = lo; t0 < len; t0 += TILE) {
        const int n = (int)(len - t0 < TILE ? len - t0 : TILE);
        const float *kr[TILE], *vr[TILE];
        const float *pf_k[TILE], *pf_v[TILE]; /* the next tile's rows, or the next task's first tile */
        {
            const int64_t *ps = t0 + TILE < len ? slots : next_slots;
            const int64_t a = t0 + TILE < len ? t0 + TILE : next_lo, e = t0 + TILE < len ? len : next_len;
            const int64_t heads_at = (int64_t)(t0 + TILE < len ? h0 : next_h0) * D; /* only the heads it reads */
            for (int i = 0; i < TILE; i++) {
                const int ok = ps && a + i < e;
                pf_k[i] = ok ? k + ps[a + i] * width + heads_at : NULL;
                pf_v[i] = ok ? v + ps[a + i] * width + heads_at : NULL;
            }
        }
        for (int i = 0; i < TILE; i++) { /* past n: the tile's first position again, its weight 0 */
            kr[i] = k + slots[t0 + (i < n ? i : 0)] * width;
            vr[i] = v + slots[t0 + (i < n ? i : 0)] * width;
        }
        for (int j = 0; j < nq; j++) {
            const int64_t off = (int64_t)((qh0 + j) / groups) * D;
            const float *qv = q + row * q_tok + (int64_t)(qh0 + j) * q_head;
            __m512 qr[8];
            for (int c = 0; c < nv; c++) qr[c] = _mm512_loadu_ps(qv + 16 * c);
            for (int i0 = 0; i0 < n; i0 += 16) {
                __m512 prod[16];
                for (int i = 0; i < 16; i++) {
                    const float *kp = kr[i0 + i] + off;
                    __m512 a = _mm512_mul_ps(qr[0], _mm512_loadu_ps(kp));
                    for (int c = 1; c < nv; c++) a = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(kp + 16 * c), a);
                    prod[i] = a;
                }
                _mm512_store_ps(s + j * TILE + i0, _mm512_mul_ps(sum16(prod), _mm512_set1_ps(scale)));
            }
        }
        if (softcap > 0.0f)
            for (int j = 0; j < nq; j++)
                for (int i = 0; i < n; i++) s[j * TILE + i] = softcap * tanhf(s[j * TILE + i] / softcap);
        for (int j = 0; j < nq; j++) { /* the online softmax: weights in s, zero past n */
            float *sj = s + j * TILE, top = m[j];
            for (int i = 0; i < n; i++) top = sj[i] > top ? sj[i] : top;
            const float rescale = expf(m[j] - top);
            v16f sum = {0};
            for (int i0 = 0; i0 < n; i0 += 16) {
                v16f w = exp16(*(v16f *)(sj + i0) - top);
                for (int i = n - i0; i < 16; i++) w[i] = 0.0f;
                *(v16f *)(sj + i0) = w;
                sum += w;
            }
            float total = 0.0f;
            for (int i = 0; i < 16; i++) total += sum[i];
            l[j] = l[j] * rescale + total;
            m[j] = top;
            for (int d = 0; d < D; d++) acc[j * D + d] *= rescale;
        }
        const int chunk = 16 / nv; /* query heads whose sums fit 16 registers */
        for (int j0 = 0; j0 < nq; j0 += chunk) {
            const int cnt = nq - j0 < chunk ? nq - j0 : chunk;
            /* the chunk's heads may span KV heads: each head's own row offset */
            __m512 c[16];
            for (int j = 0; j < 16 / nv; j++)
                for (int u = 0; u < nv; u++) c[j * nv + u] = j < cnt ? _mm512_load_ps(acc + (j0 + j) * D + 16 * u) : _mm512_setzero_ps();
            for (int i = 0; i < n; i++) {
                if (j0 == 0 && pf_k[i]) /* spread over the tile's positions: all at once, they queued behind each other */
                    for (int64_t b = 0; b < pf_bytes; b += 64)
                        _mm_prefetch((const char *)pf_k[i] + b, _MM_HINT_T0), _mm_prefetch((const char *)pf_v[i] + b, _MM_HINT_T0);
                for (int j = 0; j < 16 / nv; j++) {
                    if (j >= cnt) break;
                    const float *vp = vr[i] + (int64_t)((qh0 + j0 + j) / groups) * D;
                    const __m512 p = _mm512_set1_ps(s[(j0 + j) * TILE + i]);
                    for (int u = 0; u < nv; u++) c[j * nv + u] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vp + 16 * u), c[j * nv + u]);
                }
            }
            for (int j = 0; j < 16 / nv; j++)
                for (int u = 0; u < nv; u++)
                    if (j < cnt) _mm512_store_ps(acc + (j0 + j) * D + 16 * u, c[j * nv + u]);
        }
    }
    finish_heads(part, out, row, heads, qh0, nq, m, l, acc, D);
}

static void one_task16(const float *q, int64_t q_tok, int64_t q_head, int64_t row, const float *k, const float *v,
                       const int64_t *slots, int64_t lo, int64_t len, const float *state, float *part, float *out,
                       int heads, int kv_heads, int h0, int h1, int head_dim, float scale, float softcap,
                       const int64_t *next_slots, int64_t next_lo, int64_t next_len, int next_h0) {
    switch (head_dim / 16) { /* each width its own code: the registers' loops unrolled */
#define WIDTH(nv) case nv: one_task16_nv(q, q_tok, q_head, row, k, v, slots, lo, len, state, part, out, heads, kv_heads, \
                                         h0, h1, scale, softcap, next_slots, next_lo, next_len, next_h0, nv); break;
    WIDTH(1) WIDTH(2) WIDTH(3) WIDTH(4) WIDTH(5) WIDTH(6) WIDTH(7) WIDTH(8)
#undef WIDTH
    }
}
#endif

/* One query head's softmax states from parts of its positions (`stride` floats apart; a part with
   no positions has sum 0 and is skipped) as one: each part's sum and values rescaled to the
   largest max, into dst (max, sum, values) */
static void merge_states(const float *parts, int num_parts, int64_t stride, float *dst, int D) {
    float top = -INFINITY, l = 0.0f, acc[D];
    for (int p = 0; p < num_parts; p++) {
        const float *st = parts + p * stride;
        if (st[1] > 0.0f) top = st[0] > top ? st[0] : top;
    }
    for (int d = 0; d < D; d++) acc[d] = 0.0f;
    for (int p = 0; p < num_parts; p++) {
        const float *st = parts + p * stride;
        if (!(st[1] > 0.0f)) continue;
        const float w = expf(st[0] - top);
        l += st[1] * w;
        for (int d = 0; d < D; d++) acc[d] += st[2 + d] * w;
    }
    save_state(dst, top, l, acc, D);
}

/* One sequence's output from the softmax states its position ranges left (in order) */
static void merge_parts(const float *parts, int num_parts, int64_t part_width, float *out, int heads, int D) {
    for (int qh = 0; qh < heads; qh++) {
        float st[D + 2];
        merge_states(parts + (int64_t)qh * (D + 2), num_parts, part_width, st, D);
        float *o = out + (int64_t)qh * D;
        const float inv = 1.0f / st[1];
        for (int d = 0; d < D; d++) o[d] = st[2 + d] * inv;
    }
}

/* How many ranges each of `tasks` tasks over at most `longest` positions is split into, so that
   the threads share them evenly (the first count of at least 4 a thread): 1 when they already do */
static int split_ranges(int tasks, int64_t longest, int threads) {
    if (threads <= 1 || (tasks % threads == 0 && tasks >= 2 * threads)) return 1;
    const int most = (int)(longest / MIN_RANGE < MAX_RANGES ? longest / MIN_RANGE : MAX_RANGES);
    int ranges = 1;
    for (int r = 2; r <= most; r++) {
        if (tasks * r % threads) continue;
        ranges = r;
        if (tasks * r >= 4 * threads) break;
    }
    return ranges;
}

void rill_decode_attention(const float *q, int64_t q_tok, int64_t q_head, const int64_t *index,
                           const float *k, const float *v, const int64_t *slots, int64_t max_ctx,
                           const int64_t *lens, float *out, int num_seqs, int heads, int kv_heads,
                           int head_dim, float scale, int64_t window, float softcap, int threads) {
    /* Groups: a sequence joins the first one before it whose slots it shares for MIN_SHARED
       positions or more (the prefix cache's blocks), short of its own last position; a group's
       shared run is its members' shortest. Not with a sliding window. */
    int leader[num_seqs], members[num_seqs], group_start[num_seqs + 1]; /* a group's first member leads it */
    int64_t shared[num_seqs]; /* per sequence: positions the first pass covered */
    int num_groups = 0, num_members = 0;
    for (int b = 0; b < num_seqs; b++) leader[b] = -1, shared[b] = 0;
    for (int b = 0; b < num_seqs && window <= 0; b++) {
        if (leader[b] >= 0) continue;
        const int64_t *sb = slots + (int64_t)b * max_ctx;
        int64_t run = INT64_MAX;
        int count = 0;
        for (int c = b + 1; c < num_seqs && count + 1 < MAX_GROUP; c++) {
            if (leader[c] >= 0) continue;
            const int64_t *sc = slots + (int64_t)c * max_ctx;
            const int64_t limit = (lens[b] < lens[c] ? lens[b] : lens[c]) - 1;
            int64_t same = 0;
            while (same < limit && sb[same] == sc[same]) same++;
            if (same >= MIN_SHARED) leader[c] = b, run = same < run ? same : run, count++;
        }
        if (!count) continue;
        group_start[num_groups++] = num_members;
        members[num_members++] = b, shared[b] = run;
        for (int c = b + 1; c < num_seqs; c++)
            if (leader[c] == b) members[num_members++] = c, shared[c] = run;
    }
    group_start[num_groups] = num_members;
    const int64_t state_width = (int64_t)heads * (head_dim + 2);
    float *state = num_groups ? malloc(sizeof(float) * num_seqs * state_width) : NULL;
    if (num_groups && !state) num_groups = 0, memset(shared, 0, sizeof shared); /* no memory: alone */
    /* the shared pass: a task per group and KV head, and per range of the shared positions when
       those are too few to share evenly (a speculative step's verification: one group of a few
       rows, SmolLM2's 3 KV heads on 2 threads), each range's states merged into `state` after */
    int64_t longest_shared = 0;
    for (int g = 0; g < num_groups; g++) {
        const int64_t run = shared[members[group_start[g]]];
        longest_shared = run > longest_shared ? run : longest_shared;
    }
    int shared_ranges = split_ranges(num_groups * kv_heads, longest_shared, threads);
    float *shared_parts = shared_ranges > 1 ? malloc(sizeof(float) * (size_t)num_seqs * shared_ranges * state_width) : NULL;
    if (!shared_parts) shared_ranges = 1;
    const int shared_tasks = num_groups * kv_heads * shared_ranges;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && shared_tasks > 1)
    for (int task = 0; task < shared_tasks; task++) {
        const int g = task / (kv_heads * shared_ranges), r = task / kv_heads % shared_ranges, b = members[group_start[g]];
        shared_task(q, q_tok, q_head, index, members + group_start[g], group_start[g + 1] - group_start[g], k, v,
                    slots + (int64_t)b * max_ctx, shared[b] * r / shared_ranges, shared[b] * (r + 1) / shared_ranges,
                    shared_parts ? shared_parts + (int64_t)r * num_seqs * state_width : state, heads, kv_heads,
                    task % kv_heads, head_dim, scale, softcap);
    }
    for (int b = 0; b < num_seqs && shared_parts; b++)
        for (int qh = 0; qh < heads && shared[b]; qh++)
            merge_states(shared_parts + b * state_width + (int64_t)qh * (head_dim + 2), shared_ranges,
                         (int64_t)num_seqs * state_width, state + b * state_width + (int64_t)qh * (head_dim + 2), head_dim);
    free(shared_parts);
    /* one task per sequence (its cache rows are read whole, once); when there are too few
       sequences to keep every thread busy, per range of positions (each range's softmax state
       merged in order afterwards), the rows still read whole, front to back; and when a context
       is too short for ranges, per KV head. A task per KV head reads a slice of every row, rows
       8 KB apart on a 1.7B, slower than ranges over whole rows (docs/benchmarks-history.md) */
    int64_t longest = 0;
    for (int b = 0; b < num_seqs; b++) {
        const int64_t own = lens[b] - own_start(lens[b], shared[b], window);
        longest = own > longest ? own : longest;
    }
    int split = 1, ranges = 1;
    if (num_seqs < 4 * threads) {
        ranges = split_ranges(num_seqs, longest, threads);
        if (num_seqs * ranges < threads) /* too short to share: a task per KV head */
            split = kv_heads, ranges = split_ranges(num_seqs * split, longest, threads);
    }
    float *parts = ranges > 1 ? malloc(sizeof(float) * (size_t)num_seqs * ranges * state_width) : NULL;
    if (!parts) ranges = 1;
    const int tasks = num_seqs * split * ranges;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && tasks > 1)
    for (int task = 0; task < tasks; task++) {
        const int b = task / (split * ranges), part = task % split, r = task / split % ranges, per = kv_heads / split;
        const int64_t lo = own_start(lens[b], shared[b], window);
        const int64_t from = lo + (lens[b] - lo) * r / ranges, to = lo + (lens[b] - lo) * (r + 1) / ranges;
#ifdef __AVX512F__
        if (head_dim % 16 == 0 && head_dim <= 128) {
            /* the task this thread likely takes next (tasks go to the threads in turn), to prefetch */
            const int nt = task + threads, nb = nt / (split * ranges), nr = nt / split % ranges, nh0 = nt % split * per;
            const int64_t *next = nt < tasks ? slots + (int64_t)nb * max_ctx : NULL;
            int64_t next_from = 0, next_to = 0;
            if (next) {
                const int64_t nlo = own_start(lens[nb], shared[nb], window);
                next_from = nlo + (lens[nb] - nlo) * nr / ranges, next_to = nlo + (lens[nb] - nlo) * (nr + 1) / ranges;
            }
            one_task16(q, q_tok, q_head, index[b], k, v, slots + (int64_t)b * max_ctx, from, to,
                       shared[b] && r == 0 ? state + b * state_width : NULL,
                       parts ? parts + ((int64_t)b * ranges + r) * state_width : NULL, out, heads, kv_heads,
                       part * per, (part + 1) * per, head_dim, scale, softcap, next, next_from, next_to, nh0);
            continue;
        }
#endif
        one_task(q, q_tok, q_head, index[b], k, v, slots + (int64_t)b * max_ctx, from, to,
                 shared[b] && r == 0 ? state + b * state_width : NULL,
                 parts ? parts + ((int64_t)b * ranges + r) * state_width : NULL, out, heads, kv_heads, part * per,
                 (part + 1) * per, head_dim, scale, softcap);
    }
    for (int b = 0; b < num_seqs && parts; b++)
        merge_parts(parts + (int64_t)b * ranges * state_width, ranges, state_width,
                    out + index[b] * heads * (int64_t)head_dim, heads, head_dim);
    free(parts);
    free(state);
}
