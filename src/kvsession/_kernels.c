/* The CPU kernels behind kernels.py: GGUF blocks multiplied where they lie, and decode attention
 * read straight from the KV cache's half-precision rows.
 *
 * Decode at batch 1 reads every weight once a token; reading them as the
 * GGUF file stores them (4.5 to 8.5 bits a weight) instead of as dense
 * bfloat16 (16 bits) is most of llama.cpp's lead. These kernels take a
 * tensor's raw blocks (the memory-mapped file itself), dequantize one block
 * at a time into a small float buffer that stays in L1, and multiply it
 * there: no dense copy of any weight ever exists.
 *
 * Every block type dequantizes to exactly the values ggml's
 * dequantize_row_* gives (same formulas, same float operations in the same
 * order); tests/test_kernels.py holds each against gguf.quants.
 *
 * Attention for a few queries (decode) reads the cache's K and V rows as
 * they are stored (float16, bfloat16 or float32, token-major, a ring or
 * not), each row once per group of query heads sharing it, so that no float32
 * copy of the cache is needed.
 *
 * Entry points (all take raw addresses; the caller keeps the arrays alive
 * and checks shapes, kernels.py does):
 *   matmul(type, w, rows, cols, x, T, y, threads)    y[T, rows] = x[T, cols] . W^T, float32
 *   dequant(type, w, rows, cols, out, bf16, threads) W as float32 or bfloat16 [rows, cols]
 *   gather(type, w, cols, ids, n, out)               rows ids[0..n) of W as float32 [n, cols]
 *   attend(...)                                      softmax(q . K^T * scale) . V over cache rows
 *
 * The GIL is released while they run; threads come from the OpenMP runtime
 * PyTorch has already loaded (the same libgomp.so.1), so they share its pool.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* ggml_type numbers */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23,
       T_BF16 = 30, T_MXFP4 = 39 };

#define QK 32
#define QKK 256

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__) || defined(__AVX512F__)
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
#else
    /* IEEE half -> float, subnormals included */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000 | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else { /* subnormal: normalize */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

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

/* Q4_K's eight 6-bit scales (bytes 0-7 of u) and minimums (bytes 8-15), unpacked a word at a time
 * (scale_min_k4 for all j at once) */
static inline void k4_scales(const uint8_t *b, uint32_t u[4]) {
    memcpy(u, b + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t mins_lo = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = mins_lo;
    u[0] &= 0x3f3f3f3f;
}
#endif

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

static inline float e8m0_half(uint8_t e) {  /* ggml_e8m0_to_fp32_half: 2^(e - 128), subnormal below e = 2 */
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

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
#ifdef __AVX512BF16__
                for (int j = 0; j < values; j += 16) /* round to nearest even, as to_bf16 */
                    _mm256_storeu_si256((__m256i *)(o + j), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(buf + j)));
#else
                for (int j = 0; j < values; j++) o[j] = to_bf16(buf[j]);
#endif
            } else {
                dq(row + (size_t)b * bytes, (float *)out + at);
            }
        }
    }
}

/* --- int8 products (AVX512-VNNI, or AVX2): what llama.cpp's vec_dot does --------------------------------
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
#endif
#if defined(VNNI) || defined(AVX2_DOTS)
#define INT8_DOTS

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
#define ALWAYS static inline __attribute__((always_inline))

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
#define ALWAYS static inline __attribute__((always_inline))

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

/* Q8_0: |code| against x with code's sign */
ALWAYS void q8_0_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
#define TERM(acc)                                                                                            \
    const __m256i c = load32(b + 2), mag = _mm256_sign_epi8(c, c);                                          \
    const float d = f16(b);                                                                                 \
    for (int t = 0; t < NT; t++)                                                                            \
        acc[t] = _mm256_fmadd_ps(dp(mag, _mm256_sign_epi8(load32(x[t].q + 32 * i), c)),                     \
                                 _mm256_set1_ps(d * x[t].d[i]), acc[t]);
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
#define LUT_TERM(acc, CODES, D)                                                                              \
    const __m256i c = CODES, mag = _mm256_sign_epi8(c, c);                                                  \
    const float d = D;                                                                                      \
    for (int t = 0; t < NT; t++)                                                                            \
        acc[t] = _mm256_fmadd_ps(dp(mag, _mm256_sign_epi8(load32(x[t].q + 32 * i), c)),                     \
                                 _mm256_set1_ps(d * x[t].d[i]), acc[t]);
ALWAYS void iq4_nl_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
#define TERM(acc) LUT_TERM(acc, codes_lut(b + 2, IQ4_VALUES), f16(b))
    BLOCKS32(18, TERM, 0.0f, 0.0f, hsum(_mm256_add_ps(a0[t], a1[t])))
#undef TERM
}
ALWAYS void mxfp4_n(const uint8_t *b, int64_t nb, const xq_t *x, const int NT, float *out) {
#define TERM(acc) LUT_TERM(acc, codes_lut(b + 1, FP4_VALUES), e8m0_half(b[0]))
    BLOCKS32(17, TERM, 0.0f, 0.0f, hsum(_mm256_add_ps(a0[t], a1[t])))
#undef TERM
}
#undef LUT_TERM
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

/* --- attention over the cache -------------------------------------------- */

/* e^x for x <= 0 (softmax after the max is taken), to about 1 ulp: Cephes' expf, branch-free so that the
 * loops calling it vectorize. Below -87 it returns 0. */
static inline float exp_neg(float x) {
    const float keep = x > -87.0f ? 1.0f : 0.0f;
    x = x > -87.0f ? x : -87.0f;
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    x = x - n * 0.693359375f - n * -2.12194440e-4f;
    const float z = x * x;
    float p = 1.9875691500e-4f;
    p = p * x + 1.3981999507e-3f;
    p = p * x + 8.3334519073e-3f;
    p = p * x + 4.1665795894e-2f;
    p = p * x + 1.6666665459e-1f;
    p = p * x + 5.0000001201e-1f;
    p = p * z + x + 1.0f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &e, 4);
    return p * two_n * keep;
}

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };
#define MAX_HEAD_DIM 256
#define MAX_HEADS 256
#define KEY_CHUNK 128 /* keys per piece of work: the pieces of one query are merged at the end */

static inline void row_to_float(int dtype, const void *row, float *out, int D) {
#ifdef SIMD512
    for (int i = 0; i < D; i += 16) {
        __m512 f;
        if (dtype == KV_F16) f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)));
        else if (dtype == KV_BF16)
            f = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i))), 16));
        else f = _mm512_loadu_ps((const float *)row + i);
        _mm512_store_ps(out + i, f);
    }
#else
    if (dtype == KV_F16) {
        for (int i = 0; i < D; i++) out[i] = f16((const uint8_t *)row + 2 * i);
    } else if (dtype == KV_BF16) {
        const uint16_t *h = (const uint16_t *)row;
        for (int i = 0; i < D; i++) {
            const uint32_t bits = (uint32_t)h[i] << 16;
            memcpy(out + i, &bits, 4);
        }
    } else {
        memcpy(out, row, (size_t)D * sizeof(float));
    }
#endif
}

