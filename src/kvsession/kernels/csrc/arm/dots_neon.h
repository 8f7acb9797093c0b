#pragma once
/* The int8 products on AArch64's NEON, with or without the dot-product extension (isa_neon.c,
 * isa_neon_dotprod.c; included by dots.h) */
#ifdef NEON_DOTS
/* AArch64 (isa_neon.c, isa_neon_dotprod.c). Its int8 products multiply signed bytes by signed bytes, so, as
 * llama.cpp's ARM kernels do, each type's codes go in signed: less the type's offset (Q4_0's 8, Q5_0's 16, Q6_K's
 * 32), or its table's values (IQ4_NL, IQ4_XS, MXFP4), as they are (Q8_0), or 0..15 (Q4_1, Q4_K, whose minimums
 * come back through the activations' code sums). The activations are rounded as the AVX2 build rounds them (one scale a
 * 32; a 256, llama.cpp's Q8_K, for Q4_K and Q6_K), and the integer sums are the same, so the outputs are the
 * x86 builds' to float rounding. */

/* int32 lane i += the products of bytes 4i..4i+3: sdot where the CPU has the dot-product extension (armv8.2-a,
 * the neon_dotprod build), else two widening multiplies and pairwise adds, whose 16-bit pair sums are exact as
 * one side is an activation's code (|code| <= 127: 2 * 128 * 127 < 32768). Both make the same lanes, so the
 * two builds' outputs are equal bit for bit (tests/neon/harness.c holds them to it). */
static inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#ifdef __ARM_FEATURE_DOTPROD
    return vdotq_s32(acc, a, b);
#else
    return vpadalq_s16(acc, vpaddq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)), vmull_high_s8(a, b)));
#endif
}

/* 32 codes against 32 activation codes at x: the int32 sums, four lanes */
static inline int32x4_t dot32(int8x16x2_t c, const int8_t *x) {
    return dot16(dot16(vdupq_n_s32(0), c.val[0], vld1q_s8(x)), c.val[1], vld1q_s8(x + 16));
}

static inline int8x16x2_t bytes32(const uint8_t *p) {
    return (int8x16x2_t){{vld1q_s8((const int8_t *)p), vld1q_s8((const int8_t *)p + 16)}};
}

/* 32 4-bit codes, values j and j + 16 in byte j (16 bytes), as 0..15 */
static inline int8x16x2_t codes_q4_neon(const uint8_t *qs) {
    const uint8x16_t q = vld1q_u8(qs);
    return (int8x16x2_t){{vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0F))), vreinterpretq_s8_u8(vshrq_n_u8(q, 4))}};
}

/* 32 4-bit indices, as codes_q4_neon's, as their values in a 16-entry table */
static inline int8x16x2_t codes_lut_neon(const uint8_t *qs, const int8_t *table) {
    const int8x16_t t = vld1q_s8(table);
    const int8x16x2_t i = codes_q4_neon(qs);
    return (int8x16x2_t){{vqtbl1q_s8(t, vreinterpretq_u8_s8(i.val[0])), vqtbl1q_s8(t, vreinterpretq_u8_s8(i.val[1]))}};
}

/* Q4_0's codes less 8 (-8..7) */
static inline int8x16x2_t codes_q4_0_neon(const uint8_t *b) {
    int8x16x2_t c = codes_q4_neon(b + 2);
    for (int h = 0; h < 2; h++) c.val[h] = vsubq_s8(c.val[h], vdupq_n_s8(8));
    return c;
}

/* Q5_0's codes less 16 (-16..15): bit j of qh is value j's fifth bit */
static inline int8x16x2_t codes_q5_0_neon(const uint8_t *b) {
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const uint8x16_t bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    int8x16x2_t c = codes_q4_neon(b + 6);
    for (int h = 0; h < 2; h++) {
        const uint32_t bits = qh >> (16 * h);
        const uint8x16_t spread = vcombine_u8(vdup_n_u8((uint8_t)bits), vdup_n_u8((uint8_t)(bits >> 8)));
        const uint8x16_t high = vandq_u8(vtstq_u8(spread, bit), vdupq_n_u8(0x10));
        c.val[h] = vsubq_s8(vorrq_s8(c.val[h], vreinterpretq_s8_u8(high)), vdupq_n_s8(16));
    }
    return c;
}

