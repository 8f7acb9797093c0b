/* --- int8 products (AVX512-VNNI, AVX2, or NEON): what llama.cpp's vec_dot does --------------------------
 *
 * Dequantizing to float costs two conversions a 16 weights, and on two cores that, not memory, bounded the
 * float kernels (Q5_0 at ~15 GB/s where memory gives ~30). llama.cpp instead rounds the activations to 8
 * bits, one scale a 32 values, and multiplies integer codes with the CPU's int8 dot product (vpdpbusd: 64
 * products a instruction). These kernels do the same for the types the packaged models use: the weights'
 * codes, unsigned, against the activations' signed codes, an int32 sum a group, scaled by both scales in
 * float; offsets and minimums come back through each group's sum of activation codes. */
#if defined(SIMD512) && defined(__AVX512VNNI__)
#define VNNI
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define AVX2_DOTS
#elif defined(NEON_DOTS) /* isa_neon*.c: NEON is in every AArch64 CPU, so the portable build has it too */
#include <arm_neon.h>
#endif
#if defined(VNNI) || defined(AVX2_DOTS)
#define INT8_GEMM /* gemm.h */
#endif
#if defined(VNNI) || defined(AVX2_DOTS) || defined(NEON_DOTS)
#define INT8_DOTS
#define ALWAYS static inline __attribute__((always_inline))

/* one token's activations, rounded: codes [cols], a scale a 32 values, and each 32's and 16's code sum
 * times its scale (the "x sums" offsets and minimums need) */
typedef struct {
    int8_t *q;
    float *d, *s32, *s16;
    /* the same activations rounded with one scale a 256 (llama.cpp's Q8_K, for the K-quants): codes, scale, and
     * each 32's and 16's code sum */
    int8_t *qk;
    float *dk;
    int16_t *bk, *bk16;
} xq_t;

static size_t xq_bytes(int64_t cols) {
    return (size_t)2 * cols + 16 * (cols / 32) + 4 * (cols / 256) + 2 * (cols / 32) + 2 * (cols / 16);
}

static xq_t xq_at(char *m, int64_t cols) {
    const int64_t g = cols / 32;
    float *f = (float *)(m + 2 * cols);
    int16_t *bk = (int16_t *)(f + 4 * g + cols / 256);
    return (xq_t){(int8_t *)m, f, f + g, f + 2 * g, (int8_t *)(m + cols), f + 4 * g, bk, bk + g};
}

#endif

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
            o->d[b] = d;
            o->s16[2 * b] = d * sa;
            o->s16[2 * b + 1] = d * sc;
            o->s32[b] = d * (sa + sc);
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

/* Several tokens a row make the products as slow as memory, or slower: with the next lines asked for ahead
 * (as the AVX2 products do), the two overlap. Qwen2.5-Coder-1.5B, four sessions a pass: 49 -> 66-70 tokens/s;
 * one token a row keeps the hardware prefetcher alone, which measured as fast. */
#define PREFETCH_AHEAD(p, n)                                                                                \
    do {                                                                                                    \
        if (NT > 1)                                                                                         \
            for (int o_ = 0; o_ < (n); o_ += 64) _mm_prefetch((const char *)(p) + 2048 + o_, _MM_HINT_T0);     \
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
            o->d[b] = d;
            o->s16[2 * b] = d * sa;
            o->s16[2 * b + 1] = d * sc;
            o->s32[b] = d * (sa + sc);
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

ALWAYS void q8_0_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
#define TERM(acc) SIGNED_TERM(acc, load32(b + 2), f16(b))
    BLOCKS32(34, TERM, 0.0f, 0.0f, hsum(_mm256_add_ps(a0[t], a1[t])))
#undef TERM
}

/* Q5_0: codes 0..31, less 16 through the 32's activation sum */
ALWAYS void q5_0_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
#define TERM(acc)                                                                                            \
    const __m256i c = codes_q5_0(b);                                                                        \
    const float d = f16(b);                                                                                 \
    for (int t = 0; t < NT; t++)                                                                            \
        acc[t] = _mm256_fmadd_ps(dp(c, load32(x[t].q + 32 * i)), _mm256_set1_ps(d * x[t].d[i]), acc[t]);
    BLOCKS32(22, TERM, f16(b), x[t].s32[i], fmaf(-16.0f, corr[t], hsum(_mm256_add_ps(a0[t], a1[t]))))
#undef TERM
}

/* Q4_1: codes 0..15 times d, plus m through the 32's activation sum */
ALWAYS void q4_1_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
#define TERM(acc)                                                                                            \
    const __m256i c = codes_q4(b + 4);                                                                      \
    const float d = f16(b);                                                                                 \
    for (int t = 0; t < NT; t++)                                                                            \
        acc[t] = _mm256_fmadd_ps(dp(c, load32(x[t].q + 32 * i)), _mm256_set1_ps(d * x[t].d[i]), acc[t]);
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

