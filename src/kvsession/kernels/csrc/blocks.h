#pragma once
/* One block to floats per type, the float products, and the type table (included by isa.h) */

#if defined(__AVX2__)
#include <immintrin.h>
/* Codes of the packed types as bytes, 32 at a time (AVX2; the int8 products of both instruction sets use them) */

/* Q6_K codes 0..63 of 128 values (one half of a block): v[0] values 0-31, v[1] 32-63, v[2] 64-95, v[3] 96-127 */
static inline void q6_codes(const uint8_t *ql, const uint8_t *qh, __m256i v[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    const __m256i a = _mm256_loadu_si256((const __m256i *)ql), c = _mm256_loadu_si256((const __m256i *)(ql + 32));
    const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
#define HI2(s) _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, s), m2), 4)
    v[0] = _mm256_or_si256(_mm256_and_si256(a, m4), HI2(0));
    v[1] = _mm256_or_si256(_mm256_and_si256(c, m4), HI2(2));
    v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), HI2(4));
    v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4), HI2(6));
#undef HI2
}

static inline __m256i codes_q4(const uint8_t *qs) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
}


/* the sum of 4 floats, of 8, and the largest of 8 */
static inline float hsum4(__m128 v) {
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

static inline float hsum(__m256 v) { return hsum4(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))); }

static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* byte j = 0xFF where bit j of bits is set */
static inline __m256i bits_to_bytes(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0x0000000000000000));
    return _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
}

/* Q5_0 codes 0..31 of one block, low half's values then the high half's */
static inline __m256i codes_q5_0(const uint8_t *b) {
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    return _mm256_or_si256(codes_q4(b + 6), _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
}

#endif

/* Q4_K's eight 6-bit scales (bytes 0-7 of u) and minimums (bytes 8-15), unpacked a word at a time
 * (scale_min_k4 for all j at once; the int8 products and GEMM use it) */
static inline void k4_scales(const uint8_t *b, uint32_t u[4]) {
    memcpy(u, b + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t mins_lo = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = mins_lo;
    u[0] &= 0x3f3f3f3f;
}

/* --- one block to floats (ggml's dequantize_row_* for one block) ---------- */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SIMD512
#include <immintrin.h>
/* AVX-512: the same float operations as the portable versions below, 16 values at a time. */

static inline __m512 codes(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }

static inline void put_scaled(float *y, __m128i q, __m512 d) { _mm512_storeu_ps(y, _mm512_mul_ps(codes(q), d)); }

static inline void put_scaled_add(float *y, __m128i q, __m512 d, __m512 m) {  /* q * d + m */
    _mm512_storeu_ps(y, _mm512_add_ps(_mm512_mul_ps(codes(q), d), m));
}

static inline void put_scaled_sub(float *y, __m128i q, __m512 d, __m512 m) {  /* d * q - m */
    _mm512_storeu_ps(y, _mm512_sub_ps(_mm512_mul_ps(d, codes(q)), m));
}

static inline __m128i lo128(__m256i v) { return _mm256_castsi256_si128(v); }
static inline __m128i hi128(__m256i v) { return _mm256_extracti128_si256(v, 1); }

static inline void dq_q4_0(const uint8_t *b, float *y) {
    const __m512 d = _mm512_set1_ps(f16(b));
    const __m128i qs = _mm_loadu_si128((const __m128i *)(b + 2)), m4 = _mm_set1_epi8(0x0F), k8 = _mm_set1_epi8(8);
    put_scaled(y, _mm_sub_epi8(_mm_and_si128(qs, m4), k8), d);
    put_scaled(y + 16, _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), k8), d);
}

static inline void dq_q4_1(const uint8_t *b, float *y) {
    const __m512 d = _mm512_set1_ps(f16(b)), m = _mm512_set1_ps(f16(b + 2));
    const __m128i qs = _mm_loadu_si128((const __m128i *)(b + 4)), m4 = _mm_set1_epi8(0x0F);
    put_scaled_add(y, _mm_and_si128(qs, m4), d, m);
    put_scaled_add(y + 16, _mm_and_si128(_mm_srli_epi16(qs, 4), m4), d, m);
}

static inline __m128i high_bits(uint32_t bits16) {  /* bit j set -> byte j = 0x10 */
    return _mm_maskz_mov_epi8((__mmask16)bits16, _mm_set1_epi8(0x10));
}