static inline float dot(const float *restrict a, const float *restrict b, int D) {
#ifdef SIMD512
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= D; i += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_load_ps(a + i), _mm512_loadu_ps(b + i), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_load_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
    }
    if (i < D) acc0 = _mm512_fmadd_ps(_mm512_load_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#else
    float acc[LANES] = {0};
    for (int j = 0; j < D; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[j + l] * b[j + l];
    return sum_lanes(acc);
#endif
}

/* out[i] += w * v[i] */
static inline void axpy(float *restrict out, float w, const float *restrict v, int D) {
#ifdef SIMD512
    const __m512 vw = _mm512_set1_ps(w);
    for (int i = 0; i < D; i += 16)
        _mm512_storeu_ps(out + i, _mm512_fmadd_ps(vw, _mm512_loadu_ps(v + i), _mm512_loadu_ps(out + i)));
#else
    for (int i = 0; i < D; i++) out[i] += w * v[i];
#endif
}

/* One piece: every query head of one query over keys [lo, hi), reading each key's row (all KV heads, contiguous)
 * once. Writes, per query head h, the scores' max m[h], the sum of e^(score - m) l[h], and the unnormalized sum
 * of e^(score - m) * v in o[h * D ..]. scores: H * KEY_CHUNK floats of scratch. */
/* Gemma 2's attention soft-capping: each score becomes c * tanh(score / c) before the softmax (0: none) */
static void cap_scores(float *scores, int H, int64_t S, float softcap) {
    if (softcap <= 0.0f) return;
    for (int h = 0; h < H; h++)
        for (int64_t j = 0; j < S; j++) scores[h * KEY_CHUNK + j] = softcap * tanhf(scores[h * KEY_CHUNK + j] / softcap);
}

static void attend_piece(int dtype, const uint8_t *k, const uint8_t *v, int64_t cap, int ring, int Hk, int D,
                         const float *q, int H, int64_t lo, int64_t hi, float scale, float softcap, float *m, float *l,
                         float *o, float *scores) {
    const int64_t S = hi - lo;
    const int G = H / Hk;
    const size_t esize = dtype == KV_F32 ? 4 : 2, head = (size_t)D * esize, row = Hk * head;
    float rowf[MAX_HEAD_DIM] __attribute__((aligned(64)));
    for (int64_t j = 0; j < S; j++) {
        const int64_t p = lo + j, r = ring ? p % cap : p;
        for (int hk = 0; hk < Hk; hk++) {
            row_to_float(dtype, k + r * row + hk * head, rowf, D);
            for (int g = 0; g < G; g++) {
                const int h = hk * G + g;
                scores[h * KEY_CHUNK + j] = dot(rowf, q + (size_t)h * D, D) * scale;
            }
        }
    }
    cap_scores(scores, H, S, softcap);
    for (int h = 0; h < H; h++) {
        float *sc = scores + h * KEY_CHUNK, mx = sc[0], sum = 0.0f;
        for (int64_t j = 1; j < S; j++) mx = sc[j] > mx ? sc[j] : mx;
        for (int64_t j = 0; j < S; j++) sc[j] = exp_neg(sc[j] - mx);
        for (int64_t j = 0; j < S; j++) sum += sc[j];
        m[h] = mx;
        l[h] = sum;
    }
    memset(o, 0, (size_t)H * D * sizeof(float));
    for (int64_t j = 0; j < S; j++) {
        const int64_t p = lo + j, r = ring ? p % cap : p;
        for (int hk = 0; hk < Hk; hk++) {
            row_to_float(dtype, v + r * row + hk * head, rowf, D);
            for (int g = 0; g < G; g++) {
                const int h = hk * G + g;
                axpy(o + (size_t)h * D, scores[h * KEY_CHUNK + j], rowf, D);
            }
        }
    }
}

/* The register-held kernel below on either vector width: vf is one register of VL floats */
#if defined(SIMD512)
#define VATTEND
typedef __m512 vf;
#define VL 16
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset(float x) { return _mm512_set1_ps(x); }
static inline vf vloadu(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstoreu(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vfnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
static inline vf vfloor(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline vf vpow2i(vf n) {  /* 2^n for whole n in float range */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline vf vzero_unless_gt(vf x, vf y, float lim) {  /* y where x > lim, else 0 */
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lim), _CMP_GT_OQ), y);
}
/* VL numbers of a cache row as floats */
static inline vf vload_kv(int dtype, const uint8_t *p) {
    if (dtype == KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    if (dtype == KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VATTEND
typedef __m256 vf;
#define VL 8
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset(float x) { return _mm256_set1_ps(x); }
static inline vf vloadu(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstoreu(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vfnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline float vsum(vf a) { return hsum(a); }
static inline float vhmax(vf a) { return hmax(a); }
static inline vf vfloor(vf a) { return _mm256_floor_ps(a); }
static inline vf vpow2i(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf vzero_unless_gt(vf x, vf y, float lim) {
    return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(lim), _CMP_GT_OQ), y);
}
static inline vf vload_kv(int dtype, const uint8_t *p) {
    if (dtype == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (dtype == KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps((const float *)p);
}
#endif

#ifdef VATTEND
/* exp_neg on VL numbers */
static inline vf vexp_neg(vf x0) {
    vf x = vmax(x0, vset(-87.0f));
    const vf n = vfloor(vadd(vmul(x, vset(1.44269504088896341f)), vset(0.5f)));
    x = vfnmadd(n, vset(0.693359375f), x);
    x = vfnmadd(n, vset(-2.12194440e-4f), x);
    const vf z = vmul(x, x);
    vf p = vset(1.9875691500e-4f);
    p = vfmadd(p, x, vset(1.3981999507e-3f));
    p = vfmadd(p, x, vset(8.3334519073e-3f));
    p = vfmadd(p, x, vset(4.1665795894e-2f));
    p = vfmadd(p, x, vset(1.6666665459e-1f));
    p = vfmadd(p, x, vset(5.0000001201e-1f));
    p = vadd(vfmadd(p, z, x), vset(1.0f));
    return vzero_unless_gt(x0, vmul(p, vpow2i(n)), -87.0f);
}

/* attend_piece for heads of NV * VL numbers, NV a constant where it is inlined: a key row's heads stay in
 * registers while every query head of its group is scored against it; each output head is summed in
 * registers over the piece's keys (VB vectors at a time), never stored and reloaded per key. */
static inline __attribute__((always_inline)) void attend_piece_nv(
    const int NV, int dtype, const uint8_t *k, const uint8_t *v, int64_t cap, int ring, int Hk, const float *q,
    int H, int64_t lo, int64_t hi, float scale, float softcap, float *m, float *l, float *o, float *scores) {
    enum { VB_MAX = 8 };
    const int D = NV * VL, G = H / Hk, VB = NV < VB_MAX ? NV : VB_MAX;
    const int64_t S = hi - lo;
    const size_t es = dtype == KV_F32 ? 4 : 2, head = (size_t)D * es, row = Hk * head, step = VL * es;
    for (int64_t j = 0; j < S; j++) {
        const int64_t p = lo + j, r = ring ? p % cap : p;
        for (int hk = 0; hk < Hk; hk++) {
            const uint8_t *kr = k + r * row + hk * head;
            vf kv[NV];
            for (int i = 0; i < NV; i++) kv[i] = vload_kv(dtype, kr + i * step);
            for (int g = 0; g < G; g++) {
                const int h = hk * G + g;
                const float *qh = q + (size_t)h * D;
                vf a0 = vmul(kv[0], vloadu(qh)), a1 = vzero();
                for (int i = 1; i < NV; i += 2) {
                    a1 = vfmadd(kv[i], vloadu(qh + VL * i), a1);
                    if (i + 1 < NV) a0 = vfmadd(kv[i + 1], vloadu(qh + VL * (i + 1)), a0);
                }
                scores[h * KEY_CHUNK + j] = vsum(vadd(a0, a1)) * scale;
            }
        }
    }
    cap_scores(scores, H, S, softcap);
    for (int h = 0; h < H; h++) {
        float *sc = scores + h * KEY_CHUNK;
        vf vm = vset(-INFINITY);
        int64_t j = 0;
        for (; j + VL <= S; j += VL) vm = vmax(vm, vloadu(sc + j));
        float mx = vhmax(vm);
        for (; j < S; j++) mx = sc[j] > mx ? sc[j] : mx;
        const vf vmx = vset(mx);
        vf vs = vzero();
        for (j = 0; j + VL <= S; j += VL) {
            const vf e = vexp_neg(vsub(vloadu(sc + j), vmx));
            vstoreu(sc + j, e);
            vs = vadd(vs, e);
        }
        float sum = vsum(vs);
        for (; j < S; j++) sum += sc[j] = exp_neg(sc[j] - mx);
        m[h] = mx;
        l[h] = sum;
    }
    for (int hk = 0; hk < Hk; hk++)
        for (int g = 0; g < G; g++) {
            const int h = hk * G + g;
            const float *sc = scores + h * KEY_CHUNK;
            for (int b0 = 0; b0 < NV; b0 += VB) {
                vf acc[VB_MAX];
                for (int i = 0; i < VB; i++) acc[i] = vzero();
                for (int64_t j = 0; j < S; j++) {
                    const int64_t p = lo + j, r = ring ? p % cap : p;
                    const uint8_t *vr = v + r * row + hk * head + b0 * step;
                    const vf w = vset(sc[j]);
                    for (int i = 0; i < VB; i++) acc[i] = vfmadd(w, vload_kv(dtype, vr + i * step), acc[i]);
                }
                for (int i = 0; i < VB; i++) vstoreu(o + (size_t)h * D + (b0 + i) * VL, acc[i]);
            }
        }
}
#endif

/* attend_piece, through the register-held kernel where the head size has one */
static void attend_piece_any(int dtype, const uint8_t *k, const uint8_t *v, int64_t cap, int ring, int Hk, int D,
                             const float *q, int H, int64_t lo, int64_t hi, float scale, float softcap, float *m,
                             float *l, float *o, float *scores) {
#ifdef VATTEND
    switch (D) {
    case 64: attend_piece_nv(64 / VL, dtype, k, v, cap, ring, Hk, q, H, lo, hi, scale, softcap, m, l, o, scores); return;
    case 128: attend_piece_nv(128 / VL, dtype, k, v, cap, ring, Hk, q, H, lo, hi, scale, softcap, m, l, o, scores); return;
    case 256: attend_piece_nv(256 / VL, dtype, k, v, cap, ring, Hk, q, H, lo, hi, scale, softcap, m, l, o, scores); return;
    }
#endif
    attend_piece(dtype, k, v, cap, ring, Hk, D, q, H, lo, hi, scale, softcap, m, l, o, scores);
}

/* softmax(q . K^T * scale) . V for T queries at positions pos0.. over the cache's rows; sinks (NULL: none): a
 * logit of each head's that joins its softmax and adds no value (gpt-oss). 0 when out of memory */
static int attend_mt(int dtype, const uint8_t *k, const uint8_t *v, int64_t cap, int ring, int Hk, int D,
                     const float *q, int64_t T, int H, int64_t pos0, int64_t key_lo, int64_t window, float scale,
                     float softcap, const float *sinks, float *out, int threads) {
    const size_t stride = (size_t)H * (D + 2);
    /* pieces: (query t, chunk of keys); a query's chunks start at its first visible key. The cut depends on
     * positions only, never on the thread count: the same cache gives the same bits. */
    const int64_t most = pos0 + T - key_lo, chunks = (most + KEY_CHUNK - 1) / KEY_CHUNK, pieces = T * chunks;
    float *part = malloc((size_t)pieces * stride * sizeof(float));
    if (!part) return 0;
    int failed = 0;
    const int nt = threads < pieces ? threads : (int)pieces;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        float *scores = malloc((size_t)H * KEY_CHUNK * sizeof(float));
        failed = !scores;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < pieces; i++) {
            const int64_t t = i / chunks, c = i % chunks, p = pos0 + t;
            int64_t first = window > 0 ? p - window + 1 : 0;
            first = first > key_lo ? first : key_lo;
            const int64_t lo = first + c * KEY_CHUNK, hi = lo + KEY_CHUNK < p + 1 ? lo + KEY_CHUNK : p + 1;
            float *m = part + (size_t)i * stride, *l = m + H, *o = l + H;
            if (lo >= hi || !scores) { /* this query sees fewer keys than the last one: an empty piece */
                for (int h = 0; h < H; h++) m[h] = -INFINITY, l[h] = 0.0f;
                continue;
            }
            attend_piece_any(dtype, k, v, cap, ring, Hk, D, q + (size_t)t * H * D, H, lo, hi, scale, softcap, m, l, o,
                             scores);
        }
        free(scores);
        /* merge each query head's pieces: rescaled to the overall max, summed, normalized */
#pragma omp for schedule(static)
        for (int64_t th = 0; th < T * H; th++) {
            const int64_t t = th / H, h = th % H;
            float mx = sinks ? sinks[h] : -INFINITY, sum = 0.0f;
            for (int64_t c = 0; c < chunks; c++) {
                const float mc = part[(size_t)(t * chunks + c) * stride + h];
                mx = mc > mx ? mc : mx;
            }
            float *dst = out + ((size_t)t * H + h) * D;
            memset(dst, 0, (size_t)D * sizeof(float));
            for (int64_t c = 0; c < chunks; c++) {
                const float *m = part + (size_t)(t * chunks + c) * stride, *l = m + H, *o = l + H;
                if (l[h] == 0.0f) continue;
                const float w = m[h] == mx ? 1.0f : expf(m[h] - mx);
                sum += w * l[h];
                axpy(dst, w, o + (size_t)h * D, D);
            }
            if (sinks) sum += expf(sinks[h] - mx);
            const float inv = 1.0f / sum;
            for (int i = 0; i < D; i++) dst[i] *= inv;
        }
    }
    free(part);
    return !failed;
}

/* --- Python --------------------------------------------------------------- */

static int check_shape(const block_type *bt, int64_t rows, int64_t cols) {
    if (rows < 0 || cols <= 0 || cols % bt->values) {
        PyErr_Format(PyExc_ValueError, "%lld x %lld is not a whole number of %d-value blocks",
                     (long long)rows, (long long)cols, bt->values);
        return 0;
    }
    return 1;
}

static const block_type *type_arg(int type) {
    const block_type *bt = find_type(type);
    if (!bt) PyErr_Format(PyExc_ValueError, "no kernel for GGML type %d", type);
    return bt;
}

/* Threads: at most `threads`, and no more than one per `grain` rows, so that a small matrix is not cut
 * into pieces that cost more to hand out than to multiply. */
static int team(int threads, int64_t rows, int64_t grain) {
    int64_t most = rows / grain;
    if (most < 1) most = 1;
    return (int)(threads < most ? threads : most);
}

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

#ifdef INT8_DOTS
/* --- prefill's int8 GEMM (AVX512-VNNI, or AVX2) ---------------------------------------------------------
 *
 * Many tokens at once: the bfloat16 GEMM of dequantized slabs runs at an AVX512-BF16 CPU's bfloat16 peak (32
 * products a cycle a core), where vpdpbusd makes 64. Each thread takes 16 rows at a time and repacks their blocks in L2:
 * the unsigned codes, 4 consecutive values of each row a lane ([cols / 4][16 rows][4]), and every sub-block's
 * scale (and minimum) a row a lane, as floats. Every tile of GEMM_NT tokens is then multiplied against them:
 * a token's 4 codes broadcast to the 16 lanes, one vpdpbusd for 64 products, an int32 sum a sub-block, scaled
 * per row. The activations are rounded to 8 bits with one scale a 32 values for every type, as llama.cpp's
 * Q8_0 and Q8_1; for the K-quants llama.cpp's Q8_K has one a 256, cheaper (the scaling once a 256) but coarser:
 * Gemma 3's teacher-forced agreement with llama.cpp reads 90.1% with it, 92.9% with 32, 91.9% with the bfloat16
 * GEMM this replaces (tests/test_gemma.py; its floor, llama.cpp against itself, is 91%). A weight is
 * s * (code + off) + m: the offsets come into the int32 sum from the activations' code sums, the minimums
 * through their rounded sums.
 *
 * Q8_0, Q5_0, Q4_K and Q6_K. Not Q4_1 (SmolLM2): in int8 its teacher-forced agreement read 95.2% against a
 * floor of 95% (bfloat16 GEMM: 95.6%), one or two positions from failing on another CPU, and SmolLM2's prefill
 * is 2.9x-3.5x llama.cpp's without it.
 *
 * On AVX2 (no vpdpbusd) the same layout goes through vpmaddubsw, whose s16 pair sums saturate: a type adds as
 * many of them in s16 as its codes allow (Q4_K's 4-bit codes: a whole 32-value sub-block; Q5_0's 5-bit: 16
 * values; Q6_K's 6-bit: 8) before vpmaddwd widens them to s32. Q8_0's codes stay signed there, and go in as
 * llama.cpp's AVX2 kernels take them: their magnitudes against the activations with the codes' signs, each
 * pair sum widened at once. The sums are exact: the outputs are the VNNI build's to float rounding. */
#define GEMM_ROWS 16
#define GEMM_NT 8
#define GEMM_ROUND QK /* activation values a scale */

/* nt tokens' outputs for 16 rows (n of them real), y[t * ldy + r]: codes, scales and minimums as gemm_repack
 * lays them out, the tile's activations as gemm_quantize does */
typedef void gemm_tiles_fn(int nt, const uint8_t *codes, const float *s, const float *m, const int32_t *xq,
                           const float *da, const int32_t *ioff, const float *xs, int64_t cols, float *y,
                           int64_t ldy, int n);

typedef struct {
    int type; /* its blocks' size: the type table's */
    int sub;  /* values a scale */
    int off;  /* code offset */
    int mins; /* whether there are minimums */
    void (*unpack)(const uint8_t *b, uint8_t *codes, float *s, float *m); /* one block: its codes, scales, minimums */
    gemm_tiles_fn *tiles;
} gemm_type;

#ifdef VNNI
static void unpack_q8_0(const uint8_t *b, uint8_t *codes, float *s, float *m) {
    _mm256_storeu_si256((__m256i *)codes, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)),
                                                           _mm256_set1_epi8((char)0x80)));
    s[0] = f16(b);
}
#else
static void unpack_q8_0(const uint8_t *b, uint8_t *codes, float *s, float *m) { /* signed, for gemm_pair */
    memcpy(codes, b + 2, QK);
    s[0] = f16(b);
}
#endif

static void unpack_q5_0(const uint8_t *b, uint8_t *codes, float *s, float *m) {
    _mm256_storeu_si256((__m256i *)codes, codes_q5_0(b));
    s[0] = f16(b);
}

static void unpack_q4_k(const uint8_t *b, uint8_t *codes, float *s, float *m) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    uint32_t u[4];
    k4_scales(b, u);
    const uint8_t *sc = (const uint8_t *)u, *mn = sc + 8;
    const float d = f16(b), dmin = f16(b + 2);
    for (int j = 0; j < 8; j += 2) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 16 * j));
        _mm256_storeu_si256((__m256i *)(codes + 32 * j), _mm256_and_si256(q, m4));
        _mm256_storeu_si256((__m256i *)(codes + 32 * j + 32), _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
    }
    for (int j = 0; j < 8; j++) {
        s[j] = d * sc[j];
        m[j] = -(dmin * mn[j]);
    }
}

