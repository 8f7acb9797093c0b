#pragma once
/* The int8 products on AVX2 with FMA and F16C (isa_avx2.c; included by dots.h) */
#ifdef AVX2_DOTS
/* Decode streams each thread's rows from memory once; the hardware prefetcher alone left this CPU (Zen 3, 2
 * threads) at 9-12 GB/s of the ~15 a plain sum reads, so each block asks for the lines AHEAD_BYTES on, past the
 * row's end into the next row (a prefetch beyond the mapping is dropped, never a fault). 2,048 measured best
 * of 512-4,096 on Qwen 1.5B's matrices: 10-12 -> 13-16 GB/s. */
#define AHEAD_BYTES 2048
#define AHEAD(p, n)                                                                                         \
    do {                                                                                                    \
        for (int o_ = 0; o_ < (n); o_ += 64) _mm_prefetch((const char *)(p) + AHEAD_BYTES + o_, _MM_HINT_T0); \
    } while (0)
/* AVX2 without VNNI (the products llama.cpp's AVX2 path makes): vpmaddubsw multiplies u8 by s8 and adds pairs
 * into s16, saturating, so the unsigned side is a code of at most 6 bits, or for Q8_0 the weights' magnitudes
 * against the activations carrying the weights' signs (a pair is at most 2 * 128 * 127); vpmaddwd adds pairs of
 * s16 into s32, times a scale where a group has one. The same integer sums as the VNNI kernels, scaled and
 * added in float in another order -- but for Q6_K, which here takes llama.cpp's Q8_K activations (one scale a
 * 256) and sums whole blocks in integers, where the VNNI kernel takes one scale a 32. */

/* The largest magnitude of 32 floats */
static inline __m256 abs_max32(const float *x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x)), _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8))),
                         _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + 16)), _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 24))));
}

/* 32 floats times id rounded to bytes at q (half to even, as vcvtps2dq); the code sums of the two 16s */
static inline void round32(const float *x, float id, int8_t *q, float s[2]) {
    const __m256 m = _mm256_set1_ps(id);
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), m));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), m));
    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), m));
    const __m256i e = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), m));
    /* the packs work within 128-bit halves: 4-byte pieces come out as a0 b0 c0 e0 a1 b1 c1 e1 */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, e));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    s[0] = hsum(_mm256_cvtepi32_ps(_mm256_add_epi32(a, b)));
    s[1] = hsum(_mm256_cvtepi32_ps(_mm256_add_epi32(c, e)));
}

/* 32 values of x rounded to 8 bits with one scale (returned): their codes at q, and each 16's code sum */
static inline float round32_256(const float *x, int8_t *q, int sums[2]) {
    const float amax = hmax(abs_max32(x)), id = amax > 0.0f ? 127.0f / amax : 0.0f;
    float s[2];
    round32(x, id, q, s);
    sums[0] = (int)s[0];
    sums[1] = (int)s[1];
    return amax / 127.0f;
}

