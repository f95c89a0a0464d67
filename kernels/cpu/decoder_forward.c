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
#include <stdlib.h>

#include "decoder_ops.h"

/* One decoder layer: its norms' weights (null where the family's layer has no such norm:
 * engine/model/weights.py's roles), its q/k norms (null: none; [D] per head or [Hq * D] / [Hk * D]
 * over the projection, TbForward.qk_norm), its RoPE table cos/sin [max_pos][rotary_dim] (null: a
 * layer without RoPE), its KV cache [blocks][2][block_size][Hk][D] (fp32), its four linears. */
typedef struct {
    const float *attn_in_norm, *attn_out_norm, *mlp_in_norm, *mlp_out_norm, *q_norm, *k_norm;
    const float *cos, *sin;
    float *kv;
    Lin qkv, o, gate_up, down;
    int64_t window; /* sliding window in keys (0: the whole context), Dims.window */
} TbLayer;

/* One call. x [T][H] (in: embeddings; out: the last layer's residual stream, before the final
 * norm), positions/slots [T], row_ctx [T] (context length incl. the row itself), row_req [T] (the
 * row's request), block_tables [B][max_blocks]. qk_norm: 0 none, 1 per head, 2 over the
 * projection; rotary_dim: the dims of a head that RoPE turns (the rest pass); residual_mult: a
 * block's output is scaled by it before it joins the residual stream (Granite; 1: not at all).
 * Taps (EAGLE-3's auxiliary hidden states, engine/model/aux_states.py): for j < num_aux, the
 * residual stream at the input of layer aux_layers[j] is copied to aux [T][num_aux][H] at [r][j];
 * num_aux = 0 (aux and aux_layers null) taps nothing, and the taps never change x. */
typedef struct {
    int64_t num_tokens, hidden, num_heads, num_kv_heads, head_dim, intermediate, num_layers, block_size, max_blocks,
        num_threads, qk_norm, rotary_dim, gelu; /* gelu: the MLP's gate is gelu_tanh (GeGLU), else SiLU */
    /* RMSNorm epsilon, softmax scale, residual multiplier, attention logit soft-cap (0: none) */
    float eps, scale, residual_mult, softcap;
    const TbLayer *layers;
    float *x;
    const int64_t *positions;
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


/* x += block (as the GEMM's accumulate does) where the layer has no norm on the block's output and
 * no multiplier; else block = norm(block) (if any), x = x + block * m (or x + block). */
static void add_block(float *x, float *block, int64_t t, int64_t h, const float *out_norm, float eps, float m,
                      float *tmp, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < t; r++) {
        float *b = block + r * h, *xr = x + r * h;
        if (out_norm) {
            rms_norm_row(b, out_norm, h, eps, tmp + r * h);
            b = tmp + r * h;
        }
        if (m != 1.0f)
            for (int64_t i = 0; i < h; i++) xr[i] = xr[i] + b[i] * m;
        else
            for (int64_t i = 0; i < h; i++) xr[i] = xr[i] + b[i];
    }
}

/* The rows of x normalized by w into out, or copied where w is null (a layer without that norm). */
static void norm_rows(const float *x, const float *w, int64_t t, int64_t h, float eps, float *out, int nthreads) {
    if (!w) {
        memcpy(out, x, t * h * sizeof(float));
        return;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < t; r++) rms_norm_row(x + r * h, w, h, eps, out + r * h);
}