static inline void dq_q5_0(const uint8_t *b, float *y) {
    const __m512 d = _mm512_set1_ps(f16(b));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const __m128i qs = _mm_loadu_si128((const __m128i *)(b + 6)), m4 = _mm_set1_epi8(0x0F), k16 = _mm_set1_epi8(16);
    put_scaled(y, _mm_sub_epi8(_mm_or_si128(_mm_and_si128(qs, m4), high_bits(qh & 0xFFFF)), k16), d);
    put_scaled(y + 16, _mm_sub_epi8(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), high_bits(qh >> 16)), k16),
               d);
}

static inline void dq_q5_1(const uint8_t *b, float *y) {
    const __m512 d = _mm512_set1_ps(f16(b)), m = _mm512_set1_ps(f16(b + 2));
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    const __m128i qs = _mm_loadu_si128((const __m128i *)(b + 8)), m4 = _mm_set1_epi8(0x0F);
    put_scaled_add(y, _mm_or_si128(_mm_and_si128(qs, m4), high_bits(qh & 0xFFFF)), d, m);
    put_scaled_add(y + 16, _mm_or_si128(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), high_bits(qh >> 16)), d, m);
}

static inline void dq_q8_0(const uint8_t *b, float *y) {
    const __m512 d = _mm512_set1_ps(f16(b));
    put_scaled(y, _mm_loadu_si128((const __m128i *)(b + 2)), d);
    put_scaled(y + 16, _mm_loadu_si128((const __m128i *)(b + 18)), d);
}

static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

/* Q4_K and Q5_K: 32 codes (0..31) of one sub-block, d * q - m */
static inline void put_k32(float *y, __m256i q, float d, float m) {
    const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
    put_scaled_sub(y, lo128(q), vd, vm);
    put_scaled_sub(y + 16, hi128(q), vd, vm);
}

static inline void dq_q4_k(const uint8_t *b, float *y) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    uint8_t sc, m;
    for (int is = 0; is < 8; is += 2) {
        const __m256i qv = _mm256_loadu_si256((const __m256i *)q);
        scale_min_k4(is, scales, &sc, &m);
        put_k32(y, _mm256_and_si256(qv, m4), d * sc, dmin * m);
        scale_min_k4(is + 1, scales, &sc, &m);
        put_k32(y + 32, _mm256_and_si256(_mm256_srli_epi16(qv, 4), m4), d * sc, dmin * m);
        y += 64;
        q += 32;
    }
}

static inline void dq_q5_k(const uint8_t *b, float *y) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *scales = b + 4, *ql = b + 48;
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)), m4 = _mm256_set1_epi8(0x0F),
                  k16 = _mm256_set1_epi8(16);
    uint8_t sc, m, u1 = 1, u2 = 2;
    for (int is = 0; is < 8; is += 2) {
        const __m256i qv = _mm256_loadu_si256((const __m256i *)ql);
        const __m256i h1 = _mm256_maskz_mov_epi8(_mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)u1)), k16);
        const __m256i h2 = _mm256_maskz_mov_epi8(_mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)u2)), k16);
        scale_min_k4(is, scales, &sc, &m);
        put_k32(y, _mm256_or_si256(_mm256_and_si256(qv, m4), h1), d * sc, dmin * m);
        scale_min_k4(is + 1, scales, &sc, &m);
        put_k32(y + 32, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qv, 4), m4), h2), d * sc, dmin * m);
        y += 64;
        ql += 32;
        u1 <<= 2;
        u2 <<= 2;
    }
}

/* Q6_K: 32 codes of two 16-value groups with scales d * sc[0], d * sc[1] */
static inline void put_6(float *y, __m256i q, float d, const int8_t *sc) {
    put_scaled(y, lo128(q), _mm512_set1_ps(d * sc[0]));
    put_scaled(y + 16, hi128(q), _mm512_set1_ps(d * sc[1]));
}

