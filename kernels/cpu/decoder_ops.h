/* The row operations of a decoder layer that the C forwards share (decoder_forward.c: the
 * target's layers; eagle3_head.c: the EAGLE-3 head's one layer): the 16-lane sum, RMSNorm, RoPE,
 * SiLU or GELU-tanh * up, and the attention of a request's rows over a paged K/V cache. Each is computed from
 * its row (and the row's own context) alone, in an order fixed by the row: the batch invariance
 * and the variants' bitwise agreement that decoder_forward.c's header states rest on it. Static:
 * each including file gets its own copy. */
#pragma once
#include <math.h>
#include <stdint.h>
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

/* window: a query at context c sees keys [c - window, c) only (0: all, the torch reference's rule);
 * softcap: scores -> softcap * tanh(score / softcap) before the softmax (0: none, Gemma 2). */
typedef struct {
    int64_t h, hq, hk, d, inter, bs, max_blocks;
    float eps, scale;
    int64_t window;
    float softcap;
} Dims;

/* The first key a query at context ctx sees (its sliding window's start; 0 without one). */
INLINE int64_t first_key(const Dims *dm, int64_t ctx) { return dm->window && ctx > dm->window ? ctx - dm->window : 0; }

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
#include "attention_avx512.h"
#else
#include "attention_portable.h"
#endif

/* attend_nd (the variant's header) with ND = D / 16 a constant for D = 64 and 128, so its loops over
 * a key's 16-lane chunks unroll into registers; any other D runs the same code with ND a variable. */
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

/* On the first rot dims of each of nh heads of D: x = x * cos + roll(x, rot/2) * sin (sin carries
 * rotate_half's sign; cos/sin hold rot values); the other D - rot dims pass unchanged (partial
 * rotary). */
static void rope_heads(float *x, int64_t nh, int64_t d, int64_t rot, const float *cos, const float *sin) {
    float tmp[512];
    const int64_t half = rot / 2;
    for (int64_t hh = 0; hh < nh; hh++) {
        float *v = x + hh * d;
        for (int64_t i = 0; i < rot; i++) tmp[i] = v[i];
        for (int64_t i = 0; i < half; i++) v[i] = tmp[i] * cos[i] + tmp[i + half] * sin[i];
        for (int64_t i = half; i < rot; i++) v[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
    }
}

/* out = silu(g) * u over I values (I a multiple of 32: the down GEMM's K). */
static void silu_mul_row(const float *gr, const float *ur, int64_t inter, float *ar) {
#if defined(TB_AVX512_VNNI)
    for (int64_t i = 0; i < inter; i += LANES) {
        const __m512 gv = _mm512_loadu_ps(gr + i), one = _mm512_set1_ps(1.0f);
        const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        _mm512_storeu_ps(ar + i, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(ur + i)));
    }
#else
    for (int64_t i = 0; i < inter; i += VL) {
        const vn gv = loadn(gr + i), sig = splat(1.0f) / (splat(1.0f) + exp_poly(splat(0.0f) - gv));
        storen(ar + i, (gv * sig) * loadn(ur + i));
    }
#endif
}

/* out = gelu_tanh(g) * u over I values: 0.5 g (1 + tanh(u)) written as g * sigmoid(2u), u =
 * sqrt(2/pi) (g + 0.044715 g^3) (the same function; no cancellation for negative g). */
static void gelu_mul_row(const float *gr, const float *ur, int64_t inter, float *ar) {
#if defined(TB_AVX512_VNNI)
    for (int64_t i = 0; i < inter; i += LANES) {
        const __m512 gv = _mm512_loadu_ps(gr + i), one = _mm512_set1_ps(1.0f);
        const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(gv, gv), gv);
        const __m512 u = _mm512_mul_ps(_mm512_add_ps(gv, _mm512_mul_ps(cube, _mm512_set1_ps(0.044715f))),
                                       _mm512_set1_ps(0.7978845608028654f));
        const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_mul_ps(u, _mm512_set1_ps(-2.0f)))));
        _mm512_storeu_ps(ar + i, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(ur + i)));
    }
#else
    for (int64_t i = 0; i < inter; i += VL) {
        const vn gv = loadn(gr + i), u = (gv + ((gv * gv) * gv) * 0.044715f) * 0.7978845608028654f;
        const vn sig = splat(1.0f) / (splat(1.0f) + exp_poly(u * -2.0f));
        storen(ar + i, (gv * sig) * loadn(ur + i));
    }
#endif
}