/* Q4_K's codes (0..15) of two 32-value sub-blocks: the low nibbles of 32 bytes are sub-block j's, the high j + 1's */
static inline void codes_q4_k_neon(const uint8_t *q, int8x16x2_t *lo, int8x16x2_t *hi) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F), a = vld1q_u8(q), c = vld1q_u8(q + 16);
    *lo = (int8x16x2_t){{vreinterpretq_s8_u8(vandq_u8(a, m4)), vreinterpretq_s8_u8(vandq_u8(c, m4))}};
    *hi = (int8x16x2_t){{vreinterpretq_s8_u8(vshrq_n_u8(a, 4)), vreinterpretq_s8_u8(vshrq_n_u8(c, 4))}};
}

/* Q6_K's codes less 32 (-32..31) of 128 values (half a block): v[k] values 32k..32k + 31, its 16-value groups
 * 2k and 2k + 1 in val[0] and val[1] */
static inline void codes_q6_k_neon(const uint8_t *ql, const uint8_t *qh, int8x16x2_t v[4]) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F), m2 = vdupq_n_u8(0x30);
    const int8x16_t k32 = vdupq_n_s8(32);
    for (int h = 0; h < 2; h++) {
        const uint8x16_t a = vld1q_u8(ql + 16 * h), c = vld1q_u8(ql + 32 + 16 * h), e = vld1q_u8(qh + 16 * h);
        const uint8x16_t u[4] = {vorrq_u8(vandq_u8(a, m4), vandq_u8(vshlq_n_u8(e, 4), m2)),
                                 vorrq_u8(vandq_u8(c, m4), vandq_u8(vshlq_n_u8(e, 2), m2)),
                                 vorrq_u8(vshrq_n_u8(a, 4), vandq_u8(e, m2)),
                                 vorrq_u8(vshrq_n_u8(c, 4), vandq_u8(vshrq_n_u8(e, 2), m2))};
        for (int k = 0; k < 4; k++) v[k].val[h] = vsubq_s8(vreinterpretq_s8_u8(u[k]), k32);
    }
}

/* the largest magnitude of n floats (n a multiple of 4) */
static inline float abs_max_neon(const float *x, int n) {
    float32x4_t m = vdupq_n_f32(0.0f);
    for (int j = 0; j < n; j += 4) m = vmaxq_f32(m, vabsq_f32(vld1q_f32(x + j)));
    return vmaxvq_f32(m);
}

/* 16 floats times id rounded to bytes at q (half to even, as the x86 builds' vcvtps2dq); their code sum */
static inline int round16_neon(const float *x, float id, int8_t *q) {
    int32x4_t c[4];
    for (int k = 0; k < 4; k++) c[k] = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + 4 * k), id));
    const int16x8_t lo = vcombine_s16(vqmovn_s32(c[0]), vqmovn_s32(c[1])), hi = vcombine_s16(vqmovn_s32(c[2]), vqmovn_s32(c[3]));
    vst1q_s8(q, vcombine_s8(vqmovn_s16(lo), vqmovn_s16(hi)));
    return vaddvq_s32(vaddq_s32(vaddq_s32(c[0], c[1]), vaddq_s32(c[2], c[3])));
}

/* x rounded to 8 bits with one scale a `rounds` values (32: q, d, s16, s32; 256: qk, dk, bk, bk16) */
static void quantize_x(const float *x, int64_t cols, int rounds, xq_t *o) {
    if (rounds == 32)
        for (int64_t b = 0; b < cols / 32; b++) {
            const float *xb = x + 32 * b;
            const float amax = abs_max_neon(xb, 32), id = amax > 0.0f ? 127.0f / amax : 0.0f, d = amax / 127.0f;
            const float sa = (float)round16_neon(xb, id, o->q + 32 * b), sc = (float)round16_neon(xb + 16, id, o->q + 32 * b + 16);
            xq_scales32(o, b, d, sa, sc);
        }
    else
        for (int64_t b = 0; b < cols / 256; b++) {
            const float *xb = x + 256 * b;
            const float amax = abs_max_neon(xb, 256), id = amax > 0.0f ? 127.0f / amax : 0.0f;
            o->dk[b] = amax / 127.0f;
            for (int j = 0; j < 16; j++) o->bk16[16 * b + j] = (int16_t)round16_neon(xb + 16 * j, id, o->qk + 256 * b + 16 * j);
            for (int j = 0; j < 8; j++) o->bk[8 * b + j] = (int16_t)(o->bk16[16 * b + 2 * j] + o->bk16[16 * b + 2 * j + 1]);
        }
}

