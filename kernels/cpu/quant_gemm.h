/* What the GEMM driver (quant_gemm.c), the per-instruction-set tile kernels (gemm_<variant>.h) and
 * the decoder forward (decoder_forward.c) share. Internal to the library: Python reaches the GEMMs
 * through tb_gemm_q4 / tb_gemm_q8 and the forward through tb_forward. */
#pragma once
#include <stdint.h>
#include <string.h>

#define GROUP 32  /* input columns per quantization group (weights and activations) */
#define NB 16     /* output columns per weight block */
#define Q4_REC 320
#define Q8_REC 512

#define INLINE static inline __attribute__((always_inline))

/* fp16 bits -> fp32, exactly (the scalar and NEON kernels' weight scales, Q8_0 embedding rows). */
INLINE float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, mant = h & 0x3FF;
    uint32_t bits;
    if (e == 0) {
        const float v = (float)mant * 5.9604644775390625e-8f; /* 2^-24: zero and subnormals */
        return sign ? -v : v;
    }
    bits = sign | (e == 31 ? 0x7F800000u | (mant << 13) : ((e + 112) << 23) | (mant << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* One linear's weights (formats: quant_gemm.c's header). int64_t fmt: the same 8-byte slots as
 * the ctypes mirror (kernels/cpu/decoder_forward.py, TbLinear). */
typedef struct {
    int64_t fmt;       /* 4: q4, 8: q8 */
    const uint8_t *w;  /* records, see quant_gemm.c */
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

/* The variant this library was built as (quant_gemm.c). */
const char *tb_variant(void);

/* The threads a call over `rows` rows runs on: one below TEAM_MIN_ROWS. A batch-1 decode or verify
 * streams the weights about as fast on one thread as on two (84.7 vs 88 tok/s, issue 24), while a
 * thread team forks and meets at barriers ~6 times per layer, and on a busy machine the team waits
 * for a descheduled member (2 threads fell to 33 tok/s beside one busy process, from 91). */
#define TEAM_MIN_ROWS 8
static inline int tb_team(int64_t rows, int nthreads) { return rows >= TEAM_MIN_ROWS ? nthreads : 1; }

/* Room for m quantized rows of up to k columns (1, or 0 when out of memory; free with
 * tb_rows_free either way): a forward allocates it once for all its linears. */
__attribute__((visibility("hidden"))) int tb_rows_alloc(XRows *x, int64_t m, int64_t k);
__attribute__((visibility("hidden"))) void tb_rows_free(XRows *x);

/* out[m][n] (+)= x[m] . W[n] (+ bias[n]), batch invariant; 0, or -1 when out of memory. rows: scratch
 * from tb_rows_alloc for at least m x k, or NULL (the call allocates its own). */
__attribute__((visibility("hidden"))) int tb_linear(const Lin *L, const float *x, int64_t m, int64_t k, int64_t n,
                                                    float *out, int accumulate, int nthreads, XRows *rows);
