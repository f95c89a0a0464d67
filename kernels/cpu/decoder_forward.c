/* The decoder forward of a Llama-family model whose linears are all q4/q8 (tb_forward), one
 * source for every kernel variant: portable C that each variant's flags vectorize (AVX-512, AVX2,
 * NEON, or the baseline), over the variant's GEMMs (tb_linear, quant_gemm.h) in the same library
 * (kernels/cpu/native.py builds one per variant).
 *
 * One call runs every layer over a flat batch of T tokens (prefill chunks, decodes and verifies of
 * several requests in any mix), replacing ~100 torch ops per layer. Batch invariance holds by the
 * same construction as the GEMMs: every row-wise op (RMSNorm, RoPE, SiLU, residual adds) and the
 * attention of a query row are computed from that row and its own context alone, in an order that
 * depends only on the row (its context length), never on T or on threads. Reductions run in 16
 * lanes (element i in lane i % 16) summed by one fixed tree (sum16); multiplies and adds stay
 * separate (-ffp-contract=off, no -ffast-math) and exp is a polynomial of IEEE operations, no
 * libm: so the variants compute the same operations and agree bitwise today (tests check it).
 * The AVX-512 variant has its own attention, RMSNorm and SiLU in intrinsics (#if TB_AVX512_VNNI),
 * the same operations in the same order (16 keys' sums by one transposed tree), so it agrees too.
 *
 * The interface is one struct, TbForward (below), mirrored field for field by ctypes.Structure
 * classes in kernels/cpu/decoder_forward.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_gemm.h"

#define LANES 16

/* The 16 lanes summed by one fixed tree: (i, i + 8), then (i, i + 4), (i, i + 2), (i, i + 1). */
INLINE float sum16(const float a[LANES]) {
    float b[8], c[4];
    for (int i = 0; i < 8; i++) b[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) c[i] = b[i] + b[i + 4];
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* expf (Cephes' polynomial, about 2 ulp), from IEEE multiplies and adds only: the same bits on
 * every variant. x is clamped to [-87.33, 88]; 2^n is built in the exponent field. */
INLINE float exp_poly(float x) {
    x = x > 88.0f ? 88.0f : (x < -87.3365447505531f ? -87.3365447505531f : x);
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest even */
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#if defined(TB_AVX512_VNNI)
/* The AVX-512 variant's attention, norm and SiLU in intrinsics (gcc does not vectorize the
 * portable loops: scalar sum16 per key, scalar exp). The same IEEE operations in the same order as
 * the portable code (multiplies and adds separate, no FMA; sum16's tree done on 16 keys at once),
 * so its outputs equal the portable forward's bitwise. */
#include <immintrin.h>

/* exp_poly in 16 lanes: the same operations. */
INLINE __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.3365447505531f));
    const __m512 big = _mm512_set1_ps(12582912.0f);
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), big), big);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_add_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* Lane m of the result = sum16 of the lanes of a[(m % 4) * 4 + m / 4] (callers put key m in that
 * slot): lanes i + 8 added to i, then i + 4, then (0 + 2) + (1 + 3): sum16's tree, for 16 vectors
 * at once with no horizontal sum per vector. */
INLINE __m512 sum16x16(const __m512 a[16]) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

INLINE float sum16v(__m512 v) {
    float lanes[LANES];
    _mm512_storeu_ps(lanes, v);
    return sum16(lanes);
}
#endif

/* out = w * (x / sqrt(mean(x^2) + eps)), H a multiple of 16. */
static void rms_norm_row(const float *x, const float *w, int64_t h, float eps, float *out) {
#if defined(TB_AVX512_VNNI)
    __m512 ssv = _mm512_setzero_ps();
    for (int64_t i = 0; i < h; i += LANES) {
        const __m512 v = _mm512_loadu_ps(x + i);
        ssv = _mm512_add_ps(ssv, _mm512_mul_ps(v, v));
    }
    const float r = 1.0f / sqrtf(sum16v(ssv) / (float)h + eps);
    const __m512 rv = _mm512_set1_ps(r);
    for (int64_t i = 0; i < h; i += LANES)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(w + i), _mm512_mul_ps(_mm512_loadu_ps(x + i), rv)));
#else
    float ss[LANES] = {0};
    for (int64_t i = 0; i < h; i += LANES)
        for (int j = 0; j < LANES; j++) ss[j] = ss[j] + x[i + j] * x[i + j];
    const float r = 1.0f / sqrtf(sum16(ss) / (float)h + eps);
    for (int64_t i = 0; i < h; i++) out[i] = w[i] * (x[i] * r);