static void unpack_q6_k(const uint8_t *b, uint8_t *codes, float *s, float *m) {
    for (int n = 0; n < 2; n++) {
        __m256i v[4];
        q6_codes(b + 64 * n, b + 128 + 32 * n, v);
        for (int i = 0; i < 4; i++) _mm256_storeu_si256((__m256i *)(codes + 128 * n + 32 * i), v[i]);
    }
    const float d = f16(b + 208);
    for (int g = 0; g < 16; g++) s[g] = d * (int8_t)b[192 + g];
}

/* one token rounded, into its lane of a tile of GEMM_NT tokens (every array's stride GEMM_NT, so that a tile's
 * kernel reads all its tokens from one pointer): codes q [cols / 4] words, scales da [cols / 32], and each
 * sub-block's code sum times off (ioff) and times its scale (xs) [cols / sub] */
static void gemm_quantize(const float *x, int64_t cols, int sub, int off, int32_t *q, float *da, int32_t *ioff,
                          float *xs) {
    for (int64_t b = 0; b < cols / GEMM_ROUND; b++) {
        _Alignas(32) int32_t c[8];
        int sums[2];
#ifdef VNNI
        __m128i p[2];
        const float d = round32_512(x + GEMM_ROUND * b, p, sums);
        _mm_store_si128((__m128i *)c, p[0]);
        _mm_store_si128((__m128i *)(c + 4), p[1]);
#else
        const float d = round32_256(x + GEMM_ROUND * b, (int8_t *)c, sums);
#endif
        da[b * GEMM_NT] = d;
        for (int k = 0; k < 8; k++) q[(8 * b + k) * GEMM_NT] = c[k];
        if (sub == 16)
            for (int h = 0; h < 2; h++) {
                ioff[(2 * b + h) * GEMM_NT] = off * sums[h];
                xs[(2 * b + h) * GEMM_NT] = d * (float)sums[h];
            }
        else {
            ioff[b * GEMM_NT] = off * (sums[0] + sums[1]);
            xs[b * GEMM_NT] = d * (float)(sums[0] + sums[1]);
        }
    }
}

