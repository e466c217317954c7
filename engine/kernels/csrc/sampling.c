// rill_sample: the next token of each row of a step's logits, the same token engine/sampler.py's
// reference (`_apply_penalties`, the min_tokens ban, `_draw`) chooses for the same uniform draw.
//
// Per row: penalties (repetition over prompt and output, frequency and presence over the output)
// and the banned ids, then either the argmax, or temperature, top-k, top-p and min-p and the
// inverse CDF at the row's draw u. Penalties are the reference's float32 operations, one by one
// (no fused multiply-add), so those logits are bit-identical. The weights exp((l - max) / t) are
// this file's exp, which may differ from torch's in the last bit: every decision that a few ulps
// of the weights (or the order of float64 sums) could flip -- the draw within kMargin of a token's
// edge, a near-tie at the top-k or top-p boundary or beside the drawn token, a weight at min-p's
// threshold -- makes the row "ambiguous" (status 1) and the caller draws it with the reference.
// That happens about once in 10^5 draws; every other row gets the reference's token.
//
// Top-k and top-p sort only candidates: the tokens above a threshold weight (found by counting
// above a few fixed thresholds) that hold the k tokens or the top-p mass; a quicksort for a few,
// a radix sort of the weights' bits for thousands.

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define kBlock 512                 // tokens per float64 block sum of the inverse CDF
#define kRel 9.5367431640625e-07   // 2^-20: twice what two exps within 1 ulp of exp each may differ by, relative
#define kTiny 8.673617379884035e-19  // 2^-60: a weight this small moves no sum by a margin
#define kThresholds 8

enum { MODE_SKIP = 0, MODE_ARGMAX = 1, MODE_DRAW = 2 };
enum { DRAWN = 0, AMBIGUOUS = 1, TOO_FLAT = 2 };

// the float32 product, never fused into the following subtraction (the reference rounds it first)
static inline float rounded(float x) {
    volatile float v = x;
    return v;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp of 8 floats, x <= 0 (SLEEF's expf u10 scheme: within 1 ulp; 0 below -104)
static inline __m256 exp8(__m256 d) {
    __m256 q = _mm256_round_ps(_mm256_mul_ps(d, _mm256_set1_ps(1.442695040888963407f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i qi = _mm256_cvtps_epi32(q);
    __m256 s = _mm256_fmadd_ps(q, _mm256_set1_ps(-0.693145751953125f), d);
    s = _mm256_fmadd_ps(q, _mm256_set1_ps(-1.428606765330187045e-06f), s);
    __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
    u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    // u * 2^q in two steps, so that a denormal result is rounded once, as ldexp does
    __m256i h = _mm256_srai_epi32(qi, 1);
    __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, _mm256_set1_epi32(127)), 23));
    __m256 p2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(qi, h), _mm256_set1_epi32(127)), 23));
    u = _mm256_mul_ps(_mm256_mul_ps(u, p1), p2);
    return _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), u);  // also -inf -> 0
}
#endif

// w[i] = exp((x[i] - top) / t) for i < n (the reference's float32 subtraction and division), and
// the float64 sum of each kBlock tokens in block[]; returns their total
static double weigh(const float *x, int64_t n, float top, float t, float *w, double *block) {
    double total = 0;
    for (int64_t b = 0; b < n; b += kBlock) {
        int64_t end = b + kBlock < n ? b + kBlock : n, i = b;
        double sum = 0;
#if defined(__AVX2__) && defined(__FMA__)
        __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
        __m256 vt = _mm256_set1_ps(t), vtop = _mm256_set1_ps(top);
        for (; i + 8 <= end; i += 8) {
            __m256 e = exp8(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vtop), vt));
            _mm256_storeu_ps(w + i, e);
            acc0 = _mm256_add_pd(acc0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            acc1 = _mm256_add_pd(acc1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        }
        double lanes[4];
        _mm256_storeu_pd(lanes, _mm256_add_pd(acc0, acc1));
        sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
        for (; i < end; i++) {
            float z = (x[i] - top) / t;
            w[i] = z < -104.0f ? 0.0f : expf(z);
            sum += w[i];
        }
        block[b / kBlock] = sum;
        total += sum;
    }
    return total;
}

