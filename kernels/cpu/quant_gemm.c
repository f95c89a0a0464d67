/* Weight-only quantized GEMMs: y[M, N] = x[M, K] @ W[N, K]^T, one driver for every instruction set.
 *
 * Built and loaded at first use by kernels/cpu/native.py, once per kernel variant: the variant's
 * compiler flags define TB_<VARIANT>, which picks the tile kernels below (gemm_<variant>.h); the
 * driver, the activation quantization, the weight formats and the float rule are this file's and
 * the same for all. decoder_forward.c calls tb_linear (quant_gemm.h), in the same library.
 *
 * The activations are quantized per row in groups of 32 to int8 (scale = amax / 127, round to
 * nearest even: GGUF's Q8 activations) and the products are exact integer dot products (vpdpbusd,
 * vpmaddubsw + vpmaddwd, sdot, or plain C, as the variant has them). The weights are laid out by
 * blocks of 16 output columns, 4 consecutive K-elements of one column next to each other, so a
 * register holds 4 inputs of each of 16 (AVX-512), 8 (AVX2) or 4 (NEON) columns and a group's
 * integer sums land in one lane per column: no horizontal sums. Formats (N padded to a multiple of
 * 16 with zero columns):
 *   q4: 4-bit asymmetric per group of 32 input columns, w = q * d + m, q in [0, 15] (GGUF Q4_1).
 *       Per (column block, group) a 320-byte record: 4 x 64 bytes of nibbles (sub-block s, lane j,
 *       byte i: low nibble = element 8s + i of column j, high nibble = element 8s + 4 + i), then
 *       fp16 d[16], fp16 m[16]. Records run group by group within a block: one stream per block.
 *   q8: 8-bit symmetric per output channel, w = q * s, q in [-127, 127], stored as u8 q + 128.
 *       Per (block, group) 512 bytes: 8 x 64 (sub-block s, lane j, byte i = element 4s + i of
 *       column j); s: fp32 [N padded].
 * K must be a multiple of 32.
 *
 * The float rule, one for every variant (the tile kernels implement it lane by lane): per group g
 * in order, with the exact integer dot product isum,
 *   q4: acc = acc + float(isum) * (d_w * d_x);  acc = acc + m_w * xs     (xs = d_x * sum(q_x))
 *   q8: acc = acc + float(isum) * d_x;          at the end acc = acc * s_w
 * then out = (old +) (acc (+ bias)). Separate multiplies and adds, no FMA (-ffp-contract=off, no
 * -ffast-math), so every variant computes the same IEEE operations: they agree bitwise (the tests
 * check it), although the contract only promises that each variant is batch invariant.
 *
 * Batch invariance, by construction: output (m, n) is that sequence of operations whatever the
 * row count M, the tile it falls in and the thread that runs it. Threads split work items.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_gemm.h"

#if defined(TB_AVX512_VNNI)
#include "gemm_avx512_vnni.h"
#elif defined(TB_AVX_VNNI)
#include "gemm_avx_vnni.h"
#elif defined(TB_AVX2)
#include "gemm_avx2.h"
#elif defined(TB_NEON)
#include "gemm_neon.h"
#else
#include "gemm_scalar.h"
#endif

#define MBLOCK 64 /* rows per work item: a block's quantized rows stay in L2 while the weights stream */
/* Up to this many bytes of quantized rows (m * k), work items go columns outer: the threads split
 * W, and each 16-column block of W is read from memory once and reused from L1 by every row
 * block (rows outer, each row block streams all of W again). Beyond it (a long prefill chunk),
 * rows outer: the rows would no longer stay in cache across the column blocks. */
#define COLS_OUTER_ROW_BYTES (1 << 20)

/* The variant this library was built as (native.py checks it). */
const char *tb_variant(void) { return TB_VARIANT_NAME; }

/* max |a[i]| over a group: on the bit patterns with the sign cleared, whose integer order is the
 * order of the non-negative floats (exact; an integer max vectorizes, a float max does not
 * without -ffast-math). */
INLINE float group_amax(const float *a) {
    uint32_t m = 0;
    for (int i = 0; i < GROUP; i++) {
        uint32_t b;
        memcpy(&b, a + i, 4);
        b &= 0x7FFFFFFFu;
        m = b > m ? b : m;
    }
    float f;
    memcpy(&f, &m, 4);
    return f;
}

/* The quantization in generic vectors of the variant's register width (gcc and clang vector
 * extensions; wider ones are built through the stack by gcc): each lane computes exactly the
 * scalar operation it replaces. */