#endif
}

/* x = x * cos + roll(x, D/2) * sin (sin carries rotate_half's sign), for nh heads of D. */
static void rope_heads(float *x, int64_t nh, int64_t d, const float *cos, const float *sin) {
    float tmp[512];
    const int64_t half = d / 2;
    for (int64_t hh = 0; hh < nh; hh++) {
        float *v = x + hh * d;
        for (int64_t i = 0; i < d; i++) tmp[i] = v[i];
        for (int64_t i = 0; i < half; i++) v[i] = tmp[i] * cos[i] + tmp[i + half] * sin[i];
        for (int64_t i = half; i < d; i++) v[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
    }
}

/* 16 floats as one value (gcc and clang vector extension): element-wise IEEE operations, which
 * the compiler maps to the variant's registers (one zmm, two ymm, four xmm/NEON q, or 16 scalars).
 * Written out because a 16-lane accumulator array in a loop is not vectorized by gcc 12. */
typedef float v16 __attribute__((vector_size(64)));

INLINE v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* q . k, D a multiple of 16: lane j accumulates elements j, j + 16, ...; then sum16. */
INLINE float dot16(const float *a, const float *b, int64_t d) {
    v16 acc = load16(a) * load16(b);
    for (int64_t i = LANES; i < d; i += LANES) acc = acc + load16(a + i) * load16(b + i);
    float lanes[LANES];
    memcpy(lanes, &acc, sizeof lanes);
    return sum16(lanes);
}

typedef struct {
    int64_t h, hq, hk, d, inter, bs, max_blocks;
    float eps, scale;
} Dims;

#define MAX_GROUP 8 /* (row, query head) pairs handled together in P @ V (more: several passes) */
#define MAX_ROWS 8  /* consecutive rows of one request attended together (one pass over its keys) */
#define MAX_D 256

/* Attention of nr consecutive query rows of one request (row i at context ctxs[i], increasing:
 * a verify, a prefill chunk's slice, or one decode), kv head g (its G = hq / hk query heads) over
 * the request's paged cache ([blocks][2][bs][hk][d]). The rows share one pass over the keys and
 * one over the values (each K and V row is loaded once for all nr * G pairs: a 5-row verify
 * streams the context once, not five times), but every (row, head) pair's arithmetic is what
 * it would be alone: scores key by key; per pair max, exp and a 16-lane sum (position p in lane
 * p % 16) over its own context; then P @ V in position order up to its own context. So each
 * operation's order is fixed by the row's context alone, whatever nr is. scores holds
 * nr * G * cmax floats (cmax = the largest context), pair (r, j) at (r * G + j) * cmax. */
#if defined(TB_AVX512_VNNI)
/* The same attention (same operations, same order) in AVX-512: scores for 16 keys at a time, their
 * lane sums by one transposed tree (sum16x16); exp in 16 lanes; P @ V with the pass's accumulators
 * in registers. attend_nd is inlined once per head size with ND = D / 16 a constant (4: D = 64,
 * 8: D = 128) and once with ND a variable (any other D), so the loops over a key's 16-lane chunks
 * and over a pass's pairs unroll into registers where it matters. */

/* Scores of one (row, head) pair against the n <= 16 keys of a chunk, times scale, into s[0, n):
 * key i's q . k accumulates its ND chunks in order; the 16 keys' lanes are summed by sum16x16. */
INLINE void qk_chunk(const float *qj, const float *const *keys, const int64_t n, const int64_t ND, __m512 scale,
                     float *s) {
    __m512 qv[MAX_D / LANES], acc[LANES];
    for (int64_t e = 0; e < ND; e++) qv[e] = _mm512_loadu_ps(qj + LANES * e);
    for (int64_t i = 0; i < LANES; i++) {
        const int64_t key = (i % 4) * 4 + i / 4; /* the slot sum16x16 puts in lane key */
        if (key < n) {
            const float *k = keys[key];
            __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
            for (int64_t e = 1; e < ND; e++) a = _mm512_add_ps(a, _mm512_mul_ps(qv[e], _mm512_loadu_ps(k + LANES * e)));
            acc[i] = a;
        } else {
            acc[i] = _mm512_setzero_ps();
        }
    }
    const __mmask16 mk = n == LANES ? 0xFFFF : (__mmask16)((1u << n) - 1);
    _mm512_mask_storeu_ps(s, mk, _mm512_mul_ps(sum16x16(acc), scale));
}

#define PV_REGS 24 /* accumulators of one P @ V pass (of 32 zmm: the rest hold a V row and a score) */

/* P @ V for the NP pairs k0 .. k0 + NP - 1 (pair k's context pctx[k]): out = (sum over p < pctx[k],
 * in order, of s_k[p] * v_p) * inv, in ND 16-lane slices. Each V row is loaded once for the whole
 * pass (NP * ND accumulators), walked block by block (no division per key). */
INLINE void pv_pass(const int64_t NP, const int64_t ND, const Dims *dm, const float *kv, const int32_t *blocks,
                    int64_t g, const float *scores, int64_t cmax, int64_t k0, const int64_t *pctx, const float *inv,
                    int64_t gsz, float *out, int64_t ostride) {
    const int64_t d = dm->d, bs = dm->bs, vstride = dm->hk * d;
    __m512 acc[PV_REGS];
    int64_t lo = INT64_MAX, hi = 0; /* all pairs run to lo; only some past it */
    for (int64_t k = 0; k < NP; k++) {
        lo = pctx[k] < lo ? pctx[k] : lo;
        hi = pctx[k] > hi ? pctx[k] : hi;
    }
    for (int64_t a = 0; a < NP * ND; a++) acc[a] = _mm512_setzero_ps();
    const float *sp = scores + k0 * cmax;
    for (int64_t p0 = 0, b = 0; p0 < hi; p0 += bs, b++) {
        const float *vrow = kv + (((int64_t)blocks[b] * 2 + 1) * bs) * vstride + g * d;
        const int64_t pend = p0 + bs < hi ? p0 + bs : hi;
        for (int64_t p = p0; p < pend; p++, vrow += vstride) {
            __m512 v[MAX_D / LANES];
            for (int64_t i = 0; i < ND; i++) v[i] = _mm512_loadu_ps(vrow + LANES * i);
            for (int64_t k = 0; k < NP; k++) {
                if (p >= lo && p >= pctx[k]) continue;
                const __m512 sv = _mm512_set1_ps(sp[k * cmax + p]);
                for (int64_t i = 0; i < ND; i++) acc[k * ND + i] = _mm512_add_ps(acc[k * ND + i], _mm512_mul_ps(sv, v[i]));
            }
        }
    }
    for (int64_t k = 0; k < NP; k++) {
        const int64_t pr = k0 + k, r = pr / gsz, j = pr % gsz;
        const __m512 iv = _mm512_set1_ps(inv[pr]);
        for (int64_t i = 0; i < ND; i++)
            _mm512_storeu_ps(out + r * ostride + (g * gsz + j) * d + LANES * i, _mm512_mul_ps(acc[k * ND + i], iv));
    }
}

INLINE void attend_nd(const int64_t ND, const Dims *dm, const float *q, int64_t qstride, int64_t nr,
                      const int32_t *ctxs, const float *kv, const int32_t *blocks, int64_t g, float *scores,
                      float *out, int64_t ostride) {
    const int64_t d = dm->d, hk = dm->hk, gsz = dm->hq / hk, bs = dm->bs;
    int64_t cmax = 0;
    for (int64_t r = 0; r < nr; r++) cmax = ctxs[r] > cmax ? ctxs[r] : cmax;
    const __m512 scale = _mm512_set1_ps(dm->scale);
    for (int64_t p0 = 0; p0 < cmax; p0 += LANES) {
        const int64_t n = cmax - p0 < LANES ? cmax - p0 : LANES;
        const float *keys[LANES]; /* the n keys' rows, walked block by block (no division per key) */
        for (int64_t i = 0, b = p0 / bs, off = p0 % bs; i < n; i++) {
            keys[i] = kv + ((int64_t)blocks[b] * 2 * bs + off) * hk * d + g * d;
            if (++off == bs) off = 0, b++;
        }
        for (int64_t r = 0; r < nr; r++) {
            if (p0 >= ctxs[r]) continue;
            const int64_t nk = ctxs[r] - p0 < LANES ? ctxs[r] - p0 : LANES; /* this row's keys here */
            for (int64_t j = 0; j < gsz; j++) {
                const float *qj = q + r * qstride + (g * gsz + j) * d;
                float *s = scores + (r * gsz + j) * cmax + p0;
                if (nk == LANES)
                    qk_chunk(qj, keys, LANES, ND, scale, s);
                else
                    qk_chunk(qj, keys, nk, ND, scale, s);
            }
        }
    }
    const int64_t npairs = nr * gsz;
    float inv[npairs];
    int64_t pctx[npairs];
    for (int64_t pr = 0; pr < npairs; pr++) {
        const int64_t ctx = pctx[pr] = ctxs[pr / gsz];
        float *s = scores + pr * cmax;
        __m512 mxv = _mm512_set1_ps(-INFINITY);
        for (int64_t p = 0; p < ctx; p += LANES) {
            const __mmask16 mk = ctx - p >= LANES ? 0xFFFF : (__mmask16)((1u << (ctx - p)) - 1);
            mxv = _mm512_mask_max_ps(mxv, mk, mxv, _mm512_maskz_loadu_ps(mk, s + p));
        }
        /* a maximum is exact whatever the order (a zero's sign aside, which exp_poly(s - mx) ignores) */
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mxv));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t p = 0; p < ctx; p += LANES) {
            const __mmask16 mk = ctx - p >= LANES ? 0xFFFF : (__mmask16)((1u << (ctx - p)) - 1);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + p), mx));
            _mm512_mask_storeu_ps(s + p, mk, e);
            sum = _mm512_mask_add_ps(sum, mk, sum, e);
        }
        inv[pr] = 1.0f / sum16v(sum);
    }
    /* passes of up to PV_REGS / ND pairs (a decode's G pairs in one pass at D = 64), each pass
     * inlined for its pair count where ND is a constant */
    const int64_t width = PV_REGS / ND;
    for (int64_t k0 = 0; k0 < npairs; k0 += width) {
        const int64_t np = npairs - k0 < width ? npairs - k0 : width;
#define PV(NP) pv_pass(NP, ND, dm, kv, blocks, g, scores, cmax, k0, pctx + k0, inv, gsz, out, ostride)
        switch (ND == 4 || ND == 8 ? np : 0) {
        case 1: PV(1); break;
        case 2: PV(2); break;
        case 3: PV(3); break;
        case 4: PV(4); break;
        case 5: PV(5); break;
        case 6: PV(6); break;
        default: PV(np);
        }
#undef PV
    }
}

