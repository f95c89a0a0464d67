/* Weight-only quantized GEMMs for x86 CPUs with AVX-512 VNNI: y[M, N] = x[M, K] @ W[N, K]^T.
 *
 * Built and loaded at first use by kernels/cpu/native.py (cc -O3, cached per source and flags),
 * in one library with decoder_forward.c, which calls tb_linear (quant_gemm.h).
 *
 * The activations are quantized per row in groups of 32 to int8 (scale = amax / 127, round to
 * nearest even: GGUF's Q8 activations) and the products run as u8 x s8 integer dot products
 * (vpdpbusd). The weights are laid out by blocks of 16 output columns: in a 512-bit register
 * lane j holds 4 consecutive K-elements of column n0 + j, so one vpdpbusd against 4 broadcast
 * activation bytes advances 16 outputs by 4 products each, and a group's integer sums land in
 * the 16 lanes of the 16 outputs: no horizontal sums, and scales apply once per group to 16
 * columns at a time. Formats (N padded to a multiple of 16 with zero columns):
 *   q4: 4-bit asymmetric per group of 32 input columns, w = q * d + m, q in [0, 15] (GGUF Q4_1).
 *       Per (column block, group) a 320-byte record: 4 x 64 bytes of nibbles (sub-block s, lane j,
 *       byte i: low nibble = element 8s + i of column j, high nibble = element 8s + 4 + i), then
 *       fp16 d[16], fp16 m[16]. Records run group by group within a block: one stream per block.
 *   q8: 8-bit symmetric per output channel, w = q * s, q in [-127, 127], stored as u8 q + 128.
 *       Per (block, group) 512 bytes: 8 x 64 (sub-block s, lane j, byte i = element 4s + i of
 *       column j); s: fp32 [N padded].
 * K must be a multiple of 32.
 *
 * Batch invariance, by construction: output (m, n) is the same sequence of operations whatever
 * the row count M, the tile it falls in and the thread that runs it: per group g in order, an
 * exact integer dot product, then acc = fma(float(isum), d_w * d_x, acc) (+ fma(m_w, s_x, acc)
 * for q4); no reassociation (no -ffast-math, -ffp-contract=off). Threads split work items.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_gemm.h"

#define GROUP 32
#define NB 16     /* columns per block = lanes of a register */
#define MBLOCK 64 /* rows per work item: a block's quantized rows stay in L2 while the weights stream */
#define Q4_REC 320
#define Q8_REC 512

#define INLINE static inline __attribute__((always_inline))


/* Quantized activation rows: q [M][K] int8; per row and group: dx (scale), xs = dx * sum(q)
 * (q4's min term), corr = -128 * sum(q) (undoes q8's u8 offset exactly, in integers). */
typedef struct {
    int8_t *q;
    float *dx, *xs;
    int32_t *corr;
    int64_t k;
} XRows;

static void quantize_row(const XRows *x, const float *src, int64_t m) {
    const int64_t k = x->k, ng = k / GROUP;
    int8_t *q = x->q + m * k;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t g = 0; g < ng; g++) {
        const float *a = src + g * GROUP;
        __m512 a0 = _mm512_loadu_ps(a), a1 = _mm512_loadu_ps(a + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a0), _mm512_andnot_ps(sign, a1)));
        float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, _mm512_set1_ps(id)));
        __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(q + g * GROUP), _mm512_cvtsepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(q + g * GROUP + 16), _mm512_cvtsepi32_epi8(i1));
        int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
        x->dx[m * ng + g] = d;
        x->xs[m * ng + g] = d * (float)sum;
        x->corr[m * ng + g] = -128 * sum;
    }
}

INLINE __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* Store 16 lanes into out[n0 .. n0 + 16) (masked past n), adding bias and the old value. */
INLINE void store16(float *o, __m512 v, const Lin *L, int64_t n0, int64_t n, int accumulate) {
    const __mmask16 mk = n - n0 >= NB ? 0xFFFF : (__mmask16)((1u << (n - n0)) - 1);
    if (L->bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, L->bias + n0));
    if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mk, o), v);
    _mm512_mask_storeu_ps(o, mk, v);
}

/* RM rows from m0 against column block b (16 columns). */
INLINE void q4_tile(const XRows *x, int64_t m0, const int RM, const Lin *L, int64_t b, int64_t n, float *out,
                    int accumulate) {
    const int64_t k = x->k, ng = k / GROUP;
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    __m512 acc[8];
    for (int i = 0; i < RM; i++) acc[i] = _mm512_setzero_ps();
    const uint8_t *p = L->w + b * ng * Q4_REC;
    for (int64_t g = 0; g < ng; g++, p += Q4_REC) {
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256)));
        const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 288)));
        __m512i isum[8];
        for (int i = 0; i < RM; i++) isum[i] = _mm512_setzero_si512();
        for (int sb = 0; sb < 4; sb++) {
            const __m512i raw = _mm512_loadu_si512(p + 64 * sb);
            const __m512i lo = _mm512_and_si512(raw, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
            for (int i = 0; i < RM; i++) {
                const int8_t *xk = x->q + (m0 + i) * k + g * GROUP + 8 * sb;
                isum[i] = _mm512_dpbusd_epi32(isum[i], lo, bcast4(xk));
                isum[i] = _mm512_dpbusd_epi32(isum[i], hi, bcast4(xk + 4));
            }
        }
        for (int i = 0; i < RM; i++) {
            const int64_t r = (m0 + i) * ng + g;
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(dw, _mm512_set1_ps(x->dx[r])), acc[i]);
            acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x->xs[r]), acc[i]);
        }
    }
    for (int i = 0; i < RM; i++) store16(out + (m0 + i) * n + b * NB, acc[i], L, b * NB, n, accumulate);
}

