/* Tile kernels for x86 with AVX-512 VNNI (Ice Lake, Sapphire Rapids, Zen 4/5): one 512-bit
 * vpdpbusd advances all 16 columns of a block by 4 products each (u8 weights x s8 activations; q8's
 * +128 offset is undone by XRows.corr). Included by quant_gemm.c, which states the float rule. */
#include <immintrin.h>

#define TB_VARIANT_NAME "avx512_vnni"
#define TILE_M 8

INLINE __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* RM rows from m0 against column block b: res[i][j] = acc of row m0 + i, column 16b + j. */
INLINE void q4_tile(const XRows *x, int64_t m0, const int RM, const Lin *L, int64_t b, float (*res)[NB]) {
    const int64_t k = x->k, ng = k / GROUP;
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    __m512 acc[8];
    for (int i = 0; i < RM; i++) acc[i] = _mm512_setzero_ps();
    const uint8_t *p = L->w + b * ng * Q4_REC;
    for (int64_t g = 0; g < ng; g++, p += Q4_REC) {
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256)));
        const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 288)));
        __m512i isum[8];
        for (int i = 0; i < RM; i++) isum[i] = _mm512_setzero_si512();
        for (int sb = 0; sb < 4; sb++) {
            const __m512i raw = _mm512_loadu_si512(p + 64 * sb);
            const __m512i lo = _mm512_and_si512(raw, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
            for (int i = 0; i < RM; i++) {
                const int8_t *xk = x->q + (m0 + i) * k + g * GROUP + 8 * sb;
                isum[i] = _mm512_dpbusd_epi32(isum[i], lo, bcast4(xk));
                isum[i] = _mm512_dpbusd_epi32(isum[i], hi, bcast4(xk + 4));
            }
        }
        for (int i = 0; i < RM; i++) {
            const int64_t r = (m0 + i) * ng + g;
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_cvtepi32_ps(isum[i]),
                                                         _mm512_mul_ps(dw, _mm512_set1_ps(x->dx[r]))));
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(mw, _mm512_set1_ps(x->xs[r])));
        }
    }
    for (int i = 0; i < RM; i++) _mm512_storeu_ps(res[i], acc[i]);
}

INLINE void q8_tile(const XRows *x, int64_t m0, const int RM, const Lin *L, int64_t b, float (*res)[NB]) {
    const int64_t k = x->k, ng = k / GROUP;
    __m512 acc[8];
    for (int i = 0; i < RM; i++) acc[i] = _mm512_setzero_ps();
    const uint8_t *p = L->w + b * ng * Q8_REC;
    for (int64_t g = 0; g < ng; g++, p += Q8_REC) {
        __m512i isum[8];
        for (int i = 0; i < RM; i++) isum[i] = _mm512_set1_epi32(x->corr[(m0 + i) * ng + g]);
        for (int sb = 0; sb < 8; sb++) {
            const __m512i wv = _mm512_loadu_si512(p + 64 * sb);
            for (int i = 0; i < RM; i++)
                isum[i] = _mm512_dpbusd_epi32(isum[i], wv, bcast4(x->q + (m0 + i) * k + g * GROUP + 4 * sb));
        }
        for (int i = 0; i < RM; i++)
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_cvtepi32_ps(isum[i]),
                                                         _mm512_set1_ps(x->dx[(m0 + i) * ng + g])));
    }
    for (int i = 0; i < RM; i++) _mm512_storeu_ps(res[i], acc[i]);
}