#ifdef VNNI
/* a 16 x 16 matrix of 32-bit words, row i in r[i], transposed in place: r[j] then holds word j of every row */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) { /* lane L: rows i, i + 1 interleaved, words 4L, 4L + 1 (lo) or + 2, + 3 (hi) */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    __m512i u[16];
    for (int g = 0; g < 16; g += 4) { /* u[g + c], lane L: word 4L + c of rows g .. g + 3 */
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int c = 0; c < 4; c++) { /* the 4 x 4 lanes of u[c], u[4 + c], u[8 + c], u[12 + c], transposed */
        const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        const __m512i x2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        const __m512i x3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(x0, x2, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(x1, x3, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
    }
}
#else
/* an 8 x 8 matrix of 32-bit words, row i in r[i], transposed in place: r[j] then holds word j of every row */
static inline void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) { /* each half: rows i, i + 1 interleaved, words 0, 1 (lo) or 2, 3 (hi), + 4 */
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int g = 0; g < 8; g += 4) { /* u[g + c]: word c of rows g .. g + 3, then word 4 + c */
        u[g] = _mm256_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm256_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm256_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm256_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
        r[4 + c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
    }
}
#endif

/* 16 rows (n of them real) of a GGUF tensor repacked for the tile functions (gemm_tiles_fn): codes
 * [cols / 4][16][4], scales and minimums [cols / sub][16]. 256 codes of each row are unpacked side by side, then
 * turned 64 at a time. */
static void gemm_repack(const block_type *bt, const gemm_type *gt, const uint8_t *w, int64_t n, int64_t cols,
                        uint8_t *codes, float *s, float *m) {
    const int64_t nb = cols / bt->values, row_bytes = nb * bt->bytes, spb = bt->values / gt->sub;
    const int64_t bps = QKK / bt->values; /* blocks a stage */
    _Alignas(64) uint8_t stage[GEMM_ROWS][QKK];
    float bs[16], bm[16];
    if (n < GEMM_ROWS) {
        memset(s, 0, sizeof(float) * (cols / gt->sub) * GEMM_ROWS);
        memset(m, 0, sizeof(float) * (cols / gt->sub) * GEMM_ROWS);
    }
    for (int64_t b0 = 0; b0 < nb; b0 += bps) {
        const int64_t nbs = nb - b0 < bps ? nb - b0 : bps, width = nbs * bt->values;
        for (int64_t r = 0; r < GEMM_ROWS; r++) {
            if (r >= n) {
                memset(stage[r], 0, QKK);
                continue;
            }
            for (int64_t b = 0; b < nbs; b++) {
                gt->unpack(w + r * row_bytes + (b0 + b) * bt->bytes, stage[r] + b * bt->values, bs, bm);
                for (int64_t j = 0; j < spb; j++) {
                    s[((b0 + b) * spb + j) * GEMM_ROWS + r] = bs[j];
                    if (gt->mins) m[((b0 + b) * spb + j) * GEMM_ROWS + r] = bm[j];
                }
            }
            if (width % 64) memset(stage[r] + width, 0, 64 - width % 64);
        }
        for (int64_t c = 0; c < width; c += 64) {
            const int64_t k0 = (b0 * bt->values + c) / 4, nk = width - c >= 64 ? 16 : (width - c) / 4;
#ifdef VNNI
            __m512i v[GEMM_ROWS];
            for (int r = 0; r < GEMM_ROWS; r++) v[r] = _mm512_load_si512((const void *)(stage[r] + c));
            transpose16(v);
            for (int64_t k = 0; k < nk; k++) _mm512_store_si512((void *)(codes + (k0 + k) * 64), v[k]);
#else
            for (int h = 0; h < 2; h++)     /* words 8h .. 8h + 7 */
                for (int g = 0; g < 2; g++) { /* of rows 8g .. 8g + 7 */
                    __m256i v[8];
                    for (int r = 0; r < 8; r++)
                        v[r] = _mm256_load_si256((const __m256i *)(stage[8 * g + r] + c + 32 * h));
                    transpose8(v);
                    for (int64_t k = 0; k < 8 && 8 * h + k < nk; k++)
                        _mm256_store_si256((__m256i *)(codes + (k0 + 8 * h + k) * 64 + 32 * g), v[k]);
                }
#endif
        }
    }
}

#ifdef VNNI
/* gemm_tiles_fn's work for nt tokens (GEMM_NT at most) at once, a 16-lane register a token */
static inline __attribute__((always_inline)) void gemm_tile(const int nt, const int sub, const int mins,
                                                            const uint8_t *codes, const float *s, const float *m,
                                                            const int32_t *xq, const float *da, const int32_t *ioff,
                                                            const float *xs, int64_t cols, float *y, int64_t ldy,
                                                            int n) {
    __m512 acc[GEMM_NT], blk[GEMM_NT];
    __m512i ia[GEMM_NT];
    const int64_t nsub = cols / sub;
    const int per = GEMM_ROUND / sub;
    for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t j0 = 0, rb = 0; j0 < nsub; j0 += per, rb++) {
        for (int t = 0; t < nt; t++) blk[t] = _mm512_setzero_ps();
        for (int64_t j = j0; j < j0 + per; j++) {
            for (int t = 0; t < nt; t++) ia[t] = _mm512_set1_epi32(ioff[j * GEMM_NT + t]);
            const uint8_t *c = codes + j * sub * GEMM_ROWS;
            const int32_t *xj = xq + j * (sub / 4) * GEMM_NT;
            for (int k = 0; k < sub / 4; k++) {
                const __m512i wv = _mm512_load_si512((const void *)(c + 64 * k));
                for (int t = 0; t < nt; t++)
                    ia[t] = _mm512_dpbusd_epi32(ia[t], wv, _mm512_set1_epi32(xj[k * GEMM_NT + t]));
            }
            const __m512 sv = _mm512_load_ps(s + GEMM_ROWS * j);
            for (int t = 0; t < nt; t++) blk[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[t]), sv, blk[t]);
            if (mins) {
                const __m512 mv = _mm512_load_ps(m + GEMM_ROWS * j);
                for (int t = 0; t < nt; t++)
                    acc[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[j * GEMM_NT + t]), acc[t]);
            }
        }
        for (int t = 0; t < nt; t++) acc[t] = _mm512_fmadd_ps(blk[t], _mm512_set1_ps(da[rb * GEMM_NT + t]), acc[t]);
    }
    const __mmask16 mask = (__mmask16)((1u << n) - 1);
    for (int t = 0; t < nt; t++) _mm512_mask_storeu_ps(y + t * ldy, mask, acc[t]);
}

