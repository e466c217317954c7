/* Decode attention on the paged KV cache, float32, for CPUs (built by engine/cpu.py).
 *
 * One query token per sequence; each sequence is one task (or each (sequence, KV head) pair when
 * sequences are few): it reads its keys and values straight from their cache slots, a tile of
 * positions at a time, each position's row once for all heads, with an online softmax. No gathered copy
 * of the context and no mask tensor, unlike the torch path in attention.py, which computes the
 * same thing with index_select + scaled_dot_product_attention.
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
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE 32

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

/* e^x for x <= 0, within 2e-7 relative of expf, in plain arithmetic the compiler vectorizes (libm's
   expf is a call per element): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x; /* e^-87 ~ 1.6e-38: still a normal float, and negligible in a softmax */
    const float n = __builtin_rintf(x * 1.44269504f);
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f; /* ln2 split in two for precision */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* KV heads [h0, h1) of one sequence: reads each position's cache row once, for all those heads. */
static void one_task(const float *q, int64_t q_tok, int64_t q_head, int64_t row,
                     const float *k, const float *v, const int64_t *slots, int64_t len,
                     float *out, int heads, int kv_heads, int h0, int h1, int head_dim,
                     float scale, int64_t window, float softcap) {
    const int groups = heads / kv_heads, D = head_dim;
    const int qh0 = h0 * groups, nq = (h1 - h0) * groups; /* the query heads of this task */
    float m[nq], l[nq], acc[nq * D], s[nq * TILE];
    const float *qj[nq]; /* each query head's vector */
    int64_t kv_off[nq]; /* where its KV head sits in a cache row */
    for (int j = 0; j < nq; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
        qj[j] = q + row * q_tok + (int64_t)(qh0 + j) * q_head;
        kv_off[j] = (int64_t)((qh0 + j) / groups) * D;
    }
    for (int i = 0; i < nq * D; i++) acc[i] = 0.0f;
    const int64_t lo = (window > 0 && len > window) ? len - window : 0;
    for (int64_t t0 = lo; t0 < len; t0 += TILE) {
        const int n = (int)(len - t0 < TILE ? len - t0 : TILE);
        for (int i = 0; i < n; i++) {
            const float *kp = k + slots[t0 + i] * kv_heads * D; /* the position's row: every KV head */
            for (int j = 0; j < nq; j++) s[j * TILE + i] = dot(qj[j], kp + kv_off[j], D) * scale;
        }
        if (softcap > 0.0f) {
            for (int j = 0; j < nq; j++)
                for (int i = 0; i < n; i++) s[j * TILE + i] = softcap * tanhf(s[j * TILE + i] / softcap);
        }
        for (int j = 0; j < nq; j++) {
            float *sj = s + j * TILE, top = m[j];
            for (int i = 0; i < n; i++) top = sj[i] > top ? sj[i] : top;
            const float rescale = expf(m[j] - top); /* 0 on the first tile (m = -inf) */
            float sum = 0.0f;
            for (int i = 0; i < n; i++) sj[i] = exp_nonpositive(sj[i] - top);
            for (int i = 0; i < n; i++) sum += sj[i];
            l[j] = l[j] * rescale + sum;
            m[j] = top;
            float *aj = acc + j * D;
            for (int d = 0; d < D; d++) aj[d] *= rescale;
        }
        for (int i = 0; i < n; i++) {
            const float *vp = v + slots[t0 + i] * kv_heads * D;
            for (int j = 0; j < nq; j++) {
                const float p = s[j * TILE + i], *restrict vh = vp + kv_off[j];
                float *restrict aj = acc + j * D;
                for (int d = 0; d < D; d++) aj[d] += p * vh[d];
            }
        }
    }
    for (int j = 0; j < nq; j++) {
        float *o = out + (row * heads + qh0 + j) * (int64_t)D;
        const float inv = 1.0f / l[j];
        for (int d = 0; d < D; d++) o[d] = acc[j * D + d] * inv;
    }
}

void rill_decode_attention(const float *q, int64_t q_tok, int64_t q_head, const int64_t *index,
                           const float *k, const float *v, const int64_t *slots, int64_t max_ctx,
                           const int64_t *lens, float *out, int num_seqs, int heads, int kv_heads,
                           int head_dim, float scale, int64_t window, float softcap, int threads) {
    /* one task per sequence (its cache rows are read whole, once); per KV head when there are
       too few sequences to keep every thread busy */
    const int split = num_seqs < 4 * threads ? kv_heads : 1, tasks = num_seqs * split;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && tasks > 1)
    for (int task = 0; task < tasks; task++) {
        const int b = task / split, part = task % split, per = kv_heads / split;
        one_task(q, q_tok, q_head, index[b], k, v, slots + (int64_t)b * max_ctx, lens[b], out,
                 heads, kv_heads, part * per, (part + 1) * per, head_dim, scale, window, softcap);
    }
}
