/* One forward of the EAGLE-3 draft head (engine/model/eagle3.py says what it computes) in one C
 * call (tb_eagle3), over the head's q4/q8 linears: its one decoder layer, final norm and draft lm
 * head, for the rows of several requests at once.
 *
 * Why: a draft step at batch 1 is one row through ~40 small torch ops (the embedding lookup, norms,
 * a concatenation, seven GEMMs, RoPE, attention as two batched matmuls, SiLU, residual adds, the lm
 * head, the argmax), each a few microseconds of dispatch, run k times per engine step right after
 * the target's forward has evicted the head from the caches. One call does all of it; what remains
 * is reading the weights.
 *
 * Rows come in segments, one per request: segment s is seg_rows[s] consecutive positions of one
 * request whose K/V go to rows [seg_at[s], seg_at[s] + seg_rows[s]) of its own buffer
 * (seg_kv[s], [2][seg_cap[s]][Hk][D]: K rows then V rows, the one-block paged layout
 * attend_rows reads), after the rows [0, seg_at[s]) already there. Every row's K/V is computed
 * and written; only each segment's last row queries and produces an output (h_out [S][H], the
 * pre-norm output that the next draft step reads as its hidden state, and logits [S][V_draft]):
 * the head is one layer, so a row whose output nobody reads needs only its K/V. A draft step is S
 * segments of one row; the catch-up over a prompt is one segment of many rows.
 *
 * The call starts from the rows' token ids and either the target's tap states (fused by fc: a
 * catch-up) or the previous draft step's outputs, and ends with each segment's greedy draft (the
 * first largest logit, as a target id): every step of drafting at batch 1 but the sampling of
 * non-greedy requests, which reads the logits.
 *
 * Row ops, attention and GEMMs are decoder_forward.c's (decoder_ops.h): each row is computed from
 * itself and its own context, so a request's drafts do not depend on the batch.
 */
#include <stdlib.h>

#include "decoder_ops.h"

typedef struct {
    int64_t num_rows, num_segments, hidden, num_heads, num_kv_heads, head_dim, intermediate, draft_vocab,
        num_threads, norm_before_residual, aux_width;
    float eps, scale; /* RMSNorm epsilon, softmax scale */
    const float *input_norm, *hidden_norm, *post_norm, *norm;
    Lin fc, q, k, v, o, gate, up, down, lm_head;
    /* the input token's embedding: row token_ids[r] of embed_f32 [V][H], or (embed_f32 null) of
     * the Q8_0 table embed_codes [V][H] int8 x embed_scales [V][H / 32] fp16, as Q8Embedding
     * dequantizes it (code * scale, one float multiply) */
    const int64_t *token_ids;
    const float *embed_f32;
    const int8_t *embed_codes;
    const uint16_t *embed_scales;
    /* the hidden state: fc(aux) with aux [T][aux_width] (the target's tap states, a catch-up), or
     * (aux null) hidden_in [T][H] (the previous draft step's output) */
    const float *aux, *hidden_in;
    const int64_t *positions;        /* [T] */
    const float *cos, *sin;          /* [max_pos][D] */
    const int64_t *seg_kv;           /* [S] addresses of the segments' K/V buffers */
    const int64_t *seg_cap, *seg_at, *seg_rows; /* [S] */
    const int64_t *d2t;              /* [V_draft]: target id = draft id + d2t[draft id] */
    float *h_out, *logits;           /* [S][H], [S][V_draft] */
    int64_t *greedy;                 /* [S]: the target id of each segment's first largest logit */
} TbEagle3;

/* Row r's embedding into out [H]. */
static void embed_row(const TbEagle3 *a, int64_t r, float *out) {
    const int64_t h = a->hidden, id = a->token_ids[r];
    if (a->embed_f32) {
        memcpy(out, a->embed_f32 + id * h, h * sizeof(float));
        return;
    }
    const int8_t *c = a->embed_codes + id * h;
    const uint16_t *sc = a->embed_scales + id * (h / GROUP);
    for (int64_t g = 0; g < h / GROUP; g++) {
        const float d = half_to_float(sc[g]);
        for (int64_t i = g * GROUP; i < (g + 1) * GROUP; i++) out[i] = (float)c[i] * d;
    }
}