/* The activations rounded as quantize_x above does, one scale a `rounds` values */
static void quantize_x(const float *x, int64_t cols, int rounds, xq_t *o) {
    if (rounds == 32)
        for (int64_t b = 0; b < cols / 32; b++) {
            int sums[2];
            const float d = round32_256(x + 32 * b, o->q + 32 * b, sums), sa = (float)sums[0], sc = (float)sums[1];
            xq_scales32(o, b, d, sa, sc);
        }
    else
        for (int64_t b = 0; b < cols / 256; b++) {
            const float *xb = x + 256 * b;
            __m256 mx = abs_max32(xb);
            for (int j = 32; j < 256; j += 32) mx = _mm256_max_ps(mx, abs_max32(xb + j));
            const float amax = hmax(mx), id = amax > 0.0f ? 127.0f / amax : 0.0f;
            o->dk[b] = amax / 127.0f;
            for (int j = 0; j < 256; j += 32) {
                float s[2];
                round32(xb + j, id, o->qk + 256 * b + j, s);
                o->bk16[16 * b + j / 16] = (int16_t)s[0];
                o->bk16[16 * b + j / 16 + 1] = (int16_t)s[1];
                o->bk[8 * b + j / 32] = (int16_t)(s[0] + s[1]);
            }
        }
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* int32 sums of u8 x s8 products, 4 adjacent bytes a lane (u at most 6 bits, or see q8_0's), as floats */
static inline __m256 dp(__m256i u, __m256i s) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

/* Each product below is written once for NT tokens (x[0..NT-1]) against one row: a block's codes are unpacked
 * once and multiplied with every token's activations (prefill), NT = 1 being decode. Each token's sums are
 * the same operations in the same order whatever NT is, so a token's result does not depend on the tokens it
 * was multiplied with. */
#define MAX_NT 4

/* The 32-value types: a float term a block, alternate blocks into two accumulators, so that consecutive FMAs
 * do not wait on each other; `corr` the offsets' or minimums' terms, CA * CB a block. Scalar products are
 * written as fmaf: the compiler contracts a * b + c or not depending on whether it vectorizes the loop over the
 * tokens, and a token's result must not depend on NT. */
#define BLOCKS32(BYTES, TERM, CA, CB, FINISH)                                                                   \
    __m256 a0[MAX_NT], a1[MAX_NT];                                                                          \
    float corr[MAX_NT];                                                                                     \
    for (int t = 0; t < NT; t++) a0[t] = a1[t] = _mm256_setzero_ps(), corr[t] = 0.0f;                        \
    int64_t i = 0;                                                                                          \
    for (; i < nb; i++, b += BYTES) {                                                                       \
        AHEAD(b, BYTES);                                                                                    \
        if (i & 1) {                                                                                        \
            TERM(a1)                                                                                        \
        } else {                                                                                            \
            TERM(a0)                                                                                        \
        }                                                                                                   \
        for (int t = 0; t < NT; t++) corr[t] = fmaf(CA, CB, corr[t]);                                      \
    }                                                                                                       \
    for (int t = 0; t < NT; t++) out[t] = FINISH;

/* The types of signed codes (Q8_0's; IQ4_NL's and MXFP4's table values): |code| against x with code's sign */
#define SIGNED_TERM(acc, CODES, D)                                                                           \
    const __m256i c = CODES, mag = _mm256_sign_epi8(c, c);                                                  \
    const float d = D;                                                                                      \
    for (int t = 0; t < NT; t++)                                                                            \
        acc[t] = _mm256_fmadd_ps(dp(mag, _mm256_sign_epi8(load32(x[t].q + 32 * i), c)),                     \
                                 _mm256_set1_ps(d * x[t].d[i]), acc[t]);

/* unsigned codes 0..2^k-1 against the rounded activations; their offset or minimum comes in through FINISH */
#define UNSIGNED_TERM(acc, CODES, D)                                                                         \
    const __m256i c = CODES;                                                                                \
    const float d = D;                                                                                      \
    for (int t = 0; t < NT; t++)                                                                            \
        acc[t] = _mm256_fmadd_ps(dp(c, load32(x[t].q + 32 * i)), _mm256_set1_ps(d * x[t].d[i]), acc[t]);

ALWAYS void q8_0_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
#define TERM(acc) SIGNED_TERM(acc, load32(b + 2), f16(b))
    BLOCKS32(34, TERM, 0.0f, 0.0f, hsum(_mm256_add_ps(a0[t], a1[t])))
#undef TERM
}

/* Q4_0: codes 0..15, less 8 through the 32's activation sum */
ALWAYS void q4_0_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
#define TERM(acc) UNSIGNED_TERM(acc, codes_q4(b + 2), f16(b))
    BLOCKS32(18, TERM, f16(b), x[t].s32[i], fmaf(-8.0f, corr[t], hsum(_mm256_add_ps(a0[t], a1[t]))))
#undef TERM
}

/* Q5_0: codes 0..31, less 16 through the 32's activation sum */
ALWAYS void q5_0_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
#define TERM(acc) UNSIGNED_TERM(acc, codes_q5_0(b), f16(b))
    BLOCKS32(22, TERM, f16(b), x[t].s32[i], fmaf(-16.0f, corr[t], hsum(_mm256_add_ps(a0[t], a1[t]))))
#undef TERM
}

/* Q4_1: codes 0..15 times d, plus m through the 32's activation sum */
ALWAYS void q4_1_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
#define TERM(acc) UNSIGNED_TERM(acc, codes_q4(b + 4), f16(b))
    BLOCKS32(20, TERM, f16(b + 2), x[t].s32[i], hsum(_mm256_add_ps(a0[t], a1[t])) + corr[t])
#undef TERM
}

/* IQ4_NL and MXFP4: a table's signed values, as Q8_0's codes */
ALWAYS void iq4_nl_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
#define TERM(acc) SIGNED_TERM(acc, codes_lut(b + 2, IQ4_VALUES), f16(b))
    BLOCKS32(18, TERM, 0.0f, 0.0f, hsum(_mm256_add_ps(a0[t], a1[t])))
#undef TERM
}
ALWAYS void mxfp4_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
#define TERM(acc) SIGNED_TERM(acc, codes_lut(b + 1, FP4_VALUES), e8m0_half(b[0]))
    BLOCKS32(17, TERM, 0.0f, 0.0f, hsum(_mm256_add_ps(a0[t], a1[t])))
#undef TERM
}
#undef SIGNED_TERM
#undef UNSIGNED_TERM
#undef BLOCKS32

