/* Tile kernels in portable C (any CPU, any C compiler; the compiler vectorizes what it can for
 * the baseline instruction set). Included by quant_gemm.c, whose float rule it writes out lane by
 * lane, so it computes exactly what the SIMD variants compute. */

#define TB_VARIANT_NAME "scalar"
#define TILE_M 4

INLINE void q4_tile(const XRows *x, int64_t m0, const int RM, const Lin *L, int64_t b, float (*res)[NB]) {
    const int64_t k = x->k, ng = k / GROUP;
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < NB; j++) res[i][j] = 0.0f;
    const uint8_t *p = L->w + b * ng * Q4_REC;
    for (int64_t g = 0; g < ng; g++, p += Q4_REC) {
        float dw[NB], mw[NB];
        for (int j = 0; j < NB; j++) {
            uint16_t hd, hm;
            memcpy(&hd, p + 256 + 2 * j, 2);
            memcpy(&hm, p + 288 + 2 * j, 2);
            dw[j] = half_to_float(hd);
            mw[j] = half_to_float(hm);
        }
        for (int i = 0; i < RM; i++) {
            const int64_t r = (m0 + i) * ng + g;
            const int8_t *xg = x->q + (m0 + i) * k + g * GROUP;
            int32_t isum[NB] = {0};
            for (int sb = 0; sb < 4; sb++)
                for (int j = 0; j < NB; j++) {
                    const uint8_t *wp = p + 64 * sb + 4 * j;
                    int32_t s = 0;
                    for (int e = 0; e < 4; e++) s += (wp[e] & 0x0F) * xg[8 * sb + e] + (wp[e] >> 4) * xg[8 * sb + 4 + e];
                    isum[j] += s;
                }
            const float dx = x->dx[r], xs = x->xs[r];
            for (int j = 0; j < NB; j++) {
                res[i][j] = res[i][j] + (float)isum[j] * (dw[j] * dx);
                res[i][j] = res[i][j] + mw[j] * xs;
            }
        }
    }
}

INLINE void q8_tile(const XRows *x, int64_t m0, const int RM, const Lin *L, int64_t b, float (*res)[NB]) {
    const int64_t k = x->k, ng = k / GROUP;
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < NB; j++) res[i][j] = 0.0f;
    const uint8_t *p = L->w + b * ng * Q8_REC;
    for (int64_t g = 0; g < ng; g++, p += Q8_REC) {
        for (int i = 0; i < RM; i++) {
            const int8_t *xg = x->q + (m0 + i) * k + g * GROUP;
            int32_t isum[NB] = {0};
            for (int sb = 0; sb < 8; sb++)
                for (int j = 0; j < NB; j++) {
                    const uint8_t *wp = p + 64 * sb + 4 * j;
                    int32_t s = 0;
                    for (int e = 0; e < 4; e++) s += ((int32_t)wp[e] - 128) * xg[4 * sb + e];
                    isum[j] += s;
                }
            const float dx = x->dx[(m0 + i) * ng + g];
            for (int j = 0; j < NB; j++) res[i][j] = res[i][j] + (float)isum[j] * dx;
        }
    }
}