// the first index of the largest value (no NaN: the caller replaced them), as numpy's argmax
static int64_t argmax(const float *x, int64_t n) {
    float top = x[0];
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (n >= 8) {
        __m256 m = _mm256_loadu_ps(x);
        for (i = 8; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int l = 0; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
    }
#endif
    for (; i < n; i++) top = x[i] > top ? x[i] : top;
    for (i = 0; i < n; i++)
        if (x[i] == top) return i;
    return 0;
}

// equal within what the two exps may differ by (callers except a weight of exactly 1: exp(0) in both)
static inline int near(double a, double b) {
    double hi = a > b ? a : b;
    return hi > kTiny && fabs(a - b) <= kRel * hi;
}

// candidate keys: ~weight bits above, the id below, so that ascending keys are descending weights
// with the lower id first among equal ones
static inline uint64_t key_of(float w, int64_t id) {
    uint32_t bits;
    memcpy(&bits, &w, 4);
    return ((uint64_t)(~bits) << 32) | (uint64_t)id;
}
static inline float weight_of(uint64_t key) {
    uint32_t bits = ~(uint32_t)(key >> 32);
    float w;
    memcpy(&w, &bits, 4);
    return w;
}

static void sort_keys(uint64_t *a, int64_t n) {  // ascending: quicksort, insertion sort below 24
    while (n > 24) {
        uint64_t x = a[0], y = a[n / 2], z = a[n - 1];
        uint64_t pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        int64_t i = 0, j = n - 1;
        while (i <= j) {
            while (a[i] < pivot) i++;
            while (a[j] > pivot) j--;
            if (i <= j) {
                uint64_t t = a[i]; a[i] = a[j]; a[j] = t;
                i++, j--;
            }
        }
        if (j + 1 < n - i) {  // recurse into the smaller side, loop on the larger
            sort_keys(a, j + 1);
            a += i, n -= i;
        } else {
            sort_keys(a + i, n - i);
            n = j + 1;
        }
    }
    for (int64_t i = 1; i < n; i++) {
        uint64_t v = a[i];
        int64_t j = i - 1;
        for (; j >= 0 && a[j] > v; j--) a[j + 1] = a[j];
        a[j + 1] = v;
    }
}

// ascending by the upper 32 bits, stable (ids were gathered ascending, so equal weights keep the
// lower id first): three passes of 11 bits through tmp
static void radix_sort_keys(uint64_t *a, int64_t n, uint64_t *tmp) {
    for (int pass = 0; pass < 3; pass++) {
        int shift = 32 + 11 * pass;
        int64_t count[2049] = {0};
        for (int64_t i = 0; i < n; i++) count[((a[i] >> shift) & 2047) + 1]++;
        for (int d = 0; d < 2048; d++) count[d + 1] += count[d];
        for (int64_t i = 0; i < n; i++) tmp[count[(a[i] >> shift) & 2047]++] = a[i];
        uint64_t *t = a; a = tmp; tmp = t;
    }
    memcpy(tmp, a, n * sizeof(uint64_t));  // three passes: the result is in the other buffer
}

// the inverse CDF over w[i] >= floor (index order): the token (and the mass before it, and the
// total), or -1 when ambiguous (check: a weight at the floor is ambiguous, as at min-p's threshold)
static int64_t draw_in_order(const float *w, int64_t n, const double *block, float floor, int check, double u,
                             double *mass_before, double *mass_total) {
    int64_t blocks = (n + kBlock - 1) / kBlock;
    double masses[(1 << 20) / kBlock];  // vocabularies up to 2^20 (the caller checks)
    const double *mass = block;
    double total = 0;
    if (floor > 0) {
        for (int64_t b = 0; b < blocks; b++) {
            int64_t end = (b + 1) * kBlock < n ? (b + 1) * kBlock : n;
            double sum = 0;
            for (int64_t i = b * kBlock; i < end; i++) {
                if (check && w[i] != 1.0f && near(w[i], floor)) return -1;  // min-p's threshold: kept or not depends on the last bit
                sum += w[i] >= floor ? w[i] : 0.0f;
            }
            masses[b] = sum;
        }
        mass = masses;
    }
    for (int64_t b = 0; b < blocks; b++) total += mass[b];
    double target = u * total, margin = kRel * total, before = 0;
    int64_t b = 0;
    while (b < blocks - 1 && before + mass[b] <= target) before += mass[b++];
    for (int64_t i = b * kBlock, end = (b + 1) * kBlock < n ? (b + 1) * kBlock : n; i < end; i++) {
        double wi = w[i] >= floor ? w[i] : 0.0f, after = before + wi;
        if (after > target) {
            if (target - before <= margin || after - target <= margin) return -1;
            *mass_before = before, *mass_total = total;
            return i;
        }
        before = after;
    }
    return -1;  // the draw at the very end of the mass (rounding): the reference decides
}

// the reference's kept count for a cut (engine/sampler.py `_kept`): the first probe that holds the
// cut or is top-k gives a sorted prefix; -1: the wide rule (no probe held it)
static int64_t kept_of(int64_t cut, const int64_t *probes, int n_probes, int64_t K, double top_p) {
    for (int p = 0; p < n_probes; p++) {
        int64_t c = cut < probes[p] ? cut : probes[p];
        if (top_p >= 1) return probes[p];
        if (c < probes[p] || probes[p] == K) return c > 1 ? c : 1;
    }
    return -1;
}

// the inverse CDF over the first `kept` sorted candidates (min-p applied): the token, or -1
static int64_t draw_prefix(const uint64_t *keys, int64_t kept, int64_t m, int edge_clear, double min_p, double u) {
    if (kept > m) kept = m;  // the rest are zero weights
    if (kept < m ? near(weight_of(keys[kept - 1]), weight_of(keys[kept])) : !edge_clear) return -1;
    float thr = min_p > 0 ? (float)min_p * weight_of(keys[0]) : 0;
    double sum = 0;
    for (int64_t i = 0; i < kept; i++) {
        float wi = weight_of(keys[i]);
        if (min_p > 0 && wi != 1.0f && near(wi, thr)) return -1;
        if (wi >= thr) sum += wi;
    }
    double target = u * sum, before = 0, margin = kRel * sum;
    for (int64_t i = 0; i < kept; i++) {
        float wi = weight_of(keys[i]);
        if (wi < thr) continue;
        double after = before + wi;
        if (after > target) {
            if (target - before <= margin || after - target <= margin) return -1;
            if ((i > 0 && near(wi, weight_of(keys[i - 1]))) || (i + 1 < kept && near(wi, weight_of(keys[i + 1]))))
                return -1;  // a near-tie beside the drawn token: the reference may order them otherwise
            return (int64_t)(keys[i] & 0xffffffffu);
        }
        before = after;
    }
    return -1;
}

// how many weights are >= each of taus[kThresholds] (descending), and their float32 sums
static void threshold_counts(const float *w, int64_t n, const float *taus, int64_t *counts, double *mass) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256i c[kThresholds];
    __m256 s[kThresholds], t[kThresholds];
    for (int j = 0; j < kThresholds; j++)
        c[j] = _mm256_setzero_si256(), s[j] = _mm256_setzero_ps(), t[j] = _mm256_set1_ps(taus[j]);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(w + i);
        for (int j = 0; j < kThresholds; j++) {
            __m256 ge = _mm256_cmp_ps(v, t[j], _CMP_GE_OQ);
            c[j] = _mm256_sub_epi32(c[j], _mm256_castps_si256(ge));
            s[j] = _mm256_add_ps(s[j], _mm256_and_ps(ge, v));
        }
    }
    for (int j = 0; j < kThresholds; j++) {
        int32_t cs[8];
        float ss[8];
        _mm256_storeu_si256((__m256i *)cs, c[j]);
        _mm256_storeu_ps(ss, s[j]);
        for (int l = 0; l < 8; l++) counts[j] += cs[l], mass[j] += ss[l];
    }