static inline void dq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16(b + 208);
    const __m256i k32 = _mm256_set1_epi8(32);
    for (int n = 0; n < QKK; n += 128) {
        __m256i v[4];
        q6_codes(ql, qh, v);
        for (int i = 0; i < 4; i++) put_6(y + 32 * i, _mm256_sub_epi8(v[i], k32), d, sc + 2 * i);
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

#else
/* Portable versions: what ggml's dequantize_row_* does, one block. */

static inline void dq_q4_0(const uint8_t *b, float *y) {
    const float d = f16(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = (float)((qs[j] & 0x0F) - 8) * d;
        y[j + QK / 2] = (float)((qs[j] >> 4) - 8) * d;
    }
}

static inline void dq_q4_1(const uint8_t *b, float *y) {
    const float d = f16(b), m = f16(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = (float)(qs[j] & 0x0F) * d + m;
        y[j + QK / 2] = (float)(qs[j] >> 4) * d + m;
    }
}

static inline void dq_q5_0(const uint8_t *b, float *y) {
    const float d = f16(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < QK / 2; j++) {
        const int32_t x0 = ((qs[j] & 0x0F) | (((qh >> j) << 4) & 0x10)) - 16;
        const int32_t x1 = ((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16;
        y[j] = (float)x0 * d;
        y[j + QK / 2] = (float)x1 * d;
    }
}

static inline void dq_q5_1(const uint8_t *b, float *y) {
    const float d = f16(b), m = f16(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < QK / 2; j++) {
        const int32_t x0 = (qs[j] & 0x0F) | (((qh >> j) << 4) & 0x10);
        const int32_t x1 = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10);
        y[j] = (float)x0 * d + m;
        y[j + QK / 2] = (float)x1 * d + m;
    }
}

static inline void dq_q8_0(const uint8_t *b, float *y) {
    const float d = f16(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < QK; j++) y[j] = (float)qs[j] * d;
}

static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

static inline void dq_q4_k(const uint8_t *b, float *y) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    int is = 0;
    uint8_t sc, m;
    for (int j = 0; j < QKK; j += 64) {
        scale_min_k4(is + 0, scales, &sc, &m);
        const float d1 = d * sc, m1 = dmin * m;
        scale_min_k4(is + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 32; l++) y[l] = d1 * (float)(q[l] & 0xF) - m1;
        for (int l = 0; l < 32; l++) y[l + 32] = d2 * (float)(q[l] >> 4) - m2;
        y += 64;
        q += 32;
        is += 2;
    }
}

static inline void dq_q5_k(const uint8_t *b, float *y) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
    int is = 0;
    uint8_t sc, m, u1 = 1, u2 = 2;
    for (int j = 0; j < QKK; j += 64) {
        scale_min_k4(is + 0, scales, &sc, &m);
        const float d1 = d * sc, m1 = dmin * m;
        scale_min_k4(is + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 32; l++) y[l] = d1 * (float)((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++) y[l + 32] = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
        y += 64;
        ql += 32;
        is += 2;
        u1 <<= 2;
        u2 <<= 2;
    }
}

static inline void dq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16(b + 208);
    for (int n = 0; n < QKK; n += 128) {
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int8_t q1 = (int8_t)((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int8_t q2 = (int8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int8_t q3 = (int8_t)((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int8_t q4 = (int8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l + 0] = d * sc[is + 0] * q1;
            y[l + 32] = d * sc[is + 2] * q2;
            y[l + 64] = d * sc[is + 4] * q3;
            y[l + 96] = d * sc[is + 6] * q4;
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

#endif

static inline void dq_f16(const uint8_t *b, float *y) {
    for (int j = 0; j < QK; j++) y[j] = f16(b + 2 * j);
}

static inline void dq_bf16(const uint8_t *b, float *y) {
    for (int j = 0; j < QK; j++) {
        uint16_t h;
        memcpy(&h, b + 2 * j, 2);
        uint32_t bits = (uint32_t)h << 16;
        memcpy(y + j, &bits, 4);
    }
}

static inline void dq_f32(const uint8_t *b, float *y) { memcpy(y, b, QK * sizeof(float)); }

/* The types of dynamic quants and gpt-oss, one portable version each (what ggml's dequantize_row_* does): their
 * products dequantize a block into L1 and multiply it in float32, under every instruction set. */

static inline void dq_q2_k(const uint8_t *b, float *y) {  /* scales[16], qs[64], d, dmin */
    const uint8_t *scales = b, *q = b + 16;
    const float d = f16(b + 80), dmin = f16(b + 82);
    int is = 0;
    for (int n = 0; n < QKK; n += 128) {
        for (int shift = 0; shift < 8; shift += 2) {
            for (int half = 0; half < 2; half++) {
                const uint8_t sc = scales[is++];
                const float dl = d * (float)(sc & 0xF), ml = dmin * (float)(sc >> 4);
                for (int l = 0; l < 16; l++) *y++ = dl * (float)((q[l + 16 * half] >> shift) & 3) - ml;
            }
        }
        q += 32;
    }
}

static inline void dq_q3_k(const uint8_t *b, float *y) {  /* hmask[32], qs[64], scales[12] (6 bits each), d */
    const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    const float d = f16(b + 108);
    for (int i = 0; i < 16; i++) {  /* 16 values a scale; value v: bit v/32 of hmask[v%32], 2 bits of qs */
        const int lo = (sc[i % 8] >> (4 * (i / 8))) & 0xF, hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        const float dl = d * (float)((int8_t)(lo | (hi << 4)) - 32);
        for (int j = 0; j < 16; j++) {
            const int v = 16 * i + j, l = v % 32, bit = v / 32;
            const int q = (qs[32 * (bit / 4) + l] >> (2 * (bit % 4))) & 3;
            y[v] = dl * (float)(q - ((hmask[l] >> bit) & 1 ? 0 : 4));
        }
    }
}

static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* MXFP4's e2m1 values, doubled (the scale below is halved to match) */
static const int8_t FP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline void put_nibbles(const uint8_t *qs, const int8_t *values, float d, float *y) {  /* 16 bytes -> 32 */
    for (int j = 0; j < QK / 2; j++) {
        y[j] = d * (float)values[qs[j] & 0xF];
        y[j + QK / 2] = d * (float)values[qs[j] >> 4];
    }
}

static inline void dq_iq4_nl(const uint8_t *b, float *y) { put_nibbles(b + 2, IQ4_VALUES, f16(b), y); }

static inline int iq4_xs_scale(const uint8_t *b, int ib) {  /* sub-block ib's 6-bit scale, less 32 */
    const unsigned scales_h = b[2] | (b[3] << 8);
    return (((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4)) - 32;
}

static inline void dq_iq4_xs(const uint8_t *b, float *y) {  /* d, scales_h (u16), scales_l[4], qs[128] */
    const float d = f16(b);
    for (int ib = 0; ib < QKK / QK; ib++) put_nibbles(b + 8 + 16 * ib, IQ4_VALUES, d * (float)iq4_xs_scale(b, ib), y + QK * ib);
}

/* ggml_e8m0_to_fp32_half: 2^(e - 128), subnormal below e = 2; a table lookup (e8m0_half_table, module.c), as a
 * conversion in bits cost the MXFP4 product a quarter of its speed */
static inline float e8m0_half(uint8_t e) { return e8m0_half_table[e]; }

static inline void dq_mxfp4(const uint8_t *b, float *y) { put_nibbles(b + 1, FP4_VALUES, e8m0_half(b[0]), y); }

#if defined(__AVX2__)
/* a block's 32 4-bit indices (16 bytes: values j and j + 16 in byte j) as their values in a 16-entry table */
static inline __m256i codes_lut(const uint8_t *qs, const int8_t *table) {
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table));
    return _mm256_shuffle_epi8(t, codes_q4(qs));
}
#endif

/* --- kernels ------------------------------------------------------------- */

#define LANES 16  /* one 512-bit register of floats; two 256-bit ones elsewhere */

/* acc[l] += a[l] * b[l] over n values (n a multiple of LANES): lane-wise, so the compiler vectorizes it
 * without reassociating anything */
static inline void fma_lanes(float *restrict acc, const float *restrict a, const float *restrict b, int n) {
    for (int j = 0; j < n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[j + l] * b[j + l];
}

static inline float sum_lanes(const float *acc) {
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    return s;
}

/* Tokens multiplied per pass over a row: each block is dequantized once for all of them. */
#define TILE 4

typedef void (*dq_fn)(const uint8_t *, float *);

#ifdef SIMD512
/* NT tokens (1..TILE) against one row: each block is dequantized once into buf (L1) and multiplied with every
 * token's activations. Two sets of accumulators take alternate 32-value halves of each 64 values, so that
 * consecutive FMAs do not wait on each other. */
static inline __attribute__((always_inline)) void row_tile(const int values, const int bytes, const dq_fn dq,
                                                           const uint8_t *row, int64_t nb, const float *x,
                                                           int64_t cols, const int NT, float *out,
                                                           int64_t out_stride) {
    __m512 a[TILE][4];
    float buf[QKK + 32] __attribute__((aligned(64)));
    for (int t = 0; t < NT; t++) a[t][0] = a[t][1] = a[t][2] = a[t][3] = _mm512_setzero_ps();
    const int per = values >= 64 ? 1 : 2;  /* blocks per 64 values */
    int64_t b = 0;
    for (; b + per <= nb; b += per) {
        for (int i = 0; i < per; i++) dq(row + (size_t)(b + i) * bytes, buf + i * values);
        const float *xb = x + b * values;
        for (int j = 0; j < per * values; j += 64) {
            const __m512 w0 = _mm512_load_ps(buf + j), w1 = _mm512_load_ps(buf + j + 16);
            const __m512 w2 = _mm512_load_ps(buf + j + 32), w3 = _mm512_load_ps(buf + j + 48);
            for (int t = 0; t < NT; t++) {
                const float *xt = xb + t * cols + j;
                a[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt), a[t][0]);
                a[t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), a[t][1]);
                a[t][2] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xt + 32), a[t][2]);
                a[t][3] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xt + 48), a[t][3]);
            }
        }
    }
    for (; b < nb; b++) {  /* an odd last 32-value block */
        dq(row + (size_t)b * bytes, buf);
        const __m512 w0 = _mm512_load_ps(buf), w1 = _mm512_load_ps(buf + 16);
        for (int t = 0; t < NT; t++) {
            const float *xt = x + t * cols + b * values;
            a[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt), a[t][0]);
            a[t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), a[t][1]);
        }
    }
    for (int t = 0; t < NT; t++)
        out[t * out_stride] =
            _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[t][0], a[t][2]), _mm512_add_ps(a[t][1], a[t][3])));
}

