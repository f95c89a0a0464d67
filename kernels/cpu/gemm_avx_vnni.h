/* Tile kernels for x86 with AVX-VNNI but no AVX-512 (Alder Lake and later Intel clients, Zen 5
 * builds without it): gemm_avx512_vnni.h's scheme on 256-bit registers, a 16-column block as two
 * halves of 8 columns (vpdpbusd ymm, VEX encoded). Included by quant_gemm.c (the float rule). */
#include <immintrin.h>

#define TB_VARIANT_NAME "avx_vnni"
#define TILE_M 8

INLINE __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

INLINE void q4_tile(const XRows *x, int64_t m0, const int RM, const Lin *L, int64_t b, float (*res)[NB]) {
    const int64_t k = x->k, ng = k / GROUP;
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    __m256 acc[8][2];
    for (int i = 0; i < RM; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const uint8_t *p = L->w + b * ng * Q4_REC;
    for (int64_t g = 0; g < ng; g++, p += Q4_REC) {
        __m256i isum[8][2];
        for (int i = 0; i < RM; i++) isum[i][0] = isum[i][1] = _mm256_setzero_si256();
        for (int sb = 0; sb < 4; sb++) {
            for (int h = 0; h < 2; h++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 64 * sb + 32 * h));
                const __m256i lo = _mm256_and_si256(raw, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
                for (int i = 0; i < RM; i++) {
                    const int8_t *xk = x->q + (m0 + i) * k + g * GROUP + 8 * sb;
                    isum[i][h] = _mm256_dpbusd_avx_epi32(isum[i][h], lo, bcast4(xk));
                    isum[i][h] = _mm256_dpbusd_avx_epi32(isum[i][h], hi, bcast4(xk + 4));
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 256 + 16 * h)));
            const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 288 + 16 * h)));
            for (int i = 0; i < RM; i++) {
                const int64_t r = (m0 + i) * ng + g;
                acc[i][h] = _mm256_add_ps(acc[i][h], _mm256_mul_ps(_mm256_cvtepi32_ps(isum[i][h]),
                                                                   _mm256_mul_ps(dw, _mm256_set1_ps(x->dx[r]))));
                acc[i][h] = _mm256_add_ps(acc[i][h], _mm256_mul_ps(mw, _mm256_set1_ps(x->xs[r])));
            }
        }
    }
    for (int i = 0; i < RM; i++) {
        _mm256_storeu_ps(res[i], acc[i][0]);
        _mm256_storeu_ps(res[i] + 8, acc[i][1]);
    }
}

INLINE void q8_tile(const XRows *x, int64_t m0, const int RM, const Lin *L, int64_t b, float (*res)[NB]) {
    const int64_t k = x->k, ng = k / GROUP;
    __m256 acc[8][2];
    for (int i = 0; i < RM; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const uint8_t *p = L->w + b * ng * Q8_REC;
    for (int64_t g = 0; g < ng; g++, p += Q8_REC) {
        __m256i isum[8][2];
        for (int i = 0; i < RM; i++) isum[i][0] = isum[i][1] = _mm256_set1_epi32(x->corr[(m0 + i) * ng + g]);
        for (int sb = 0; sb < 8; sb++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(p + 64 * sb));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(p + 64 * sb + 32));
            for (int i = 0; i < RM; i++) {
                const __m256i xb = bcast4(x->q + (m0 + i) * k + g * GROUP + 4 * sb);
                isum[i][0] = _mm256_dpbusd_avx_epi32(isum[i][0], w0, xb);
                isum[i][1] = _mm256_dpbusd_avx_epi32(isum[i][1], w1, xb);
            }
        }
        for (int i = 0; i < RM; i++) {
            const __m256 dx = _mm256_set1_ps(x->dx[(m0 + i) * ng + g]);
            for (int h = 0; h < 2; h++)
                acc[i][h] = _mm256_add_ps(acc[i][h], _mm256_mul_ps(_mm256_cvtepi32_ps(isum[i][h]), dx));
        }
    }
    for (int i = 0; i < RM; i++) {
        _mm256_storeu_ps(res[i], acc[i][0]);
        _mm256_storeu_ps(res[i] + 8, acc[i][1]);
    }
}