/* Each product below is written once for NT tokens (x[0..NT-1]) against one row, as the x86 ones are: a block's
 * codes are unpacked once for every token, and each token's sums are the same operations in the same order
 * whatever NT is (vfmaq and fmaf, never a * b + c, which the compiler may contract one way for NT = 1 and another
 * for NT = 4), so a token's result does not depend on the tokens it was multiplied with. */
#define MAX_NT 4

/* The 32-value types: CODES block i's signed codes, D its scale, CA * CB its offset or minimum term (two
 * constant zeros where there is none), FINISH(t) the token's result */
#define BLOCKS32_NEON(BYTES, CODES, D, CA, CB, FINISH)                                                           \
    float32x4_t acc[MAX_NT];                                                                                \
    float corr[MAX_NT];                                                                                     \
    for (int t = 0; t < NT; t++) acc[t] = vdupq_n_f32(0.0f), corr[t] = 0.0f;                                \
    for (int64_t i = 0; i < nb; i++, b += (BYTES)) {                                                        \
        const int8x16x2_t c = CODES;                                                                        \
        const float d = D;                                                                                  \
        for (int t = 0; t < NT; t++) {                                                                      \
            acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(dot32(c, x[t].q + 32 * i)), d * x[t].d[i]);          \
            corr[t] = fmaf(CA, CB, corr[t]);                                                                \
        }                                                                                                   \
    }                                                                                                       \
    for (int t = 0; t < NT; t++) out[t] = FINISH;

ALWAYS void q8_0_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    BLOCKS32_NEON(34, bytes32(b + 2), f16(b), 0.0f, 0.0f, vaddvq_f32(acc[t]))
}

ALWAYS void q4_0_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    BLOCKS32_NEON(18, codes_q4_0_neon(b), f16(b), 0.0f, 0.0f, vaddvq_f32(acc[t]))
}

ALWAYS void q5_0_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    BLOCKS32_NEON(22, codes_q5_0_neon(b), f16(b), 0.0f, 0.0f, vaddvq_f32(acc[t]))
}

/* Q4_1: codes 0..15 times d, plus m through the 32's activation sum */
ALWAYS void q4_1_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    BLOCKS32_NEON(20, codes_q4_neon(b + 4), f16(b), f16(b + 2), x[t].s32[i], vaddvq_f32(acc[t]) + corr[t])
}

ALWAYS void iq4_nl_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    BLOCKS32_NEON(18, codes_lut_neon(b + 2, IQ4_VALUES), f16(b), 0.0f, 0.0f, vaddvq_f32(acc[t]))
}

ALWAYS void mxfp4_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    BLOCKS32_NEON(17, codes_lut_neon(b + 1, FP4_VALUES), e8m0_half(b[0]), 0.0f, 0.0f, vaddvq_f32(acc[t]))
}
#undef BLOCKS32_NEON

/* IQ4_XS: IQ4_NL's values, eight 32s a block of 256, each with its 6-bit scale; activations with one scale a 32 */
ALWAYS void iq4_xs_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    float32x4_t acc[MAX_NT];
    for (int t = 0; t < NT; t++) acc[t] = vdupq_n_f32(0.0f);
    for (int64_t i = 0; i < nb; i++, b += 136) {
        const float d = f16(b);
        for (int ib = 0; ib < 8; ib++) {
            const int8x16x2_t c = codes_lut_neon(b + 8 + 16 * ib, IQ4_VALUES);
            const float dl = d * (float)iq4_xs_scale(b, ib);
            const int64_t g = 8 * i + ib;
            for (int t = 0; t < NT; t++)
                acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(dot32(c, x[t].q + 32 * g)), dl * x[t].d[g]);
        }
    }
    for (int t = 0; t < NT; t++) out[t] = vaddvq_f32(acc[t]);
}