/* 0, or -1 when out of memory. */
int tb_forward(const TbForward *a) {
    const int64_t t = a->num_tokens, nl = a->num_layers;
    const int nthreads = tb_team(t, (int)a->num_threads);
    Dims dm = {a->hidden, a->num_heads, a->num_kv_heads, a->head_dim, a->intermediate, a->block_size,
                     a->max_blocks, a->eps, a->scale, 0, a->softcap};
    float *x = a->x;
    const int64_t *positions = a->positions, *slots = a->slots;
    const int32_t *row_ctx = a->row_ctx, *row_req = a->row_req, *block_tables = a->block_tables;
    const int64_t h = dm.h, d = dm.d, qsz = dm.hq * d, kvsz = dm.hk * d, qkvn = qsz + 2 * kvsz, inter = dm.inter;
    const int64_t rot = a->rotary_dim;
    const float rm = a->residual_mult;
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
    float *act = malloc(t * inter * sizeof(float)), *blk = malloc(t * h * sizeof(float));
    float *tmp = malloc(t * (qsz > h ? qsz : h) * sizeof(float));
    XRows rows = {0}; /* the quantized activations of every linear: K is at most max(H, Hq * D, I) */
    const int64_t kmax = h > qsz ? (h > inter ? h : inter) : (qsz > inter ? qsz : inter);
    int rc = grp && hs && qkv && att && gu && act && blk && tmp && tb_rows_alloc(&rows, t, kmax) ? 0 : -1;
    const int par_rows = nthreads;
    for (int64_t l = 0; l < nl && rc == 0; l++) {
        const TbLayer *layer = a->layers + l;
        float *kv = layer->kv;
        dm.window = layer->window;
        const Lin *lqkv = &layer->qkv, *lo = &layer->o, *lgu = &layer->gate_up, *ldn = &layer->down;
        for (int64_t j = 0; j < a->num_aux; j++)
            if (a->aux_layers[j] == l) tap_rows(a, j);
        norm_rows(x, layer->attn_in_norm, t, h, dm.eps, hs, par_rows);
        rc |= tb_linear(lqkv, hs, t, h, qkvn, qkv, 0, nthreads, &rows);
#pragma omp parallel for num_threads(par_rows) schedule(static)
        for (int64_t r = 0; r < t; r++) {
            float *row = qkv + r * qkvn, *scratch = tmp + r * (qsz > h ? qsz : h);
            if (a->qk_norm == 2) { /* over the whole projection (OLMo 2), then the heads split */
                memcpy(scratch, row, qsz * sizeof(float));
                rms_norm_row(scratch, layer->q_norm, qsz, dm.eps, row);
                memcpy(scratch, row + qsz, kvsz * sizeof(float));
                rms_norm_row(scratch, layer->k_norm, kvsz, dm.eps, row + qsz);
            } else if (a->qk_norm == 1) { /* per head (Qwen3, Gemma 3) */
                for (int64_t hh = 0; hh < dm.hq + dm.hk; hh++) {
                    memcpy(scratch, row + hh * d, d * sizeof(float));
                    rms_norm_row(scratch, hh < dm.hq ? layer->q_norm : layer->k_norm, d, dm.eps, row + hh * d);
                }
            }
            if (layer->cos)
                rope_heads(row, dm.hq + dm.hk, d, rot, layer->cos + positions[r] * rot, layer->sin + positions[r] * rot);
            const int64_t b = slots[r] / dm.bs, off = slots[r] % dm.bs;
            memcpy(kv + ((b * 2) * dm.bs + off) * kvsz, row + qsz, kvsz * sizeof(float));
            memcpy(kv + ((b * 2 + 1) * dm.bs + off) * kvsz, row + qsz + kvsz, kvsz * sizeof(float));
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
        if (layer->attn_out_norm || rm != 1.0f) {
            rc |= tb_linear(lo, att, t, qsz, h, blk, 0, nthreads, &rows);
            add_block(x, blk, t, h, layer->attn_out_norm, dm.eps, rm, tmp, par_rows);
        } else {
            rc |= tb_linear(lo, att, t, qsz, h, x, 1, nthreads, &rows);
        }
        norm_rows(x, layer->mlp_in_norm, t, h, dm.eps, hs, par_rows);
        rc |= tb_linear(lgu, hs, t, h, 2 * inter, gu, 0, nthreads, &rows);
#pragma omp parallel for num_threads(par_rows) schedule(static)
        for (int64_t r = 0; r < t; r++) {
            const float *gr = gu + r * 2 * inter;
            if (a->gelu)
                gelu_mul_row(gr, gr + inter, inter, act + r * inter);
            else
                silu_mul_row(gr, gr + inter, inter, act + r * inter);
        }
        if (layer->mlp_out_norm || rm != 1.0f) {
            rc |= tb_linear(ldn, act, t, inter, h, blk, 0, nthreads, &rows);
            add_block(x, blk, t, h, layer->mlp_out_norm, dm.eps, rm, tmp, par_rows);
        } else {
            rc |= tb_linear(ldn, act, t, inter, h, x, 1, nthreads, &rows);
        }
    }
    free(grp);
    free(hs);
    free(qkv);
    free(att);
    free(gu);
    free(act);
    free(blk);
    free(tmp);
    tb_rows_free(&rows);
    return rc ? -1 : 0;
}
