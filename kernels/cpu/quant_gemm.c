/* Weight-only quantized GEMMs for x86 CPUs with AVX-512 VNNI: y[M, N] = x[M, K] @ W[N, K]^T.
 *
 * Built and loaded at first use by kernels/cpu/native.py (cc -O3, cached per source and flags).
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

#define GROUP 32
#define NB 16     /* columns per block = lanes of a register */
#define MBLOCK 64 /* rows per work item: a block's quantized rows stay in L2 while the weights stream */
#define Q4_REC 320
#define Q8_REC 512

#define INLINE static inline __attribute__((always_inline))

typedef struct {
    int fmt;           /* 4: q4, 8: q8 */
    const uint8_t *w;  /* records, see the header */
    const float *s;    /* q8: per-channel scales [N padded]; q4: unused */
    const float *bias; /* [N] or NULL */
} Lin;

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
static int linear(const Lin *L, const float *x, int64_t m, int64_t k, int64_t n, float *out, int accumulate,
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
    return linear(&L, x, m, k, n, out, 0, nthreads);
}

int tb_gemm_q8(const float *x, int64_t m, int64_t k, const uint8_t *w, const float *s, int64_t n, float *out,
               int nthreads) {
    Lin L = {8, w, s, NULL};
    return linear(&L, x, m, k, n, out, 0, nthreads);
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

/* ------------------------------------------------------------------------------------------
 * The decoder forward of a Llama-family model whose linears are all q4/q8 (tb_forward).
 *
 * One call runs every layer over a flat batch of T tokens (prefill chunks, decodes and verifies of
 * several requests in any mix), replacing ~100 torch ops per layer. Batch invariance holds by the
 * same construction as the GEMMs: every row-wise op (RMSNorm, RoPE, SiLU, residual adds) and the
 * attention of a query row are computed from that row and its own context alone, in an order that
 * depends only on the row (its context length), never on T or on threads.
 * ---------------------------------------------------------------------------------------- */
#include <math.h>

/* expf, vectorized (Cephes polynomial; about 2 ulp; deterministic). */
INLINE __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365447505531f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* out = w * (x / sqrt(mean(x^2) + eps)), H a multiple of 16. */
static void rms_norm_row(const float *x, const float *w, int64_t h, float eps, float *out) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < h; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)h + eps));
    for (int64_t i = 0; i < h; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(w + i), _mm512_mul_ps(_mm512_loadu_ps(x + i), r)));
}

/* x = x * cos + roll(x, D/2) * sin (sin carries rotate_half's sign), for nh heads of D. */
static void rope_heads(float *x, int64_t nh, int64_t d, const float *cos, const float *sin) {
    float tmp[512];
    const int64_t half = d / 2;
    for (int64_t hh = 0; hh < nh; hh++) {
        float *v = x + hh * d;
        for (int64_t i = 0; i < d; i++) tmp[i] = v[i];
        for (int64_t i = 0; i < d; i++) v[i] = tmp[i] * cos[i] + tmp[(i + half) % d] * sin[i];
    }
}

/* q . k for one key, left in 16 lanes (summed by hsum16 with the other keys of its group). */
INLINE __m512 dot_lanes(const float *a, const float *b, int64_t d) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (int64_t i = 16; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return acc;
}

/* Lane j of the result = the sum of the 16 lanes of a[j]. The same add tree for every j (pairs
 * within 128-bit segments, then segments), so a key's score does not depend on its slot. */
INLINE __m512 hsum16(const __m512 a[16]) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

typedef struct {
    int64_t h, hq, hk, d, inter, bs, max_blocks;
    float eps, scale;
} Dims;

#define MAX_GROUP 8 /* query heads per kv head handled together in P @ V (more: several passes) */

/* Attention of one query row, kv head g (its G = hq / hk query heads) over positions 0..ctx-1 of
 * its request's paged cache ([blocks][2][bs][hk][d]). Scores in groups of 16 keys (fixed from
 * position 0), then per head max, exp and sum, then P @ V in position order: every operation's
 * order is fixed by ctx alone. */
