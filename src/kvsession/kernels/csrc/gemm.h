#pragma once
#include "blocks.h" /* what this file uses; each header stands alone */
#include "dots.h"
#ifdef INT8_GEMM
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
 * Q8_0, Q4_0, Q5_0, Q4_K and Q6_K. Not Q4_1 (SmolLM2): in int8 its teacher-forced agreement read 95.2% against a
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

static void unpack_q4_0(const uint8_t *b, uint8_t *codes, float *s, float *m) {
    _mm256_storeu_si256((__m256i *)codes, codes_q4(b + 2));
    s[0] = f16(b);
}

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
    {T_Q4_0, 32, -8, 0, unpack_q4_0, gemm_tiles_32_0},
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

