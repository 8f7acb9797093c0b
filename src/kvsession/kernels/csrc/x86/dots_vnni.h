#pragma once
/* The int8 products on AVX512-VNNI (isa_avx512.c, isa_avx512bf16.c; included by dots.h) */
#ifdef VNNI
/* 32 values of x rounded to 8 bits with one scale (returned): their codes, 16 a register, and each 16's code sum */
static inline float round32_512(const float *x, __m128i q[2], int sums[2]) {
    const __m512 a = _mm512_loadu_ps(x), c = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
    const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(id)));
    q[0] = _mm512_cvtsepi32_epi8(qa);
    q[1] = _mm512_cvtsepi32_epi8(qc);
    sums[0] = _mm512_reduce_add_epi32(qa);
    sums[1] = _mm512_reduce_add_epi32(qc);
    return amax / 127.0f;
}

/* x rounded to 8 bits with one scale a `rounds` values (32: q, d, s16, s32; 256: qk, dk, bk) */
static void quantize_x(const float *x, int64_t cols, int rounds, xq_t *o) {
    if (rounds == 32)
        for (int64_t b = 0; b < cols / 32; b++) {
            __m128i q[2];
            int sums[2];
            const float d = round32_512(x + 32 * b, q, sums), sa = (float)sums[0], sc = (float)sums[1];
            _mm_storeu_si128((__m128i *)(o->q + 32 * b), q[0]);
            _mm_storeu_si128((__m128i *)(o->q + 32 * b + 16), q[1]);
            xq_scales32(o, b, d, sa, sc);
        }
    else
        for (int64_t b = 0; b < cols / 256; b++) {
            const float *xb = x + 256 * b;
            __m512 mx = _mm512_setzero_ps();
            for (int j = 0; j < 256; j += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xb + j)));
            const float amax = _mm512_reduce_max_ps(mx), id = amax > 0.0f ? 127.0f / amax : 0.0f;
            o->dk[b] = amax / 127.0f;
            for (int j = 0; j < 256; j += 32) {
                const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + j), _mm512_set1_ps(id)));
                const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + j + 16), _mm512_set1_ps(id)));
                _mm_storeu_si128((__m128i *)(o->qk + 256 * b + j), _mm512_cvtsepi32_epi8(qa));
                _mm_storeu_si128((__m128i *)(o->qk + 256 * b + j + 16), _mm512_cvtsepi32_epi8(qc));
                const int sa = _mm512_reduce_add_epi32(qa), sc = _mm512_reduce_add_epi32(qc);
                o->bk16[16 * b + j / 16] = (int16_t)sa;
                o->bk16[16 * b + j / 16 + 1] = (int16_t)sc;
                o->bk[8 * b + j / 32] = (int16_t)(sa + sc);
            }
        }
}

/* int32 sums of u8 x s8 products, 4 adjacent bytes a lane, as floats */
static inline __m512 dp(__m512i u, __m512i s) {
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s));
}

static inline __m512i join(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

static inline __m512 halves(float lo, float hi) {  /* lanes 0-7 lo, 8-15 hi */
    return _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(hi), 1);
}

/* The next lines of the row asked for ahead, whatever the token count. Several tokens a row make the products as
 * slow as memory, or slower, and with the prefetch the two overlap (Qwen2.5-Coder-1.5B, four sessions a pass: 49
 * -> 66-70 tokens/s on Zen 4). One token a row was left to the hardware prefetcher, which measured as fast on
 * Zen 4; on an Intel Xeon with AMX (a VM) it left each core at a third of its memory bandwidth: every
 * Q4_0 matrix of LFM2-1.2B once, 106 -> 51 ms (BENCHMARKS.md, "Kernels"). */
#define PREFETCH_AHEAD(p, n)                                                                                \
    do {                                                                                                    \
        for (int o_ = 0; o_ < (n); o_ += 64) _mm_prefetch((const char *)(p) + 2048 + o_, _MM_HINT_T0);         \
    } while (0)

/* Each product below is written once for NT tokens (x[0..NT-1]) against one row, as the AVX2 ones are: a
 * block's codes are unpacked once and multiplied with every token's activations (several sequences decoded at
 * once, a speculative draft verified), NT = 1 being one token. Each token's sums are the same operations in the
 * same order whatever NT is (scalar products written as fmaf, which the compiler cannot contract one way for
 * NT = 1 and another for NT = 4), so a token's result does not depend on the tokens it was multiplied with. */