static inline __attribute__((always_inline)) void matmul_rows(const int values, const int bytes, const dq_fn dq,
                                                              const uint8_t *w, int64_t r0, int64_t r1,
                                                              int64_t cols, const float *x, int64_t T, float *y,
                                                              int64_t rows) {
    const int64_t nb = cols / values;
    const size_t row_bytes = (size_t)nb * bytes;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + (size_t)r * row_bytes;
        for (int64_t t0 = 0; t0 < T; t0 += TILE) {
            const float *xt = x + t0 * cols;
            float *out = y + t0 * rows + r;
            switch (T - t0 < TILE ? T - t0 : TILE) {  /* a constant NT for each, so the accumulators are registers */
            case 1: row_tile(values, bytes, dq, row, nb, xt, cols, 1, out, rows); break;
            case 2: row_tile(values, bytes, dq, row, nb, xt, cols, 2, out, rows); break;
            case 3: row_tile(values, bytes, dq, row, nb, xt, cols, 3, out, rows); break;
            default: row_tile(values, bytes, dq, row, nb, xt, cols, 4, out, rows); break;
            }
        }
    }
}
#else
static inline __attribute__((always_inline)) void matmul_rows(const int values, const int bytes, const dq_fn dq,
                                                              const uint8_t *w, int64_t r0, int64_t r1,
                                                              int64_t cols, const float *x, int64_t T, float *y,
                                                              int64_t rows) {
    const int64_t nb = cols / values;
    const size_t row_bytes = (size_t)nb * bytes;
    float buf[QKK] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + (size_t)r * row_bytes;
        for (int64_t t0 = 0; t0 < T; t0 += TILE) {
            const int nt = (int)(T - t0 < TILE ? T - t0 : TILE);
            float acc[TILE][LANES] __attribute__((aligned(64)));
            memset(acc, 0, sizeof acc);
            for (int64_t b = 0; b < nb; b++) {
                dq(row + (size_t)b * bytes, buf);
                const int64_t at = b * values;
                for (int t = 0; t < nt; t++) fma_lanes(acc[t], buf, x + (t0 + t) * cols + at, values);
            }
            for (int t = 0; t < nt; t++) y[(t0 + t) * rows + r] = sum_lanes(acc[t]);
        }
    }
}