#ifdef NEON_DOTS
/* AArch64 (isa_neon.c, isa_neon_dotprod.c). Its int8 products multiply signed bytes by signed bytes, so, as
 * llama.cpp's ARM kernels do, each type's codes go in signed: less the type's offset (Q5_0's 16, Q6_K's 32), or
 * its table's values (IQ4_NL, IQ4_XS, MXFP4), as they are (Q8_0), or 0..15 (Q4_1, Q4_K, whose minimums come back
 * through the activations' code sums). The activations are rounded as the AVX2 build rounds them (one scale a
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
            o->d[b] = d;
            o->s16[2 * b] = d * sa;
            o->s16[2 * b + 1] = d * sc;
            o->s32[b] = d * (sa + sc);
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

#if defined(AVX2_DOTS) || defined(NEON_DOTS)
/* nt tokens against one row: MAX_NT at once, fewer one by one */
#define DOTS(NAME)                                                                                           \
    static void dots_##NAME(const uint8_t *b, int64_t nb, const xq_t *x, int nt, float *out) {             \
        if (nt == MAX_NT)                                                                                   \
            NAME##_n(b, nb, x, MAX_NT, out);                                                                \
        else                                                                                                \
            for (int t = 0; t < nt; t++) NAME##_n(b, nb, x + t, 1, out + t);                                \
    }
#endif

#ifdef INT8_DOTS
DOTS(q8_0)
DOTS(q5_0)
DOTS(q4_1)
DOTS(q4_k)
DOTS(q6_k)
DOTS(iq4_nl)
DOTS(iq4_xs)
DOTS(mxfp4)
#undef DOTS

/* out[t] = row . x[t] for nt <= MAX_NT tokens */
typedef void (*dots_fn)(const uint8_t *, int64_t, const xq_t *, int, float *);

static dots_fn find_dot(int type) {
    switch (type) {
    case T_Q8_0: return dots_q8_0;
    case T_Q5_0: return dots_q5_0;
    case T_Q4_1: return dots_q4_1;
    case T_Q4_K: return dots_q4_k;
    case T_Q6_K: return dots_q6_k;
    case T_IQ4_NL: return dots_iq4_nl;
    case T_IQ4_XS: return dots_iq4_xs;
    case T_MXFP4: return dots_mxfp4;
    default: return NULL;
    }
}

/* how many values share an activation scale in the type's products: llama.cpp's Q8_K (256) for the K-quant
 * types whose products sum a whole block in integers, Q8_0 (32) for the rest; 0 where there is no product */
static int rounds_of(int type) {
    return find_dot(type) == NULL ? 0 : type == T_Q4_K ? 256 : type == T_Q6_K ? Q6_K_ROUNDS : 32;
}
#endif


/* Tokens rounded and taken through the rows at a time by the int8 products when there are many (prefill): their
 * rounded activations (about a byte a value) stay in L2 while each row, in L1, meets them all */
#define TOKEN_CHUNK 32

/* y = x . W^T on `threads` threads, each a contiguous slice of rows cut at a multiple of 16: every output is
 * summed by one thread in one order, whatever the thread count */
static void matmul_mt(const block_type *bt, const uint8_t *w, int64_t rows, int64_t cols, const float *x, int64_t T,
                      float *y, int threads) {
    const int nt = team(threads, rows, 64);
#ifdef INT8_DOTS
    const dots_fn dot = find_dot(bt->type);
    const int rounds = rounds_of(bt->type);
    const int64_t nb = cols / bt->values;
    const size_t row_bytes = (size_t)nb * bt->bytes, xqb = xq_bytes(cols);
    const int64_t chunk = T < TOKEN_CHUNK ? T : TOKEN_CHUNK;
    char *mem = dot ? malloc((size_t)chunk * xqb) : NULL;
    xq_t xq[TOKEN_CHUNK];
    if (mem) { /* a chunk of tokens' activations rounded to 8 bits once, then every row against them */
        for (int64_t t0 = 0; t0 < T; t0 += TOKEN_CHUNK) {
            const int64_t n = T - t0 < TOKEN_CHUNK ? T - t0 : TOKEN_CHUNK;
#pragma omp parallel for num_threads(team(threads, n, 4)) schedule(static)
            for (int64_t t = 0; t < n; t++) {
                xq[t] = xq_at(mem + (size_t)t * xqb, cols);
                quantize_x(x + (t0 + t) * cols, cols, rounds, &xq[t]);
            }
#pragma omp parallel for num_threads(nt) schedule(static)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t t = 0; t < n; t += MAX_NT) {
                    const int k = n - t < MAX_NT ? (int)(n - t) : MAX_NT;
                    float o[MAX_NT];
                    dot(w + r * row_bytes, nb, xq + t, k, o);
                    for (int j = 0; j < k; j++) y[(t0 + t + j) * rows + r] = o[j];
                }
        }
        free(mem);
        return;
    }
#endif
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
        const int id = omp_get_thread_num(), n = omp_get_num_threads();
#else
        const int id = 0, n = 1;
#endif
        const int64_t per = ((rows + n - 1) / n + 15) / 16 * 16;
        const int64_t r0 = id * per < rows ? id * per : rows, r1 = r0 + per < rows ? r0 + per : rows;
        if (r0 < r1) bt->matmul(w, r0, r1, cols, x, T, y, rows);
    }
}

