/* The attention of every variant but AVX-512 (AVX2, AVX-VNNI, NEON, scalar), included by
 * decoder_ops.h, in generic vectors of the variant's register width (vn: 8 floats on AVX2 and
 * AVX-VNNI, 4 on NEON and the SSE2 baseline; gcc and clang vector extensions). The operations and
 * their order are the contract stated above attend_rows' include (what the scalar loops computed,
 * and attention_avx512.h computes): a key's score is its q . k in 16 lanes (position i in lane
 * i % 16) summed by sum16's tree, the softmax's exp is exp_poly and its sum runs in 16 lanes, and
 * P @ V adds s_p * v_p in key order. So every variant gives the scalar one's bits
 * (tests/test_cpu_kernels.py checks it). Wider-than-register generic vectors are avoided: gcc
 * builds their products with a scalar through the stack. */

#if defined(TB_AVX2) || defined(TB_AVX_VNNI)
#define VL 8
#else
#define VL 4
#endif
#define NV (LANES / VL) /* registers per 16 lanes */

typedef float vn __attribute__((vector_size(VL * 4)));
typedef int32_t vni __attribute__((vector_size(VL * 4)));
typedef float v4f __attribute__((vector_size(16)));

INLINE vn loadn(const float *p) {
    vn v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void storen(float *p, vn v) { memcpy(p, &v, sizeof v); }

INLINE vn splat(float x) { return (vn){0} + x; }

/* Lane by lane: m ? a : b (m from a comparison: all ones or zero). */
INLINE vn selectn(vni m, vn a, vn b) {
    vni ai, bi;
    memcpy(&ai, &a, sizeof a);
    memcpy(&bi, &b, sizeof b);
    ai = (ai & m) | (bi & ~m);
    memcpy(&a, &ai, sizeof a);
    return a;
}

/* sum16 of 16 lanes held in NV registers (lane l in a[l / VL]): (l, l + 8), (l, l + 4), then
 * (0 + 2) + (1 + 3), as sum16 does. */
INLINE float sum16n(const vn *a) {
#if VL == 8
    const vn b = a[0] + a[1];
    const v4f c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
#else
    const v4f c = (a[0] + a[2]) + (a[1] + a[3]);
#endif
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* expf lane by lane (Cephes' polynomial, about 2 ulp), from IEEE multiplies and adds only: the same
 * bits on every variant (attention_avx512.h's exp16 is these operations in intrinsics). x is clamped
 * to [-87.33, 88]; 2^n is built in the exponent field. */
INLINE vn exp_poly(vn x) {
    const vn hi = splat(88.0f), lo = splat(-87.3365447505531f);
    x = selectn(x > hi, hi, selectn(x < lo, lo, x));
    const vn n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    vn r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    vn p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    const vni bits = (__builtin_convertvector(n, vni) + 127) << 23;
    vn scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* q . k over ND 16-lane chunks accumulated in order, then sum16. */
INLINE float dotn(const float *q, const float *k, const int64_t ND) {
    vn acc[NV];
    for (int v = 0; v < NV; v++) acc[v] = loadn(q + VL * v) * loadn(k + VL * v);
    for (int64_t e = 1; e < ND; e++)
        for (int v = 0; v < NV; v++) acc[v] = acc[v] + loadn(q + LANES * e + VL * v) * loadn(k + LANES * e + VL * v);
    return sum16n(acc);
}

/* Softmax of one pair's ctx scores in place (exp_poly(s - max)); returns 1 / their sum, taken in
 * 16 lanes (position p in lane p % 16) and then sum16. */
/* cap * tanh(s / cap) lane by lane: tanh(y) = sign(y) (1 - t) / (1 + t), t = exp_poly(-2 |y|). */
INLINE vn softcap_n(vn s, float cap) {
    const vn y = s / cap, ay = selectn(y < splat(0.0f), splat(0.0f) - y, y);
    const vn t = exp_poly(ay * -2.0f), th = (splat(1.0f) - t) / (splat(1.0f) + t);
    return selectn(y < splat(0.0f), splat(0.0f) - th, th) * cap;
}

/* The soft-cap over n scores in place (the tail through a 16-lane buffer). */
INLINE void softcap_scores(float *s, int64_t n, float cap) {
    int64_t p = 0;
    for (; p + VL <= n; p += VL) storen(s + p, softcap_n(loadn(s + p), cap));
    if (p < n) {
        float tail[VL] = {0};
        memcpy(tail, s + p, (n - p) * sizeof(float));
        storen(tail, softcap_n(loadn(tail), cap));
        memcpy(s + p, tail, (n - p) * sizeof(float));
    }
}

INLINE float softmax_lanes(float *s, int64_t ctx) {
    float mx = -INFINITY; /* a maximum is exact in any order */
    vn mxv = splat(-INFINITY);
    int64_t p = 0;
    for (; p + VL <= ctx; p += VL) {
        const vn v = loadn(s + p);
        mxv = selectn(v > mxv, v, mxv);
    }
    for (int l = 0; l < VL; l++) mx = mxv[l] > mx ? mxv[l] : mx;
    for (; p < ctx; p++) mx = s[p] > mx ? s[p] : mx;
    vn sum[NV];
    for (int v = 0; v < NV; v++) sum[v] = splat(0.0f);
    const vn mxs = splat(mx);
    for (p = 0; p + LANES <= ctx; p += LANES)
        for (int v = 0; v < NV; v++) {
            const vn e = exp_poly(loadn(s + p + VL * v) - mxs);
            storen(s + p + VL * v, e);
            sum[v] = sum[v] + e;
        }
    if (p < ctx) { /* the tail: its lanes only (adding +0 to the others leaves those sums as they are) */
        float tail[LANES] = {0};
        memcpy(tail, s + p, (ctx - p) * sizeof(float));
        for (int v = 0; v < NV; v++) storen(tail + VL * v, exp_poly(loadn(tail + VL * v) - mxs));
        for (int64_t l = ctx - p; l < LANES; l++) tail[l] = 0.0f;
        memcpy(s + p, tail, (ctx - p) * sizeof(float));
        for (int v = 0; v < NV; v++) sum[v] = sum[v] + loadn(tail + VL * v);
    }
    return 1.0f / sum16n(sum);
}

INLINE void attend_nd(const int64_t ND, const Dims *dm, const float *q, int64_t qstride, int64_t nr,
                      const int32_t *ctxs, const float *kv, const int32_t *blocks, int64_t g, float *scores,
                      float *out, int64_t ostride) {
    const int64_t d = dm->d, hk = dm->hk, gsz = dm->hq / hk, bs = dm->bs, vstride = hk * d;
    int64_t cmax = 0, kmin = INT64_MAX; /* keys [kmin, cmax) are some row's */
    for (int64_t r = 0; r < nr; r++) {
        cmax = ctxs[r] > cmax ? ctxs[r] : cmax;
        kmin = first_key(dm, ctxs[r]) < kmin ? first_key(dm, ctxs[r]) : kmin;
    }
    /* scores: each key row is read once for all nr * G pairs, walked block by block */
    for (int64_t p0 = kmin / bs * bs, b = kmin / bs; p0 < cmax; p0 += bs, b++) {
        const int64_t pstart = p0 > kmin ? p0 : kmin;
        const float *krow = kv + ((int64_t)blocks[b] * 2 * bs + (pstart - p0)) * vstride + g * d;
        const int64_t pend = p0 + bs < cmax ? p0 + bs : cmax;
        for (int64_t p = pstart; p < pend; p++, krow += vstride) {
            for (int64_t e = 0; e < ND; e++) __builtin_prefetch(krow + 4 * vstride + LANES * e);
            for (int64_t r = 0; r < nr; r++) {
                if (p >= ctxs[r] || p < first_key(dm, ctxs[r])) continue;
                for (int64_t j = 0; j < gsz; j++)
                    scores[(r * gsz + j) * cmax + p] = dotn(q + r * qstride + (g * gsz + j) * d, krow, ND) * dm->scale;
            }
        }
    }
    /* per pair: softmax, then P @ V in key order (ND * NV accumulators in registers) */
    for (int64_t pr = 0; pr < nr * gsz; pr++) {
        const int64_t ctx = ctxs[pr / gsz], lo = first_key(dm, ctx);
        float *s = scores + pr * cmax;
        if (dm->softcap != 0.0f) softcap_scores(s + lo, ctx - lo, dm->softcap);
        const float inv = softmax_lanes(s + lo, ctx - lo); /* key p in lane (p - lo) % 16 */
        vn acc[MAX_D / VL];
        for (int64_t i = 0; i < ND * NV; i++) acc[i] = splat(0.0f);
        for (int64_t p0 = lo / bs * bs, b = lo / bs; p0 < ctx; p0 += bs, b++) {
            const int64_t pstart = p0 > lo ? p0 : lo;
            const float *vrow = kv + (((int64_t)blocks[b] * 2 + 1) * bs + (pstart - p0)) * vstride + g * d;
            const int64_t pend = p0 + bs < ctx ? p0 + bs : ctx;
            for (int64_t p = pstart; p < pend; p++, vrow += vstride) {
                for (int64_t e = 0; e < ND; e++) __builtin_prefetch(vrow + 4 * vstride + LANES * e);
                const vn sp = splat(s[p]);
                for (int64_t i = 0; i < ND * NV; i++) acc[i] = acc[i] + sp * loadn(vrow + VL * i);
            }
        }
        float *o = out + (pr / gsz) * ostride + (g * gsz + pr % gsz) * d;
        const vn iv = splat(inv);
        for (int64_t i = 0; i < ND * NV; i++) storen(o + VL * i, acc[i] * iv);
    }
}
