/* What kernels/cpu/decoder_forward.c uses of kernels/cpu/quant_gemm.c: one quantized linear.
 * (Internal to the library: Python reaches the GEMMs through tb_gemm_q4 / tb_gemm_q8.) */
#pragma once
#include <stdint.h>

/* One linear's weights (formats: quant_gemm.c's header). int64_t fmt: the same 8-byte slots as
 * the ctypes mirror (kernels/cpu/decoder_forward.py, TbLinear). */
typedef struct {
    int64_t fmt;       /* 4: q4, 8: q8 */
    const uint8_t *w;  /* records, see quant_gemm.c */
    const float *s;    /* q8: per-channel scales [N padded]; q4: unused */
    const float *bias; /* [N] or NULL */
} Lin;

/* out[m][n] (+)= x[m] . W[n] (+ bias[n]), batch invariant; 0, or -1 when out of memory. */
__attribute__((visibility("hidden"))) int tb_linear(const Lin *L, const float *x, int64_t m, int64_t k, int64_t n,
                                                    float *out, int accumulate, int nthreads);