#if defined(TB_AVX512_VNNI)
#define QL 16
#elif defined(TB_AVX2) || defined(TB_AVX_VNNI)
#define QL 8
#else
#define QL 4
#endif
typedef float qf __attribute__((vector_size(QL * 4)));
typedef int32_t qi __attribute__((vector_size(QL * 4)));
typedef int8_t qb __attribute__((vector_size(QL)));

/* Round to nearest even for |v| < 2^22, with two IEEE adds (the same in every variant, no libm). */
INLINE qf round_even(qf v) { return (v + 12582912.0f) - 12582912.0f; }

/* min(max(r, -128), 127) lane by lane, NaN kept (as the scalar comparisons keep it). Never active
 * for finite inputs (|a * 127 / amax| <= 127 after rounding), but 127 / amax overflows to inf for
 * amax below ~4e-37, and then it is. */
INLINE qf clamp_i8(qf r) {
    const qf hi = (qf){0} + 127.0f, lo = (qf){0} - 128.0f;
    qi ri, hii, loi;
    const qi gt = r > hi, lt = r < lo;
    memcpy(&ri, &r, sizeof r);
    memcpy(&hii, &hi, sizeof hi);
    memcpy(&loi, &lo, sizeof lo);
    ri = (ri & ~gt & ~lt) | (hii & gt) | (loi & lt);
    memcpy(&r, &ri, sizeof r);
    return r;
}

static void quantize_row(const XRows *x, const float *src, int64_t m) {
    const int64_t k = x->k, ng = k / GROUP;
    int8_t *q = x->q + m * k;
    for (int64_t g = 0; g < ng; g++) {
        const float *a = src + g * GROUP;
        const float amax = group_amax(a);
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const qf idv = (qf){0} + id;
        qi sums = {0};
        for (int h = 0; h < GROUP; h += QL) {
            qf v;
            memcpy(&v, a + h, sizeof v);
            const qi qv = __builtin_convertvector(clamp_i8(round_even(v * idv)), qi); /* integral: exact */
            const qb q8 = __builtin_convertvector(qv, qb);
            memcpy(q + g * GROUP + h, &q8, sizeof q8);
            sums += qv;
        }
        int32_t sum = 0;
        for (int i = 0; i < QL; i++) sum += sums[i];
        x->dx[m * ng + g] = d;
        x->xs[m * ng + g] = d * (float)sum;
        x->corr[m * ng + g] = -128 * sum;
    }
}

/* res (one tile's acc, rows x 16) -> out[.][n0 .. n0 + 16) (cut at n): q8's scale, bias, old value. */
static void store_tile(const float (*res)[NB], int rm, const Lin *L, int64_t m0, int64_t b, int64_t n, float *out,
                       int accumulate) {
    const int64_t n0 = b * NB, cols = n - n0 < NB ? n - n0 : NB;
    const float *s = L->fmt == 8 ? L->s + n0 : NULL, *bias = L->bias ? L->bias + n0 : NULL;
    for (int i = 0; i < rm; i++) {
        float v[NB];
        float *o = out + (m0 + i) * n + n0;
        for (int j = 0; j < NB; j++) v[j] = res[i][j];
        if (s)
            for (int j = 0; j < NB; j++) v[j] = v[j] * s[j]; /* s is padded to the block */
        if (bias)
            for (int64_t j = 0; j < cols; j++) v[j] = v[j] + bias[j];
        if (accumulate)
            for (int64_t j = 0; j < cols; j++) o[j] = o[j] + v[j];
        else
            for (int64_t j = 0; j < cols; j++) o[j] = v[j];
    }
}

#define TILE_ARGS (const XRows *x, int64_t m0, const Lin *L, int64_t b, float (*res)[NB])
#define DEF_TILE(FMT, RM) \
    static void FMT##_##RM TILE_ARGS { FMT##_tile(x, m0, RM, L, b, res); }
DEF_TILE(q4, 1) DEF_TILE(q4, 2) DEF_TILE(q4, 3) DEF_TILE(q4, 4)
DEF_TILE(q8, 1) DEF_TILE(q8, 2) DEF_TILE(q8, 3) DEF_TILE(q8, 4)
#if TILE_M == 8
DEF_TILE(q4, 5) DEF_TILE(q4, 6) DEF_TILE(q4, 7) DEF_TILE(q4, 8)
DEF_TILE(q8, 5) DEF_TILE(q8, 6) DEF_TILE(q8, 7) DEF_TILE(q8, 8)
#endif
typedef void(*tile_fn) TILE_ARGS;
#if TILE_M == 8
static const tile_fn Q4_TILES[8] = {q4_1, q4_2, q4_3, q4_4, q4_5, q4_6, q4_7, q4_8};
static const tile_fn Q8_TILES[8] = {q8_1, q8_2, q8_3, q8_4, q8_5, q8_6, q8_7, q8_8};
#else
static const tile_fn Q4_TILES[4] = {q4_1, q4_2, q4_3, q4_4};
static const tile_fn Q8_TILES[4] = {q8_1, q8_2, q8_3, q8_4};
#endif