#define MAX_NT 8

/* The 32-value types, two blocks a 512-bit product: CODES(b) the pair's codes, SCALE(b) a block's scale,
 * CORR(b, t, i) the pair's offset or minimum term for token t, FINISH(t) the token's result */
#define PAIRS32(BYTES, CODES, ONE, SCALE, CA, FINISH)                                                         \
    __m512 acc[MAX_NT];                                                                                     \
    float corr[MAX_NT];                                                                                     \
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps(), corr[t] = 0.0f;                              \
    int64_t i = 0;                                                                                          \
    for (; i + 2 <= nb; i += 2, b += 2 * (BYTES)) {                                                         \
        PREFETCH_AHEAD(b, 2 * (BYTES));                                                                     \
        const float d0 = SCALE(b), d1 = SCALE(b + (BYTES));                                                 \
        const float c0 = CA(b), c1 = CA(b + (BYTES));                                                       \
        const __m512i c = CODES(b);                                                                         \
        for (int t = 0; t < NT; t++) {                                                                      \
            acc[t] = _mm512_fmadd_ps(dp(c, _mm512_loadu_si512(x[t].q + 32 * i)),                           \
                                     halves(d0 * x[t].d[i], d1 * x[t].d[i + 1]), acc[t]);                   \
            corr[t] = fmaf(c1, x[t].s32[i + 1], fmaf(c0, x[t].s32[i], corr[t]));                           \
        }                                                                                                   \
    }                                                                                                       \
    for (; i < nb; i++, b += (BYTES)) {                                                                     \
        const float d0 = SCALE(b), c0 = CA(b);                                                              \
        const __m512i c = _mm512_castsi256_si512(ONE(b));                                                   \
        for (int t = 0; t < NT; t++) {                                                                      \
            const __m512i xs = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(x[t].q + 32 * i))); \
            acc[t] = _mm512_fmadd_ps(_mm512_maskz_mov_ps(0xFF, dp(c, xs)), _mm512_set1_ps(d0 * x[t].d[i]), acc[t]); \
            corr[t] = fmaf(c0, x[t].s32[i], corr[t]);                                                       \
        }                                                                                                   \
    }                                                                                                       \
    for (int t = 0; t < NT; t++) out[t] = FINISH;

/* Q8_0: codes + 128 (u8) against x; less 128 * sum(x) */
static inline __m256i q8_0_one(const uint8_t *b) {
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
}
#define Q8_0_PAIR(b) join(q8_0_one(b), q8_0_one((b) + 34))
#define F16_AT(b) f16(b)
ALWAYS void q8_0_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    PAIRS32(34, Q8_0_PAIR, q8_0_one, F16_AT, F16_AT, fmaf(-128.0f, corr[t], _mm512_reduce_add_ps(acc[t])))
}

/* Q4_0: codes 0..15, less 8 through the 32's activation sum */
#define Q4_0_ONE(b) codes_q4((b) + 2)
#define Q4_0_PAIR(b) join(codes_q4((b) + 2), codes_q4((b) + 20))
ALWAYS void q4_0_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    PAIRS32(18, Q4_0_PAIR, Q4_0_ONE, F16_AT, F16_AT, fmaf(-8.0f, corr[t], _mm512_reduce_add_ps(acc[t])))
}

/* Q5_0: codes 0..31, less 16 through the 32's activation sum */
#define Q5_0_PAIR(b) join(codes_q5_0(b), codes_q5_0((b) + 22))
ALWAYS void q5_0_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    PAIRS32(22, Q5_0_PAIR, codes_q5_0, F16_AT, F16_AT, fmaf(-16.0f, corr[t], _mm512_reduce_add_ps(acc[t])))
}

/* Q4_1: value d * code + m */
#define Q4_1_ONE(b) codes_q4((b) + 4)
#define Q4_1_PAIR(b) join(codes_q4((b) + 4), codes_q4((b) + 24))
#define Q4_1_MIN(b) f16((b) + 2)
ALWAYS void q4_1_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    PAIRS32(20, Q4_1_PAIR, Q4_1_ONE, F16_AT, Q4_1_MIN, _mm512_reduce_add_ps(acc[t]) + corr[t])
}