INLINE void q8_tile(const XRows *x, int64_t m0, const int RM, const Lin *L, int64_t b, int64_t n, float *out,
                    int accumulate) {
    const int64_t k = x->k, ng = k / GROUP;
    __m512 acc[8];
    for (int i = 0; i < RM; i++) acc[i] = _mm512_setzero_ps();
    const uint8_t *p = L->w + b * ng * Q8_REC;
    for (int64_t g = 0; g < ng; g++, p += Q8_REC) {
        __m512i isum[8];
        for (int i = 0; i < RM; i++) isum[i] = _mm512_set1_epi32(x->corr[(m0 + i) * ng + g]);
        for (int sb = 0; sb < 8; sb++) {
            const __m512i wv = _mm512_loadu_si512(p + 64 * sb);
            for (int i = 0; i < RM; i++)
                isum[i] = _mm512_dpbusd_epi32(isum[i], wv, bcast4(x->q + (m0 + i) * k + g * GROUP + 4 * sb));
        }
        for (int i = 0; i < RM; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_set1_ps(x->dx[(m0 + i) * ng + g]), acc[i]);
    }
    const __m512 s = _mm512_loadu_ps(L->s + b * NB);
    for (int i = 0; i < RM; i++) store16(out + (m0 + i) * n + b * NB, _mm512_mul_ps(acc[i], s), L, b * NB, n, accumulate);
}

#define TILE_ARGS (const XRows *x, int64_t m0, const Lin *L, int64_t b, int64_t n, float *out, int acc)
#define DEF_TILE(FMT, RM) \
    static void FMT##_##RM TILE_ARGS { FMT##_tile(x, m0, RM, L, b, n, out, acc); }
DEF_TILE(q4, 1) DEF_TILE(q4, 2) DEF_TILE(q4, 3) DEF_TILE(q4, 4)
DEF_TILE(q4, 5) DEF_TILE(q4, 6) DEF_TILE(q4, 7) DEF_TILE(q4, 8)
DEF_TILE(q8, 1) DEF_TILE(q8, 2) DEF_TILE(q8, 3) DEF_TILE(q8, 4)
DEF_TILE(q8, 5) DEF_TILE(q8, 6) DEF_TILE(q8, 7) DEF_TILE(q8, 8)
typedef void(*tile_fn) TILE_ARGS;
static const tile_fn Q4_TILES[8] = {q4_1, q4_2, q4_3, q4_4, q4_5, q4_6, q4_7, q4_8};
static const tile_fn Q8_TILES[8] = {q8_1, q8_2, q8_3, q8_4, q8_5, q8_6, q8_7, q8_8};

static int alloc_rows(XRows *x, int64_t m, int64_t k) {
    x->k = k;
    x->q = malloc(m * k);
    x->dx = malloc(m * (k / GROUP) * sizeof(float));
    x->xs = malloc(m * (k / GROUP) * sizeof(float));
    x->corr = malloc(m * (k / GROUP) * sizeof(int32_t));
    return x->q && x->dx && x->xs && x->corr;
}

static void free_rows(XRows *x) {
    free(x->q);
    free(x->dx);
    free(x->xs);
    free(x->corr);
}

/* out[m][n] (+)= x[m] . W[n] (+ bias[n]): threads quantize the rows of x, then split the
 * (MBLOCK rows x 16 columns) work items, rows outer: a decode (one row block) splits N, a long
 * prefill gives each thread whole row blocks, which stay in cache while all of W streams past
 * them once. Within an item, tiles of up to 8 rows. 0, or -1 when out of memory. */
int tb_linear(const Lin *L, const float *x, int64_t m, int64_t k, int64_t n, float *out, int accumulate,
              int nthreads) {
    if (m <= 0) return 0;
    XRows rows;
    if (!alloc_rows(&rows, m, k)) {
        free_rows(&rows);
        return -1;
    }
    const tile_fn *tiles = L->fmt == 4 ? Q4_TILES : Q8_TILES;
    const int64_t nblocks = (n + NB - 1) / NB, mblocks = (m + MBLOCK - 1) / MBLOCK;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) quantize_row(&rows, x + i * k, i);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < mblocks * nblocks; item++) {
            const int64_t mb = item / nblocks, b = item % nblocks;
            const int64_t m_end = (mb + 1) * MBLOCK < m ? (mb + 1) * MBLOCK : m;
            for (int64_t m0 = mb * MBLOCK; m0 < m_end; m0 += 8) {
                const int rm = m_end - m0 < 8 ? (int)(m_end - m0) : 8;
                tiles[rm - 1](&rows, m0, L, b, n, out, accumulate);
            }
        }
    }
    free_rows(&rows);
    return 0;
}

int tb_gemm_q4(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *out, int nthreads) {
    Lin L = {4, w, NULL, NULL};
    return tb_linear(&L, x, m, k, n, out, 0, nthreads);
}

int tb_gemm_q8(const float *x, int64_t m, int64_t k, const uint8_t *w, const float *s, int64_t n, float *out,
               int nthreads) {
    Lin L = {8, w, s, NULL};
    return tb_linear(&L, x, m, k, n, out, 0, nthreads);
}

/* The activation quantization alone (for tests): q[m][k], group scales d[m][k / 32]. */
void tb_quantize_rows(const float *x, int64_t m, int64_t k, int8_t *q, float *d) {
    XRows rows;
    if (alloc_rows(&rows, m, k)) {
        for (int64_t i = 0; i < m; i++) quantize_row(&rows, x + i * k, i);
        memcpy(q, rows.q, m * k);
        memcpy(d, rows.dx, m * (k / GROUP) * sizeof(float));
    }
    free_rows(&rows);
}
