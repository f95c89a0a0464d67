/* What the GEMM driver (quant_gemm.c), the per-instruction-set tile kernels (gemm_<variant>.h) and
 * the decoder forward (decoder_forward.c) share. Internal to the library: Python reaches the GEMMs
 * through tb_gemm_q4 / tb_gemm_q8 and the forward through tb_forward. */
#pragma once
#include <stdint.h>

#define GROUP 32  /* input columns per quantization group (weights and activations) */
#define NB 16     /* output columns per weight block */
#define Q4_REC 320
#define Q8_REC 512

#define INLINE static inline __attribute__((always_inline))

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

/* out[m][n] (+)= x[m] . W[n] (+ bias[n]), batch invariant; 0, or -1 when out of memory. */
__attribute__((visibility("hidden"))) int tb_linear(const Lin *L, const float *x, int64_t m, int64_t k, int64_t n,
                                                    float *out, int accumulate, int nthreads);