int tb_rows_alloc(XRows *x, int64_t m, int64_t k) {
    x->k = k;
    x->q = malloc(m * k);
    x->dx = malloc(m * (k / GROUP) * sizeof(float));
    x->xs = malloc(m * (k / GROUP) * sizeof(float));
    x->corr = malloc(m * (k / GROUP) * sizeof(int32_t));
    return x->q && x->dx && x->xs && x->corr;
}

void tb_rows_free(XRows *x) {
    free(x->q);
    free(x->dx);
    free(x->xs);
    free(x->corr);
}

/* out[m][n] (+)= x[m] . W[n] (+ bias[n]): threads quantize the rows of x, then split the
 * (MBLOCK rows x 16 columns) work items, columns outer up to COLS_OUTER_ROW_BYTES of rows (a
 * decode or a verify: the threads split N and W streams once; 96 rows at 2 threads, 39.8 ->
 * 36.1 ms for the default model's forward, benches/RESULTS.md "C kernels on the CPU"), rows outer
 * beyond (a long prefill: each thread's row blocks stay in cache while W streams past them).
 * Within an item, tiles of up to TILE_M rows, as even as possible. 0, or -1 when out of memory. */
int tb_linear(const Lin *L, const float *x, int64_t m, int64_t k, int64_t n, float *out, int accumulate,
              int nthreads, XRows *scratch) {
    if (m <= 0) return 0;
    XRows rows;
    if (scratch) {
        rows = *scratch;
        rows.k = k;
    } else if (!tb_rows_alloc(&rows, m, k)) {
        tb_rows_free(&rows);
        return -1;
    }
    nthreads = tb_team(m, nthreads);
    const tile_fn *tiles = L->fmt == 4 ? Q4_TILES : Q8_TILES;
    /* row blocks of equal size (68 rows: 34 + 34, not 64 + 4, which with rows outer gave one
     * thread 64 rows and the other 4: a 2-thread step of 65-80 rows ran at 1-thread speed) */
    const int64_t nblocks = (n + NB - 1) / NB, mblocks = (m + MBLOCK - 1) / MBLOCK;
    const int64_t mbs = (m + mblocks - 1) / mblocks;
    const int cols_outer = m * k <= COLS_OUTER_ROW_BYTES;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) quantize_row(&rows, x + i * k, i);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < mblocks * nblocks; item++) {
            const int64_t mb = cols_outer ? item % mblocks : item / nblocks;
            const int64_t b = cols_outer ? item / mblocks : item % nblocks;
            const int64_t m_end = (mb + 1) * mbs < m ? (mb + 1) * mbs : m;
            float res[TILE_M][NB];
            /* tiles as even as possible: 9 rows as 5 + 4, not 8 + 1 (whose 1-row tile re-streams
             * the block for one row; a 9-row verify: forward 9.1 -> 7.9 ms at 1 thread, AVX-512) */
            const int64_t mm = m_end - mb * mbs, nt = (mm + TILE_M - 1) / TILE_M;
            for (int64_t ti = 0, m0 = mb * mbs; ti < nt; ti++) {
                const int rm = (int)(mm / nt + (ti < mm % nt));
                tiles[rm - 1](&rows, m0, L, b, res);
                store_tile((const float(*)[NB])res, rm, L, m0, b, n, out, accumulate);
                m0 += rm;
            }
        }
    }
    if (!scratch) tb_rows_free(&rows);
    return 0;
}

int tb_gemm_q4(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *out, int nthreads) {
    Lin L = {4, w, NULL, NULL};
    return tb_linear(&L, x, m, k, n, out, 0, nthreads, NULL);
}

int tb_gemm_q8(const float *x, int64_t m, int64_t k, const uint8_t *w, const float *s, int64_t n, float *out,
               int nthreads) {
    Lin L = {8, w, s, NULL};
    return tb_linear(&L, x, m, k, n, out, 0, nthreads, NULL);
}

/* The activation quantization alone (for tests): q[m][k], group scales d[m][k / 32]. */
void tb_quantize_rows(const float *x, int64_t m, int64_t k, int8_t *q, float *d) {
    XRows rows;
    if (tb_rows_alloc(&rows, m, k)) {
        for (int64_t i = 0; i < m; i++) quantize_row(&rows, x + i * k, i);
        memcpy(q, rows.q, m * k);
        memcpy(d, rows.dx, m * (k / GROUP) * sizeof(float));
    }
    tb_rows_free(&rows);
}