static void attend_rows(const Dims *dm, const float *q, int64_t qstride, int64_t nr, const int32_t *ctxs,
                        const float *kv, const int32_t *blocks, int64_t g, float *scores, float *out,
                        int64_t ostride) {
    const int64_t nd = dm->d / LANES;
    if (nd == 4)
        attend_nd(4, dm, q, qstride, nr, ctxs, kv, blocks, g, scores, out, ostride);
    else if (nd == 8)
        attend_nd(8, dm, q, qstride, nr, ctxs, kv, blocks, g, scores, out, ostride);
    else
        attend_nd(nd, dm, q, qstride, nr, ctxs, kv, blocks, g, scores, out, ostride);
}
#else
static void attend_rows(const Dims *dm, const float *q, int64_t qstride, int64_t nr, const int32_t *ctxs,
                        const float *kv, const int32_t *blocks, int64_t g, float *scores, float *out,
                        int64_t ostride) {
    const int64_t d = dm->d, hk = dm->hk, gsz = dm->hq / hk, bs = dm->bs;
    int64_t cmax = 0;
    for (int64_t r = 0; r < nr; r++) cmax = ctxs[r] > cmax ? ctxs[r] : cmax;
    for (int64_t p = 0; p < cmax; p++) {
        const float *k = kv + ((int64_t)blocks[p / bs] * 2 * bs + p % bs) * hk * d + g * d;
        for (int64_t r = 0; r < nr; r++) {
            if (p >= ctxs[r]) continue;
            for (int64_t j = 0; j < gsz; j++)
                scores[(r * gsz + j) * cmax + p] = dot16(q + r * qstride + (g * gsz + j) * d, k, d) * dm->scale;
        }
    }
    const int64_t npairs = nr * gsz;
    float inv[npairs];
    for (int64_t pr = 0; pr < npairs; pr++) {
        const int64_t ctx = ctxs[pr / gsz];
        float *s = scores + pr * cmax;
        float mx = -INFINITY;
        for (int64_t p = 0; p < ctx; p++) mx = s[p] > mx ? s[p] : mx;
        float sum[LANES] = {0};
        int64_t p = 0;
        for (; p + LANES <= ctx; p += LANES)
            for (int l = 0; l < LANES; l++) {
                s[p + l] = exp_poly(s[p + l] - mx);
                sum[l] = sum[l] + s[p + l];
            }
        for (int l = 0; p + l < ctx; l++) {
            s[p + l] = exp_poly(s[p + l] - mx);
            sum[l] = sum[l] + s[p + l];
        }
        inv[pr] = 1.0f / sum16(sum);
    }
    /* P @ V: each V row is loaded once per position for up to MAX_GROUP (row, head) pairs. */
    for (int64_t k0 = 0; k0 < npairs; k0 += MAX_GROUP) {
        const int64_t np = npairs - k0 < MAX_GROUP ? npairs - k0 : MAX_GROUP;
        float acc[MAX_GROUP][MAX_D];
        int64_t pctx[MAX_GROUP], hi = 0;
        for (int64_t k = 0; k < np; k++) {
            pctx[k] = ctxs[(k0 + k) / gsz];
            hi = pctx[k] > hi ? pctx[k] : hi;
            for (int64_t i = 0; i < d; i++) acc[k][i] = 0.0f;
        }
        for (int64_t p = 0; p < hi; p++) {
            const float *v = kv + (((int64_t)blocks[p / bs] * 2 + 1) * bs + p % bs) * hk * d + g * d;
            for (int64_t k = 0; k < np; k++) {
                if (p >= pctx[k]) continue;
                const float sp = scores[(k0 + k) * cmax + p];
                for (int64_t i = 0; i < d; i++) acc[k][i] = acc[k][i] + sp * v[i];
            }
        }
        for (int64_t k = 0; k < np; k++) {
            const int64_t pr = k0 + k, r = pr / gsz, j = pr % gsz;
            float *o = out + r * ostride + (g * gsz + j) * d;
            for (int64_t i = 0; i < d; i++) o[i] = acc[k][i] * inv[pr];
        }
    }
}
#endif