/* IQ4_NL and MXFP4: a table's values + 128 (u8) against x, as Q8_0's codes; less 128 * sum(x) */
static inline __m256i lut_u8(const uint8_t *qs, const int8_t *table) {
    return _mm256_xor_si256(codes_lut(qs, table), _mm256_set1_epi8((char)0x80));
}
#define IQ4_NL_ONE(b) lut_u8((b) + 2, IQ4_VALUES)
#define IQ4_NL_PAIR(b) join(IQ4_NL_ONE(b), IQ4_NL_ONE((b) + 18))
ALWAYS void iq4_nl_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    PAIRS32(18, IQ4_NL_PAIR, IQ4_NL_ONE, F16_AT, F16_AT, fmaf(-128.0f, corr[t], _mm512_reduce_add_ps(acc[t])))
}
#define MXFP4_ONE(b) lut_u8((b) + 1, FP4_VALUES)
#define MXFP4_PAIR(b) join(MXFP4_ONE(b), MXFP4_ONE((b) + 17))
#define E8M0_AT(b) e8m0_half((b)[0])
ALWAYS void mxfp4_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    PAIRS32(17, MXFP4_PAIR, MXFP4_ONE, E8M0_AT, E8M0_AT, fmaf(-128.0f, corr[t], _mm512_reduce_add_ps(acc[t])))
}
#undef PAIRS32

/* IQ4_XS: IQ4_NL's values, eight 32s a block of 256, each with its 6-bit scale; against activations with one
 * scale a 32, two 32s a product */
ALWAYS void iq4_xs_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    __m512 acc[MAX_NT];
    float corr[MAX_NT];
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps(), corr[t] = 0.0f;
    for (int64_t i = 0; i < nb; i++, b += 136) {
        PREFETCH_AHEAD(b, 136);
        const float d = f16(b);
        for (int ib = 0; ib < 8; ib += 2) {
            const float d0 = d * (float)iq4_xs_scale(b, ib), d1 = d * (float)iq4_xs_scale(b, ib + 1);
            const __m512i c = join(lut_u8(b + 8 + 16 * ib, IQ4_VALUES), lut_u8(b + 24 + 16 * ib, IQ4_VALUES));
            const int64_t g = 8 * i + ib;
            for (int t = 0; t < NT; t++) {
                acc[t] = _mm512_fmadd_ps(dp(c, _mm512_loadu_si512(x[t].q + 32 * g)),
                                         halves(d0 * x[t].d[g], d1 * x[t].d[g + 1]), acc[t]);
                corr[t] = fmaf(d1, x[t].s32[g + 1], fmaf(d0, x[t].s32[g], corr[t]));
            }
        }
    }
    for (int t = 0; t < NT; t++) out[t] = fmaf(-128.0f, corr[t], _mm512_reduce_add_ps(acc[t]));
}

/* Q4_K: sub-block j of 32 values is d * sc_j * code - dmin * m_j. As llama.cpp does (Q4_K x Q8_K), against
 * activations with one scale a 256: each sub-block's u8 x s8 pair sums (16 bits) times its 6-bit scale add up
 * in int32 over the whole block, converted and scaled once. */
ALWAYS void q4_k_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    __m512 acc[MAX_NT];
    __m128 accm[MAX_NT]; /* the minimums' terms: the eight 32s' code sums times their minimums, four lanes */
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps(), accm[t] = _mm_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m512i lanes = _mm512_set_epi16(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                           0, 0, 0, 0, 0, 0, 0);
    for (int64_t i = 0; i < nb; i++, b += 144) {
        PREFETCH_AHEAD(b, 144);
        const uint8_t *q = b + 16;
        uint32_t u[4];
        k4_scales(b, u);
        const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(u + 2)));
        const __m512i sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)u)));
        __m512i isum[MAX_NT];
        for (int t = 0; t < NT; t++) isum[t] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j += 2, q += 32) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)q);
            const __m512i c = join(_mm256_and_si256(qv, m4), _mm256_and_si256(_mm256_srli_epi16(qv, 4), m4));
            const __m512i scj = _mm512_permutexvar_epi16(_mm512_add_epi16(lanes, _mm512_set1_epi16(j)), sc);
            for (int t = 0; t < NT; t++)
                isum[t] = _mm512_dpwssd_epi32(isum[t], _mm512_maddubs_epi16(c, _mm512_loadu_si512(x[t].qk + 256 * i + 32 * j)),
                                              scj);
        }
        const float d = f16(b), dmin = f16(b + 2);
        for (int t = 0; t < NT; t++) {
            const float dx = x[t].dk[i];
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_set1_ps(d * dx), acc[t]);
            const __m128i m = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i *)(x[t].bk + 8 * i)));
            accm[t] = _mm_fmadd_ps(_mm_set1_ps(dmin * dx), _mm_cvtepi32_ps(m), accm[t]);
        }
    }
    for (int t = 0; t < NT; t++) out[t] = _mm512_reduce_add_ps(acc[t]) - hsum4(accm[t]);
}