#endif

static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

#if defined(SIMD512) && !defined(__AVX512BF16__)
/* 16 floats to bfloat16 as to_bf16 rounds them, in integers, where the CPU has no AVX512-BF16 (Ice Lake) */
static inline __m256i to_bf16_16(const float *f) {
    const __m512i u = _mm512_load_si512((const void *)f), one = _mm512_set1_epi32(1);
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x400000)); /* (u >> 16) | 0x40, before the shift */
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_mask_mov_epi32(rounded, nan, quiet), 16));
}
#endif

static inline __attribute__((always_inline)) void dequant_rows(const int values, const int bytes, const dq_fn dq,
                                                               const uint8_t *w, int64_t r0, int64_t r1,
                                                               int64_t cols, void *out, int bf16) {
    const int64_t nb = cols / values;
    const size_t row_bytes = (size_t)nb * bytes;
    float buf[QKK] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + (size_t)r * row_bytes;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t at = r * cols + b * values;
            if (bf16) {
                dq(row + (size_t)b * bytes, buf);
                uint16_t *o = (uint16_t *)out + at;
#if defined(__AVX512BF16__)
                for (int j = 0; j < values; j += 16) /* round to nearest even, as to_bf16 */
                    _mm256_storeu_si256((__m256i *)(o + j), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(buf + j)));
#elif defined(SIMD512)
                for (int j = 0; j < values; j += 16) _mm256_storeu_si256((__m256i *)(o + j), to_bf16_16(buf + j));
#else
                for (int j = 0; j < values; j++) o[j] = to_bf16(buf[j]);
#endif
            } else {
                dq(row + (size_t)b * bytes, (float *)out + at);
            }
        }
    }
}


