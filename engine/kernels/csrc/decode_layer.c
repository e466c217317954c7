/* The decoder layers of the Llama family for a decode step, in C (built by engine/kernels/build.py
 * with the kernels it calls, declared in rill_kernels.h): no Python between the layers' operations.
 * engine/runner/native.py calls rill_decode_step once per step of decodes and short prompt chunks
 * (all layers, then the final norm and the output head of the rows that sample); longer chunks keep
 * transformers' modules.
 *
 * For x [rows, hidden] (one row per token; row r attends dec_slots[r, :lens[r]], which holds its
 * own position: all K/V rows are written before attention), in place:
 *   h = rmsnorm(x) * norm1;  q, k, v = h Wq, h Wk, h Wv (one fused call or three);
 *   (Qwen3: q, k = rmsnorm(q) * q_norm, rmsnorm(k) * k_norm per head; NULL: none)
 *   q, k = rope(q, k) with the step's cos/sin [rows, head_dim] (computed by the model's own
 *   rotary module); k, v -> the paged cache at slot_mapping; a = attention(q, cache);
 *   x += a Wo;  h = rmsnorm(x) * norm2;  x += (silu(h Wgate) * h Wup) Wdown.
 * The same operations as transformers' LlamaDecoderLayer in float32, so the result matches it up
 * to rounding (the order of additions, fused multiply-adds).
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "blocks.h"
#include "rill_kernels.h"
#include "vec8.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* 0, or -2 when a kernel could not allocate its buffers */
static int linear(const rill_lin *lin, const float *x, int64_t x_row, float *y, int64_t rows, int threads) {
    if (lin->kind == -2 || lin->kind == -3) {
        rill_linear16(x, x_row, (const uint16_t *)lin->panels, lin->bias, y, rows, lin->out, lin->in, threads,
                      lin->kind == -3);
        return 0;
    }
    if (lin->kind < 0) {
        rill_linear(x, x_row, (const float *)lin->panels, lin->bias, y, rows, lin->out, lin->in, threads);
        return 0;
    }
    int status;
    if (lin->kind < INT8_KIND) status = rill_qlinear(x, x_row, (const uint8_t *)lin->panels, lin->bias, y, rows,
                                                     lin->out, lin->in, threads, (int)lin->kind);
    else status = rill_qlinear_i8(x, x_row, (const uint8_t *)lin->panels, lin->bias, y, rows, lin->out, lin->in,
                                  threads, (int)lin->kind - INT8_KIND);
    return status ? -2 : 0;
}

static void rmsnorm(const float *x, const float *weight, float eps, float *y, int64_t rows, int64_t hidden) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * hidden;
        float sum = 0;
        for (int64_t i = 0; i < hidden; i++) sum += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        for (int64_t i = 0; i < hidden; i++) y[r * hidden + i] = weight[i] * (xr[i] * inv);
    }
}

/* act = silu(gate) * up = gate / (1 + e^-gate) * up, eight at a time (libm's expf was a call per
 * element, on one thread: 7% of a 32-row step, the other thread waiting) */