static void attend_row(const Dims *dm, const float *q, const float *kv, const int32_t *blocks, int64_t ctx,
                       int64_t g, float *scores, float *out) {
    const int64_t d = dm->d, hk = dm->hk, gsz = dm->hq / hk, bs = dm->bs, nv = d / 16;
    const __m512 scale = _mm512_set1_ps(dm->scale);
    for (int64_t j = 0; j < gsz; j++) {
        const float *qj = q + (g * gsz + j) * d;
        for (int64_t p0 = 0; p0 < ctx; p0 += 16) {
            const int64_t n = ctx - p0 < 16 ? ctx - p0 : 16;
            __m512 acc[16];
            for (int64_t i = 0; i < 16; i++) {
                const int64_t p = p0 + i;
                acc[i] = i < n ? dot_lanes(qj, kv + ((int64_t)blocks[p / bs] * 2 * bs + p % bs) * hk * d + g * d, d)
                               : _mm512_setzero_ps();
            }
            const __mmask16 mk = n == 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
            _mm512_mask_storeu_ps(scores + j * ctx + p0, mk, _mm512_mul_ps(hsum16(acc), scale));
        }
    }
    float inv[gsz];
    for (int64_t j = 0; j < gsz; j++) {
        float *s = scores + j * ctx;
        float mx = -INFINITY;
        for (int64_t p = 0; p < ctx; p++) mx = s[p] > mx ? s[p] : mx;
        __m512 sum = _mm512_setzero_ps();
        const __m512 mxv = _mm512_set1_ps(mx);
        for (int64_t p = 0; p < ctx; p += 16) {
            const __mmask16 mk = ctx - p >= 16 ? 0xFFFF : (__mmask16)((1u << (ctx - p)) - 1);
            __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + p), mxv));
            e = _mm512_maskz_mov_ps(mk, e);
            _mm512_mask_storeu_ps(s + p, mk, e);
            sum = _mm512_add_ps(sum, e);
        }
        inv[j] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    /* P @ V: the V rows are loaded once per position for up to MAX_GROUP heads. */
    for (int64_t j0 = 0; j0 < gsz; j0 += MAX_GROUP) {
        const int64_t nh = gsz - j0 < MAX_GROUP ? gsz - j0 : MAX_GROUP;
        __m512 acc[MAX_GROUP][16];
        for (int64_t j = 0; j < nh; j++)
            for (int64_t i = 0; i < nv; i++) acc[j][i] = _mm512_setzero_ps();
        for (int64_t p = 0; p < ctx; p++) {
            const float *v = kv + (((int64_t)blocks[p / bs] * 2 + 1) * bs + p % bs) * hk * d + g * d;
            for (int64_t j = 0; j < nh; j++) {
                const __m512 sp = _mm512_set1_ps(scores[(j0 + j) * ctx + p]);
                for (int64_t i = 0; i < nv; i++) acc[j][i] = _mm512_fmadd_ps(sp, _mm512_loadu_ps(v + 16 * i), acc[j][i]);
            }
        }
        for (int64_t j = 0; j < nh; j++) {
            float *o = out + (g * gsz + j0 + j) * d;
            for (int64_t i = 0; i < nv; i++) _mm512_storeu_ps(o + 16 * i, _mm512_mul_ps(acc[j][i], _mm512_set1_ps(inv[j0 + j])));
        }
    }
}

/* Per layer, 20 int64 fields: 0 input_norm, 1 post_norm, 2 kv cache, then 4 linears (qkv, o,
 * gate_up, down) of 4 fields each at 3 + 4 * i: fmt, w, s, bias. */
#define LAYER_FIELDS 20

static Lin layer_lin(const int64_t *f, int i) {
    const int64_t *p = f + 3 + 4 * i;
    Lin L = {(int)p[0], (const uint8_t *)p[1], (const float *)p[2], (const float *)p[3]};
    return L;
}

/* dims: T, H, Hq, Hk, D, I, layers, block_size, max_blocks, threads; fparams: eps, softmax scale.
 * x [T][H] (in: embeddings; out: the last layer's residual stream, before the final norm),
 * cos/sin [max_pos][D], positions/slots [T], row_ctx [T] (context length incl. the row itself),
 * row_req [T], block_tables [B][max_blocks]. 0, or -1 when out of memory. */
