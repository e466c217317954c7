/* y = x w^T + bias on AMX tiles, exactly as the float32 block kernel computes it (csrc/qlinear.c),
 * for many rows: a prompt's chunk or a step of many sequences.
 *
 * A block's integer weights q (Q4_0/Q4_1/Q4_K nibbles, Q8_0 and Q6_KS bytes) are exact in
 * bfloat16, and a float32 x is exactly the sum of three bfloat16 pieces (x1 = x rounded to
 * bfloat16, x2 = (x - x1) rounded, x3 = x - x1 - x2, each step exact: 8 + 8 + 8 bits hold float32's
 * 24). TDPBF16PS multiplies bfloat16 pairs exactly into float32 and adds in float32, so a block's
 * sum of q x taken as three tile products (one per piece) is the float32 kernel's sum up to the order
 * of its additions. Each block's sums (Q6_KS: each half's) then take d and m (Q4_0: -8 d) times the
 * row's sum of x in float32, in the order row_panel16 adds them.
 *
 * Layout: B, a block's weights for one panel of 16 outputs, 16 rows of 32 bfloat16 (row r: inputs
 * 2r and 2r + 1 of output n at 2n and 2n + 1, the pair layout TDPBF16PS reads; Q6_KS: two tiles of 8
 * rows, one per half), widened from the panel as it is read; A, a tile of T rows (16, or all of
 * fewer) of one piece over one block's inputs, x split once per call and laid out tile after tile
 * (each tile load reads 1 KB in a row); C, T x 16 float32 sums, stored after each block and scaled
 * into each row's running sums.
 *
 * The vector work beside the tile products (widening B, scaling the sums), not the products, bounds
 * it: so B is widened once for a set of rows, two panels share each A tile, x's tiles are loaded as a
 * stream (TILELOADDT1, leaving the running sums in L1), and the scaling and widening are issued after
 * the next products (the profile and what was tried: docs/benchmarks-history.md).
 *
 * Linux lends the tiles' state to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM): refused,
 * or on a build without AMX, rill_qlinear_amx declines and the float32 kernel runs. */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#include "rill_kernels.h"
#include "blocks.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

/* rows from which the tiles run, at least (rill_qlinear_amx_rows changes it; 0: never), beside
 * where each kind takes them (amx_takes) */
static int amx_min_rows = 1;
/* Linux's answer to the tiles' request: 0 not asked yet, 1 granted, -1 refused */
static int amx_granted = 0;

enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
/* tile registers: B and C of each of two panels, A (literal numbers: GCC's tile intrinsics put them
 * into the instruction's text) */
#define TB0 0
#define TB1 1
#define TA 2
#define TC0 3
#define TC1 4
/* the second set of C tiles (and its A): a tile of rows' products go into one set while the other
 * set's sums are stored and scaled */
#define TA2 5
#define TC2 6
#define TC3 7
/* x's pieces held for a set of rows at a time (beside their sums), each panel reading them all, its
 * B tiles widened once for the set: 1.5 MB, faster than half or more than twice as much */
enum { PIECE_SET_BYTES = 1536 * 1024 };

static int amx_ready(void) {
    int state = __atomic_load_n(&amx_granted, __ATOMIC_ACQUIRE);
    if (state == 0) {
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&amx_granted, state, __ATOMIC_RELEASE);
    }
    return state == 1;
}

typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* span: inputs per scale (32, or 16 for Q6_KS's halves); every tile has T rows: 16, or all the rows
 * when there are fewer (x's pieces are padded with zero rows to a multiple of T) */
static void configure_tiles(int span, int T) {
    tile_config c = {0};
    c.palette = 1;
    c.rows[TB0] = c.rows[TB1] = span / 2, c.colsb[TB0] = c.colsb[TB1] = 64;
    c.rows[TA] = c.rows[TA2] = T, c.colsb[TA] = c.colsb[TA2] = span * 2;
    c.rows[TC0] = c.rows[TC1] = c.rows[TC2] = c.rows[TC3] = T;
    c.colsb[TC0] = c.colsb[TC1] = c.colsb[TC2] = c.colsb[TC3] = 64;
    _tile_loadconfig(&c);
}

/* Where the tiles made whole decode steps faster than the float32 kernel (Intel Xeon with AMX, 2
 * threads; docs/benchmarks-history.md): Q8_0 from 2 rows and Q4 from 3 (at one row the float32
 * kernel is bound by memory too) up to 6, and again from 16 (at 7-15 the float32 kernel's AVX-512
 * tiles are as fast); Q6_KS, whose halves take tiles of 16 inputs, from 16. */
static inline int amx_takes(int64_t rows, int kind) {
    if (!is_q4(kind) && !is_int8(kind)) return 0;  /* Q5_1, Q6_K: their bits on two planes, no tiles */
    if (kind == Q6_KS) return rows >= 16;
    return rows >= (kind == Q8_0 ? 2 : 3) && (rows <= 6 || rows >= 16);
}

/* what widen_block permutes with, built once per thread: the bfloat16 of the integers 0..31 (the
 * nibbles' table), the byte indices of a Q4 B row (row i of four from one 64-byte load), the order of
 * an int8 B row's bytes */
typedef struct { __m512i table, q4_index[4]; __m256i i8_order; } widen_consts;

static widen_consts widen_constants(void) {
    widen_consts c;
    uint16_t t[32];
    for (int q = 0; q < 32; q++) {
        const float f = (float)q;
        uint32_t bits;
        __builtin_memcpy(&bits, &f, 4);
        t[q] = (uint16_t)(bits >> 16);  /* exact: 5 bits */
    }
    c.table = _mm512_loadu_si512(t);
    for (int i = 0; i < 4; i++) {
        /* input k's 8 bytes at 8k: byte j's low nibble is output j, its high one output j + 8; word
           2n + e of the row: input 2(4g + i) + e of output n (lo: 0-63, hi: 64-127) */
        uint8_t index[64] = {0};
        for (int n = 0; n < 16; n++)
            for (int e = 0; e < 2; e++)
                index[4 * n + 2 * e] = (uint8_t)(n < 8 ? 16 * i + 8 * e + n : 64 + 16 * i + 8 * e + n - 8);
        c.q4_index[i] = _mm512_loadu_si512(index);
    }
    uint8_t order[32];
    for (int n = 0; n < 16; n++) order[2 * n] = (uint8_t)n, order[2 * n + 1] = (uint8_t)(16 + n);
    c.i8_order = _mm256_loadu_si256((const __m256i *)order);
    return c;
}

/* block blk of a panel as B: bf[16][32] bfloat16 in the pair layout */
static inline __attribute__((always_inline)) void widen_block(const uint8_t *blk, uint16_t *bf, const widen_consts *c,
                                                              const int kind) {
    if (is_q4(kind)) {
        /* four B rows (8 inputs) from one 64-byte load; each row's 32 words by one two-source byte
           permutation of the low and high nibbles (the words' high bytes zeroed), then the table */
        const __m512i low4 = _mm512_set1_epi8(15);
        for (int g = 0; g < 4; g++) {
            const __m512i v = _mm512_loadu_si512(blk + 64 * g);
            const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            for (int i = 0; i < 4; i++) {
                const __m512i words = _mm512_maskz_permutex2var_epi8(0x5555555555555555ULL, lo, c->q4_index[i], hi);
                _mm512_store_si512(bf + (4 * g + i) * 32, _mm512_permutexvar_epi16(words, c->table));
            }
        }
        return;
    }
    /* int8 q[32][16], input-major: row r's inputs 2r, 2r + 1 are the 32 bytes at 32r */
    for (int r = 0; r < 16; r++) {
        const __m256i q = _mm256_permutexvar_epi8(c->i8_order, _mm256_loadu_si256((const __m256i *)(blk + 32 * r)));
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
        const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
        _mm512_store_si512(bf + r * 32, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
    }
}

/* rows [r0, r1) of x -> their three bfloat16 pieces, tile after tile (a tile of T rows: for each unit,
 * piece 1's T x span values, then piece 2's and 3's), and their sums per scale; rows from x's `rows`
 * on are zeros */
static void split_rows(const float *x, int64_t x_row, int64_t r0, int64_t r1, int64_t rows, int64_t in,
                       uint16_t *pieces, float *xsum, int span, int sums, int T) {
    const int64_t per_row = in / span;
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * x_row;
        for (int64_t k = 0; k < in; k += 16) {
            __m512 v = r < rows ? _mm512_loadu_ps(xr + k) : _mm512_setzero_ps();
            uint16_t *at = pieces + (r / T) * 3 * T * in + (k / span) * 3 * T * span + (r % T) * span + k % span;
            for (int p = 0; p < 3; p++) {
                const __m256bh h = _mm512_cvtneps_pbh(v);
                _mm256_storeu_si256((__m256i *)(at + p * T * span), (__m256i)h);
                v = _mm512_sub_ps(v, _mm512_cvtpbh_ps(h));
            }
        }
        for (int64_t i = 0; i < (sums ? per_row : 0); i++) {
            float s = 0;
            for (int k = 0; k < span && r < rows; k++) s += xr[i * span + k];
            xsum[r * per_row + i] = s;
        }
    }
}

/* A tile of rows' products waiting to be scaled: where its sums go (acc), its x sums, its scales */
typedef struct { float *y; const float *xs; __m512 d[2], m[2]; int live; } pending_tile;

/* the sums of a pending tile (C set `set`, stored into sums) scaled into its rows' running sums */
static inline __attribute__((always_inline)) void scale_tile(pending_tile *pt, const float *sums, int64_t rows,
                                                             int64_t per_row, const int T, const int G, const int kind) {
    for (int g = 0; g < G; g++) {
        float *y = pt->y + g * rows * 16;
        const float *sg = sums + g * 256;
        for (int i = 0; i < T; i++) {
            __m512 v = _mm512_fmadd_ps(pt->d[g], _mm512_load_ps(sg + i * 16), _mm512_load_ps(y + i * 16));
            if (needs_xsum(kind)) v = _mm512_fmadd_ps(pt->m[g], _mm512_set1_ps(pt->xs[i * per_row]), v);
            _mm512_store_ps(y + i * 16, v);
        }
    }
    pt->live = 0;
}

/* C set `set`'s pending tile, if any: its sums stored (set 0: TC0/TC1, set 1: TC2/TC3) and scaled */
static inline __attribute__((always_inline)) void flush_set(pending_tile *pend, int set, float *sums, int64_t rows,
                                                            int64_t per_row, const int T, const int G, const int kind) {
    if (!pend[set].live) return;
    if (set == 0) {
        _tile_stored(TC0, sums, 64);
        if (G == 2) _tile_stored(TC1, sums + 256, 64);
    } else {
        _tile_stored(TC2, sums + 512, 64);
        if (G == 2) _tile_stored(TC3, sums + 768, 64);
    }
    scale_tile(&pend[set], sums + set * 512, rows, per_row, T, G, kind);
}

/* block b of the G panels widened into bf (G x 512 bfloat16) and its scales read */
static inline __attribute__((always_inline)) void widen_blocks(const uint8_t *panel, int64_t panel_bytes, int64_t b,
                                                               uint16_t *bf, __m512 *d, __m512 *m, __m512 *e,
                                                               const widen_consts *c, const int G, const int kind) {
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = block_at(panel + g * panel_bytes, b, kind);
        prefetch_ahead(blk, kind);
        widen_block(blk, bf + g * 512, c, kind);
        d[g] = m[g] = e[g] = _mm512_setzero_ps();
        scales16(panel + g * panel_bytes, b, blk, &d[g], &m[g], &e[g], kind);
    }
}

/* Rows [s0, s1) (whole tiles of T rows) times G panels (1 or 2, side by side from `panel`,
 * panel_bytes apart) into acc [G][s1 - s0][16]. Unit u of a panel's blocks: its block u / parts, the
 * half u % parts of it (Q6_KS's halves have a scale each). A unit's B tiles are widened and loaded
 * once for every tile of rows, and each of x's A tiles is loaded once for the G panels (x's pieces
 * come from L2: a tile of rows over all inputs is 3 x T x in bfloat16). The C tiles alternate between
 * two sets, so a tile's products are issued before the previous tile's sums are stored and scaled:
 * the vector work runs while the tiles multiply, not after them. */
static inline __attribute__((always_inline)) void panel_tiles(const uint16_t *pieces, const float *xsum,
                                                              const uint8_t *panel, int64_t panel_bytes,
                                                              int64_t blocks, int64_t s0, int64_t s1, int64_t in,
                                                              float *acc, uint16_t *bf, float *sums,
                                                              const widen_consts *c, const int T, const int G,
                                                              const int kind) {
    const int parts = scale_parts(kind), span = 32 / parts;
    const int64_t units = blocks * parts, per_row = units, rows = s1 - s0;
    for (int64_t i = 0; i < G * rows * 16; i += 16) _mm512_store_ps(acc + i, _mm512_setzero_ps());
    __m512 d[2], m[2], e[2], nd[2], nm[2], ne[2];
    pending_tile pend[2] = {{0}, {0}};
    int set = 0;
    /* block b's B rows in bf + (b & 1) * 1024: the next block is widened while this one's tiles multiply,
       so its stores are in L1 long before its tiles are loaded */
    widen_blocks(panel, panel_bytes, 0, bf, nd, nm, ne, c, G, kind);
    for (int64_t u = 0; u < units; u++) {
        const int64_t b = u / parts, part = u % parts;
        const uint16_t *bb = bf + (b & 1) * 1024;
        if (part == 0)
            for (int g = 0; g < G; g++) d[g] = nd[g], m[g] = nm[g], e[g] = ne[g];
        _tile_loadd(TB0, bb + part * 8 * 32, 64);
        if (G == 2) _tile_loadd(TB1, bb + 512 + part * 8 * 32, 64);
        __m512 dp[2], mp[2];
        for (int g = 0; g < G; g++) {
            dp[g] = part ? e[g] : d[g];
            mp[g] = has_min(kind) ? m[g] : _mm512_mul_ps(dp[g], _mm512_set1_ps((float)-q_offset(kind)));
        }
        for (int64_t row0 = s0; row0 < s1; row0 += T, set ^= 1) {
            const uint16_t *a = pieces + row0 * 3 * in + u * 3 * T * span;
            if (set == 0) {
                _tile_zero(TC0);
                if (G == 2) _tile_zero(TC1);
                for (int p = 0; p < 3; p++) {
                    _tile_stream_loadd(TA, a + p * T * span, span * 2);
                    _tile_dpbf16ps(TC0, TA, TB0);
                    if (G == 2) _tile_dpbf16ps(TC1, TA, TB1);
                }
            } else {
                _tile_zero(TC2);
                if (G == 2) _tile_zero(TC3);
                for (int p = 0; p < 3; p++) {
                    _tile_stream_loadd(TA2, a + p * T * span, span * 2);
                    _tile_dpbf16ps(TC2, TA2, TB0);
                    if (G == 2) _tile_dpbf16ps(TC3, TA2, TB1);
                }
            }
            if (row0 == s0 && part == 0 && b + 1 < blocks)  /* the next block, while these multiply */
                widen_blocks(panel, panel_bytes, b + 1, bf + ((b + 1) & 1) * 1024, nd, nm, ne, c, G, kind);
            if (set == 0) /* the other set, issued before these; a constant set in each call (flush_set with
                             set ^ 1 was slower) */
                flush_set(pend, 1, sums, rows, per_row, T, G, kind);
            else
                flush_set(pend, 0, sums, rows, per_row, T, G, kind);
            pending_tile *pt = &pend[set];
            pt->y = acc + (row0 - s0) * 16, pt->xs = xsum + row0 * per_row + u, pt->live = 1;
            for (int g = 0; g < G; g++) pt->d[g] = dp[g], pt->m[g] = mp[g];
        }
    }
    /* the last tile's products (the one before it was scaled as these were issued) */
    flush_set(pend, 0, sums, rows, per_row, T, G, kind);
    flush_set(pend, 1, sums, rows, per_row, T, G, kind);
}

static inline int64_t piece_set_rows(int64_t in) {
    const int64_t n = PIECE_SET_BYTES / (6 * in) / 16 * 16;
    return n < 16 ? 16 : n;
}

int rill_qlinear_amx(const float *x, int64_t x_row, const uint8_t *panels, const float *bias, float *y,
                     int64_t rows, int64_t out, int64_t in, int threads, int kind) {
    if (amx_min_rows <= 0 || rows < amx_min_rows || kind < 0 || kind >= NUM_KINDS || !amx_takes(rows, kind)) return -3;
    if ((is_super(kind) && in % 256) || in % 32 || !amx_ready()) return -3;
    const int parts = scale_parts(kind), span = 32 / parts, sums_needed = needs_xsum(kind);
    const int64_t blocks = in / 32, per_row = blocks * parts, num_panels = (out + 15) / 16;
    const int64_t panel_bytes = blocks * block_bytes(kind), set = piece_set_rows(in);
    const int T = rows < 16 ? (int)rows : 16;  /* fewer rows: one tile of them, not zeros up to 16 */
    const int64_t padded = (rows + T - 1) / T * T;  /* whole tiles: zero rows after x's */
    uint16_t *pieces = aligned_alloc(64, (size_t)(3 * padded * in) * 2);
    float *xsum = aligned_alloc(64, ((size_t)(padded * per_row) * 4 + 63) / 64 * 64);
    float *accs = aligned_alloc(64, sizeof(float) * (size_t)(threads * 2 * set * 16));
    if (!pieces || !xsum || !accs) {
        free(pieces), free(xsum), free(accs);
        return -1;
    }
    #pragma omp parallel num_threads(threads)
    {
        uint16_t bf[2 * 2 * 16 * 32] __attribute__((aligned(64)));
        float sums[4 * 16 * 16] __attribute__((aligned(64)));
        float *acc = accs + (size_t)omp_get_thread_num() * (size_t)(2 * set * 16);
        const widen_consts consts = widen_constants();
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < padded; r += 4)
            split_rows(x, x_row, r, r + 4 < padded ? r + 4 : padded, rows, in, pieces, xsum, span, sums_needed, T);
        configure_tiles(span, T);
        for (int64_t s0 = 0; s0 < padded; s0 += set) {  /* the threads go on to the next set unwaited */
            const int64_t s1 = s0 + set < padded ? s0 + set : padded, real = (s1 < rows ? s1 : rows) - s0;
            #pragma omp for schedule(guided) nowait
            for (int64_t pair = 0; pair < (num_panels + 1) / 2; pair++) {
                const int64_t p = 2 * pair;
                const uint8_t *panel = panels + p * panel_bytes;
                if (p + 1 < num_panels) {
#define TILES(K) panel_tiles(pieces, xsum, panel, panel_bytes, blocks, s0, s1, in, acc, bf, sums, &consts, T, 2, K)
                    PER_KIND(kind, TILES)
#undef TILES
                    store_panel(acc, bias, y + s0 * out, real, out, p);
                    store_panel(acc + (s1 - s0) * 16, bias, y + s0 * out, real, out, p + 1);
                } else {
#define TILES(K) panel_tiles(pieces, xsum, panel, panel_bytes, blocks, s0, s1, in, acc, bf, sums, &consts, T, 1, K)
                    PER_KIND(kind, TILES)
#undef TILES
                    store_panel(acc, bias, y + s0 * out, real, out, p);
                }
            }
        }
        _tile_release();
    }
    free(pieces), free(xsum), free(accs);
    return 0;
}

int rill_qlinear_amx_rows(int rows) {
    const int before = amx_min_rows;
    if (rows >= 0) amx_min_rows = rows;
    return before;
}

int rill_qlinear_amx_ready(void) { return amx_ready(); }

#else /* no AMX in this build: the float32 kernel computes every product */
int rill_qlinear_amx(const float *x, int64_t x_row, const uint8_t *panels, const float *bias, float *y,
                     int64_t rows, int64_t out, int64_t in, int threads, int kind) {
    (void)x, (void)x_row, (void)panels, (void)bias, (void)y, (void)rows, (void)out, (void)in, (void)threads, (void)kind;
    return -3;
}
int rill_qlinear_amx_rows(int rows) { (void)rows; return -1; }
int rill_qlinear_amx_ready(void) { return 0; }
#endif