/* IQ4_XS: IQ4_NL's values, eight 32s a block of 256, each with its 6-bit scale; activations with one scale a 32 */
ALWAYS void iq4_xs_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    __m256 a0[MAX_NT], a1[MAX_NT];
    for (int t = 0; t < NT; t++) a0[t] = a1[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++, b += 136) {
        AHEAD(b, 136);
        const float d = f16(b);
        for (int ib = 0; ib < 8; ib++) {
            const __m256i c = codes_lut(b + 8 + 16 * ib, IQ4_VALUES), mag = _mm256_sign_epi8(c, c);
            const float dl = d * (float)iq4_xs_scale(b, ib);
            const int64_t g = 8 * i + ib;
            for (int t = 0; t < NT; t++) {
                __m256 *acc = ib & 1 ? &a1[t] : &a0[t];
                *acc = _mm256_fmadd_ps(dp(mag, _mm256_sign_epi8(load32(x[t].q + 32 * g), c)),
                                       _mm256_set1_ps(dl * x[t].d[g]), *acc);
            }
        }
    }
    for (int t = 0; t < NT; t++) out[t] = hsum(_mm256_add_ps(a0[t], a1[t]));
}

/* 16-bit lane j of each 128-bit half of v, in every lane */
static inline __m256i word(__m256i v, int j) { return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)(0x0100 + 0x0202 * j))); }

/* Q4_K against activations with one scale a 256, as llama.cpp (Q4_K x Q8_K): sub-block j of 32 values is
 * d * sc_j * code - dmin * m_j; each sub-block's u8 x s8 pair sums (16 bits) times its 6-bit scale add up in
 * int32 over the whole block, converted and scaled once; the minimums' terms are the eight 32s' code sums
 * times their 6-bit minimums, four int32 lanes a block */
ALWAYS void q4_k_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    __m256 acc[MAX_NT];
    __m128 accm[MAX_NT];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps(), accm[t] = _mm_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t i = 0; i < nb; i++, b += 144) {
        AHEAD(b, 144);
        const uint8_t *q = b + 16;
        uint32_t u[4];
        k4_scales(b, u);
        const __m256i sm = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)u)); /* scales, then minimums */
        const __m256i sc = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
        const __m128i mins = _mm256_extracti128_si256(sm, 1);
        __m256i isum[MAX_NT];
        for (int t = 0; t < NT; t++) isum[t] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j += 2, q += 32) {
            const __m256i qv = load32(q), lo = _mm256_and_si256(qv, m4), hi = _mm256_and_si256(_mm256_srli_epi16(qv, 4), m4);
            const __m256i sl = word(sc, j), sh = word(sc, j + 1);
            for (int t = 0; t < NT; t++) {
                const int8_t *xq = x[t].qk + 256 * i + 32 * j;
                isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, load32(xq)), sl),
                                                                     _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load32(xq + 32)), sh)));
            }
        }
        const float d = f16(b), dmin = f16(b + 2);
        for (int t = 0; t < NT; t++) {
            const float dx = x[t].dk[i];
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(d * dx), acc[t]);
            const __m128i m = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i *)(x[t].bk + 8 * i)));
            accm[t] = _mm_fmadd_ps(_mm_set1_ps(dmin * dx), _mm_cvtepi32_ps(m), accm[t]);
        }
    }
    for (int t = 0; t < NT; t++) out[t] = hsum(acc[t]) - hsum4(accm[t]);
}

/* Q6_K against activations with one scale a 256, as llama.cpp (Q6_K x Q8_K): group g of 16 values is
 * d * sc_g * (code - 32), codes 0..63. A 32's pair sums cover its two groups in lanes 0-7 and 8-15, times a
 * vector of their two 8-bit scales; the -32 is the groups' code sums times their scales; all in int32 over the
 * block, converted and scaled once */
ALWAYS void q6_k_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    __m256 acc[MAX_NT];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++, b += 210) {
        AHEAD(b, 210);
        const uint8_t *ql = b, *qh = b + 128;
        const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
        __m256i isum[MAX_NT];
        for (int t = 0; t < NT; t++) /* less 32 * sum_g sc_g * (group g's code sum) */
            isum[t] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                       _mm256_slli_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(sc), load32(x[t].bk16 + 16 * i)), 5));
        for (int n = 0; n < 2; n++, ql += 64, qh += 32) {
            __m256i v[4];
            q6_codes(ql, qh, v);
            for (int k = 0; k < 4; k++) { /* groups 8n + 2k and 8n + 2k + 1 */
                const int g = 8 * n + 2 * k;
                const __m256i s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, _mm_set_epi64x(0x0101010101010101LL * (g + 1),
                                                                                          0x0101010101010101LL * g)));
                for (int t = 0; t < NT; t++)
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(_mm256_maddubs_epi16(v[k], load32(x[t].qk + 256 * i + 16 * g)), s));
            }
        }
        const float d = f16(b + 208);
        for (int t = 0; t < NT; t++) acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(d * x[t].dk[i]), acc[t]);
    }
    for (int t = 0; t < NT; t++) out[t] = hsum(acc[t]);
}

#define Q6_K_ROUNDS 256
#endif
