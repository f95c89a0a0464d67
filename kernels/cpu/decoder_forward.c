/* The decoder forward of a Llama-family model whose linears are all q4/q8 (tb_forward), for x86
 * CPUs with AVX-512. Built into one library with quant_gemm.c (kernels/cpu/native.py), whose
 * batch-invariant linear it calls (quant_gemm.h).
 *
 * One call runs every layer over a flat batch of T tokens (prefill chunks, decodes and verifies of
 * several requests in any mix), replacing ~100 torch ops per layer. Batch invariance holds by the
 * same construction as the GEMMs: every row-wise op (RMSNorm, RoPE, SiLU, residual adds) and the
 * attention of a query row are computed from that row and its own context alone, in an order that
 * depends only on the row (its context length), never on T or on threads.
 *
 * The interface is one struct, TbForward (below), mirrored field for field by ctypes.Structure
 * classes in kernels/cpu/decoder_forward.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_gemm.h"

#define INLINE static inline __attribute__((always_inline))

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

/* One decoder layer: its norms' weights, its KV cache [blocks][2][block_size][Hk][D] (fp32), its
 * four linears. */
typedef struct {
    const float *input_norm, *post_norm;
    float *kv;
    Lin qkv, o, gate_up, down;
} TbLayer;

/* One call. x [T][H] (in: embeddings; out: the last layer's residual stream, before the final
 * norm), cos/sin [max_pos][D], positions/slots [T], row_ctx [T] (context length incl. the row
 * itself), row_req [T] (the row's request), block_tables [B][max_blocks]. */
typedef struct {
    int64_t num_tokens, hidden, num_heads, num_kv_heads, head_dim, intermediate, num_layers, block_size, max_blocks,
        num_threads;
    float eps, scale; /* RMSNorm epsilon, softmax scale */
    const TbLayer *layers;
    float *x;
    const int64_t *positions;
    const float *cos, *sin;
    const int64_t *slots;
    const int32_t *row_ctx, *row_req, *block_tables;
} TbForward;

/* 0, or -1 when out of memory. */
int tb_forward(const TbForward *a) {
    const int64_t t = a->num_tokens, nl = a->num_layers;
    const int nthreads = (int)a->num_threads;
    const Dims dm = {a->hidden, a->num_heads, a->num_kv_heads, a->head_dim, a->intermediate, a->block_size,
                     a->max_blocks, a->eps, a->scale};
    float *x = a->x;
    const int64_t *positions = a->positions, *slots = a->slots;
    const float *cos = a->cos, *sin = a->sin;
    const int32_t *row_ctx = a->row_ctx, *row_req = a->row_req, *block_tables = a->block_tables;
    const int64_t h = dm.h, d = dm.d, qsz = dm.hq * d, kvsz = dm.hk * d, qkvn = qsz + 2 * kvsz, inter = dm.inter;
    int64_t max_ctx = 1;
    for (int64_t r = 0; r < t; r++) max_ctx = row_ctx[r] > max_ctx ? row_ctx[r] : max_ctx;
    float *hs = malloc(t * h * sizeof(float)), *qkv = malloc(t * qkvn * sizeof(float));
    float *att = malloc(t * qsz * sizeof(float)), *gu = malloc(t * 2 * inter * sizeof(float));
    float *act = malloc(t * inter * sizeof(float));
    int rc = hs && qkv && att && gu && act ? 0 : -1;
    const int par_rows = t >= 4 ? nthreads : 1;
    for (int64_t l = 0; l < nl && rc == 0; l++) {
        const TbLayer *layer = a->layers + l;
        const float *in_norm = layer->input_norm, *post_norm = layer->post_norm;
        float *kv = layer->kv;
        const Lin *lqkv = &layer->qkv, *lo = &layer->o, *lgu = &layer->gate_up, *ldn = &layer->down;
#pragma omp parallel for num_threads(par_rows) schedule(static)
        for (int64_t r = 0; r < t; r++) rms_norm_row(x + r * h, in_norm, h, dm.eps, hs + r * h);
        rc |= tb_linear(lqkv, hs, t, h, qkvn, qkv, 0, nthreads);
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
        rc |= tb_linear(lo, att, t, qsz, h, x, 1, nthreads);
#pragma omp parallel for num_threads(par_rows) schedule(static)
        for (int64_t r = 0; r < t; r++) rms_norm_row(x + r * h, post_norm, h, dm.eps, hs + r * h);
        rc |= tb_linear(lgu, hs, t, h, 2 * inter, gu, 0, nthreads);
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
        rc |= tb_linear(ldn, act, t, inter, h, x, 1, nthreads);
    }
    free(hs);
    free(qkv);
    free(att);
    free(gu);
    free(act);
    return rc ? -1 : 0;
}
