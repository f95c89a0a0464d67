/* A standalone driver for the C kernels (kernels/cpu), so that a variant this machine cannot load
 * (NEON on x86) runs under an emulator (qemu-aarch64): tests/test_neon_qemu.py writes the inputs,
 * runs the cross-compiled driver, and checks the outputs against numpy and the native scalar bits.
 *
 *   native_driver gemm|forward IN OUT
 * IN: blobs, each an int64 byte count then the bytes (order below); OUT: raw float32.
 *   gemm:    [fmt, m, k, n, threads] (int64), x f32 [m][k], packed w, q8 scales (or empty)
 *            -> y of all m rows in one call, then y of each row alone (row invariance)
 *   forward: [T, H, HQ, HK, D, I, BS, MAX_BLOCKS, threads] (int64), [eps, scale] (f32), x, positions
 *            (i64), cos, sin, slots (i64), row_ctx, row_req, block_tables (i32), input_norm,
 *            post_norm, kv (f32), then 4 linears (qkv, o, gate_up, down) of [fmt] (int64), w, s, bias
 *            -> x after one layer over all T rows, then after T calls of one row each (fresh cache)
 */
#include <stdio.h>

#include "decoder_forward.c"

int tb_gemm_q4(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *out, int nthreads);
int tb_gemm_q8(const float *x, int64_t m, int64_t k, const uint8_t *w, const float *s, int64_t n, float *out,
               int nthreads);

#define MAX_BLOBS 32

static void *blob[MAX_BLOBS];
static int64_t blob_len[MAX_BLOBS];

static int read_blobs(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    int n = 0;
    int64_t len;
    while (n < MAX_BLOBS && fread(&len, 8, 1, f) == 1) {
        blob[n] = malloc(len > 0 ? len : 1);
        if (len > 0 && fread(blob[n], 1, len, f) != (size_t)len) return -1;
        blob_len[n++] = len;
    }
    fclose(f);
    return n;
}

static int gemm(FILE *out) {
    const int64_t *hd = blob[0], fmt = hd[0], m = hd[1], k = hd[2], n = hd[3];
    const int threads = (int)hd[4];
    const float *x = blob[1], *s = blob[3];
    float *y = malloc(m * n * sizeof(float));
    for (int64_t pass = 0; pass < 2; pass++) {
        const int64_t step = pass == 0 ? m : 1;
        for (int64_t r = 0; r < m; r += step) {
            int rc = fmt == 4 ? tb_gemm_q4(x + r * k, step, k, blob[2], n, y + r * n, threads)
                              : tb_gemm_q8(x + r * k, step, k, blob[2], s, n, y + r * n, threads);
            if (rc) return rc;
        }
        fwrite(y, sizeof(float), m * n, out);
    }
    return 0;
}

static Lin linear(int i) {
    Lin L = {*(const int64_t *)blob[i], blob[i + 1], blob_len[i + 2] ? blob[i + 2] : NULL,
             blob_len[i + 3] ? blob[i + 3] : NULL};
    return L;
}

static int forward(FILE *out) {
    const int64_t *hd = blob[0], t = hd[0], h = hd[1];
    const float *fl = blob[1];
    TbLayer layer = {.attn_in_norm = blob[10], .mlp_in_norm = blob[11], .cos = blob[4], .sin = blob[5],
                     .qkv = linear(13), .o = linear(17), .gate_up = linear(21), .down = linear(25)};
    float *x = malloc(t * h * sizeof(float)), *kv = malloc(blob_len[12]);
    for (int pass = 0; pass < 2; pass++) {
        memcpy(x, blob[2], t * h * sizeof(float));
        memcpy(kv, blob[12], blob_len[12]);
        layer.kv = kv;
        const int64_t step = pass == 0 ? t : 1;
        for (int64_t r = 0; r < t; r += step) {
            TbForward a = {.num_tokens = step, .hidden = h, .num_heads = hd[2], .num_kv_heads = hd[3],
                           .head_dim = hd[4], .intermediate = hd[5], .num_layers = 1, .block_size = hd[6],
                           .max_blocks = hd[7], .num_threads = hd[8], .rotary_dim = hd[4], .eps = fl[0],
                           .scale = fl[1], .residual_mult = 1.0f, .layers = &layer, .x = x + r * h,
                           .positions = (const int64_t *)blob[3] + r, .slots = (const int64_t *)blob[6] + r,
                           .row_ctx = (const int32_t *)blob[7] + r, .row_req = (const int32_t *)blob[8] + r,
                           .block_tables = blob[9]};
            if (tb_forward(&a)) return -1;
        }
        fwrite(x, sizeof(float), t * h, out);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 4 || read_blobs(argv[2]) < 1) {
        fprintf(stderr, "usage: %s gemm|forward IN OUT\n", argv[0]);
        return 2;
    }
    FILE *out = fopen(argv[3], "wb");
    if (!out) return 2;
    const int rc = strcmp(argv[1], "gemm") == 0 ? gemm(out) : forward(out);
    fclose(out);
    printf("%s %s: %s\n", tb_variant(), argv[1], rc ? "failed" : "ok");
    return rc ? 1 : 0;
}