/* Q6_K: group g of 16 values is d * sc_g * (code - 32), codes 0..63 */
ALWAYS void q6_k_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
    __m512 acc[MAX_NT], corr[MAX_NT];
    for (int t = 0; t < NT; t++) acc[t] = corr[t] = _mm512_setzero_ps();
    /* lanes of a 64-value product (4 values a lane) -> its 16-value group */
    const __m512i four = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i pairs = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 1);
    for (int64_t i = 0; i < nb; i++, b += 210) {
        PREFETCH_AHEAD(b, 210);
        const uint8_t *ql = b, *qh = b + 128;
        const float d = f16(b + 208);
        const int64_t g32 = 8 * i;
        /* the 16 groups' scales d * sc_g, and with the activations' scale of the 32 each group lies in */
        const __m512 s = _mm512_mul_ps(_mm512_set1_ps(d),
                                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))));
        __m512 sx[MAX_NT];
        for (int t = 0; t < NT; t++) {
            sx[t] = _mm512_mul_ps(s, _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_loadu_ps(x[t].d + g32))));
            corr[t] = _mm512_fmadd_ps(s, _mm512_loadu_ps(x[t].s16 + 2 * g32), corr[t]);
        }
        for (int n = 0; n < 2; n++, ql += 64, qh += 32) {
            __m256i v[4];
            q6_codes(ql, qh, v);
            const __m512i lo = join(v[0], v[1]), hi = join(v[2], v[3]);
            const __m512i g0 = _mm512_add_epi32(four, _mm512_set1_epi32(8 * n)),
                          g1 = _mm512_add_epi32(four, _mm512_set1_epi32(8 * n + 4));
            for (int t = 0; t < NT; t++) {
                const int8_t *xq = x[t].q + 256 * i + 128 * n;
                acc[t] = _mm512_fmadd_ps(dp(lo, _mm512_loadu_si512(xq)), _mm512_permutexvar_ps(g0, sx[t]), acc[t]);
                acc[t] = _mm512_fmadd_ps(dp(hi, _mm512_loadu_si512(xq + 64)), _mm512_permutexvar_ps(g1, sx[t]), acc[t]);
            }
        }
    }
    for (int t = 0; t < NT; t++) out[t] = _mm512_reduce_add_ps(acc[t]) - 32.0f * _mm512_reduce_add_ps(corr[t]);
}

#define Q6_K_ROUNDS 32
/* nt (1..MAX_NT) tokens against one row, each count its own specialization */
#define DOTS(NAME)                                                                                           \
    static void dots_##NAME(const uint8_t *b, int64_t nb, const xq_t *x, int nt, float *out) {             \
        switch (nt) {                                                                                       \
        case 8: NAME##_n(b, nb, x, 8, out); break;                                                          \
        case 7: NAME##_n(b, nb, x, 7, out); break;                                                          \
        case 6: NAME##_n(b, nb, x, 6, out); break;                                                          \
        case 5: NAME##_n(b, nb, x, 5, out); break;                                                          \
        case 4: NAME##_n(b, nb, x, 4, out); break;                                                          \
        case 3: NAME##_n(b, nb, x, 3, out); break;                                                          \
        case 2: NAME##_n(b, nb, x, 2, out); break;                                                          \
        default: NAME##_n(b, nb, x, 1, out);                                                                \
        }                                                                                                   \
    }
#endif