static void silu_gate(const float *gate, const float *up, float *act, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8 g = load8(gate + i);
        store8(act + i, g / (1.0f + exp8(-g)) * load8(up + i));
    }
    for (; i < n; i++) act[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* transformers' rotate_half convention: pairs (i, i + D/2) */
static void rope(float *v, int64_t row_stride, int64_t heads, int64_t head_dim, const float *cos, const float *sin,
                 int64_t rows) {
    const int64_t half = head_dim / 2;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            float *p = v + r * row_stride + h * head_dim;
            const float *c = cos + r * head_dim, *s = sin + r * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = p[i], b = p[i + half];
                p[i] = a * c[i] - b * s[i];
                p[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
}

/* qkv: n_qkv = 1 (fused: q, k, v at q_off, k_off, v_off of each row of its output) or 3 (q, k, v);
 * gate_up: n_gu = 1 (fused: gate at 0, up at up_off) or 2. scratch: at least rows * (2 hidden +
 * heads * head_dim + max(q/k/v width, gate/up width) + 2 + intermediate) floats. Returns 0, or
 * -1 for an argument it cannot take, -2 when out of memory. */
static int decode_layer(float *x, int64_t rows, int64_t hidden, const float *norm1, const float *norm2, float eps,
                      const rill_lin *qkv, int n_qkv, int64_t q_off, int64_t k_off, int64_t v_off,
                      const rill_lin *o, const rill_lin *gate_up, int n_gu, int64_t up_off, const rill_lin *down,
                      int64_t intermediate, const float *cos, const float *sin, float *k_cache, float *v_cache,
                      const int64_t *slot_mapping, const int64_t *dec_slots, int64_t slots_width,
                      const int64_t *lens, int heads, int kv_heads, int head_dim, float scale, int64_t window,
                      float *scratch, int threads, const float *q_norm, const float *k_norm) {
    const int64_t qd = (int64_t)heads * head_dim, kvd = (int64_t)kv_heads * head_dim;
    float *h = scratch;                              /* [rows, hidden] */
    float *tmp = h + rows * hidden;                  /* [rows, hidden] */
    float *attn = tmp + rows * hidden;               /* [rows, heads * head_dim] */
    float *proj = attn + rows * qd;                  /* q/k/v outputs, then gate/up outputs */
    int64_t qkv_width = 0, gu_width = 0;
    for (int i = 0; i < n_qkv; i++) qkv_width += qkv[i].out;
    for (int i = 0; i < n_gu; i++) gu_width += gate_up[i].out;
    const int64_t proj_width = qkv_width > gu_width ? qkv_width : gu_width;
    int64_t *index = (int64_t *)(proj + rows * proj_width);  /* [rows] */
    float *act = (float *)(index + rows);            /* [rows, intermediate] */
    const float *q, *k, *v;
    int64_t q_row, k_row, v_row;

    rmsnorm(x, norm1, eps, h, rows, hidden);
    if (n_qkv == 1) {
        if (linear(&qkv[0], h, hidden, proj, rows, threads)) return -2;
        q = proj + q_off, k = proj + k_off, v = proj + v_off;
        q_row = k_row = v_row = qkv[0].out;
    } else if (n_qkv == 3) {
        if (linear(&qkv[0], h, hidden, proj, rows, threads)) return -2;
        if (linear(&qkv[1], h, hidden, proj + rows * qkv[0].out, rows, threads)) return -2;
        if (linear(&qkv[2], h, hidden, proj + rows * (qkv[0].out + qkv[1].out), rows, threads)) return -2;
        q = proj, k = proj + rows * qkv[0].out, v = proj + rows * (qkv[0].out + qkv[1].out);
        q_row = qkv[0].out, k_row = qkv[1].out, v_row = qkv[2].out;
    } else {
        return -1;
    }
    for (int64_t r = 0; r < rows && q_norm; r++)  /* Qwen3: RMSNorm of each head of q and k, before RoPE */
        rmsnorm(q + r * q_row, q_norm, eps, (float *)q + r * q_row, heads, head_dim);
    for (int64_t r = 0; r < rows && k_norm; r++)
        rmsnorm(k + r * k_row, k_norm, eps, (float *)k + r * k_row, kv_heads, head_dim);
    rope((float *)q, q_row, heads, head_dim, cos, sin, rows);
    rope((float *)k, k_row, kv_heads, head_dim, cos, sin, rows);
    for (int64_t r = 0; r < rows; r++) {
        float *kc = k_cache + slot_mapping[r] * kvd, *vc = v_cache + slot_mapping[r] * kvd;
        for (int64_t i = 0; i < kvd; i++) kc[i] = k[r * k_row + i], vc[i] = v[r * v_row + i];
    }
    for (int64_t r = 0; r < rows; r++) index[r] = r;
    rill_decode_attention(q, q_row, head_dim, index, k_cache, v_cache, dec_slots, slots_width, lens, attn, (int)rows,
                          heads, kv_heads, head_dim, scale, window, 0.0f, threads);
    if (linear(o, attn, qd, tmp, rows, threads)) return -2;
    for (int64_t i = 0; i < rows * hidden; i++) x[i] += tmp[i];

    rmsnorm(x, norm2, eps, h, rows, hidden);
    float *gate, *up;
    int64_t g_row, u_row;
    if (n_gu == 1) {
        if (linear(&gate_up[0], h, hidden, proj, rows, threads)) return -2;
        gate = proj, up = proj + up_off, g_row = u_row = gate_up[0].out;
    } else if (n_gu == 2) {
        if (linear(&gate_up[0], h, hidden, proj, rows, threads)) return -2;
        if (linear(&gate_up[1], h, hidden, proj + rows * gate_up[0].out, rows, threads)) return -2;
        gate = proj, up = proj + rows * gate_up[0].out, g_row = gate_up[0].out, u_row = gate_up[1].out;
    } else {
        return -1;
    }
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 4)
    for (int64_t r = 0; r < rows; r++) silu_gate(gate + r * g_row, up + r * u_row, act + r * intermediate, intermediate);
    if (linear(down, act, intermediate, tmp, rows, threads)) return -2;
    for (int64_t i = 0; i < rows * hidden; i++) x[i] += tmp[i];
    return 0;
}

/* The first index of the largest of v[0..n) (numpy's argmax), or -1 when one of them is not finite:
 * read while the head's output is still in the cache, where the sampler's own passes over it in
 * Python came after the step had streamed the weights through every cache level. */
static int64_t row_argmax(const float *v, int64_t n) {
    float top = -INFINITY;
    int bad = 0;
    int64_t j = 0;
#ifdef __AVX2__
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, z0 = _mm256_setzero_ps(), z1 = z0;
    for (; j + 16 <= n; j += 16) {  /* x - x is 0 for a finite x, NaN for an infinity or NaN */
        const __m256 a = _mm256_loadu_ps(v + j), b = _mm256_loadu_ps(v + j + 8);
        m0 = _mm256_max_ps(m0, a), m1 = _mm256_max_ps(m1, b);
        z0 = _mm256_or_ps(z0, _mm256_sub_ps(a, a)), z1 = _mm256_or_ps(z1, _mm256_sub_ps(b, b));
    }
    float lanes[8], flags[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
    _mm256_storeu_ps(flags, _mm256_or_ps(z0, z1));
    for (int i = 0; i < 8; i++) {
        top = lanes[i] > top ? lanes[i] : top;
        bad |= flags[i] != 0.0f;  /* true for NaN too */
    }
#endif
    for (int64_t i = j; i < n; i++) {
        bad |= !isfinite(v[i]);
        top = v[i] > top ? v[i] : top;
    }
    if (bad) return -1;
    for (int64_t i = 0; i < n; i++)
        if (v[i] == top) return i;
    return -1;
}

/* Each row's argmax of x [n, in] times `head` (float32 activations on blocks), exactly the one the
 * whole product gives, from few of its outputs. `head8` holds the same blocks for the int8 kernel,
 * which multiplies them with x rounded per block of 32 as csrc/qlinear_i8.c does (x'); its logit
 * of output o differs from the float32 one by at most |w_o . (x - x')| + the float32 roundings of
 * both sums <= |w_o| (|x - x'| + g |x|) (Cauchy-Schwarz; g: a float32 rounding, 2^-24, for each of
 * the in + in / 32 terms of the two sums, with room; |w_o| in wnorm, from
 * engine/runner/native.py; |x - x'| from the same rounding, done here). An output whose int8 logit + that
 * bound falls below some output's int8 logit - its bound cannot be the largest. The float32
 * panels of the others are computed (each output bit for bit what the whole call gives: the same
 * rows, the same tiles), and each row's first largest is taken among them. Returns 0, 1 (a value
 * that is not finite: the caller computes the whole head) or -2 (out of memory), and in *computed
 * the number of float32 panels. logits [n, head->out]: scratch. */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
static int screened_argmax(const float *x, int64_t n, const rill_lin *head, const rill_lin *head8,
                           const float *wnorm, float *logits, int64_t *best, int64_t *computed, int threads) {
    const int64_t out = head->out, in = head->in, np = (out + 15) / 16;
    if (linear(head8, x, in, logits, n, threads)) return -2;
    float *k = malloc(sizeof(float) * (size_t)(2 * n));
    unsigned char *mark = calloc((size_t)np, 1);
    if (!k || !mark) return free(k), free(mark), -2;
    const double g = 7e-8 * (double)(in + in / 32 + 32);
    float *top = k + n; /* per row: the largest int8 logit - bound */
    int bad = 0;
    for (int64_t r = 0; r < n; r++) { /* k[r] = |x - x'| + g |x|, x' rounded as the int8 kernel rounds (round_block) */
        double err = 0.0, norm = 0.0;
        for (int64_t b = 0; b < in / 32; b++) {
            const float *xb = x + r * in + b * 32;
            int8_t q[32];
            const float d = round_block(xb, q);
            for (int j = 0; j < 32; j++) {
                const double diff = (double)xb[j] - (double)d * q[j];
                err += diff * diff, norm += (double)xb[j] * xb[j];
            }
        }
        bad |= !(norm <= DBL_MAX);
        k[r] = (float)((sqrt(err) * 1.0001 + g * sqrt(norm)) * 1.0001);
        top[r] = -INFINITY;
    }
    /* Both passes read the logits a row at a time, each thread streaming its share: by panels, the
       32 rows' lines lay 192 KiB apart and the two passes took 0.55 ms of a 32-row step */
    #pragma omp parallel num_threads(threads) reduction(| : bad)
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) { /* top[r]: the row's largest int8 logit - bound */
            const float *a = logits + r * out;
            v16 low = (v16){0} - INFINITY, fin = {0}; /* fin: 0 while every logit is finite (a - a is NaN else) */
            int64_t o = 0;
            for (; o + 16 <= out; o += 16) {
                v16 x, w;
                memcpy(&x, a + o, sizeof x), memcpy(&w, wnorm + o, sizeof w);
                fin += x - x;
                const v16 lo = x - w * k[r];
                const v16i more = lo > low;
                low = (v16)(((v16i)lo & more) | ((v16i)low & ~more));
            }
            float most = -INFINITY;
            for (int j = 0; j < 16; j++) most = low[j] > most ? low[j] : most, bad |= fin[j] != 0.0f;
            for (; o < out; o++) {
                bad |= !(a[o] - a[o] == 0.0f);
                const float lo = a[o] - wnorm[o] * k[r];
                most = lo > most ? lo : most;
            }
            top[r] = most;
        }
        /* a panel with an output whose float32 logit may reach its row's top; each thread its range */
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t p0 = np * t / nt, p1 = np * (t + 1) / nt;
        for (int64_t r = 0; r < n; r++) {
            const float *a = logits + r * out;
            for (int64_t p = p0; p < p1; p++) {
                const int cols = out - p * 16 < 16 ? (int)(out - p * 16) : 16;
                if (cols < 16) {
                    for (int j = 0; j < cols; j++) mark[p] |= a[p * 16 + j] + wnorm[p * 16 + j] * k[r] >= top[r];
                    continue;
                }
                v16 x, w;
                memcpy(&x, a + p * 16, sizeof x), memcpy(&w, wnorm + p * 16, sizeof w);
                const v16i any = x + w * k[r] >= top[r];
                uint64_t u[8];
                memcpy(u, &any, sizeof u);
                mark[p] |= ((u[0] | u[1]) | (u[2] | u[3]) | (u[4] | u[5]) | (u[6] | u[7])) != 0;
            }
        }
    }
    int64_t count = 0;
    for (int64_t p = 0; p < np; p++) count += mark[p];
    const int64_t bytes = (in / 32) * block_bytes((int)head->kind);
    uint8_t *panels = bad ? NULL : malloc((size_t)(count * bytes));
    float *exact = bad ? NULL : malloc(sizeof(float) * (size_t)(n * count * 16));
    int64_t *which = bad ? NULL : malloc(sizeof(int64_t) * (size_t)(count + 1));
    int status = bad ? 1 : (!panels || !exact || !which) ? -2 : 0;
    if (!status) {
        int64_t i = 0;
        for (int64_t p = 0; p < np; p++) {
            if (!mark[p]) continue;
            memcpy(panels + i * bytes, (const uint8_t *)head->panels + p * bytes, (size_t)bytes);
            which[i++] = p;
        }
        const rill_lin picked = {panels, NULL, count * 16, in, head->kind}; /* engine/runner/native.py: no bias */
        *computed = count;
        if (linear(&picked, x, in, exact, n, threads)) status = -2;
        for (int64_t r = 0; r < n && !status; r++) { /* the first of the largest, in the order of the outputs */
            float most = -INFINITY;
            best[r] = -1;
            for (int64_t c = 0; c < count; c++)
                for (int j = 0; j < 16 && which[c] * 16 + j < out; j++) {
                    const float v = exact[r * count * 16 + c * 16 + j];
                    if (!(fabsf(v) <= FLT_MAX)) status = 1;
                    if (v > most) most = v, best[r] = which[c] * 16 + j;
                }
        }
    }
    free(k), free(mark), free(panels), free(exact), free(which);
    return status;
}