/* Q4_K against activations with one scale a 256, as llama.cpp (Q4_K x Q8_K): sub-block j of 32 values is
 * d * sc_j * code - dmin * m_j; each sub-block's int32 sums times its 6-bit scale add up over the whole block,
 * converted and scaled once; the minimums' terms are the eight 32s' code sums times their 6-bit minimums */
ALWAYS void q4_k_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    float32x4_t acc[MAX_NT], accm[MAX_NT];
    for (int t = 0; t < NT; t++) acc[t] = accm[t] = vdupq_n_f32(0.0f);
    for (int64_t i = 0; i < nb; i++, b += 144) {
        uint32_t u[4];
        k4_scales(b, u);
        const uint8_t *sc = (const uint8_t *)u;
        const int16x8_t mins = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(sc + 8)));
        int32x4_t isum[MAX_NT];
        for (int t = 0; t < NT; t++) isum[t] = vdupq_n_s32(0);
        for (int j = 0; j < 8; j += 2) {
            int8x16x2_t lo, hi;
            codes_q4_k_neon(b + 16 + 16 * j, &lo, &hi);
            for (int t = 0; t < NT; t++) {
                const int8_t *xq = x[t].qk + 256 * i + 32 * j;
                isum[t] = vmlaq_n_s32(vmlaq_n_s32(isum[t], dot32(lo, xq), sc[j]), dot32(hi, xq + 32), sc[j + 1]);
            }
        }
        const float d = f16(b), dmin = f16(b + 2);
        for (int t = 0; t < NT; t++) {
            const float dx = x[t].dk[i];
            const int16x8_t bk = vld1q_s16(x[t].bk + 8 * i);
            const int32x4_t m = vmlal_high_s16(vmull_s16(vget_low_s16(mins), vget_low_s16(bk)), mins, bk);
            acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(isum[t]), d * dx);
            accm[t] = vfmaq_n_f32(accm[t], vcvtq_f32_s32(m), dmin * dx);
        }
    }
    for (int t = 0; t < NT; t++) out[t] = vaddvq_f32(acc[t]) - vaddvq_f32(accm[t]);
}

/* Q6_K against activations with one scale a 256, as llama.cpp (Q6_K x Q8_K): group g of 16 values is
 * d * sc_g * (code - 32); each group's int32 sums times its 8-bit scale add up over the whole block, converted
 * and scaled once */
ALWAYS void q6_k_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    float32x4_t acc[MAX_NT];
    for (int t = 0; t < NT; t++) acc[t] = vdupq_n_f32(0.0f);
    for (int64_t i = 0; i < nb; i++, b += 210) {
        const int8_t *sc = (const int8_t *)(b + 192);
        int32x4_t isum[MAX_NT];
        for (int t = 0; t < NT; t++) isum[t] = vdupq_n_s32(0);
        for (int n = 0; n < 2; n++) {
            int8x16x2_t v[4];
            codes_q6_k_neon(b + 64 * n, b + 128 + 32 * n, v);
            for (int k = 0; k < 4; k++) {
                const int g = 8 * n + 2 * k;
                for (int t = 0; t < NT; t++) {
                    const int8_t *xq = x[t].qk + 256 * i + 16 * g;
                    isum[t] = vmlaq_n_s32(isum[t], dot16(vdupq_n_s32(0), v[k].val[0], vld1q_s8(xq)), sc[g]);
                    isum[t] = vmlaq_n_s32(isum[t], dot16(vdupq_n_s32(0), v[k].val[1], vld1q_s8(xq + 16)), sc[g + 1]);
                }
            }
        }
        const float d = f16(b + 208);
        for (int t = 0; t < NT; t++) acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(isum[t]), d * x[t].dk[i]);
    }
    for (int t = 0; t < NT; t++) out[t] = vaddvq_f32(acc[t]);
}

#define Q6_K_ROUNDS 256
#endif