#endif
    for (; i < n; i++)
        for (int j = 0; j < kThresholds; j++)
            if (w[i] >= taus[j]) counts[j]++, mass[j] += w[i];
}

// keys of the weights >= tau (index order), and their sum; returns how many
static int64_t gather(const float *w, int64_t n, float tau, uint64_t *keys, double *mass) {
    int64_t m = 0, i = 0;
    double sum = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 t = _mm256_set1_ps(tau);
    for (; i + 8 <= n; i += 8) {
        unsigned bits = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(w + i), t, _CMP_GE_OQ));
        for (; bits; bits &= bits - 1) {
            int64_t k = i + __builtin_ctz(bits);
            keys[m++] = key_of(w[k], k), sum += w[k];
        }
    }
#endif
    for (; i < n; i++)
        if (w[i] >= tau) keys[m++] = key_of(w[i], i), sum += w[i];
    *mass = sum;
    return m;
}

// top-k and top-p: the candidates, sorted (keys), then the kept prefix or threshold, min-p, the
// draw; returns the token or -AMBIGUOUS / -TOO_FLAT
static int64_t draw_ranked(const float *w, int64_t n, const double *block, double total, int64_t top_k,
                           double top_p, double min_p, double u, uint64_t *keys, uint64_t *tmp) {
    int64_t K = top_k > 0 && top_k < n ? top_k : n;
    // the reference's probes (engine/sampler.py `_kept`): the first of 256, 4096, K that is <= K and
    // < vocab; with top_p >= 1 the first probe is kept
    int64_t probes[3], n_probes = 0;
    const int64_t sizes[3] = {256, 4096, K};
    for (int p = 0; p < 3; p++)
        if (sizes[p] <= K && sizes[p] < n) probes[n_probes++] = sizes[p];
    int64_t need = top_p >= 1 ? probes[0] : K;  // top_p >= 1 implies K < n, so a probe exists
    double margin = kRel * total, mass_needed = top_p * total + margin;

    // counts and float32 masses above fixed thresholds, to pick where to gather
    static const float taus[kThresholds] = {0.5f, 0x1p-4f, 0x1p-10f, 0x1p-20f, 0x1p-40f, 0x1p-70f, 0x1p-100f,
                                            0x1p-149f};
    int64_t counts[kThresholds] = {0};
    double approx[kThresholds] = {0};
    threshold_counts(w, n, taus, counts, approx);
    int64_t m = 0;
    int j = 0;
    for (;; j++) {
        int last = j == kThresholds - 1;  // every nonzero weight: enough whatever the mass
        if (counts[j] >= need || last || (top_p < 1 && approx[j] >= mass_needed * (1 + 1e-4))) break;
    }
    for (;; j++) {  // gather above taus[j]; the exact mass decides, else the next threshold
        double mass = 0;
        m = gather(w, n, taus[j], keys, &mass);
        if (m >= need || j == kThresholds - 1 || (top_p < 1 && mass >= mass_needed)) break;
    }
    if (m > 2048)
        radix_sort_keys(keys, m, tmp);
    else
        sort_keys(keys, m);

    // cut: how many sorted tokens have less than top_p of the total before them; the sums may be a
    // margin off the reference's, so the cut lies in [c_lo, c_hi]
    int64_t c_lo = m, c_hi = m;
    if (top_p < 1) {
        double before = 0, goal = top_p * total;
        for (int64_t i = 0; i < m && c_hi == m; i++) {
            if (c_lo == m && before >= goal - margin) c_lo = i;
            if (before > goal + margin) c_hi = i;
            before += weight_of(keys[i]);
        }
        if (c_lo == m && before >= goal - margin) c_lo = m;  // past every candidate: the zeros after them
    }
    int64_t kept_lo = kept_of(c_lo, probes, n_probes, K, top_p), kept_hi = kept_of(c_hi, probes, n_probes, K, top_p);
    // the next weight below the candidates may be as large as taus[j]: a candidate that near it is no clear edge
    int edge_clear = j == kThresholds - 1 || !near(weight_of(keys[m - 1]), taus[j]);
    if (kept_lo < 0 || kept_hi < 0) {  // a nucleus wider than every probe: every token >= the last kept one, index order
        if (c_hi - c_lo > 64) return -AMBIGUOUS;
        int64_t last = (c_hi > 1 ? c_hi : 1) - 1;
        if (last >= m) return -TOO_FLAT;
        if (last + 1 < m ? near(weight_of(keys[last]), weight_of(keys[last + 1])) : !edge_clear) return -AMBIGUOUS;
        float floor_w = weight_of(keys[last]), thr = min_p > 0 ? (float)min_p * weight_of(keys[0]) : 0;
        int64_t lo = (c_lo > 1 ? c_lo : 1) - 1;  // sorted positions (lo, last] are kept or not as the cut falls
        if (thr > floor_w && thr < weight_of(keys[lo]) && lo != last) return -AMBIGUOUS;
        double before, sum;
        // the kept ones are clear of the rest at floor_w; min-p's threshold is checked token by token
        int64_t t = thr > floor_w ? draw_in_order(w, n, block, thr, 1, u, &before, &sum)
                                  : draw_in_order(w, n, block, floor_w, 0, u, &before, &sum);
        if (t < 0) return -AMBIGUOUS;
        if (thr >= weight_of(keys[lo])) return t;  // min-p drops every token the cut is unsure of
        // each shorter cut drops sorted positions (c, last]: the same token with a margin, or ambiguous
        for (int64_t c = last; c > lo; c--) {
            for (int64_t i = c; i <= last; i++) {
                int64_t id = (int64_t)(keys[i] & 0xffffffffu);
                if (id == t) return -AMBIGUOUS;
            }
            double b = before, total_c = sum;
            for (int64_t i = c; i <= last; i++) {
                int64_t id = (int64_t)(keys[i] & 0xffffffffu);
                total_c -= weight_of(keys[i]);
                if (id < t) b -= weight_of(keys[i]);
            }
            double target = u * total_c, margin_c = kRel * total_c;
            if (target - b <= margin_c || b + w[t] - target <= margin_c) return -AMBIGUOUS;
        }
        return t;
    }
    // the drawn token only moves forward as the prefix grows: the same token at both ends is the token
    int64_t t = draw_prefix(keys, kept_lo, m, edge_clear, min_p, u);
    if (t >= 0 && kept_hi != kept_lo && draw_prefix(keys, kept_hi, m, edge_clear, min_p, u) != t) t = -1;
    return t >= 0 ? t : -AMBIGUOUS;
}