#define GEMM_TILES(SUB, MINS)                                                                                  \
    static void gemm_tiles_##SUB##_##MINS(int nt, const uint8_t *codes, const float *s, const float *m,        \
                                          const int32_t *xq, const float *da, const int32_t *ioff,             \
                                          const float *xs, int64_t cols, float *y, int64_t ldy, int n) {       \
        switch (nt) {                                                                                          \
        case 8: gemm_tile(8, SUB, MINS, codes, s, m, xq, da, ioff, xs, cols, y, ldy, n); break;                \
        case 7: gemm_tile(7, SUB, MINS, codes, s, m, xq, da, ioff, xs, cols, y, ldy, n); break;                \
        case 6: gemm_tile(6, SUB, MINS, codes, s, m, xq, da, ioff, xs, cols, y, ldy, n); break;                \
        case 5: gemm_tile(5, SUB, MINS, codes, s, m, xq, da, ioff, xs, cols, y, ldy, n); break;                \
        case 4: gemm_tile(4, SUB, MINS, codes, s, m, xq, da, ioff, xs, cols, y, ldy, n); break;                \
        case 3: gemm_tile(3, SUB, MINS, codes, s, m, xq, da, ioff, xs, cols, y, ldy, n); break;                \
        case 2: gemm_tile(2, SUB, MINS, codes, s, m, xq, da, ioff, xs, cols, y, ldy, n); break;                \
        default: gemm_tile(1, SUB, MINS, codes, s, m, xq, da, ioff, xs, cols, y, ldy, n); break;               \
        }                                                                                                      \
    }
GEMM_TILES(32, 0)
GEMM_TILES(32, 1)
GEMM_TILES(16, 0)
#undef GEMM_TILES
#else
/* gemm_tiles_fn's work for np (1 or 2) tokens, on AVX2, 16 rows in two registers of 8: `group` 4-value steps
 * summed in s16 (vpmaddubsw's pairs), widened to s32 by vpmaddwd, a sub-block's sum scaled in float. group 0:
 * signed 8-bit codes, each step widened at once (|w| * (a with w's sign): a pair sum at most 2 * 128 * 127) */
static inline __attribute__((always_inline)) void gemm_pair(const int np, const int sub, const int mins,
                                                            const int group, const uint8_t *codes, const float *s,
                                                            const float *m, const int32_t *xq, const float *da,
                                                            const int32_t *ioff, const float *xs, int64_t cols,
                                                            float *y, int64_t ldy, int n) {
    __m256 acc[2][2];
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t nsub = cols / sub;
    for (int t = 0; t < np; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nsub; j++) {
        __m256i i32[2][2];
        for (int t = 0; t < np; t++) i32[t][0] = i32[t][1] = _mm256_set1_epi32(ioff[j * GEMM_NT + t]);
        const uint8_t *c = codes + j * sub * GEMM_ROWS;
        const int32_t *xj = xq + j * (sub / 4) * GEMM_NT;
        if (!group)
            for (int k = 0; k < sub / 4; k++) {
                const __m256i w0 = _mm256_load_si256((const __m256i *)(c + 64 * k));
                const __m256i w1 = _mm256_load_si256((const __m256i *)(c + 64 * k + 32));
                const __m256i u0 = _mm256_sign_epi8(w0, w0), u1 = _mm256_sign_epi8(w1, w1);
                for (int t = 0; t < np; t++) {
                    const __m256i a = _mm256_set1_epi32(xj[k * GEMM_NT + t]);
                    const __m256i p0 = _mm256_maddubs_epi16(u0, _mm256_sign_epi8(a, w0));
                    const __m256i p1 = _mm256_maddubs_epi16(u1, _mm256_sign_epi8(a, w1));
                    i32[t][0] = _mm256_add_epi32(i32[t][0], _mm256_madd_epi16(p0, ones));
                    i32[t][1] = _mm256_add_epi32(i32[t][1], _mm256_madd_epi16(p1, ones));
                }
            }
        for (int g0 = 0; group && g0 < sub / 4; g0 += group) {
            __m256i a16[2][2];
            for (int t = 0; t < np; t++) a16[t][0] = a16[t][1] = _mm256_setzero_si256();
            for (int k = g0; k < g0 + group; k++) {
                const __m256i w0 = _mm256_load_si256((const __m256i *)(c + 64 * k));
                const __m256i w1 = _mm256_load_si256((const __m256i *)(c + 64 * k + 32));
                for (int t = 0; t < np; t++) {
                    const __m256i a = _mm256_set1_epi32(xj[k * GEMM_NT + t]);
                    a16[t][0] = _mm256_add_epi16(a16[t][0], _mm256_maddubs_epi16(w0, a));
                    a16[t][1] = _mm256_add_epi16(a16[t][1], _mm256_maddubs_epi16(w1, a));
                }
            }
            for (int t = 0; t < np; t++)
                for (int h = 0; h < 2; h++)
                    i32[t][h] = _mm256_add_epi32(i32[t][h], _mm256_madd_epi16(a16[t][h], ones));
        }
        for (int h = 0; h < 2; h++) {
            const __m256 sv = _mm256_load_ps(s + GEMM_ROWS * j + 8 * h);
            for (int t = 0; t < np; t++) {
                const __m256 d = _mm256_set1_ps(da[(j * sub / GEMM_ROUND) * GEMM_NT + t]);
                acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[t][h]), _mm256_mul_ps(sv, d), acc[t][h]);
            }
            if (mins) {
                const __m256 mv = _mm256_load_ps(m + GEMM_ROWS * j + 8 * h);
                for (int t = 0; t < np; t++)
                    acc[t][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[j * GEMM_NT + t]), acc[t][h]);
            }
        }
    }
    for (int t = 0; t < np; t++) {
        _Alignas(32) float o[GEMM_ROWS];
        _mm256_store_ps(o, acc[t][0]);
        _mm256_store_ps(o + 8, acc[t][1]);
        memcpy(y + t * ldy, o, sizeof(float) * n);
    }
}

#define GEMM_TILES(NAME, SUB, MINS, GROUP)                                                                     \
    static void gemm_tiles_##NAME(int nt, const uint8_t *codes, const float *s, const float *m,                \
                                  const int32_t *xq, const float *da, const int32_t *ioff, const float *xs,    \
                                  int64_t cols, float *y, int64_t ldy, int n) {                                \
        int t = 0;                                                                                             \
        for (; t + 2 <= nt; t += 2)                                                                            \
            gemm_pair(2, SUB, MINS, GROUP, codes, s, m, xq + t, da + t, ioff + t, xs + t, cols, y + t * ldy,   \
                      ldy, n);                                                                                 \
        if (t < nt)                                                                                            \
            gemm_pair(1, SUB, MINS, GROUP, codes, s, m, xq + t, da + t, ioff + t, xs + t, cols, y + t * ldy,   \
                      ldy, n);                                                                                 \
    }
/* 4-value steps added in s16 (each pair sum at most 2 * 127 * the largest code): 4-bit codes (Q4_K) 8, 5-bit
 * (Q5_0) 4, 6-bit (Q6_K) 2 */
GEMM_TILES(32_1, 32, 1, 8)
GEMM_TILES(32_0, 32, 0, 4)
GEMM_TILES(16_0, 16, 0, 2)
GEMM_TILES(q8, 32, 0, 0)
#undef GEMM_TILES
#endif

static const gemm_type GEMM_TYPES[] = {
#ifdef VNNI
    {T_Q8_0, 32, -128, 0, unpack_q8_0, gemm_tiles_32_0},
#else
    {T_Q8_0, 32, 0, 0, unpack_q8_0, gemm_tiles_q8},
#endif
    {T_Q5_0, 32, -16, 0, unpack_q5_0, gemm_tiles_32_0},
    {T_Q4_K, 32, 0, 1, unpack_q4_k, gemm_tiles_32_1},
    {T_Q6_K, 16, -32, 0, unpack_q6_k, gemm_tiles_16_0},
};