/* --- the type table: one specialization of each kernel per type, so that its dequantization inlines ---- */

typedef void (*mm_fn)(const uint8_t *, int64_t, int64_t, int64_t, const float *, int64_t, float *, int64_t);
typedef void (*dq_rows_fn)(const uint8_t *, int64_t, int64_t, int64_t, void *, int);

typedef struct {
    int type;
    int values;  /* weights per block */
    int bytes;   /* bytes per block */
    mm_fn matmul;
    dq_rows_fn dequant;
} block_type;

#define KERNELS_FOR(NAME, VALUES, BYTES)                                                                      \
    static void mm_##NAME(const uint8_t *w, int64_t r0, int64_t r1, int64_t cols, const float *x, int64_t T,  \
                          float *y, int64_t rows) {                                                           \
        matmul_rows(VALUES, BYTES, dq_##NAME, w, r0, r1, cols, x, T, y, rows);                                \
    }                                                                                                         \
    static void dqr_##NAME(const uint8_t *w, int64_t r0, int64_t r1, int64_t cols, void *out, int bf16) {     \
        dequant_rows(VALUES, BYTES, dq_##NAME, w, r0, r1, cols, out, bf16);                                   \
    }
/* The float types are cut into "blocks" of 32 values like the rest. */
KERNELS_FOR(f32, QK, 4 * QK)
KERNELS_FOR(f16, QK, 2 * QK)
KERNELS_FOR(bf16, QK, 2 * QK)
KERNELS_FOR(q4_0, QK, 18)
KERNELS_FOR(q4_1, QK, 20)
KERNELS_FOR(q5_0, QK, 22)
KERNELS_FOR(q5_1, QK, 24)
KERNELS_FOR(q8_0, QK, 34)
KERNELS_FOR(q4_k, QKK, 144)
KERNELS_FOR(q5_k, QKK, 176)
KERNELS_FOR(q6_k, QKK, 210)
KERNELS_FOR(q2_k, QKK, 84)
KERNELS_FOR(q3_k, QKK, 110)
KERNELS_FOR(iq4_nl, QK, 18)
KERNELS_FOR(iq4_xs, QKK, 136)
KERNELS_FOR(mxfp4, QK, 17)

#define ENTRY(TYPE, NAME, VALUES, BYTES) {TYPE, VALUES, BYTES, mm_##NAME, dqr_##NAME}
static const block_type TYPES[] = {
    ENTRY(T_F32, f32, QK, 4 * QK),  ENTRY(T_F16, f16, QK, 2 * QK), ENTRY(T_BF16, bf16, QK, 2 * QK),
    ENTRY(T_Q4_0, q4_0, QK, 18),    ENTRY(T_Q4_1, q4_1, QK, 20),   ENTRY(T_Q5_0, q5_0, QK, 22),
    ENTRY(T_Q5_1, q5_1, QK, 24),    ENTRY(T_Q8_0, q8_0, QK, 34),   ENTRY(T_Q4_K, q4_k, QKK, 144),
    ENTRY(T_Q5_K, q5_k, QKK, 176),  ENTRY(T_Q6_K, q6_k, QKK, 210), ENTRY(T_Q2_K, q2_k, QKK, 84),
    ENTRY(T_Q3_K, q3_k, QKK, 110),  ENTRY(T_IQ4_NL, iq4_nl, QK, 18), ENTRY(T_IQ4_XS, iq4_xs, QKK, 136),
    ENTRY(T_MXFP4, mxfp4, QK, 17),
};

static const block_type *find_type(int type) {
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++)
        if (TYPES[i].type == type) return &TYPES[i];
    return NULL;
}