/* One decoder layer: its norms' weights, its KV cache [blocks][2][block_size][Hk][D] (fp32), its
 * four linears. */
typedef struct {
    const float *input_norm, *post_norm;
    float *kv;
    Lin qkv, o, gate_up, down;
} TbLayer;

/* One call. x [T][H] (in: embeddings; out: the last layer's residual stream, before the final
 * norm), cos/sin [max_pos][D], positions/slots [T], row_ctx [T] (context length incl. the row
 * itself), row_req [T] (the row's request), block_tables [B][max_blocks]. Taps (EAGLE-3's
 * auxiliary hidden states, engine/model/aux_states.py): for j < num_aux, the residual stream at
 * the input of layer aux_layers[j] is copied to aux [T][num_aux][H] at [r][j]; num_aux = 0 (aux
 * and aux_layers null) taps nothing, and the taps never change x. */
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
    int64_t num_aux;
    const int64_t *aux_layers;
    float *aux;
} TbForward;

/* The rows of x into tap slot j of aux (a copy: same bits). */
static void tap_rows(const TbForward *a, int64_t j) {
    const int64_t t = a->num_tokens, h = a->hidden, n = a->num_aux;
    for (int64_t r = 0; r < t; r++) memcpy(a->aux + (r * n + j) * h, a->x + r * h, h * sizeof(float));
}