// the row after penalties and bans, in buf (the caller's logits untouched); returns x itself when
// nothing changes it
static const float *penalized(const float *x, int64_t n, const double *f, const int64_t *p, float *buf,
                              int32_t *counts, uint8_t *seen) {
    float repetition = (float)f[4], frequency = (float)f[5], presence = (float)f[6];
    const int64_t *history = (const int64_t *)(intptr_t)p[1], *banned = (const int64_t *)(intptr_t)p[4];
    int64_t n_history = p[2], n_prompt = p[3], n_banned = p[5];
    int rep = repetition != 1.0f && n_history > 0, freq = (frequency != 0 || presence != 0) && n_history > n_prompt;
    if (!rep && !freq && n_banned == 0) return x;
    memcpy(buf, x, n * sizeof(float));
    if (rep) {  // once per distinct token of prompt and output (HF's RepetitionPenaltyLogitsProcessor)
        for (int64_t i = 0; i < n_history; i++) {
            int64_t t = history[i] < n ? history[i] : n - 1;
            if (seen[t]) continue;
            seen[t] = 1;
            buf[t] = buf[t] > 0 ? buf[t] / repetition : buf[t] * repetition;
        }
        for (int64_t i = 0; i < n_history; i++) seen[history[i] < n ? history[i] : n - 1] = 0;
    }
    if (freq) {  // logits - frequency * count - presence * (count > 0), over the output
        for (int64_t i = n_prompt; i < n_history; i++) counts[history[i] < n ? history[i] : n - 1]++;
        for (int64_t i = n_prompt; i < n_history; i++) {
            int64_t t = history[i] < n ? history[i] : n - 1;
            if (!counts[t]) continue;
            buf[t] = rounded(buf[t] - rounded(frequency * (float)counts[t])) - rounded(presence * 1.0f);
            counts[t] = 0;
        }
    }
    for (int64_t i = 0; i < n_banned; i++) buf[banned[i]] = -INFINITY;
    return buf;
}