/* 0, or -1 when out of memory. */
int tb_eagle3(const TbEagle3 *a) {
    const int64_t t = a->num_rows, ns = a->num_segments, h = a->hidden, h2 = 2 * h, d = a->head_dim;
    const int64_t qsz = a->num_heads * d, kvsz = a->num_kv_heads * d, inter = a->intermediate;
    const int all_threads = tb_team(t, (int)a->num_threads), out_threads = tb_team(ns, (int)a->num_threads);
    const Dims base = {h, a->num_heads, a->num_kv_heads, d, inter, 0, 1, a->eps, a->scale};
    float *x = malloc(t * h2 * sizeof(float)), *kb = malloc(t * kvsz * sizeof(float));
    float *emb = malloc(t * h * sizeof(float)), *fused = a->aux ? malloc(t * h * sizeof(float)) : NULL;
    float *vb = malloc(t * kvsz * sizeof(float)), *xo = malloc(ns * h2 * sizeof(float));
    float *q = malloc(ns * qsz * sizeof(float)), *att = malloc(ns * qsz * sizeof(float));
    float *hs = malloc(ns * h * sizeof(float)), *g = malloc(ns * inter * sizeof(float));
    float *u = malloc(ns * inter * sizeof(float)), *act = malloc(ns * inter * sizeof(float));
    int64_t *last = malloc(ns * sizeof(int64_t));
    XRows rows = {0};
    int64_t kmax = h2 > qsz ? (h2 > inter ? h2 : inter) : (qsz > inter ? qsz : inter);
    kmax = a->aux && a->aux_width > kmax ? a->aux_width : kmax;
    int rc = x && kb && vb && emb && (fused || !a->aux) && xo && q && att && hs && g && u && act && last &&
                     tb_rows_alloc(&rows, t > ns ? t : ns, kmax) ? 0 : -1;
    float *ho = a->h_out;
    const float *hid = a->aux ? fused : a->hidden_in;
    if (rc == 0 && a->aux)
        rc |= tb_linear(&a->fc, a->aux, t, a->aux_width, h, fused, 0, all_threads, &rows);
    if (rc == 0) {
#pragma omp parallel for num_threads(all_threads) schedule(static)
        for (int64_t r = 0; r < t; r++) {
            embed_row(a, r, emb + r * h);
            rms_norm_row(emb + r * h, a->input_norm, h, a->eps, x + r * h2);
            rms_norm_row(hid + r * h, a->hidden_norm, h, a->eps, x + r * h2 + h);
        }
        rc |= tb_linear(&a->k, x, t, h2, kvsz, kb, 0, all_threads, &rows);
        rc |= tb_linear(&a->v, x, t, h2, kvsz, vb, 0, all_threads, &rows);
    }
    for (int64_t s = 0, r0 = 0; rc == 0 && s < ns; r0 += a->seg_rows[s], s++) {
        float *kv = (float *)(intptr_t)a->seg_kv[s];
        const int64_t cap = a->seg_cap[s], at = a->seg_at[s], n = a->seg_rows[s];
        for (int64_t i = 0; i < n; i++) {
            const int64_t r = r0 + i, p = a->positions[r];
            rope_heads(kb + r * kvsz, a->num_kv_heads, d, d, a->cos + p * d, a->sin + p * d);
            memcpy(kv + (at + i) * kvsz, kb + r * kvsz, kvsz * sizeof(float));
            memcpy(kv + (cap + at + i) * kvsz, vb + r * kvsz, kvsz * sizeof(float));
        }
        const int64_t lr = last[s] = r0 + n - 1;
        memcpy(xo + s * h2, x + lr * h2, h2 * sizeof(float));
        /* the residual: the hidden state, or its norm (norm_before_residual) */
        memcpy(ho + s * h, a->norm_before_residual ? x + lr * h2 + h : hid + lr * h, h * sizeof(float));
    }
    if (rc == 0)
        rc |= tb_linear(&a->q, xo, ns, h2, qsz, q, 0, out_threads, &rows);
    for (int64_t s = 0; rc == 0 && s < ns; s++) {
        const int64_t p = a->positions[last[s]];
        rope_heads(q + s * qsz, a->num_heads, d, d, a->cos + p * d, a->sin + p * d);
    }
    if (rc == 0) {
#pragma omp parallel num_threads(out_threads)
        {
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < ns * base.hk; i++) {
                const int64_t s = i / base.hk, gi = i % base.hk;
                const int32_t ctx = (int32_t)(a->seg_at[s] + a->seg_rows[s]), block = 0;
                Dims dm = base;
                dm.bs = a->seg_cap[s];
                float *scores = malloc((base.hq / base.hk) * ctx * sizeof(float));
                if (scores)
                    attend_rows(&dm, q + s * qsz, qsz, 1, &ctx, (const float *)(intptr_t)a->seg_kv[s], &block, gi,
                                scores, att + s * qsz, qsz);
                else {
#pragma omp atomic write
                    rc = -1;
                }
                free(scores);
            }
        }
    }
    if (rc == 0) {
        rc |= tb_linear(&a->o, att, ns, qsz, h, ho, 1, out_threads, &rows);
        for (int64_t s = 0; s < ns; s++) rms_norm_row(ho + s * h, a->post_norm, h, a->eps, hs + s * h);
        rc |= tb_linear(&a->gate, hs, ns, h, inter, g, 0, out_threads, &rows);
        rc |= tb_linear(&a->up, hs, ns, h, inter, u, 0, out_threads, &rows);
        for (int64_t s = 0; s < ns; s++) silu_mul_row(g + s * inter, u + s * inter, inter, act + s * inter);
        rc |= tb_linear(&a->down, act, ns, inter, h, ho, 1, out_threads, &rows);
        for (int64_t s = 0; s < ns; s++) rms_norm_row(ho + s * h, a->norm, h, a->eps, hs + s * h);
        rc |= tb_linear(&a->lm_head, hs, ns, h, a->draft_vocab, a->logits, 0, out_threads, &rows);
        for (int64_t s = 0; s < ns; s++) {
            const float *lg = a->logits + s * a->draft_vocab;
            int64_t best = 0;
            for (int64_t i = 1; i < a->draft_vocab; i++) best = lg[i] > lg[best] ? i : best;
            a->greedy[s] = best + a->d2t[best];
        }
    }
    free(x);
    free(emb);
    free(fused);
    free(kb);
    free(vb);
    free(xo);
    free(q);
    free(att);
    free(hs);
    free(g);
    free(u);
    free(act);
    free(last);
    tb_rows_free(&rows);
    return rc ? -1 : 0;
}