int tb_forward(const int64_t *dims, const float *fparams, const int64_t *layers, float *x, const int64_t *positions,
               const float *cos, const float *sin, const int64_t *slots, const int32_t *row_ctx,
               const int32_t *row_req, const int32_t *block_tables) {
    const int64_t t = dims[0], nl = dims[6];
    const int nthreads = (int)dims[9];
    const Dims dm = {dims[1], dims[2], dims[3], dims[4], dims[5], dims[7], dims[8], fparams[0], fparams[1]};
    const int64_t h = dm.h, d = dm.d, qsz = dm.hq * d, kvsz = dm.hk * d, qkvn = qsz + 2 * kvsz, inter = dm.inter;
    int64_t max_ctx = 1;
    for (int64_t r = 0; r < t; r++) max_ctx = row_ctx[r] > max_ctx ? row_ctx[r] : max_ctx;
    float *hs = malloc(t * h * sizeof(float)), *qkv = malloc(t * qkvn * sizeof(float));
    float *att = malloc(t * qsz * sizeof(float)), *gu = malloc(t * 2 * inter * sizeof(float));
    float *act = malloc(t * inter * sizeof(float));
    int rc = hs && qkv && att && gu && act ? 0 : -1;
    const int par_rows = t >= 4 ? nthreads : 1;
    for (int64_t l = 0; l < nl && rc == 0; l++) {
        const int64_t *f = layers + l * LAYER_FIELDS;
        const float *in_norm = (const float *)f[0], *post_norm = (const float *)f[1];
        float *kv = (float *)f[2];
        const Lin lqkv = layer_lin(f, 0), lo = layer_lin(f, 1), lgu = layer_lin(f, 2), ldn = layer_lin(f, 3);
#pragma omp parallel for num_threads(par_rows) schedule(static)
        for (int64_t r = 0; r < t; r++) rms_norm_row(x + r * h, in_norm, h, dm.eps, hs + r * h);
        rc |= linear(&lqkv, hs, t, h, qkvn, qkv, 0, nthreads);
#pragma omp parallel for num_threads(par_rows) schedule(static)
        for (int64_t r = 0; r < t; r++) {
            float *row = qkv + r * qkvn;
            rope_heads(row, dm.hq + dm.hk, d, cos + positions[r] * d, sin + positions[r] * d);
            const int64_t blk = slots[r] / dm.bs, off = slots[r] % dm.bs;
            memcpy(kv + ((blk * 2) * dm.bs + off) * kvsz, row + qsz, kvsz * sizeof(float));
            memcpy(kv + ((blk * 2 + 1) * dm.bs + off) * kvsz, row + qsz + kvsz, kvsz * sizeof(float));
        }
#pragma omp parallel num_threads(t * dm.hk >= 2 ? nthreads : 1)
        {
            float *scores = malloc((dm.hq / dm.hk) * max_ctx * sizeof(float));
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < t * dm.hk; i++) {
                const int64_t r = i / dm.hk, g = i % dm.hk;
                if (scores)
                    attend_row(&dm, qkv + r * qkvn, kv, block_tables + (int64_t)row_req[r] * dm.max_blocks, row_ctx[r], g,
                               scores, att + r * qsz);
            }
            if (!scores) {
#pragma omp atomic write
                rc = -1;
            }
            free(scores);
        }
        rc |= linear(&lo, att, t, qsz, h, x, 1, nthreads);
#pragma omp parallel for num_threads(par_rows) schedule(static)
        for (int64_t r = 0; r < t; r++) rms_norm_row(x + r * h, post_norm, h, dm.eps, hs + r * h);
        rc |= linear(&lgu, hs, t, h, 2 * inter, gu, 0, nthreads);
#pragma omp parallel for num_threads(par_rows) schedule(static)
        for (int64_t r = 0; r < t; r++) {
            const float *gr = gu + r * 2 * inter, *ur = gr + inter;
            float *ar = act + r * inter;
            for (int64_t i = 0; i < inter; i += 16) {
                __m512 gv = _mm512_loadu_ps(gr + i);
                __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
                _mm512_storeu_ps(ar + i, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(ur + i)));
            }
        }
        rc |= linear(&ldn, act, t, inter, h, x, 1, nthreads);
    }
    free(hs);
    free(qkv);
    free(att);
    free(gu);
    free(act);
    return rc ? -1 : 0;
}
