/* The AVX-512 variant's attention and the 16-lane helpers its norm and SiLU use (included by
 * decoder_ops.h when TB_AVX512_VNNI). */
/* The AVX-512 variant's attention, norm and SiLU in intrinsics (gcc does not vectorize the
 * portable loops: scalar sum16 per key, scalar exp). The same IEEE operations in the same order as
 * the portable code (multiplies and adds separate, no FMA; sum16's tree done on 16 keys at once),
 * so its outputs equal the portable forward's bitwise. */
#include <immintrin.h>

/* exp_poly (attention_portable.h) in 16 lanes: the same operations. */
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

/* softcap_n (attention_portable.h) in 16 lanes: cap * sign(y) (1 - t) / (1 + t), y = s / cap,
 * t = exp16(-2 |y|): the same operations. */
INLINE __m512 softcap16(__m512 s, float cap) {
    const __m512 y = _mm512_div_ps(s, _mm512_set1_ps(cap)), zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    const __mmask16 neg = _mm512_cmp_ps_mask(y, zero, _CMP_LT_OQ);
    const __m512 ay = _mm512_mask_sub_ps(y, neg, zero, y);
    const __m512 t = exp16(_mm512_mul_ps(ay, _mm512_set1_ps(-2.0f)));
    const __m512 th = _mm512_div_ps(_mm512_sub_ps(one, t), _mm512_add_ps(one, t));
    return _mm512_mul_ps(_mm512_mask_sub_ps(th, neg, zero, th), _mm512_set1_ps(cap));
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
                    int64_t g, const float *scores, int64_t cmax, int64_t k0, const int64_t *pctx, const int64_t *pfirst,
                    const float *inv, int64_t gsz, float *out, int64_t ostride) {
    const int64_t d = dm->d, bs = dm->bs, vstride = dm->hk * d;
    __m512 acc[PV_REGS];
    int64_t lo = INT64_MAX, hi = 0; /* all pairs run to lo; only some past it */
    int64_t flo = INT64_MAX, fhi = 0; /* all pairs' windows start by fhi; some at flo */
    for (int64_t k = 0; k < NP; k++) {
        lo = pctx[k] < lo ? pctx[k] : lo;
        hi = pctx[k] > hi ? pctx[k] : hi;
        flo = pfirst[k] < flo ? pfirst[k] : flo;
        fhi = pfirst[k] > fhi ? pfirst[k] : fhi;
    }
    for (int64_t a = 0; a < NP * ND; a++) acc[a] = _mm512_setzero_ps();
    const float *sp = scores + k0 * cmax;
    for (int64_t p0 = flo / bs * bs, b = flo / bs; p0 < hi; p0 += bs, b++) {
        const int64_t pstart = p0 > flo ? p0 : flo;
        const float *vrow = kv + (((int64_t)blocks[b] * 2 + 1) * bs + (pstart - p0)) * vstride + g * d;
        const int64_t pend = p0 + bs < hi ? p0 + bs : hi;
        for (int64_t p = pstart; p < pend; p++, vrow += vstride) {
            for (int64_t i = 0; i < ND; i++) /* 4 keys ahead (past a block's end: a harmless hint) */
                _mm_prefetch((const char *)(vrow + 4 * vstride + LANES * i), _MM_HINT_T0);
            __m512 v[MAX_D / LANES];
            for (int64_t i = 0; i < ND; i++) v[i] = _mm512_loadu_ps(vrow + LANES * i);
            for (int64_t k = 0; k < NP; k++) {
                if ((p >= lo && p >= pctx[k]) || (p < fhi && p < pfirst[k])) continue;
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
    int64_t cmax = 0, kmin = INT64_MAX; /* keys [kmin, cmax) are some row's */
    for (int64_t r = 0; r < nr; r++) {
        cmax = ctxs[r] > cmax ? ctxs[r] : cmax;
        kmin = first_key(dm, ctxs[r]) < kmin ? first_key(dm, ctxs[r]) : kmin;
    }
    const __m512 scale = _mm512_set1_ps(dm->scale);
    /* chunks of 16 keys from kmin (a row scores some keys before its window: never read) */
    for (int64_t p0 = kmin; p0 < cmax; p0 += LANES) {
        const int64_t n = cmax - p0 < LANES ? cmax - p0 : LANES;
        const float *keys[LANES]; /* the n keys' rows, walked block by block (no division per key) */
        for (int64_t i = 0, b = p0 / bs, off = p0 % bs; i < n; i++) {
            keys[i] = kv + ((int64_t)blocks[b] * 2 * bs + off) * hk * d + g * d;
            if (++off == bs) off = 0, b++;
        }
        /* the next chunk's key rows on their way while these are scored: the blocks lie anywhere in the
         * pool, and a long context's K/V (46 KB per token on the default model) is read from memory */
        for (int64_t i = 0, b = (p0 + LANES) / bs, off = (p0 + LANES) % bs; i < LANES && p0 + LANES + i < cmax; i++) {
            const float *nk = kv + ((int64_t)blocks[b] * 2 * bs + off) * hk * d + g * d;
            for (int64_t e = 0; e < ND; e++) _mm_prefetch((const char *)(nk + LANES * e), _MM_HINT_T0);
            if (++off == bs) off = 0, b++;
        }
        for (int64_t r = 0; r < nr; r++) {
            if (p0 >= ctxs[r] || p0 + LANES <= first_key(dm, ctxs[r])) continue;
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
    int64_t pctx[npairs], pfirst[npairs];
    for (int64_t pr = 0; pr < npairs; pr++) {
        const int64_t ctx = pctx[pr] = ctxs[pr / gsz], lo = pfirst[pr] = first_key(dm, ctx);
        float *s = scores + pr * cmax;
        if (dm->softcap != 0.0f)
            for (int64_t p = lo; p < ctx; p += LANES) {
                const __mmask16 mk = ctx - p >= LANES ? 0xFFFF : (__mmask16)((1u << (ctx - p)) - 1);
                _mm512_mask_storeu_ps(s + p, mk, softcap16(_mm512_maskz_loadu_ps(mk, s + p), dm->softcap));
            }
        __m512 mxv = _mm512_set1_ps(-INFINITY);
        for (int64_t p = lo; p < ctx; p += LANES) {  /* key p in lane (p - lo) % 16 */
            const __mmask16 mk = ctx - p >= LANES ? 0xFFFF : (__mmask16)((1u << (ctx - p)) - 1);
            mxv = _mm512_mask_max_ps(mxv, mk, mxv, _mm512_maskz_loadu_ps(mk, s + p));
        }
        /* a maximum is exact whatever the order (a zero's sign aside, which exp_poly(s - mx) ignores) */
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mxv));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t p = lo; p < ctx; p += LANES) {
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
#define PV(NP) pv_pass(NP, ND, dm, kv, blocks, g, scores, cmax, k0, pctx + k0, pfirst + k0, inv, gsz, out, ostride)
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
