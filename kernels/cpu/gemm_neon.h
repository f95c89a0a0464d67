/* Tile kernels for 64-bit ARM with the dot-product extension (Apple M1 and later, Graviton 2+,
 * Ampere Altra, Cortex-A76+): sdot (vdotq_s32, s8 x s8 -> s32 per 4 bytes), a 16-column block as
 * four quarters of 4 columns; q4's nibbles are non-negative s8, q8's stored q + 128 becomes q by
 * flipping the top bit. Included by quant_gemm.c (the float rule). */
#include <arm_neon.h>

#define TB_VARIANT_NAME "neon"
#define TILE_M 4

INLINE int8x16_t bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return vreinterpretq_s8_s32(vdupq_n_s32(v));
}

INLINE float32x4_t load_half4(const uint8_t *p) {
    float f[4];
    for (int j = 0; j < 4; j++) {
        uint16_t h;
        memcpy(&h, p + 2 * j, 2);
        f[j] = half_to_float(h);
    }
    return vld1q_f32(f);
}

INLINE void q4_tile(const XRows *x, int64_t m0, const int RM, const Lin *L, int64_t b, float (*res)[NB]) {
    const int64_t k = x->k, ng = k / GROUP;
    const uint8x16_t lo4 = vdupq_n_u8(0x0F);
    float32x4_t acc[4][4];
    for (int i = 0; i < RM; i++)
        for (int c = 0; c < 4; c++) acc[i][c] = vdupq_n_f32(0.0f);
    const uint8_t *p = L->w + b * ng * Q4_REC;
    for (int64_t g = 0; g < ng; g++, p += Q4_REC) {
        int32x4_t isum[4][4];
        for (int i = 0; i < RM; i++)
            for (int c = 0; c < 4; c++) isum[i][c] = vdupq_n_s32(0);
        for (int sb = 0; sb < 4; sb++) {
            for (int c = 0; c < 4; c++) {
                const uint8x16_t raw = vld1q_u8(p + 64 * sb + 16 * c);
                const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(raw, lo4)), hi = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
                for (int i = 0; i < RM; i++) {
                    const int8_t *xk = x->q + (m0 + i) * k + g * GROUP + 8 * sb;
                    isum[i][c] = vdotq_s32(isum[i][c], lo, bcast4(xk));
                    isum[i][c] = vdotq_s32(isum[i][c], hi, bcast4(xk + 4));
                }
            }
        }
        for (int c = 0; c < 4; c++) {
            const float32x4_t dw = load_half4(p + 256 + 8 * c), mw = load_half4(p + 288 + 8 * c);
            for (int i = 0; i < RM; i++) {
                const int64_t r = (m0 + i) * ng + g;
                acc[i][c] = vaddq_f32(acc[i][c], vmulq_f32(vcvtq_f32_s32(isum[i][c]), vmulq_f32(dw, vdupq_n_f32(x->dx[r]))));
                acc[i][c] = vaddq_f32(acc[i][c], vmulq_f32(mw, vdupq_n_f32(x->xs[r])));
            }
        }
    }
    for (int i = 0; i < RM; i++)
        for (int c = 0; c < 4; c++) vst1q_f32(res[i] + 4 * c, acc[i][c]);
}

INLINE void q8_tile(const XRows *x, int64_t m0, const int RM, const Lin *L, int64_t b, float (*res)[NB]) {
    const int64_t k = x->k, ng = k / GROUP;
    const uint8x16_t off = vdupq_n_u8(0x80);
    float32x4_t acc[4][4];
    for (int i = 0; i < RM; i++)
        for (int c = 0; c < 4; c++) acc[i][c] = vdupq_n_f32(0.0f);
    const uint8_t *p = L->w + b * ng * Q8_REC;
    for (int64_t g = 0; g < ng; g++, p += Q8_REC) {
        int32x4_t isum[4][4];
        for (int i = 0; i < RM; i++)
            for (int c = 0; c < 4; c++) isum[i][c] = vdupq_n_s32(0);
        for (int sb = 0; sb < 8; sb++) {
            int8x16_t xb[4];
            for (int i = 0; i < RM; i++) xb[i] = bcast4(x->q + (m0 + i) * k + g * GROUP + 4 * sb);
            for (int c = 0; c < 4; c++) {
                const int8x16_t wv = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p + 64 * sb + 16 * c), off));
                for (int i = 0; i < RM; i++) isum[i][c] = vdotq_s32(isum[i][c], wv, xb[i]);
            }
        }
        for (int i = 0; i < RM; i++) {
            const float32x4_t dx = vdupq_n_f32(x->dx[(m0 + i) * ng + g]);
            for (int c = 0; c < 4; c++) acc[i][c] = vaddq_f32(acc[i][c], vmulq_f32(vcvtq_f32_s32(isum[i][c]), dx));
        }
    }
    for (int i = 0; i < RM; i++)
        for (int c = 0; c < 4; c++) vst1q_f32(res[i] + 4 * c, acc[i][c]);
}