/* Every layer over x [rows, hidden] in place (the arguments as decode_layer's), then, when head is
 * not NULL: the rows keep[0..n_keep) (ascending; NULL: all rows) gathered to the front of x,
 * RMSNorm by final_norm, logits [n_keep, head->out] = head(x) and, when best is not NULL, each
 * row's argmax in best[0..n_keep) (-1: a row with a logit that is not finite); with head8, wnorm and
 * screened as well, that argmax alone by screened_argmax (logits then hold the int8 ones), the number
 * of head panels it computed in *screened (-1: the whole head). One call per step: the
 * interpreter is left once, not once per layer. Returns 0, -1 (an argument it cannot take) or -2
 * (out of memory), and the index of the failing layer in *failed. */
int rill_decode_step(const rill_layer *layers, int n_layers, float *x, int64_t rows, int64_t hidden,
                     int64_t intermediate, const float *cos, const float *sin, const int64_t *slot_mapping,
                     const int64_t *dec_slots, int64_t slots_width, const int64_t *lens, int heads, int kv_heads,
                     int head_dim, float *scratch, int threads, const int64_t *keep, int64_t n_keep,
                     const float *final_norm, float final_eps, const rill_lin *head, float *logits, int64_t *best,
                     const rill_lin *head8, const float *wnorm, int64_t *screened, int *failed) {
    for (int l = 0; l < n_layers; l++) {
        const rill_layer *L = &layers[l];
        const int status = decode_layer(x, rows, hidden, L->norm1, L->norm2, L->eps, L->qkv, (int)L->n_qkv, L->q_off,
                                        L->k_off, L->v_off, L->o, L->gate_up, (int)L->n_gu, L->up_off, L->down,
                                        intermediate, cos, sin, L->k_cache, L->v_cache, slot_mapping, dec_slots,
                                        slots_width, lens, heads, kv_heads, head_dim, L->scale, L->window, scratch,
                                        threads, L->q_norm, L->k_norm);
        if (status) {
            *failed = l;
            return status;
        }
    }
    if (!head) return 0;
    *failed = n_layers;
    if (keep)
        for (int64_t i = 0; i < n_keep; i++)
            if (keep[i] != i) memmove(x + i * hidden, x + keep[i] * hidden, (size_t)hidden * sizeof(float));
    rmsnorm(x, final_norm, final_eps, scratch, n_keep, hidden);
    if (screened) *screened = -1;
    if (head8 && best && screened) { /* every row only wants its argmax: see screened_argmax */
        const int status = screened_argmax(scratch, n_keep, head, head8, wnorm, logits, best, screened, threads);
        if (status <= 0) return status;
        *screened = -1;
    }
    const int status = linear(head, scratch, hidden, logits, n_keep, threads);
    if (status || !best) return status;
    #pragma omp parallel for num_threads(threads) schedule(static) if (n_keep > 1)
    for (int64_t r = 0; r < n_keep; r++) best[r] = row_argmax(logits + r * head->out, head->out);
    return 0;
}
