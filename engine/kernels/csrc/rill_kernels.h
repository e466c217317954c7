/* Every entry point of the kernels library (engine/kernels/build.py compiles csrc/*.c into one
 * shared library per CPU), and the records csrc/decode_layer.c reads. Each .c file includes this
 * header, so a declaration and its definition cannot drift apart; the Python bindings (one module
 * per kernel in engine/kernels/) mirror these signatures in their ctypes argtypes. */
#ifndef RILL_KERNELS_H
#define RILL_KERNELS_H
#include <stdint.h>

/* csrc/linear.c: y [rows, out] = x [rows, in] (row stride x_row) times float32 panels of 16
 * outputs, plus bias (padded like the panels, or NULL) */
void rill_linear(const float *x, int64_t x_row, const float *panels, const float *bias, float *y,
                 int64_t rows, int64_t out, int64_t in, int threads);
/* the same over panels of 16-bit weights, widened exactly: bfloat16 (half 0) or float16 (half 1) */
void rill_linear16(const float *x, int64_t x_row, const uint16_t *panels, const float *bias, float *y,
                   int64_t rows, int64_t out, int64_t in, int threads, int half);
/* 16-bit weights [out, in] (rows in `order`, or NULL) into those panels */
void rill_pack16(const uint16_t *w, int64_t out, int64_t in, const int64_t *order, uint16_t *panels, int threads,
                 int interleave);
int rill_quantize_rows(const void *w, int64_t rows, int64_t in, int dtype, int kind, uint8_t *out, int threads);

/* csrc/qlinear.c (float32 activations) and csrc/qlinear_i8.c (int8 activations): the same over
 * GGUF blocks; kind: 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_1, 4 Q6_K (csrc/blocks.h). Return 0, -1 when out
 * of memory, -2 for another kind. */
int rill_qlinear(const float *x, int64_t x_row, const uint8_t *panels, const float *bias, float *y,
                 int64_t rows, int64_t out, int64_t in, int threads, int kind);
int rill_qlinear_i8(const float *x, int64_t x_row, const uint8_t *panels, const float *bias, float *y,
                    int64_t rows, int64_t out, int64_t in, int threads, int kind);
/* csrc/qlinear_amx.c: rill_qlinear's product on AMX tiles (exact: x in three bfloat16 pieces) from
 * each kind's rows on (and at least rows_amx); -3 where it declines (no AMX in this build or from
 * Linux, a kind it does not take, fewer rows), and rill_qlinear then computes it.
 * rill_qlinear_amx_rows sets rows_amx (0: never, below 0: unchanged) and returns the one before (-1:
 * no AMX in this build); rill_qlinear_amx_ready asks Linux for the tiles once and says whether they
 * were granted. */
int rill_qlinear_amx(const float *x, int64_t x_row, const uint8_t *panels, const float *bias, float *y,
                     int64_t rows, int64_t out, int64_t in, int threads, int kind);
int rill_qlinear_amx_rows(int rows);
int rill_qlinear_amx_ready(void);
/* the vector width of this build's block tiles: 512 (AVX-512), 256 (AVX2) or 0 (generic) */
int rill_qlinear_vector_bits(void);
/* up to how many rows the float32 block kernel widens the weights in registers once for all rows (1 with AVX-512, 6 else) */
int rill_qlinear_few_rows(void);
/* up to how many rows it widens them once per tile of those rows, de-quantizing past it (1 with AVX-512, 12 else) */
int rill_qlinear_widen_rows(void);
/* csrc/repack.c: a GGUF tensor's raw rows (ggml type number `type`; rows in `order`, or NULL) into
 * the panels of the kind that holds that type (int8: qlinear_i8.c's layout). Returns 0, or -2 for a
 * type it does not read or rows of other bytes. */
int rill_repack(const uint8_t *raw, int64_t row_bytes, const int64_t *order, int64_t out, int64_t in, int type,
                int int8, uint8_t *panels, int threads);

/* csrc/decode_attention.c: decode attention read from the paged cache, one slot per position */
void rill_decode_attention(const float *q, int64_t q_tok, int64_t q_head, const int64_t *index,
                           const float *k, const float *v, const int64_t *slots, int64_t max_ctx,
                           const int64_t *lens, float *out, int num_seqs, int heads, int kv_heads,
                           int head_dim, float scale, int64_t window, float softcap, int threads);

/* a linear as the kernels hold it: kind -1 float32 panels (csrc/linear.c), -2 bfloat16 and -3 float16
 * panels (the same file), 0-4 blocks (qlinear.c),
 * 16 + 0-4 the same kinds of blocks with int8 activations (qlinear_i8.c; INT8_KIND in blocks.h);
 * out is the padded width the kernel writes (a multiple of 16 for fused groups) */
typedef struct {
    const void *panels;
    const float *bias;
    int64_t out, in;
    int64_t kind;
} rill_lin;

/* one layer's weights and cache, as engine/kernels/decode_step.py describes them once per model */
typedef struct {
    const float *norm1, *norm2;
    const rill_lin *qkv, *o, *gate_up, *down;
    const float *q_norm, *k_norm;  /* Qwen3's, else NULL */
    float *k_cache, *v_cache;
    int64_t n_qkv, q_off, k_off, v_off, n_gu, up_off, window;
    float eps, scale;
} rill_layer;

/* csrc/decode_layer.c: every layer of a Llama-family decode step, then the final norm and head
 * (see the definition for the arguments). Returns 0, -1 (an argument it cannot take) or -2 (out
 * of memory), and the index of the failing layer in *failed. */
int rill_decode_step(const rill_layer *layers, int n_layers, float *x, int64_t rows, int64_t hidden,
                     int64_t intermediate, const float *cos, const float *sin, const int64_t *slot_mapping,
                     const int64_t *dec_slots, int64_t slots_width, const int64_t *lens, int heads, int kv_heads,
                     int head_dim, float *scratch, int threads, const int64_t *keep, int64_t n_keep,
                     const float *final_norm, float final_eps, const rill_lin *head, float *logits, int64_t *best,
                     const rill_lin *head8, const float *wnorm, int64_t *screened, int *failed);

#endif