/* 0, or -1 when out of memory. */
int tb_forward(const TbForward *a) {
    const int64_t t = a->num_tokens, nl = a->num_layers;
    const int nthreads = tb_team(t, (int)a->num_threads);
    const Dims dm = {a->hidden, a->num_heads, a->num_kv_heads, a->head_dim, a->intermediate, a->block_size,
                     a->max_blocks, a->eps, a->scale};
    float *x = a->x;
    const int64_t *positions = a->positions, *slots = a->slots;
    const float *cos = a->cos, *sin = a->sin;
    const int32_t *row_ctx = a->row_ctx, *row_req = a->row_req, *block_tables = a->block_tables;
    const int64_t h = dm.h, d = dm.d, qsz = dm.hq * d, kvsz = dm.hk * d, qkvn = qsz + 2 * kvsz, inter = dm.inter;
    int64_t max_ctx = 1;
    for (int64_t r = 0; r < t; r++) max_ctx = row_ctx[r] > max_ctx ? row_ctx[r] : max_ctx;
    /* attention groups: runs of up to MAX_ROWS consecutive rows of one request at consecutive
     * positions (a verify, a slice of a prefill chunk), each attended in one pass over its keys */
    int64_t *grp = malloc((t + 1) * sizeof(int64_t)), ngrp = 0;
    for (int64_t r = 0; grp && r < t;) {
        int64_t n = 1;
        while (r + n < t && n < MAX_ROWS && row_req[r + n] == row_req[r] && row_ctx[r + n] == row_ctx[r] + n) n++;
        grp[ngrp++] = r;
        r += n;
    }
    if (grp) grp[ngrp] = t;
    float *hs = malloc(t * h * sizeof(float)), *qkv = malloc(t * qkvn * sizeof(float));
    float *att = malloc(t * qsz * sizeof(float)), *gu = malloc(t * 2 * inter * sizeof(float));
    float *act = malloc(t * inter * sizeof(float));
    XRows rows = {0}; /* the quantized activations of every linear: K is at most max(H, Hq * D, I) */
    const int64_t kmax = h > qsz ? (h > inter ? h : inter) : (qsz > inter ? qsz : inter);
    int rc = grp && hs && qkv && att && gu && act && tb_rows_alloc(&rows, t, kmax) ? 0 : -1;
    const int par_rows = nthreads;
    for (int64_t l = 0; l < nl && rc == 0; l++) {
        const TbLayer *layer = a->layers + l;
        const float *in_norm = layer->input_norm, *post_norm = layer->post_norm;
        float *kv = layer->kv;
        const Lin *lqkv = &layer->qkv, *lo = &layer->o, *lgu = &layer->gate_up, *ldn = &layer->down;
        for (int64_t j = 0; j < a->num_aux; j++)
            if (a->aux_layers[j] == l) tap_rows(a, j);
#pragma omp parallel for num_threads(par_rows) schedule(static)
        for (int64_t r = 0; r < t; r++) rms_norm_row(x + r * h, in_norm, h, dm.eps, hs + r * h);
        rc |= tb_linear(lqkv, hs, t, h, qkvn, qkv, 0, nthreads, &rows);
#pragma omp parallel for num_threads(par_rows) schedule(static)
        for (int64_t r = 0; r < t; r++) {
            float *row = qkv + r * qkvn;
            rope_heads(row, dm.hq + dm.hk, d, cos + positions[r] * d, sin + positions[r] * d);
            const int64_t blk = slots[r] / dm.bs, off = slots[r] % dm.bs;
            memcpy(kv + ((blk * 2) * dm.bs + off) * kvsz, row + qsz, kvsz * sizeof(float));
            memcpy(kv + ((blk * 2 + 1) * dm.bs + off) * kvsz, row + qsz + kvsz, kvsz * sizeof(float));
        }
#pragma omp parallel num_threads(nthreads)
        {
            float *scores = malloc(MAX_ROWS * (dm.hq / dm.hk) * max_ctx * sizeof(float));
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < ngrp * dm.hk; i++) {
                const int64_t r = grp[i / dm.hk], nr = grp[i / dm.hk + 1] - r, g = i % dm.hk;
                if (scores)
                    attend_rows(&dm, qkv + r * qkvn, qkvn, nr, row_ctx + r, kv,
                                block_tables + (int64_t)row_req[r] * dm.max_blocks, g, scores, att + r * qsz, qsz);
            }
            if (!scores) {
#pragma omp atomic write
                rc = -1;
            }
            free(scores);
        }
        rc |= tb_linear(lo, att, t, qsz, h, x, 1, nthreads, &rows);
#pragma omp parallel for num_threads(par_rows) schedule(static)
        for (int64_t r = 0; r < t; r++) rms_norm_row(x + r * h, post_norm, h, dm.eps, hs + r * h);
        rc |= tb_linear(lgu, hs, t, h, 2 * inter, gu, 0, nthreads, &rows);
#pragma omp parallel for num_threads(par_rows) schedule(static)
        for (int64_t r = 0; r < t; r++) {
            const float *gr = gu + r * 2 * inter, *ur = gr + inter;
            float *ar = act + r * inter;
#if defined(TB_AVX512_VNNI)
            for (int64_t i = 0; i < inter; i += LANES) {
                const __m512 gv = _mm512_loadu_ps(gr + i), one = _mm512_set1_ps(1.0f);
                const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
                _mm512_storeu_ps(ar + i, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(ur + i)));
            }
#else
            for (int64_t i = 0; i < inter; i++) {
                const float gv = gr[i], sig = 1.0f / (1.0f + exp_poly(0.0f - gv));
                ar[i] = (gv * sig) * ur[i];
            }
#endif
        }
        rc |= tb_linear(ldn, act, t, inter, h, x, 1, nthreads, &rows);
    }
    free(grp);
    free(hs);
    free(qkv);
    free(att);
    free(gu);
    free(act);
    tb_rows_free(&rows);
    return rc ? -1 : 0;
}