static const gemm_type *find_gemm(int type) {
    for (size_t i = 0; i < sizeof GEMM_TYPES / sizeof GEMM_TYPES[0]; i++)
        if (GEMM_TYPES[i].type == type) return &GEMM_TYPES[i];
    return NULL;
}

/* y[t * ldy + r] = x[t * ldx ...] . W[r] for T tokens on `threads` threads, each a contiguous run of 16-row groups;
 * returns 0 where memory ran out */
static int gemm_i8(const block_type *bt, const gemm_type *gt, const uint8_t *w, int64_t rows, int64_t cols,
                   const float *x, int64_t ldx, int64_t T, float *y, int64_t ldy, int threads) {
    if (T == 0) return 1;
    const int64_t nsub = cols / gt->sub, nr = cols / GEMM_ROUND, row_bytes = cols / bt->values * bt->bytes;
    const int64_t tiles = (T + GEMM_NT - 1) / GEMM_NT, lanes = tiles * GEMM_NT;
    int32_t *xq = malloc(sizeof(int32_t) * lanes * (cols / 4)), *ioff = malloc(sizeof(int32_t) * lanes * nsub);
    float *da = malloc(sizeof(float) * lanes * nr), *xs = malloc(sizeof(float) * lanes * nsub);
    int ok = xq && da && xs && ioff;
    if (ok) {
#pragma omp parallel for num_threads(team(threads, T, 4)) schedule(static)
        for (int64_t t = 0; t < T; t++) {
            const int64_t tile = t / GEMM_NT, lane = t % GEMM_NT;
            gemm_quantize(x + t * ldx, cols, gt->sub, gt->off, xq + tile * GEMM_NT * (cols / 4) + lane,
                          da + tile * GEMM_NT * nr + lane, ioff + tile * GEMM_NT * nsub + lane,
                          xs + tile * GEMM_NT * nsub + lane);
        }
        const int64_t groups = (rows + GEMM_ROWS - 1) / GEMM_ROWS;
#pragma omp parallel num_threads(team(threads, rows, 64))
        {
            uint8_t *codes = aligned_alloc(64, (size_t)cols * GEMM_ROWS);
            float *s = aligned_alloc(64, sizeof(float) * nsub * GEMM_ROWS);
            float *m = aligned_alloc(64, sizeof(float) * nsub * GEMM_ROWS);
            const int mine = codes && s && m;
            if (!mine) {
#pragma omp atomic write
                ok = 0;
            }
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                if (!mine) continue;
                const int64_t r0 = g * GEMM_ROWS, n = rows - r0 < GEMM_ROWS ? rows - r0 : GEMM_ROWS;
                gemm_repack(bt, gt, w + r0 * row_bytes, n, cols, codes, s, m);
                for (int64_t i = 0; i < tiles; i++) {
                    const int64_t t0 = i * GEMM_NT;
                    gt->tiles(T - t0 < GEMM_NT ? (int)(T - t0) : GEMM_NT, codes, s, m, xq + t0 * (cols / 4),
                              da + t0 * nr, ioff + t0 * nsub, xs + t0 * nsub, cols, y + t0 * ldy + r0, ldy, (int)n);
                }
            }
            free(codes);
            free(s);
            free(m);
        }
    }
    free(xq);
    free(da);
    free(xs);
    free(ioff);
    return ok;
}
#endif

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    int type, threads;
    Py_ssize_t w, x, y;
    long long rows, cols, T;
    if (!PyArg_ParseTuple(args, "inLLnLni", &type, &w, &rows, &cols, &x, &T, &y, &threads)) return NULL;
    const block_type *bt = type_arg(type);
    if (!bt || !check_shape(bt, rows, cols)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    matmul_mt(bt, (const uint8_t *)w, rows, cols, (const float *)x, T, (float *)y, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* gemm(type, w, rows, cols, x, ldx, T, y, ldy, threads): y[t * ldy + r] = x[t * ldx ...] . W[r], the int8 GEMM
 * (VNNI builds) */
static PyObject *py_gemm(PyObject *self, PyObject *args) {
    int type, threads;
    Py_ssize_t w, x, y;
    long long rows, cols, ldx, T, ldy;
    if (!PyArg_ParseTuple(args, "inLLnLLnLi", &type, &w, &rows, &cols, &x, &ldx, &T, &y, &ldy, &threads)) return NULL;
    const block_type *bt = type_arg(type);
    if (!bt || !check_shape(bt, rows, cols)) return NULL;
#ifdef INT8_DOTS
    const gemm_type *gt = find_gemm(type);
#else
    const void *gt = NULL;
#endif
    if (!gt || T < 0 || ldx < cols || ldy < rows) {
        PyErr_Format(PyExc_ValueError, "gemm: no int8 GEMM for type %d here, or a bad shape", type);
        return NULL;
    }
    int ok = 1;
#ifdef INT8_DOTS
    Py_BEGIN_ALLOW_THREADS
    ok = gemm_i8(bt, gt, (const uint8_t *)w, rows, cols, (const float *)x, ldx, T, (float *)y, ldy, threads);
    Py_END_ALLOW_THREADS
#endif
    if (!ok) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static int attend_args_ok(int dtype, int Hk, int H, int D, long long T, long long cap, long long key_lo,
                          long long pos0) {
    if (Hk <= 0 || H % Hk || H > MAX_HEADS || D <= 0 || D > MAX_HEAD_DIM || D % 16 || T <= 0 || cap <= 0 ||
        key_lo < 0 || key_lo > pos0 || (dtype != KV_F32 && dtype != KV_F16 && dtype != KV_BF16)) {
        PyErr_SetString(PyExc_ValueError, "attend: bad shape");
        return 0;
    }
    return 1;
}

static PyObject *py_attend(PyObject *self, PyObject *args) {
    int dtype, ring, Hk, D, H, threads, ok;
    Py_ssize_t k, v, q, sinks, out;
    long long cap, T, pos0, key_lo, window;
    float scale, softcap;
    if (!PyArg_ParseTuple(args, "innLpiinLiLLLffnni", &dtype, &k, &v, &cap, &ring, &Hk, &D, &q, &T, &H, &pos0,
                          &key_lo, &window, &scale, &softcap, &sinks, &out, &threads))
        return NULL;
    if (!attend_args_ok(dtype, Hk, H, D, T, cap, key_lo, pos0)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ok = attend_mt(dtype, (const uint8_t *)k, (const uint8_t *)v, cap, ring, Hk, D, (const float *)q, T, H, pos0,
                   key_lo, window, scale, softcap, (const float *)sinks, (float *)out, threads);
    Py_END_ALLOW_THREADS
    if (!ok) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* --- a stack of layers for a few tokens (decode) ---------------------------- */
/*
 * One call runs T tokens through every layer: norms, projections, RoPE, the
 * cache's new rows, attention, the feed-forward, the residual stream. What
 * model.py's Block does with some thirty PyTorch operations a layer, each a
 * few microseconds of dispatch that a 135M model's decode step cannot afford,
 * done here in one pass with the same arithmetic (float32, ggml's GELU on
 * float16-rounded inputs). The weights are the same blocks, the cache the
 * same rows: model.py describes both once (kernels.Stack) and calls this
 * only where every weight has a kernel.
 */

typedef struct {
    const block_type *bt;
    const uint8_t *w;
    int64_t rows, cols;
    const float *bias; /* [rows] or NULL */
} mat_t;

typedef struct {
    mat_t q, k, v, o, gate, up, down;
    const float *attn_norm, *ffn_norm, *q_norm, *k_norm, *post_attn_norm, *post_ffn_norm; /* NULL: none */
    int64_t window; /* 0: full attention */
    int rope;       /* which of the two RoPE tables */
} layer_t;

typedef struct {
    int n_layers, d_model, H, Hk, D, d_ff;
    int gelu;       /* 0: SiLU, 1: ggml's GELU (tanh) */
    int neox;       /* RoPE pairs (i, i + dim/2) instead of (2i, 2i + 1) */
    int rope_dim;   /* leading dimensions of a head that rotate */
    float eps, scale;
    float residual; /* 0: none; else attention's and the FFN's outputs times this before the residual add */
    float softcap;  /* 0: none; else each attention score is softcap * tanh(score / softcap) (Gemma 2) */
    layer_t layers[];
} stack_t;

static const char *STACK = "kvsession._kernels.stack";

static void stack_free(PyObject *capsule) { free(PyCapsule_GetPointer(capsule, STACK)); }

static void rms_norm(const float *x, const float *w, float *out, int64_t n, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

static void add_bias(float *y, const float *bias, int64_t T, int64_t n) {
    if (!bias) return;
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < n; i++) y[t * n + i] += bias[i];
}

static void project(const mat_t *m, const float *x, int64_t T, float *y, int threads) {
    matmul_mt(m->bt, m->w, m->rows, m->cols, x, T, y, threads);
    add_bias(y, m->bias, T, m->rows);
}

/* heads [n, D] of one token at position p, their first rope_dim dimensions rotated */
static void rope(float *x, int n, int D, int rope_dim, int neox, const float *cos, const float *sin) {
    const int half = rope_dim / 2;
    for (int h = 0; h < n; h++) {
        float *xh = x + (size_t)h * D;
        for (int i = 0; i < half; i++) {
            const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
            const float x0 = xh[a], x1 = xh[b];
            xh[a] = x0 * cos[i] - x1 * sin[i];
            xh[b] = x0 * sin[i] + x1 * cos[i];
        }
    }
}

static inline float to_f16_and_back(float x) { return (float)(_Float16)x; }

/* ggml's CPU GELU (GGML_GELU_FP16): the tanh form of every float16 value, rounded to float16, looked up by the
 * input rounded to float16; exact past +-10. The table is filled when the module loads. */
static float GELU[65536];

static void gelu_init(void) {
    for (int i = 0; i < 65536; i++) {
        const uint16_t bits = (uint16_t)i;
        _Float16 h;
        memcpy(&h, &bits, 2);
        const float xh = (float)h; /* ggml_gelu_f32, as ggml writes it */
        GELU[i] = to_f16_and_back(0.5f * xh * (1.0f + tanhf(0.79788456080286535587989211986876f * xh *
                                                             (1.0f + 0.044715f * xh * xh))));
    }
}

static inline float gelu(float x) {
    if (x <= -10.0f) return 0.0f;
    if (x >= 10.0f) return x;
    const _Float16 h = (_Float16)x;
    uint16_t bits;
    memcpy(&bits, &h, 2);
    return GELU[bits];
}

/* g = act(g) * u over n values, on the threads the products use (each value the same arithmetic wherever it is
 * computed): at several tokens a step the scalar SiLU was a fifth of a small model's step on one core */
static void activate(float *g, const float *u, int64_t n, int gelu_, int threads) {
#pragma omp parallel for num_threads(team(threads, n, 4096)) schedule(static)
    for (int64_t i = 0; i < n; i++) g[i] = gelu_ ? gelu(g[i]) * u[i] : g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void store_row(int dtype, float *src, uint8_t *dst, int64_t n) {
    if (dtype == KV_F16) {
        _Float16 *d = (_Float16 *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = (_Float16)src[i];
    } else if (dtype == KV_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = to_bf16(src[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

static int mat_arg(PyObject *t, mat_t *m, int64_t rows, int64_t cols) {
    int type;
    Py_ssize_t w, bias;
    long long r, c;
    if (!PyArg_ParseTuple(t, "inLLn", &type, &w, &r, &c, &bias)) return 0;
    m->bt = type_arg(type);
    if (!m->bt || !check_shape(m->bt, r, c)) return 0;
    if (r != rows || c != cols) {
        PyErr_Format(PyExc_ValueError, "a %lld x %lld weight where %lld x %lld belongs", r, c, (long long)rows,
                     (long long)cols);
        return 0;
    }
    m->w = (const uint8_t *)w, m->rows = r, m->cols = c, m->bias = (const float *)bias;
    return 1;
}

/* stack((n_layers, d_model, H, Hk, D, d_ff, gelu, neox, rope_dim, eps, scale, residual, softcap), [layer, ...])
 * -> capsule
 * layer: (q, k, v, o, gate, up, down, attn_norm, ffn_norm, q_norm, k_norm, post_attn_norm, post_ffn_norm,
 *         window, rope), a matrix (type, address, rows, cols, bias address or 0), a norm an address or 0. The
 * caller keeps every array alive as long as the capsule. */
static PyObject *py_stack(PyObject *self, PyObject *args) {
    int L, dm, H, Hk, D, dff, gelu, neox, rope_dim;
    float eps, scale, residual, softcap;
    PyObject *layers;
    if (!PyArg_ParseTuple(args, "(iiiiiiiiiffff)O!", &L, &dm, &H, &Hk, &D, &dff, &gelu, &neox, &rope_dim, &eps, &scale,
                          &residual, &softcap, &PyList_Type, &layers))
        return NULL;
    if (L <= 0 || PyList_GET_SIZE(layers) != L || dm <= 0 || dff <= 0 || rope_dim > D || rope_dim % 2 ||
        !attend_args_ok(KV_F16, Hk, H, D, 1, 1, 0, 0))
        return PyErr_Format(PyExc_ValueError, "stack: bad shape");
    stack_t *s = calloc(1, sizeof(stack_t) + (size_t)L * sizeof(layer_t));
    if (!s) return PyErr_NoMemory();
    *s = (stack_t){L, dm, H, Hk, D, dff, gelu, neox, rope_dim, eps, scale, residual, softcap};
    for (int i = 0; i < L; i++) {
        layer_t *l = &s->layers[i];
        PyObject *q, *k, *v, *o, *g, *u, *d;
        Py_ssize_t n[6];
        long long window;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(layers, i), "OOOOOOOnnnnnnLi", &q, &k, &v, &o, &g, &u, &d, &n[0],
                              &n[1], &n[2], &n[3], &n[4], &n[5], &window, &l->rope) ||
            !mat_arg(q, &l->q, (int64_t)H * D, dm) || !mat_arg(k, &l->k, (int64_t)Hk * D, dm) ||
            !mat_arg(v, &l->v, (int64_t)Hk * D, dm) || !mat_arg(o, &l->o, dm, (int64_t)H * D) ||
            !mat_arg(g, &l->gate, dff, dm) || !mat_arg(u, &l->up, dff, dm) || !mat_arg(d, &l->down, dm, dff)) {
            free(s);
            return NULL;
        }
        l->attn_norm = (const float *)n[0], l->ffn_norm = (const float *)n[1], l->q_norm = (const float *)n[2];
        l->k_norm = (const float *)n[3], l->post_attn_norm = (const float *)n[4];
        l->post_ffn_norm = (const float *)n[5], l->window = window;
        if (!l->attn_norm || !l->ffn_norm || (l->rope != 0 && l->rope != 1) || window < 0) {
            free(s);
            return PyErr_Format(PyExc_ValueError, "stack: layer %d is incomplete", i);
        }
    }
    PyObject *capsule = PyCapsule_New(s, STACK, stack_free);
    if (!capsule) free(s);
    return capsule;
}

/* run(stack, x, T, segments, S, caches, kv_dtype, cos0, sin0, cos1, sin1, threads): x [T, d_model] float32, in
 * place: the tokens of S sequences one after another. segments: int64 [S, 2] = (tokens, first position) of each
 * sequence, the tokens adding up to T; caches: int64 [S, n_layers, 5] = (k address, v address, capacity, ring,
 * first visible position) of each sequence's caches, which already hold room for its positions; cos/sin: the
 * two RoPE tables [positions, rope_dim / 2]. The projections read each weight once for all T tokens (decode of
 * several sequences at once: a step's bytes shared by all of them); RoPE, the new rows and attention are each
 * sequence's own. A token's result does not depend on the others (matmul_mt), so a sequence decodes here
 * exactly as it does alone. */
static PyObject *py_run(PyObject *self, PyObject *args) {
    PyObject *capsule;
    Py_ssize_t xa, sa, ca, c0, s0, c1, s1;
    long long T, S;
    int dtype, threads, ok = 1;
    if (!PyArg_ParseTuple(args, "OnLnLninnnni", &capsule, &xa, &T, &sa, &S, &ca, &dtype, &c0, &s0, &c1, &s1,
                          &threads))
        return NULL;
    const stack_t *s = PyCapsule_GetPointer(capsule, STACK);
    if (!s) return NULL;
    const int64_t *segs = (const int64_t *)sa;
    long long total = 0;
    for (long long i = 0; i < S; i++) {
        if (segs[2 * i] <= 0 || segs[2 * i + 1] < 0) return PyErr_Format(PyExc_ValueError, "run: bad segment %lld", i);
        total += segs[2 * i];
    }
    if (T <= 0 || S <= 0 || total != T || (dtype != KV_F32 && dtype != KV_F16 && dtype != KV_BF16))
        return PyErr_Format(PyExc_ValueError, "run: bad arguments");
    const int64_t dm = s->d_model, H = s->H, Hk = s->Hk, D = s->D, dff = s->d_ff, L = s->n_layers;
    const size_t esize = dtype == KV_F32 ? 4 : 2, half = s->rope_dim / 2;
    float *x = (float *)xa;
    const int64_t *caches = (const int64_t *)ca;
    const float *tables[2][2] = {{(const float *)c0, (const float *)s0}, {(const float *)c1, (const float *)s1}};
    float *buf = malloc(sizeof(float) * (size_t)T * (dm + (H + 2 * Hk) * D + H * D + 2 * dff + dm));
    if (!buf) return PyErr_NoMemory();
    float *h = buf, *q = h + T * dm, *k = q + T * H * D, *v = k + T * Hk * D, *att = v + T * Hk * D,
          *g = att + T * H * D, *u = g + T * dff, *y = u + T * dff;
    Py_BEGIN_ALLOW_THREADS
    for (int li = 0; li < L && ok; li++) {
        const layer_t *l = &s->layers[li];
        for (int64_t t = 0; t < T; t++) rms_norm(x + t * dm, l->attn_norm, h + t * dm, dm, s->eps);
        project(&l->q, h, T, q, threads);
        project(&l->k, h, T, k, threads);
        project(&l->v, h, T, v, threads);
        for (int64_t si = 0, t0 = 0; si < S && ok; t0 += segs[2 * si], si++) {
            const int64_t n = segs[2 * si], pos0 = segs[2 * si + 1];
            const int64_t *c = caches + 5 * (si * L + li);
            uint8_t *kc = (uint8_t *)c[0], *vc = (uint8_t *)c[1];
            const int64_t cap = c[2], ring = c[3], key_lo = c[4];
            for (int64_t t = t0; t < t0 + n; t++) {
                const int64_t p = pos0 + (t - t0);
                float *qt = q + t * H * D, *kt = k + t * Hk * D;
                if (l->q_norm) {
                    for (int64_t j = 0; j < H; j++) rms_norm(qt + j * D, l->q_norm, qt + j * D, D, s->eps);
                    for (int64_t j = 0; j < Hk; j++) rms_norm(kt + j * D, l->k_norm, kt + j * D, D, s->eps);
                }
                const float *cs = tables[l->rope][0] + p * half, *sn = tables[l->rope][1] + p * half;
                rope(qt, H, D, s->rope_dim, s->neox, cs, sn);
                rope(kt, Hk, D, s->rope_dim, s->neox, cs, sn);
                const int64_t r = ring ? p % cap : p;
                store_row(dtype, kt, kc + (size_t)r * Hk * D * esize, Hk * D);
                store_row(dtype, v + t * Hk * D, vc + (size_t)r * Hk * D * esize, Hk * D);
            }
            ok = attend_mt(dtype, kc, vc, cap, (int)ring, (int)Hk, (int)D, q + t0 * H * D, n, (int)H, pos0, key_lo,
                           l->window, s->scale, s->softcap, NULL, att + t0 * H * D, threads);
        }
        project(&l->o, att, T, y, threads);
        for (int64_t t = 0; t < T; t++) {
            if (l->post_attn_norm) rms_norm(y + t * dm, l->post_attn_norm, y + t * dm, dm, s->eps);
            if (s->residual != 0.0f)
                for (int64_t i = 0; i < dm; i++) y[t * dm + i] *= s->residual;
            for (int64_t i = 0; i < dm; i++) x[t * dm + i] += y[t * dm + i];
            rms_norm(x + t * dm, l->ffn_norm, h + t * dm, dm, s->eps);
        }
        project(&l->gate, h, T, g, threads);
        project(&l->up, h, T, u, threads);
        activate(g, u, T * dff, s->gelu, threads);
        project(&l->down, g, T, y, threads);
        for (int64_t t = 0; t < T; t++) {
            if (l->post_ffn_norm) rms_norm(y + t * dm, l->post_ffn_norm, y + t * dm, dm, s->eps);
            if (s->residual != 0.0f)
                for (int64_t i = 0; i < dm; i++) y[t * dm + i] *= s->residual;
            for (int64_t i = 0; i < dm; i++) x[t * dm + i] += y[t * dm + i];
        }
    }
    Py_END_ALLOW_THREADS
    free(buf);
    if (!ok) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_dequant(PyObject *self, PyObject *args) {
    int type, bf16, threads;
    Py_ssize_t w, out;
    long long rows, cols;
    if (!PyArg_ParseTuple(args, "inLLnpi", &type, &w, &rows, &cols, &out, &bf16, &threads)) return NULL;
    const block_type *bt = type_arg(type);
    if (!bt || !check_shape(bt, rows, cols)) return NULL;
    const int nt = team(threads, rows, 64);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long long r = 0; r < rows; r += 16)
        bt->dequant((const uint8_t *)w, r, r + 16 < rows ? r + 16 : rows, cols, (void *)out, bf16);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* gelu_mul(gu, T, d_ff, out, threads): out[t, i] = GELU(gu[t, i]) * gu[t, d_ff + i] (prefill's FFN; decode's
 * stack does the same in activate) */
static PyObject *py_gelu_mul(PyObject *self, PyObject *args) {
    Py_ssize_t gu, out;
    long long T, dff;
    int threads;
    if (!PyArg_ParseTuple(args, "nLLni", &gu, &T, &dff, &out, &threads)) return NULL;
    if (T < 0 || dff <= 0) {
        PyErr_SetString(PyExc_ValueError, "gelu_mul: bad shape");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(team(threads, T, 4)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *g = (const float *)gu + 2 * dff * t, *u = g + dff;
        float *o = (float *)out + dff * t;
        for (int64_t i = 0; i < dff; i++) o[i] = gelu(g[i]) * u[i];
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_gather(PyObject *self, PyObject *args) {
    int type;
    Py_ssize_t w, ids, out;
    long long cols, n;
    if (!PyArg_ParseTuple(args, "inLnLn", &type, &w, &cols, &ids, &n, &out)) return NULL;
    const block_type *bt = type_arg(type);
    if (!bt || !check_shape(bt, 1, cols)) return NULL;
    const size_t row_bytes = (size_t)(cols / bt->values) * bt->bytes;
    Py_BEGIN_ALLOW_THREADS
    for (long long i = 0; i < n; i++) {
        const int64_t id = ((const int64_t *)ids)[i];
        bt->dequant((const uint8_t *)w + id * row_bytes, 0, 1, cols, (float *)out + i * cols, 0);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_block_size(PyObject *self, PyObject *args) {
    int type;
    if (!PyArg_ParseTuple(args, "i", &type)) return NULL;
    const block_type *bt = find_type(type);
    if (!bt) Py_RETURN_NONE;
#ifdef INT8_DOTS
    const int rounds = rounds_of(type);
#else
    const int rounds = 0;
#endif
#ifdef INT8_DOTS
    const int gemm = find_gemm(type) != NULL;
#else
    const int gemm = 0;
#endif
    return Py_BuildValue("(iiii)", bt->values, bt->bytes, rounds, gemm);
}

static PyMethodDef METHODS[] = {
    {"matmul", py_matmul, METH_VARARGS, "matmul(type, w, rows, cols, x, T, y, threads): y = x . W^T"},
    {"gemm", py_gemm, METH_VARARGS, "gemm(type, w, rows, cols, x, ldx, T, y, ldy, threads): y[t, :rows] = x[t] . W^T, int8"},
    {"dequant", py_dequant, METH_VARARGS, "dequant(type, w, rows, cols, out, bf16, threads)"},
    {"gather", py_gather, METH_VARARGS, "gather(type, w, cols, ids, n, out): rows ids of W as float32"},
    {"gelu_mul", py_gelu_mul, METH_VARARGS, "gelu_mul(gu, T, d_ff, out, threads): out = GELU(gate) * up, ggml's GELU"},
    {"attend", py_attend, METH_VARARGS,
     "attend(kv_dtype, k, v, capacity, ring, Hk, D, q, T, H, pos0, key_lo, window, scale, out, threads)"},
    {"stack", py_stack, METH_VARARGS, "stack(shape, layers) -> a layer stack for run (see _kernels.c)"},
    {"run", py_run, METH_VARARGS, "run(stack, x, T, pos0, caches, kv_dtype, cos0, sin0, cos1, sin1, threads)"},
    {"block_size", py_block_size, METH_VARARGS,
     "block_size(type) -> (values, bytes, rounds, gemm), or None; rounds: a few tokens' activations are rounded to 8 "
     "bits with one scale a `rounds` values (0: they are not); gemm: many tokens have the int8 GEMM"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_kernels", "CPU kernels (see _kernels.c)", -1, METHODS, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    gelu_init();
    PyObject *m = PyModule_Create(&MODULE);
#ifdef INT8_DOTS
    const int tiles = MAX_NT > 1;
#else
    const int tiles = 0;
#endif
    /* TOKEN_TILES: the int8 products unpack a block once for several tokens (prefill can use them) */
    if (m && PyModule_AddIntConstant(m, "TOKEN_TILES", tiles) < 0) Py_CLEAR(m);
    return m;
}