// the bytes of scratch one thread needs for a vocabulary of n (the caller zeroes it once)
int64_t rill_sample_scratch(int64_t n) {
    return n * (int64_t)(2 * sizeof(float) + sizeof(int32_t) + sizeof(uint8_t)) + 2 * n * (int64_t)sizeof(uint64_t) +
           ((n + kBlock - 1) / kBlock) * (int64_t)sizeof(double) + 64;
}

// fparams [rows][7]: temperature, top_p, min_p, u, repetition, frequency, presence penalties;
// iparams [rows][7]: mode (0 skip, 1 argmax, 2 draw), history (int64 ids: prompt then output),
// its length, the prompt's length, banned ids, their count, top_k. Writes tokens[row] and
// status[row] (0 drawn, 1 ambiguous, 2 too flat for the candidates: the caller's reference draws).
void rill_sample(const float *logits, int64_t stride, int64_t rows, int64_t n, const double *fparams,
                 const int64_t *iparams, int64_t *tokens, int32_t *status, uint8_t *scratch, int threads) {
    int64_t per_thread = rill_sample_scratch(n);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const double *f = fparams + 7 * r;
        const int64_t *p = iparams + 7 * r;
        status[r] = DRAWN;
        if (p[0] == MODE_SKIP) continue;
        uint8_t *mine = scratch + per_thread * (rows > 1 ? omp_get_thread_num() : 0);
        float *buf = (float *)mine, *w = buf + n;
        int32_t *counts = (int32_t *)(w + n);
        uint64_t *keys = (uint64_t *)(((uintptr_t)(counts + n) + 7) & ~(uintptr_t)7), *tmp = keys + n;
        double *block = (double *)(tmp + n);
        uint8_t *seen = (uint8_t *)(block + (n + kBlock - 1) / kBlock);
        const float *x = penalized(logits + r * stride, n, f, p, buf, counts, seen);
        int64_t best = argmax(x, n);
        float t = (float)f[0], top = x[best];
        if (p[0] == MODE_ARGMAX || t == 0 || n > (1 << 20)) {  // a float32 temperature of 0: NaN weights, argmax
            tokens[r] = best;
            status[r] = p[0] == MODE_ARGMAX || t == 0 ? DRAWN : TOO_FLAT;
            continue;
        }
        double total = weigh(x, n, isfinite(top) ? top : 0.0f, t, w, block);
        if (!(total > 0)) {
            tokens[r] = best;
            continue;
        }
        int64_t K = p[6] > 0 && p[6] < n ? p[6] : n;
        int64_t token;
        if (K < n || f[1] < 1) {
            token = draw_ranked(w, n, block, total, p[6], f[1], f[2], f[3], keys, tmp);
        } else {
            float floor_w = f[2] > 0 ? (float)f[2] * 1.0f : 0;  // min-p of the best weight, exp(0) = 1
            double before, sum;
            token = draw_in_order(w, n, block, floor_w, 1, f[3], &before, &sum);
            if (token < 0) token = -AMBIGUOUS;
        }
        if (token < 0) {
            status[r] = (int32_t)-token;
            tokens[r] = best;
        } else {
            tokens[r] = token;
        }
    }
}
