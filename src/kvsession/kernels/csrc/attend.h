#pragma once
#include "blocks.h" /* what this file uses; each header stands alone */
#include "dots.h"
#include "gemm.h" /* transpose16, transpose8 */
/* Attention over the cache's rows, read as they are stored (float16, bfloat16, float32 or q8_0 blocks, token-major,
 * a ring or not): flash attention, for a prompt's chunk and for decode alike. Included by isa.h.
 *
 * The work is cut into tiles: the queries of a few positions times the query heads of one KV group (rows), against
 * FA_KT keys at a time. A tile's keys are converted once into a layout the products read with whole vectors
 * (K transposed, V with pairs of keys interleaved where the products are bfloat16) and serve every row of the
 * tile, so each K/V row is read once per group of query heads and per tile of queries, not once per query head.
 * The scores of a tile never leave L1: an online softmax (running max m and sum l of each row, in log2 units, the
 * output rescaled when the max grows) folds them into the row's output as they come. Tiles wholly above the
 * causal diagonal, or below a ring's window, are never visited: a row's keys run from its first visible one to
 * its own position.
 *
 * Products: on the avx512bf16 build with a float16 or bfloat16 cache, K.Q and P.V are bfloat16 dot products
 * (vdpbf16ps: 32 products an instruction, float32 sums), the queries, keys, values and probabilities rounded to
 * bfloat16; everywhere else (and for a float32 cache) float32 FMAs. On both AVX-512 builds (VNNI) with a q8_0 cache,
 * K.Q is an int8 product instead (vpdpbusd: 64 products an instruction, int32 sums, twice bfloat16's rate): each
 * query row is quantized as llama.cpp quantizes an activation against q8_0 weights (blocks of 32, int8 and a float
 * scale), a key's int8 are taken as they are stored, and each block's sum is scaled by both blocks' scales in
 * float32; its P.V is bfloat16 on the avx512bf16 build (values widened and rounded as a tile is packed), float32 on
 * the avx512 one. Elsewhere a q8_0 row is widened (its int8 times its block's scale) as its tile is packed, so it
 * costs half an f16 row's memory and the same products. Softmax, its sums and the output are float32.
 *
 * Threads: a prompt's chunk splits over its tiles of queries (and groups), the tiles of the last queries, which
 * see the most keys, handed out first. A few queries (decode) make one tile of queries, so their keys are cut into
 * pieces of FA_SPLIT (flash-decoding): each piece's partial max, sum and output, merged in order afterwards. Every
 * cut depends on positions and shapes only, never on the thread count: the same cache gives the same bits. */

#define FA_KT 64      /* keys a tile */
#define FA_ROWS 256   /* rows (queries x the heads of a group) a tile of queries holds, at most (or one query's) */
#define FA_RC 24      /* rows taken through a key tile at a time (a multiple of every FA_MB) */
#define FA_SPLIT 256  /* keys a piece where one tile of queries has its keys cut among threads */
#define FA_LOG2E 1.44269504088896341f
#define FA_MASKED -1e30f /* a score no key gets: 2^(it - any max) is 0 */
#define FA_SLACK 8.0f /* log2 units a score may pass its row's running max by before the max moves */

#if defined(VNNI) && defined(__AVX512BF16__)
#define FA_BF16 /* bfloat16 products for float16, bfloat16 and q8_0 caches (P.V only for q8_0) */
#endif
#if defined(VNNI)
#define FA_I8 /* int8 K.Q against a q8_0 cache */
#endif

/* --- vectors of VL floats: AVX-512, AVX2, or the compiler's vectors (the portable builds, NEON) ------------ */
#if defined(VNNI) /* every AVX-512 build */
typedef __m512 vf;
#define VL 16
#define FA_MB 6 /* rows a product block: 6 x 4 accumulators, 4 vectors of B, a broadcast */
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset(float x) { return _mm512_set1_ps(x); }
static inline vf vloadu(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstoreu(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vabs(vf a) { return _mm512_abs_ps(a); }
static inline vf vcopysign(vf mag, vf sign) {
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(mag), _mm512_castps_si512(sign),
                                                         _mm512_set1_epi32(0x7fffffff), 0xe4));
}
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline int vany_gt(vf a, float x) { return _mm512_cmp_ps_mask(a, vset(x), _CMP_GT_OQ) != 0; }
static inline float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
/* s where lo <= off <= hi, else FA_MASKED */
static inline vf vkeep(vf off, float lo, float hi, vf s) {
    const __mmask16 in = _mm512_cmp_ps_mask(off, vset(lo), _CMP_GE_OQ) & _mm512_cmp_ps_mask(off, vset(hi), _CMP_LE_OQ);
    return _mm512_mask_blend_ps(in, vset(FA_MASKED), s);
}
static inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vldexp(vf p, vf n) { return _mm512_scalef_ps(p, n); } /* p 2^n, 0 far enough below */
/* VL int8 as floats */
static inline vf vload_i8(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
/* VL numbers of a float32, float16 or bfloat16 row from p, as floats */
static inline vf vload_raw(int dtype, const uint8_t *p) {
    if (dtype == KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    if (dtype == KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}
#elif defined(AVX2_DOTS)
typedef __m256 vf;
#define VL 8
#define FA_MB 2 /* 2 x 4 accumulators, 4 vectors of B, a broadcast: 13 of the 16 registers */
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset(float x) { return _mm256_set1_ps(x); }
static inline vf vloadu(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstoreu(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vabs(vf a) { return _mm256_andnot_ps(vset(-0.0f), a); }
static inline vf vcopysign(vf mag, vf sign) {
    return _mm256_or_ps(_mm256_andnot_ps(vset(-0.0f), mag), _mm256_and_ps(vset(-0.0f), sign));
}
static inline float vsum(vf a) { return hsum(a); }
static inline int vany_gt(vf a, float x) { return _mm256_movemask_ps(_mm256_cmp_ps(a, vset(x), _CMP_GT_OQ)) != 0; }
static inline float vhmax(vf a) { return hmax(a); }
static inline vf vkeep(vf off, float lo, float hi, vf s) {
    const vf in = _mm256_and_ps(_mm256_cmp_ps(off, vset(lo), _CMP_GE_OQ), _mm256_cmp_ps(off, vset(hi), _CMP_LE_OQ));
    return _mm256_blendv_ps(vset(FA_MASKED), s, in);
}
static inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vldexp(vf p, vf n) { /* p 2^n, 0 from n = -127 down: a zero exponent field */
    const __m256i e = _mm256_cvtps_epi32(vmax(n, vset(-127.0f)));
    return vmul(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)));
}
static inline vf vload_i8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline vf vload_raw(int dtype, const uint8_t *p) {
    if (dtype == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (dtype == KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps((const float *)p);
}
#else
/* the compiler's vectors: SSE2 on a baseline x86-64, NEON on AArch64 */
typedef float vf __attribute__((vector_size(16)));
typedef int32_t vi __attribute__((vector_size(16)));
#define VL 4
#define FA_MB 2
static inline vf vzero(void) { return (vf){0.0f, 0.0f, 0.0f, 0.0f}; }
static inline vf vset(float x) { return (vf){x, x, x, x}; }
static inline vf vloadu(const float *p) {
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}
static inline void vstoreu(float *p, vf x) { memcpy(p, &x, sizeof x); }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline vf vsub(vf a, vf b) { return a - b; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vdiv(vf a, vf b) { return a / b; }
static inline vf vfmadd(vf a, vf b, vf c) { return a * b + c; }
static inline vf vpick(vi m, vf a, vf b) { return (vf)((m & (vi)a) | (~m & (vi)b)); } /* a where m, else b */
static inline vf vmax(vf a, vf b) { return vpick(a > b, a, b); }
static inline vf vabs(vf a) { return (vf)((vi)a & 0x7fffffff); }
static inline vf vcopysign(vf mag, vf sign) { return (vf)(((vi)mag & 0x7fffffff) | ((vi)sign & (vi)vset(-0.0f))); }
static inline float vsum(vf a) { return (a[0] + a[1]) + (a[2] + a[3]); }
static inline int vany_gt(vf a, float x) { return a[0] > x || a[1] > x || a[2] > x || a[3] > x; }
static inline float vhmax(vf a) {
    const float x = a[0] > a[1] ? a[0] : a[1], y = a[2] > a[3] ? a[2] : a[3];
    return x > y ? x : y;
}
static inline vf vkeep(vf off, float lo, float hi, vf s) { return vpick((off >= lo) & (off <= hi), s, vset(FA_MASKED)); }
static inline vf vround(vf x) { return vpick(vabs(x) < 4194304.0f, (x + 12582912.0f) - 12582912.0f, x); } /* 1.5 2^23 */
static inline vf vldexp(vf p, vf n) { /* p 2^n, 0 from n = -127 down: a zero exponent field */
    return p * (vf)((__builtin_convertvector(vmax(n, vset(-127.0f)), vi) + 127) << 23);
}
static inline vf vload_i8(const uint8_t *p) {
    const int8_t *s = (const int8_t *)p;
    return (vf){(float)s[0], (float)s[1], (float)s[2], (float)s[3]};
}
static inline vf vload_raw(int dtype, const uint8_t *p) {
    float f[VL];
    for (int i = 0; i < VL; i++) {
        if (dtype == KV_F16) f[i] = f16(p + 2 * i);
        else if (dtype == KV_BF16) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            const uint32_t bits = (uint32_t)h << 16;
            memcpy(f + i, &bits, 4);
        } else memcpy(f + i, p + 4 * i, 4);
    }
    return vloadu(f);
}
#endif

/* a q8_0 block's scale (its first two bytes, float16) */
static inline float q8_0_scale(const uint8_t *block) {
    uint16_t h;
    memcpy(&h, block, 2);
    return half_to_float(h);
}

/* numbers d .. d + VL - 1 of one head of a cache row (p: the head's first byte) as floats */
static inline vf vload_kv(int dtype, const uint8_t *p, int d) {
    if (dtype == KV_Q8_0) {
        const uint8_t *b = p + (size_t)(d / KV_QBLOCK) * KV_QBYTES;
        return vmul(vset(q8_0_scale(b)), vload_i8(b + 2 + d % KV_QBLOCK));
    }
    return vload_raw(dtype, p + (size_t)d * (dtype == KV_F32 ? 4 : 2));
}

/* rows [VL][VL] of floats (row i: numbers d.. of the head at src[i], a zero row where src[i] is NULL) to columns:
 * dst[c * ld + i] */
static inline void transpose_rows(int dtype, const uint8_t *const src[VL], int d, float *dst, int64_t ld) {
#if defined(VNNI)
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = src[i] ? _mm512_castps_si512(vload_kv(dtype, src[i], d)) : _mm512_setzero_si512();
    transpose16(r);
    for (int c = 0; c < 16; c++) _mm512_storeu_si512(dst + c * ld, r[c]);
#elif defined(AVX2_DOTS)
    __m256i r[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_castps_si256(src[i] ? vload_kv(dtype, src[i], d) : vzero());
    transpose8(r);
    for (int c = 0; c < 8; c++) _mm256_storeu_si256((__m256i *)(dst + c * ld), r[c]);
#else
    for (int i = 0; i < VL; i++) {
        const vf r = src[i] ? vload_kv(dtype, src[i], d) : vzero();
        for (int c = 0; c < VL; c++) dst[c * ld + i] = r[c];
    }
#endif
}

/* 2^f for f in [-1/2, 1/2]: a degree-5 fit of the relative error (2e-7) */
static inline vf vpoly2(vf f) {
    vf p = vset(1.3216948508455932e-3f);
    p = vfmadd(p, f, vset(9.666754022118708e-3f));
    p = vfmadd(p, f, vset(5.550833820363229e-2f));
    p = vfmadd(p, f, vset(2.4022318176107543e-1f));
    p = vfmadd(p, f, vset(6.93146938039758e-1f));
    return vfmadd(p, f, vset(1.0f));
}
/* 2^x for finite x <= 0 (relative error 2e-7); 0 far below (FA_MASKED) */
static inline vf vexp2(vf x) {
    const vf n = vround(x);
    return vldexp(vpoly2(vsub(x, n)), n);
}

#define FA_NB 4              /* vectors of B a product block */
#define FA_COLS (FA_NB * VL) /* and their numbers */
#define FA_ALWAYS static inline __attribute__((always_inline))

/* softcap * tanh(x / softcap) */
static inline vf vsoftcap(vf x, float softcap) {
    const vf e = vexp2(vmul(vabs(x), vset(-2.0f * FA_LOG2E / softcap))); /* e^(-2|x|/c): tanh = (1 - e) / (1 + e) */
    return vcopysign(vmul(vset(softcap), vdiv(vsub(vset(1.0f), e), vadd(vset(1.0f), e))), x);
}

/* --- the products of a tile: C[MB rows][FA_COLS] = alpha * C + A . B, float32 ------------------------------ */

/* A [rows][K] (row stride lda), B [K][FA_COLS] (row stride ldb); alpha NULL: C = A . B */
FA_ALWAYS void mk_f32(const int MB, const float *A, int64_t lda, const float *B, int64_t ldb, int64_t K, float *C,
                      int64_t ldc, const float *alpha) {
    vf acc[FA_MB][FA_NB];
    for (int r = 0; r < MB; r++)
        for (int c = 0; c < FA_NB; c++)
            acc[r][c] = alpha ? vmul(vset(alpha[r]), vloadu(C + r * ldc + c * VL)) : vzero();
    for (int64_t k = 0; k < K; k++) {
        vf b[FA_NB];
        for (int c = 0; c < FA_NB; c++) b[c] = vloadu(B + k * ldb + c * VL);
        for (int r = 0; r < MB; r++) {
            const vf a = vset(A[r * lda + k]);
            for (int c = 0; c < FA_NB; c++) acc[r][c] = vfmadd(a, b[c], acc[r][c]);
        }
    }
    for (int r = 0; r < MB; r++)
        for (int c = 0; c < FA_NB; c++) vstoreu(C + r * ldc + c * VL, acc[r][c]);
}

/* C [M][N] = alpha * C + A [M][K] . B [K][N], N a multiple of FA_COLS */
static void gemm_f32(int M, int64_t N, const float *A, int64_t lda, const float *B, int64_t ldb, int64_t K, float *C,
                     int64_t ldc, const float *alpha) {
    for (int64_t n = 0; n < N; n += FA_COLS)
        for (int r = 0; r < M; r += FA_MB) {
            const float *a = A + r * lda, *al = alpha ? alpha + r : NULL;
            float *c = C + r * ldc + n;
            switch (M - r < FA_MB ? M - r : FA_MB) {
            case 1: mk_f32(1, a, lda, B + n, ldb, K, c, ldc, al); break;
#if FA_MB > 2
            case 2: mk_f32(2, a, lda, B + n, ldb, K, c, ldc, al); break;
            case 3: mk_f32(3, a, lda, B + n, ldb, K, c, ldc, al); break;
            case 4: mk_f32(4, a, lda, B + n, ldb, K, c, ldc, al); break;
            case 5: mk_f32(5, a, lda, B + n, ldb, K, c, ldc, al); break;
#endif
            default: mk_f32(FA_MB, a, lda, B + n, ldb, K, c, ldc, al); break;
            }
        }
}

#ifdef FA_BF16
/* the same in bfloat16: A [rows][K] and B [K][FA_COLS] pairs of bfloat16 (one 32-bit word each), dot products of
 * pairs summed in float32 */
FA_ALWAYS void mk_bf16(const int MB, const uint32_t *A, int64_t lda, const uint32_t *B, int64_t ldb, int64_t K,
                       float *C, int64_t ldc, const float *alpha) {
    vf acc[FA_MB][FA_NB];
    for (int r = 0; r < MB; r++)
        for (int c = 0; c < FA_NB; c++)
            acc[r][c] = alpha ? vmul(vset(alpha[r]), vloadu(C + r * ldc + c * VL)) : vzero();
    for (int64_t k = 0; k < K; k++) {
        __m512bh b[FA_NB];
        for (int c = 0; c < FA_NB; c++) b[c] = (__m512bh)_mm512_loadu_si512(B + k * ldb + c * VL);
        for (int r = 0; r < MB; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)A[r * lda + k]);
            for (int c = 0; c < FA_NB; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, b[c]);
        }
    }
    for (int r = 0; r < MB; r++)
        for (int c = 0; c < FA_NB; c++) vstoreu(C + r * ldc + c * VL, acc[r][c]);
}

static void gemm_bf16(int M, int64_t N, const uint32_t *A, int64_t lda, const uint32_t *B, int64_t ldb, int64_t K,
                      float *C, int64_t ldc, const float *alpha) {
    for (int64_t n = 0; n < N; n += FA_COLS)
        for (int r = 0; r < M; r += FA_MB) {
            const uint32_t *a = A + r * lda;
            const float *al = alpha ? alpha + r : NULL;
            float *c = C + r * ldc + n;
            switch (M - r < FA_MB ? M - r : FA_MB) {
            case 1: mk_bf16(1, a, lda, B + n, ldb, K, c, ldc, al); break;
            case 2: mk_bf16(2, a, lda, B + n, ldb, K, c, ldc, al); break;
            case 3: mk_bf16(3, a, lda, B + n, ldb, K, c, ldc, al); break;
            case 4: mk_bf16(4, a, lda, B + n, ldb, K, c, ldc, al); break;
            case 5: mk_bf16(5, a, lda, B + n, ldb, K, c, ldc, al); break;
            default: mk_bf16(FA_MB, a, lda, B + n, ldb, K, c, ldc, al); break;
            }
        }
}

/* numbers d .. d + 31 of a cache row's head (p: its first byte) as bfloat16, in order; half: 16, then zeros (a
 * head of 16 x an odd number) */
static inline __m512i load_bf16x32(int dtype, const uint8_t *p, int d, int half) {
    if (dtype == KV_BF16) {
        p += 2 * (size_t)d;
        return half ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)p)) : _mm512_loadu_si512(p);
    }
    return (__m512i)_mm512_cvtne2ps_pbh(half ? vzero() : vload_kv(dtype, p, d + 16), vload_kv(dtype, p, d));
}
#endif

#ifdef FA_I8
/* the same for K.Q in int8 against a q8_0 cache. A: a tile's quantized query rows, row r at A + r * qrow
 * (fa_qrow): D int8, then nb float32 scales and nb int32 corrections (-128 x the block's sum), a block each;
 * B: a key tile's words [D / 4][FA_KT] (four numbers a word, each its int8 + 128: vpdpbusd's unsigned side), sk
 * its keys' scales [nb][FA_KT], both offset to the product block's first key (row stride FA_KT). Each block's int32 sum (the correction
 * taking the 128s back out) times the query's and the key's scales, summed in float32. */
#define FA_MB8 4 /* rows an int8 product block: 4 x 2 int32 sums, 4 x 2 float32 ones */
#define FA_NB8 2 /* vectors of keys a product block */

/* the 32 numbers at x times qs, quantized as llama.cpp's quantize_row_q8_0 quantizes a block: int8 into dst, the
 * scale returned, the int8's sum into *sum (NULL: not wanted) */
static inline float fa_quantize_block(const float *x, vf qs, uint8_t *dst, int32_t *sum) {
    const vf x0 = vmul(qs, vloadu(x)), x1 = vmul(qs, vloadu(x + VL));
    const float amax = vhmax(vmax(vabs(x0), vabs(x1)));
    const vf id = vset(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i i0 = _mm512_cvtps_epi32(vmul(x0, id)), i1 = _mm512_cvtps_epi32(vmul(x1, id));
    _mm_storeu_si128((__m128i *)dst, _mm512_cvtsepi32_epi8(i0));
    _mm_storeu_si128((__m128i *)(dst + VL), _mm512_cvtsepi32_epi8(i1));
    if (sum) *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    return amax / 127.0f;
}

static inline size_t fa_qrow(int D) { return (size_t)D + 8 * (size_t)(D / KV_QBLOCK); }

static inline int32_t fa_word(const uint8_t *p) {
    int32_t x;
    memcpy(&x, p, 4);
    return x;
}

FA_ALWAYS void mk_kq8(const int MB, const uint8_t *A, size_t qrow, int nb, const int32_t *B, const float *sk,
                     float *C, int64_t ldc) {
    vf f[FA_MB8][FA_NB8];
    for (int r = 0; r < MB; r++)
        for (int c = 0; c < FA_NB8; c++) f[r][c] = vzero();
    for (int b = 0; b < nb; b++) {
        __m512i acc[FA_MB8][FA_NB8];
        for (int r = 0; r < MB; r++) {
            const __m512i c0 = _mm512_set1_epi32(fa_word(A + r * qrow + (size_t)KV_QBLOCK * nb + 4 * (nb + b)));
            for (int c = 0; c < FA_NB8; c++) acc[r][c] = c0;
        }
        const int32_t *kb = B + (size_t)b * (KV_QBLOCK / 4) * FA_KT;
        for (int i = 0; i < KV_QBLOCK / 4; i++) {
            __m512i k[FA_NB8];
            for (int c = 0; c < FA_NB8; c++) k[c] = _mm512_loadu_si512(kb + i * FA_KT + c * VL);
            for (int r = 0; r < MB; r++) {
                const __m512i q = _mm512_set1_epi32(fa_word(A + r * qrow + (size_t)KV_QBLOCK * b + 4 * i));
                for (int c = 0; c < FA_NB8; c++) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], k[c], q);
            }
        }
        for (int c = 0; c < FA_NB8; c++) {
            const vf s = vloadu(sk + (size_t)b * FA_KT + c * VL);
            for (int r = 0; r < MB; r++) {
                float qd;
                memcpy(&qd, A + r * qrow + (size_t)KV_QBLOCK * nb + 4 * b, 4);
                f[r][c] = vfmadd(_mm512_cvtepi32_ps(acc[r][c]), vmul(s, vset(qd)), f[r][c]);
            }
        }
    }
    for (int r = 0; r < MB; r++)
        for (int c = 0; c < FA_NB8; c++) vstoreu(C + r * ldc + c * VL, f[r][c]);
}

/* C [M][FA_KT] = the scores of M quantized query rows against a key tile */
static void gemm_kq8(int M, const uint8_t *A, size_t qrow, int nb, const int32_t *B, const float *sk, float *C,
                    int64_t ldc) {
    for (int n = 0; n < FA_KT; n += FA_NB8 * VL)
        for (int r = 0; r < M; r += FA_MB8) {
            const uint8_t *a = A + r * qrow;
            float *c = C + r * ldc + n;
            switch (M - r < FA_MB8 ? M - r : FA_MB8) {
            case 1: mk_kq8(1, a, qrow, nb, B + n, sk + n, c, ldc); break;
            case 2: mk_kq8(2, a, qrow, nb, B + n, sk + n, c, ldc); break;
            case 3: mk_kq8(3, a, qrow, nb, B + n, sk + n, c, ldc); break;
            default: mk_kq8(FA_MB8, a, qrow, nb, B + n, sk + n, c, ldc); break;
            }
        }
}
#endif

/* --- one call's shape, and a thread's tile ------------------------------------------------------------------ */

typedef struct {
    int dtype, ring, Hk, H, G, D, Dp; /* Dp: D rounded up to whole product blocks (FA_COLS), zero-padded */
    int bf16;                         /* bfloat16 products */
    int i8;                           /* int8 K.Q (a q8_0 cache, FA_I8) */
    const uint8_t *k, *v;
    int64_t cap;
    size_t row, head; /* bytes of a cache row (every KV head) and of one head */
    const float *q;   /* [T, H, D] */
    int64_t T, pos0, key_lo, window;
    float scale, softcap;
} fa_call;

typedef struct {
    void *q;              /* the tile's queries [M][Dp]: float32, bfloat16, or int8 rows of fa_qrow bytes */
    void *k;              /* a key tile transposed: float32 [Dp][FA_KT], pairs of bfloat16 [Dp / 2][FA_KT], or
                             words of four int8 + 128 [D / 4][FA_KT] then the keys' scales [D / 32][FA_KT] */
    void *v;              /* a value tile: float32 [FA_KT][Dp], or pairs of keys' bfloat16 [FA_KT / 2][Dp] */
    float *s;             /* scores [FA_RC][FA_KT] */
    void *p;              /* probabilities [FA_RC][FA_KT]: float32, or bfloat16 */
    float *o;             /* unnormalized output [M][Dp] */
    float *m, *alpha;     /* [M] each: running max (log2 units), this tile's rescaling */
    float *l;             /* [M][VL]: running sums, VL partial sums a row */
} fa_tile;

/* the first key query t sees */
static inline int64_t fa_first(const fa_call *a, int64_t t) {
    const int64_t w = a->window > 0 ? a->pos0 + t - a->window + 1 : 0;
    return w > a->key_lo ? w : a->key_lo;
}

static inline const uint8_t *fa_row(const fa_call *a, const uint8_t *base, int64_t pos, int hk) {
    return base + (size_t)(a->ring ? pos % a->cap : pos) * a->row + (size_t)hk * a->head;
}

/* rows r = (t - t0) * G + g: query t's head hk * G + g */
static void fa_pack_q(const fa_call *a, fa_tile *w, int hk, int64_t t0, int64_t t1) {
    const int G = a->G, D = a->D, Dp = a->Dp;
    const vf qs = vset(a->scale); /* ahead: exact for a power of two (head sizes 64, 256), no rounding added */
    for (int64_t t = t0; t < t1; t++)
        for (int g = 0; g < G; g++) {
            const float *src = a->q + ((size_t)t * a->H + (size_t)hk * G + g) * D;
            const int64_t r = (t - t0) * G + g;
#ifdef FA_I8
            if (a->i8) { /* blocks of 32: int8 and a scale, as llama.cpp's quantize_row_q8_0 */
                uint8_t *row = (uint8_t *)w->q + r * fa_qrow(D);
                const int nb = D / KV_QBLOCK;
                for (int b = 0; b < nb; b++) {
                    int32_t sum;
                    const float d = fa_quantize_block(src + KV_QBLOCK * b, qs, row + KV_QBLOCK * b, &sum);
                    const int32_t corr = -128 * sum;
                    memcpy(row + (size_t)KV_QBLOCK * nb + 4 * b, &d, 4);
                    memcpy(row + (size_t)KV_QBLOCK * nb + 4 * (nb + b), &corr, 4);
                }
                continue;
            }
#endif
#ifdef FA_BF16
            if (a->bf16) {
                uint16_t *dst = (uint16_t *)w->q + r * Dp;
                for (int d = 0; d < Dp; d += 32) {
                    const __m512 lo = d < D ? vmul(qs, _mm512_loadu_ps(src + d)) : vzero();
                    const __m512 hi = d + 16 < D ? vmul(qs, _mm512_loadu_ps(src + d + 16)) : vzero();
                    _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                }
                continue;
            }
#endif
            float *dst = (float *)w->q + r * Dp;
            for (int d = 0; d < D; d += VL) vstoreu(dst + d, vmul(qs, vloadu(src + d)));
            memset(dst + D, 0, (size_t)(Dp - D) * sizeof(float));
        }
}

#ifdef FA_I8
/* keys j0 .. j0 + n - 1 of group hk (a q8_0 cache) into the int8 key tile: 16 keys' words at a time, two blocks
 * (16 words) a key, transposed so that a vector holds one word of 16 keys; keys past n are zeros (128) */
static void fa_pack_k8(const fa_call *a, fa_tile *w, int hk, int64_t j0, int n) {
    const int nb = a->D / KV_QBLOCK;
    int32_t *kt = w->k;
    float *sk = (float *)((uint8_t *)w->k + (size_t)a->D * FA_KT);
    const __m512i off = _mm512_set1_epi8((char)0x80);
    for (int jb = 0; jb < FA_KT; jb += 16) {
        const uint8_t *rows[16];
        for (int i = 0; i < 16; i++) {
            rows[i] = jb + i < n ? fa_row(a, a->k, j0 + jb + i, hk) : NULL;
            for (int b = 0; b < nb; b++) sk[b * FA_KT + jb + i] = rows[i] ? q8_0_scale(rows[i] + b * KV_QBYTES) : 0.0f;
        }
        for (int b = 0; b < nb; b += 2) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                if (!rows[i]) {
                    r[i] = _mm512_setzero_si512();
                    continue;
                }
                const uint8_t *p = rows[i] + b * KV_QBYTES + 2;
                const __m256i hi = b + 1 < nb ? _mm256_loadu_si256((const __m256i *)(p + KV_QBYTES)) : _mm256_setzero_si256();
                r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)), hi, 1);
            }
            transpose16(r);
            for (int c = 0; c < (b + 1 < nb ? 16 : 8); c++)
                _mm512_storeu_si512(kt + (size_t)(8 * b + c) * FA_KT + jb, _mm512_xor_si512(r[c], off));
        }
    }
}
#endif

/* keys j0 .. j0 + n - 1 of group hk, into the tile's K and V layouts; keys past n are zeros */
static void fa_pack_kv(const fa_call *a, fa_tile *w, int hk, int64_t j0, int n) {
    const int D = a->D, Dp = a->Dp;
#ifdef FA_BF16
    if (a->bf16) {
        uint32_t *kt = w->k, *vt = w->v;
        if (a->i8) fa_pack_k8(a, w, hk, j0, n);
        else
        for (int jb = 0; jb < FA_KT; jb += 16) { /* K: 16 keys x 16 pairs of numbers, transposed */
            for (int d = 0; d < Dp; d += 32) {
                __m512i r[16];
                for (int i = 0; i < 16; i++)
                    r[i] = jb + i < n && d < D ? load_bf16x32(a->dtype, fa_row(a, a->k, j0 + jb + i, hk), d, d + 16 >= D)
                                               : _mm512_setzero_si512();
                transpose16(r);
                for (int c = 0; c < 16; c++) _mm512_storeu_si512(kt + (d / 2 + c) * FA_KT + jb, r[c]);
            }
        }
        /* V: keys 2i and 2i + 1 interleaved, number by number */
        const __m512i mix = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                             21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        for (int i = 0; 2 * i < n; i++) {
            const uint8_t *r0 = fa_row(a, a->v, j0 + 2 * i, hk);
            const uint8_t *r1 = 2 * i + 1 < n ? fa_row(a, a->v, j0 + 2 * i + 1, hk) : NULL;
            for (int d = 0; d < Dp; d += 16) {
                __m512i x = _mm512_setzero_si512();
                if (d < D && a->dtype == KV_BF16)
                    x = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(r0 + 2 * d))),
                                           r1 ? _mm256_loadu_si256((const __m256i *)(r1 + 2 * d)) : _mm256_setzero_si256(), 1);
                else if (d < D)
                    x = (__m512i)_mm512_cvtne2ps_pbh(r1 ? vload_kv(a->dtype, r1, d) : vzero(), vload_kv(a->dtype, r0, d));
                x = _mm512_permutexvar_epi16(mix, x); /* [key 2i's 16, key 2i + 1's 16] to pairs */
                _mm512_storeu_si512(vt + (size_t)i * Dp + d, x);
            }
        }
        return;
    }
#endif
    float *kt = w->k, *vt = w->v;
#ifdef FA_I8
    if (a->i8) fa_pack_k8(a, w, hk, j0, n);
    else
#endif
    for (int jb = 0; jb < FA_KT; jb += VL) { /* K: VL keys x VL numbers, transposed */
        const uint8_t *rows[VL];
        for (int i = 0; i < VL; i++) rows[i] = jb + i < n ? fa_row(a, a->k, j0 + jb + i, hk) : NULL;
        for (int d = 0; d < Dp; d += VL) {
            if (d < D) transpose_rows(a->dtype, rows, d, kt + d * FA_KT + jb, FA_KT);
            else
                for (int c = 0; c < VL; c++) memset(kt + (d + c) * FA_KT + jb, 0, VL * sizeof(float));
        }
    }
    for (int j = 0; j < n; j++) {
        const uint8_t *src = fa_row(a, a->v, j0 + j, hk);
        float *dst = vt + (size_t)j * Dp;
        if (a->dtype == KV_Q8_0) /* a block's scale once */
            for (int d = 0; d < D; d += KV_QBLOCK, src += KV_QBYTES) {
                const vf s = vset(q8_0_scale(src));
                for (int i = 0; i < KV_QBLOCK; i += VL) vstoreu(dst + d + i, vmul(s, vload_i8(src + 2 + i)));
            }
        else
            for (int d = 0; d < D; d += VL) vstoreu(dst + d, vload_kv(a->dtype, src, d));
        memset(dst + D, 0, (size_t)(Dp - D) * sizeof(float));
    }
}

/* The scores of keys j0.. (the tile's s, already times scale; soft-capped here) into each row's running softmax,
 * in log2 units: p = 2^(s log2 e - m). A row's max m moves only when a score passes it by more than FA_SLACK (the
 * first tile a row sees sets it): p then stays below 2^FA_SLACK, as safe in float32 sums and bfloat16 as below 1,
 * and most tiles of a long row skip the horizontal max and the rescaling (alpha 1). l: each row's sum, a vector of
 * partial sums. full: every row sees every key of the tile. */
static void fa_softmax(const fa_call *a, fa_tile *w, int r0, int r1, int64_t t0, int64_t j0, int n, int full) {
    enum { NV = FA_KT / VL };
    vf off[NV];
    for (int c = 0; c < NV; c++) {
        float o[VL];
        for (int i = 0; i < VL; i++) o[i] = (float)(c * VL + i);
        off[c] = vloadu(o);
    }
    for (int r = r0; r < r1; r++) {
        const int64_t t = t0 + r / a->G;
        /* the keys of this tile row r sees, as offsets from j0 (clamped: a float holds them exactly) */
        int64_t lo = fa_first(a, t) - j0, hi = a->pos0 + t - j0 < n - 1 ? a->pos0 + t - j0 : n - 1;
        lo = lo < 0 ? 0 : lo > FA_KT ? FA_KT : lo;
        hi = hi < -1 ? -1 : hi > FA_KT ? FA_KT : hi;
        const float *sr = w->s + (size_t)(r - r0) * FA_KT;
        vf s[NV], mx = vset(-INFINITY);
        for (int c = 0; c < NV; c++) {
            s[c] = vloadu(sr + c * VL);
            s[c] = vmul(a->softcap > 0.0f ? vsoftcap(s[c], a->softcap) : s[c], vset(FA_LOG2E));
            if (!full) s[c] = vkeep(off[c], (float)lo, (float)hi, s[c]);
            mx = vmax(mx, s[c]);
        }
        float m = w->m[r], al = 1.0f;
        const float m1 = vany_gt(mx, m + FA_SLACK) ? vhmax(mx) : m;
        if (m1 > FA_MASKED) {
            al = m == -INFINITY ? 0.0f : exp2f(m - m1);
            w->m[r] = m = m1;
        } else { /* nothing seen yet: this row's keys all lie in later tiles */
            w->alpha[r] = 1.0f;
            if (a->bf16) memset((uint16_t *)w->p + (size_t)(r - r0) * FA_KT, 0, FA_KT * 2);
            else memset((float *)w->p + (size_t)(r - r0) * FA_KT, 0, FA_KT * 4);
            continue;
        }
        const vf vm = vset(m);
        vf sum = vzero();
        for (int c = 0; c < NV; c++) {
            s[c] = vexp2(vsub(s[c], vm));
            sum = vadd(sum, s[c]);
        }
#ifdef FA_BF16
        if (a->bf16) {
            uint16_t *pr = (uint16_t *)w->p + (size_t)(r - r0) * FA_KT;
            for (int c = 0; c < NV; c += 2) _mm512_storeu_si512(pr + c * VL, (__m512i)_mm512_cvtne2ps_pbh(s[c + 1], s[c]));
        } else
#endif
        {
            float *pr = (float *)w->p + (size_t)(r - r0) * FA_KT;
            for (int c = 0; c < NV; c++) vstoreu(pr + c * VL, s[c]);
        }
        w->alpha[r] = al;
        float *l = w->l + (size_t)r * VL;
        vstoreu(l, vfmadd(vloadu(l), vset(al), sum));
    }
}

/* the next tile's K and V rows on their way while this one is multiplied: decode streams the cache from memory,
 * one head's few lines a row at a stride, where the hardware's prefetchers fell behind (decode at 16k tokens
 * ~1.3x slower without) */
static inline void fa_prefetch(const fa_call *a, int hk, int64_t j0, int64_t kb) {
    for (int64_t j = j0; j < j0 + FA_KT && j < kb; j++)
        for (size_t b = 0; b < a->head; b += 64) {
            __builtin_prefetch(fa_row(a, a->k, j, hk) + b, 0, 1); /* to L2: L1 holds this tile's work */
            __builtin_prefetch(fa_row(a, a->v, j, hk) + b, 0, 1);
        }
}

#ifdef FA_I8
/* the scores of rows r0..r1-1 against the packed int8 key tile (fa_pack_k8) */
static inline void fa_scores_i8(const fa_call *a, fa_tile *w, int r0, int r1) {
    gemm_kq8(r1 - r0, (const uint8_t *)w->q + (size_t)r0 * fa_qrow(a->D), fa_qrow(a->D), a->D / KV_QBLOCK, w->k,
             (const float *)((const uint8_t *)w->k + (size_t)a->D * FA_KT), w->s, FA_KT);
}
#endif

/* Queries t0..t1-1 of group hk over keys [ka, kb): each row's running max, sum and unnormalized output in w */
static void fa_run(const fa_call *a, fa_tile *w, int hk, int64_t t0, int64_t t1, int64_t ka, int64_t kb) {
    const int M = (int)(t1 - t0) * a->G, Dp = a->Dp, G = a->G;
    fa_pack_q(a, w, hk, t0, t1);
    for (int r = 0; r < M; r++) w->m[r] = -INFINITY;
    memset(w->l, 0, (size_t)M * VL * sizeof(float));
    memset(w->o, 0, (size_t)M * Dp * sizeof(float));
    for (int64_t j0 = ka; j0 < kb; j0 += FA_KT) {
        const int n = kb - j0 < FA_KT ? (int)(kb - j0) : FA_KT;
        fa_prefetch(a, hk, j0 + FA_KT, kb);
        fa_pack_kv(a, w, hk, j0, n);
        /* FA_RC rows at a time through scores, softmax and output: their scores stay in L1 */
        for (int r0 = 0; r0 < M; r0 += FA_RC) {
            const int r1 = r0 + FA_RC < M ? r0 + FA_RC : M;
            const int64_t ta = t0 + r0 / G, tb = t0 + (r1 - 1) / G;
            if (a->pos0 + tb < j0 || fa_first(a, ta) > j0 + n - 1) continue; /* these rows see none of the tile */
            const int full = n == FA_KT && fa_first(a, tb) <= j0 && a->pos0 + ta >= j0 + FA_KT - 1;
#ifdef FA_BF16
            if (a->bf16) {
                if (a->i8) fa_scores_i8(a, w, r0, r1);
                else
                    gemm_bf16(r1 - r0, FA_KT, (const uint32_t *)w->q + (size_t)r0 * Dp / 2, Dp / 2, w->k, FA_KT,
                              Dp / 2, w->s, FA_KT, NULL);
                fa_softmax(a, w, r0, r1, t0, j0, n, full);
                gemm_bf16(r1 - r0, Dp, w->p, FA_KT / 2, w->v, Dp, (n + 1) / 2, w->o + (size_t)r0 * Dp, Dp,
                          w->alpha + r0);
                continue;
            }
#endif
#ifdef FA_I8
            if (a->i8) fa_scores_i8(a, w, r0, r1);
            else
#endif
            gemm_f32(r1 - r0, FA_KT, (const float *)w->q + (size_t)r0 * Dp, Dp, w->k, FA_KT, Dp, w->s, FA_KT, NULL);
            fa_softmax(a, w, r0, r1, t0, j0, n, full);
            gemm_f32(r1 - r0, Dp, w->p, FA_KT, w->v, Dp, n, w->o + (size_t)r0 * Dp, Dp, w->alpha + r0);
        }
    }
}

#ifdef FA_I8
/* --- decode's few rows against a q8_0 cache: rows in lanes, nothing packed --------------------------------------
 *
 * With at most FA_FEW rows (one query's heads of a KV group) a key tile packed for the products above serves too
 * few rows to pay for its packing (two thirds of decode's time went there). Here the rows lie in the lanes of one
 * 256-bit vector instead, and the cache is read as it is stored:
 *   K.Q: each row's int8 query words (+128: vpdpbusd's unsigned side) one vector a word, the key's word broadcast
 *        from its row into vpdpbusd; lane 7 holds a zero query, so it sums 128 x the key's block, which every other
 *        lane subtracts; each block's sum times both scales. Four keys side by side: one key's chain of sums is
 *        bounded by the instruction's latency;
 *   softmax: a key's scores are one vector, so a tile's max is a vector max, and its probabilities one exp a key;
 *   P.V: each probability times its value block's scale, as int16 against the tile's largest for that row and
 *        block (2^-16 of it: finer than bfloat16's rounding of the other paths), two keys to a word; the values'
 *        int8 widened to int16, two keys interleaved number by number; vpdpwssd, int32 sums a tile, then scaled
 *        into the float32 output. The interleave leaves a block's 32 numbers permuted; undone at the end.
 * Each key's rows are fetched as the key a tile before it is read: at 16k keys from memory the tile-at-once
 * prefetch left two threads at a third of the machine's read bandwidth.
 * On the avx512bf16 build only, whose other products round to bfloat16 already: the avx512 one keeps P.V in
 * float32. Against the tiles, two threads (Zen 4): 0.5B's shapes (7 rows, 64 numbers) 10% faster in cache, 20%
 * from memory at 16k keys; 1.5B's (6, 128) 8% and 17%. */
#define FA_FEW 7 /* rows this path takes: lane 7 is the correction's */
/* acc + the dot products of a's uint8 with the int8 word at p, broadcast from memory in the instruction (the
 * compiler makes a separate broadcast of _mm256_set1_epi32) */
static inline __m256i fa_dpbusd_word(__m256i acc, __m256i a, const uint8_t *p) {
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*(const int32_t *)p));
    return acc;
}
#define FA_FEW_AHEAD FA_KT /* keys ahead whose rows are fetched as a key is read (128 and 256: no faster) */
#define FA_FEW_KEYS 4 /* keys whose scores are summed side by side */
#define FA_P16 32767.0f /* a tile's largest probability x value scale, as int16 */

/* rows r < R: acc[r][0..3] += row r's int16 pair of probabilities (pq[r]) . a block's values (vq, 4 vectors of
 * pairs of keys' int16 a pair) */
FA_ALWAYS void fa_few_pv(const int R, const uint32_t *pq, const __m256i *vq, int pairs, __m256i acc[4][4]) {
    for (int q = 0; q < pairs; q++, pq += 8, vq += 4)
        for (int r = 0; r < R; r++) {
            const __m256i p = _mm256_set1_epi32((int)pq[r]);
            for (int i = 0; i < 4; i++) acc[r][i] = _mm256_dpwssd_epi32(acc[r][i], p, _mm256_load_si256(vq + i));
        }
}

static inline __m256 fa_bhalf(const uint8_t *p) { /* a float16 at p, in every lane */
    int16_t h;
    memcpy(&h, p, 2);
    return _mm256_cvtph_ps(_mm_set1_epi16(h));
}

/* Queries t0..t1-1 of group hk over keys [ka, kb), M = (t1 - t0) G <= FA_FEW rows: as fa_run leaves them */
static void fa_run_few(const fa_call *a, fa_tile *w, int hk, int64_t t0, int64_t t1, int64_t ka, int64_t kb) {
    const int G = a->G, D = a->D, Dp = a->Dp, M = (int)(t1 - t0) * G, nb = D / KV_QBLOCK, nw = D / 4;
    /* scratch: the query words and scales where fa_run's key tile goes; scores, probabilities' words and the
     * values' interleave where its scores, probabilities and value tile go */
    __m256i *qt = (__m256i *)w->k;                  /* [nw] */
    __m256 *qd = (__m256 *)(qt + nw);               /* [nb] each row's block scale x log2 e; 0 past M */
    __m256 *S = (__m256 *)w->s;                     /* [FA_KT] a key's scores, rows in lanes */
    uint32_t *pq = (uint32_t *)w->p;                /* [FA_KT / 2][8] one block's probabilities, int16 pairs */
    __m256 *pf = (__m256 *)w->v;                    /* [nb][FA_KT] probabilities x value scales */
    __m256i *vq = (__m256i *)(pf + (size_t)nb * FA_KT); /* [FA_KT / 2][4] one block's values, pairs of keys */
    static const uint8_t zeros[KV_QBLOCK] __attribute__((aligned(64)));
    {
        uint8_t q8[FA_FEW + 1][256] = {{0}}; /* D <= 256 */
        float dq[FA_FEW + 1][8] = {{0}};
        const vf qs = vset(a->scale);
        for (int r = 0; r < M; r++) { /* as fa_pack_q */
            const float *src = a->q + ((size_t)(t0 + r / G) * a->H + (size_t)hk * G + r % G) * D;
            for (int b = 0; b < nb; b++)
                dq[r][b] = fa_quantize_block(src + KV_QBLOCK * b, qs, q8[r] + KV_QBLOCK * b, NULL) * FA_LOG2E;
        }
        for (int i = 0; i < nw; i++) {
            int32_t lanes[8];
            for (int r = 0; r < 8; r++) lanes[r] = fa_word(q8[r] + 4 * i) ^ (int32_t)0x80808080;
            qt[i] = _mm256_loadu_si256((const __m256i *)lanes);
        }
        for (int b = 0; b < nb; b++) {
            float lanes[8];
            for (int r = 0; r < 8; r++) lanes[r] = dq[r][b];
            qd[b] = _mm256_loadu_ps(lanes);
        }
    }
    /* each row's visible keys, as offsets from ka */
    int32_t lo_[8], hi_[8];
    for (int r = 0; r < 8; r++) {
        const int64_t t = t0 + (r < M ? r / G : 0);
        lo_[r] = (int32_t)(fa_first(a, t) - ka), hi_[r] = (int32_t)(a->pos0 + t - ka);
    }
    const __m256i lov = _mm256_loadu_si256((const __m256i *)lo_), hiv = _mm256_loadu_si256((const __m256i *)hi_);
    int32_t lo_max = lo_[0], hi_min = hi_[0];
    for (int r = 1; r < M; r++) lo_max = lo_[r] > lo_max ? lo_[r] : lo_max, hi_min = hi_[r] < hi_min ? hi_[r] : hi_min;
    __m256 m = _mm256_set1_ps(-INFINITY), l = _mm256_setzero_ps();
    float *o = w->o; /* [M][Dp], each block's numbers permuted until the end */
    memset(o, 0, (size_t)M * Dp * sizeof(float));
    const __m256i last = _mm256_set1_epi32(7);
    for (int64_t j0 = ka; j0 < kb; j0 += FA_KT) {
        const int n = kb - j0 < FA_KT ? (int)(kb - j0) : FA_KT;
        const int full = lo_max <= j0 - ka && hi_min >= j0 - ka + n - 1;
        if (j0 == ka) /* later keys' rows as the key FA_FEW_AHEAD before them is read */
            for (int64_t x = ka; x < ka + FA_FEW_AHEAD; x += FA_KT) fa_prefetch(a, hk, x, kb);
        /* K.Q: a key's scores, every row at once; four keys at a time, two sums a block each (independent chains:
         * vpdpbusd's latency, not its rate, bounded a key at a time) */
        __m256 tmax = _mm256_set1_ps(FA_MASKED);
        for (int j = 0; j < n; j += FA_FEW_KEYS) {
            const uint8_t *kr[FA_FEW_KEYS];
            __m256 s[FA_FEW_KEYS];
            for (int k = 0; k < FA_FEW_KEYS; k++)
                kr[k] = j + k < n ? fa_row(a, a->k, j0 + j + k, hk) : fa_row(a, a->k, j0 + j, hk), s[k] = _mm256_setzero_ps();
            for (int64_t x = j0 + j + FA_FEW_AHEAD; x < j0 + j + FA_FEW_AHEAD + FA_FEW_KEYS && x < kb; x++)
                for (size_t b = 0; b < a->head; b += 64) {
                    __builtin_prefetch(fa_row(a, a->k, x, hk) + b, 0, 1);
                    __builtin_prefetch(fa_row(a, a->v, x, hk) + b, 0, 1);
                }
            for (int b = 0; b < nb; b++) {
                __m256i acc[FA_FEW_KEYS][2];
                for (int k = 0; k < FA_FEW_KEYS; k++) acc[k][0] = acc[k][1] = _mm256_setzero_si256();
                for (int i = 0; i < KV_QBLOCK / 4; i++) {
                    const __m256i qw = qt[b * (KV_QBLOCK / 4) + i];
                    for (int k = 0; k < FA_FEW_KEYS; k++)
                        acc[k][i & 1] = fa_dpbusd_word(acc[k][i & 1], qw, kr[k] + b * KV_QBYTES + 2 + 4 * i);
                }
                for (int k = 0; k < FA_FEW_KEYS; k++) {
                    const __m256i x = _mm256_add_epi32(acc[k][0], acc[k][1]);
                    s[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(x, _mm256_permutevar8x32_epi32(x, last))),
                                           _mm256_mul_ps(qd[b], fa_bhalf(kr[k] + b * KV_QBYTES)), s[k]);
                }
            }
            for (int k = 0; k < FA_FEW_KEYS && j + k < n; k++) {
                if (!full) {
                    const __m256i jv = _mm256_set1_epi32((int32_t)(j0 - ka + j + k));
                    const __mmask8 seen = _mm256_cmpge_epi32_mask(jv, lov) & _mm256_cmple_epi32_mask(jv, hiv);
                    s[k] = _mm256_mask_blend_ps(seen, _mm256_set1_ps(FA_MASKED), s[k]);
                }
                S[j + k] = s[k];
                tmax = _mm256_max_ps(tmax, s[k]);
            }
        }
        /* the running max moves where a score passes it by more than FA_SLACK (fa_softmax) */
        __mmask8 move = _mm256_cmp_ps_mask(tmax, _mm256_add_ps(m, _mm256_set1_ps(FA_SLACK)), _CMP_GT_OQ) &
                        _mm256_cmp_ps_mask(tmax, _mm256_set1_ps(FA_MASKED), _CMP_GT_OQ);
        float alpha[8] = {1, 1, 1, 1, 1, 1, 1, 1};
        if (move) {
            float mo[8], mt[8];
            _mm256_storeu_ps(mo, m), _mm256_storeu_ps(mt, tmax);
            for (int r = 0; r < 8; r++)
                if (move >> r & 1) alpha[r] = mo[r] == -INFINITY ? 0.0f : exp2f(mo[r] - mt[r]), mo[r] = mt[r];
            m = _mm256_loadu_ps(mo);
            l = _mm256_mul_ps(l, _mm256_loadu_ps(alpha));
        }
        /* rows that have seen no key yet (max -inf) take 0: their masked scores give 0 */
        const __m256 mu = _mm256_mask_blend_ps(_mm256_cmp_ps_mask(m, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ), m,
                                               _mm256_setzero_ps());
        /* probabilities, times each value block's scale; each row's and block's largest */
        __m256 pmax[8];
        for (int b = 0; b < nb; b++) pmax[b] = _mm256_setzero_ps();
        __m256 lsum = _mm256_setzero_ps();
        const uint8_t *vrow[FA_KT]; /* each key's value row, found once a tile */
        const vf mu2 = _mm512_insertf32x8(_mm512_castps256_ps512(mu), mu, 1);
        for (int j = 0; j < n; j += 2) {
            const vf p2 = vexp2(vsub(_mm512_loadu_ps((const float *)(S + j)), mu2)); /* keys j, j + 1 */
            for (int h = 0; h < 2 && j + h < n; h++) {
                const __m256 p = h ? _mm512_extractf32x8_ps(p2, 1) : _mm512_castps512_ps256(p2);
                lsum = _mm256_add_ps(lsum, p);
                const uint8_t *vr = vrow[j + h] = fa_row(a, a->v, j0 + j + h, hk);
                for (int b = 0; b < nb; b++) {
                    const __m256 pv = _mm256_mul_ps(p, fa_bhalf(vr + b * KV_QBYTES));
                    pf[b * FA_KT + j + h] = pv;
                    pmax[b] = _mm256_max_ps(pmax[b], pv);
                }
            }
        }
        l = _mm256_add_ps(l, lsum);
        if (n & 1)
            for (int b = 0; b < nb; b++) pf[b * FA_KT + n] = _mm256_setzero_ps();
        /* per block: the probabilities' words, the values interleaved, the products, into the output */
        const int pairs = (n + 1) / 2;
        for (int b = 0; b < nb; b++) {
            const __m256 pm = pmax[b];
            const __mmask8 any = _mm256_cmp_ps_mask(pm, _mm256_setzero_ps(), _CMP_GT_OQ);
            const __m256 qs = _mm256_maskz_div_ps(any, _mm256_set1_ps(FA_P16), pm);
            for (int i = 0; i < pairs; i++) {
                const __m256 *x = pf + b * FA_KT + 2 * i;
                const __m256i u0 = _mm256_cvtps_epi32(_mm256_mul_ps(x[0], qs)), u1 = _mm256_cvtps_epi32(_mm256_mul_ps(x[1], qs));
                _mm256_storeu_si256((__m256i *)(pq + 8 * i), _mm256_or_si256(u0, _mm256_slli_epi32(u1, 16)));
                const uint8_t *r0 = vrow[2 * i] + b * KV_QBYTES + 2;
                const uint8_t *r1 = 2 * i + 1 < n ? vrow[2 * i + 1] + b * KV_QBYTES + 2 : zeros;
                const __m256i y0 = _mm256_loadu_si256((const __m256i *)r0), y1 = _mm256_loadu_si256((const __m256i *)r1);
                const __m256i a0 = _mm256_unpacklo_epi8(y0, y1), a1 = _mm256_unpackhi_epi8(y0, y1);
                /* numbers 0-7, 16-23, 8-15, 24-31, two keys each, int16 */
                _mm256_store_si256(vq + 4 * i + 0, _mm256_cvtepi8_epi16(_mm256_castsi256_si128(a0)));
                _mm256_store_si256(vq + 4 * i + 1, _mm256_cvtepi8_epi16(_mm256_extracti128_si256(a0, 1)));
                _mm256_store_si256(vq + 4 * i + 2, _mm256_cvtepi8_epi16(_mm256_castsi256_si128(a1)));
                _mm256_store_si256(vq + 4 * i + 3, _mm256_cvtepi8_epi16(_mm256_extracti128_si256(a1, 1)));
            }
            float ps[8];
            _mm256_storeu_ps(ps, _mm256_mul_ps(pm, _mm256_set1_ps(1.0f / FA_P16)));
            for (int r0 = 0; r0 < M; r0 += 4) {
                __m256i acc[4][4];
                for (int r = 0; r < 4; r++)
                    for (int i = 0; i < 4; i++) acc[r][i] = _mm256_setzero_si256();
                switch (M - r0 < 4 ? M - r0 : 4) {
                case 1: fa_few_pv(1, pq + r0, vq, pairs, acc); break;
                case 2: fa_few_pv(2, pq + r0, vq, pairs, acc); break;
                case 3: fa_few_pv(3, pq + r0, vq, pairs, acc); break;
                default: fa_few_pv(4, pq + r0, vq, pairs, acc); break;
                }
                for (int r = r0; r < M && r < r0 + 4; r++) {
                    float *orow = o + (size_t)r * Dp + b * KV_QBLOCK;
                    const __m256 f = _mm256_set1_ps(ps[r]), g = _mm256_set1_ps(alpha[r]);
                    for (int i = 0; i < 4; i++)
                        _mm256_storeu_ps(orow + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r - r0][i]), f,
                                                                      _mm256_mul_ps(_mm256_loadu_ps(orow + 8 * i), g)));
                }
            }
        }
    }
    /* what fa_run leaves: max, sum (the first of VL partial sums), output with each block's numbers in order */
    float mm[8], ll[8];
    _mm256_storeu_ps(mm, m), _mm256_storeu_ps(ll, l);
    for (int r = 0; r < M; r++) {
        w->m[r] = mm[r];
        memset(w->l + (size_t)r * VL, 0, VL * sizeof(float));
        w->l[(size_t)r * VL] = ll[r];
        float *orow = o + (size_t)r * Dp;
        for (int b = 0; b < nb; b++) {
            float x[KV_QBLOCK];
            memcpy(x, orow + b * KV_QBLOCK, sizeof x);
            for (int i = 0; i < 4; i++) /* vector i: numbers 0-7, 16-23, 8-15, 24-31 */
                memcpy(orow + b * KV_QBLOCK + (i & 1) * 16 + (i >> 1) * 8, x + 8 * i, 8 * sizeof(float));
        }
    }
}
#endif

/* fa_run, or fa_run_few where it applies */
static void fa_go(const fa_call *a, fa_tile *w, int hk, int64_t t0, int64_t t1, int64_t ka, int64_t kb) {
#ifdef FA_I8
    if (a->bf16 && a->i8 && (t1 - t0) * a->G <= FA_FEW && a->softcap == 0.0f && a->D <= 256) {
        fa_run_few(a, w, hk, t0, t1, ka, kb);
        return;
    }
#endif
    fa_run(a, w, hk, t0, t1, ka, kb);
}

/* the parts of one thread's tile of M rows, each rounded up to 64 bytes: q, k, v, s, p, o, then m, alpha, l */
static void fa_tile_sizes(int M, int Dp, size_t sizes[7]) {
    const size_t fl = sizeof(float), raw[7] = {(size_t)M * Dp * fl, (size_t)Dp * FA_KT * fl, (size_t)FA_KT * Dp * fl,
                                              (size_t)FA_RC * FA_KT * fl, (size_t)FA_RC * FA_KT * fl,
                                              (size_t)M * Dp * fl, (2 + VL) * (size_t)M * fl};
    for (int i = 0; i < 7; i++) sizes[i] = (raw[i] + 63) / 64 * 64;
}

static size_t fa_tile_bytes(int M, int Dp) {
    size_t sizes[7], total = 0;
    fa_tile_sizes(M, Dp, sizes);
    for (int i = 0; i < 7; i++) total += sizes[i];
    return total;
}

/* a tile of M rows in b (64-byte aligned, fa_tile_bytes(M, Dp) of them); all NULL where b is */
static fa_tile fa_tile_at(char *b, int M, int Dp) {
    size_t sizes[7];
    fa_tile_sizes(M, Dp, sizes);
    fa_tile w = {0};
    if (!b) return w;
    void *at[7];
    for (int i = 0; i < 7; i++) at[i] = b, b += sizes[i];
    w.q = at[0], w.k = at[1], w.v = at[2], w.s = at[3], w.p = at[4], w.o = at[5];
    w.m = at[6], w.alpha = w.m + M, w.l = w.alpha + M;
    return w;
}

static inline int64_t fa_query_tile(int G) { return G < FA_ROWS ? FA_ROWS / G : 1; }

/* an upper bound of the scratch attend_in takes for T queries at pos0.. (any window, any first key): each of
 * `threads` threads' tile, then the pieces' partials of flash-decoding */
static size_t attend_scratch_bytes(int Hk, int D, int64_t T, int H, int64_t pos0, int threads) {
    const int G = H / Hk, Dp = (D + FA_COLS - 1) / FA_COLS * FA_COLS;
    const int64_t QT = fa_query_tile(G), M = (QT < T ? QT : T) * G, pieces = (pos0 + T + FA_SPLIT - 1) / FA_SPLIT;
    return (size_t)threads * fa_tile_bytes((int)M, Dp) + (size_t)pieces * T * H * (D + 2) * sizeof(float);
}

/* softmax(q . K^T * scale) . V for T queries at positions pos0.. over the cache's rows; sinks (NULL: none): a
 * logit of each head's that joins its softmax and adds no value (gpt-oss). scratch: attend_scratch_bytes of
 * memory, 64-byte aligned, for `threads` threads; NULL: taken here. 0 when out of memory (never with scratch) */
static int attend_in(int dtype, const uint8_t *k, const uint8_t *v, int64_t cap, int ring, int Hk, int D,
                     const float *q, int64_t T, int H, int64_t pos0, int64_t key_lo, int64_t window, float scale,
                     float softcap, const float *sinks, float *out, int threads, char *scratch) {
    const int G = H / Hk, Dp = (D + FA_COLS - 1) / FA_COLS * FA_COLS;
    fa_call a = {dtype, ring, Hk, H, G, D, Dp, 0, 0, k, v, cap, kv_bytes(dtype, (int64_t)Hk * D), kv_bytes(dtype, D), q, T, pos0,
                 key_lo, window, scale, softcap};
#ifdef FA_BF16
    a.bf16 = dtype != KV_F32;
#endif
#ifdef FA_I8
    a.i8 = dtype == KV_Q8_0;
#endif
    const int64_t QT = fa_query_tile(G), tiles = (T + QT - 1) / QT;
    /* one tile of queries: its keys cut into pieces, each piece's partial (m, l, o) of every row, merged after */
    const int64_t ka = fa_first(&a, 0), span = pos0 + T - ka;
    const int64_t pieces = tiles == 1 ? (span + FA_SPLIT - 1) / FA_SPLIT : 1, items = pieces > 1 ? pieces : Hk * tiles;
    const size_t stride = (size_t)T * H * (D + 2); /* a piece's partials: m [T * H], l [T * H], o [T * H][D] */
    const int M = (int)(QT < T ? QT : T) * G;
    const size_t tile_bytes = fa_tile_bytes(M, Dp);
    float *part = pieces <= 1 ? NULL
                  : scratch   ? (float *)(scratch + (size_t)threads * tile_bytes)
                              : malloc((size_t)pieces * stride * sizeof(float));
    if (pieces > 1 && !part) return 0;
    const float sink_scale = FA_LOG2E;
    int failed = 0;
    const int nt = threads < items ? threads : (int)items;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
#ifdef _OPENMP
        const int id = omp_get_thread_num();
#else
        const int id = 0;
#endif
        fa_tile w = fa_tile_at(scratch ? scratch + (size_t)id * tile_bytes : aligned_alloc(64, tile_bytes), M, Dp);
        failed = !w.q;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            if (!w.q) continue;
            if (pieces > 1) { /* every group of one piece: its rows, all KV heads, are read from memory once */
                const int64_t c = i, lo = ka + c * FA_SPLIT, hi = lo + FA_SPLIT < ka + span ? lo + FA_SPLIT : ka + span;
                float *m = part + (size_t)c * stride, *l = m + T * H, *o = l + T * H;
                for (int hk = 0; hk < Hk; hk++) {
                    fa_go(&a, &w, hk, 0, T, lo, hi);
                    for (int64_t t = 0; t < T; t++)
                        for (int g = 0; g < G; g++) {
                            const int64_t r = t * G + g, h = t * H + hk * G + g;
                            m[h] = w.m[r], l[h] = vsum(vloadu(w.l + r * VL));
                            memcpy(o + h * D, w.o + r * Dp, (size_t)D * sizeof(float));
                        }
                }
                continue;
            }
            const int hk = (int)(i % Hk);
            /* the tiles of the last queries, which see the most keys, first */
            const int64_t qt = tiles - 1 - i / Hk, t0 = qt * QT, t1 = t0 + QT < T ? t0 + QT : T;
            fa_go(&a, &w, hk, t0, t1, fa_first(&a, t0), pos0 + t1);
            for (int64_t t = t0; t < t1; t++)
                for (int g = 0; g < G; g++) {
                    const int64_t r = (t - t0) * G + g, h = hk * G + g;
                    float mx = w.m[r], sum = vsum(vloadu(w.l + r * VL)), wo = 1.0f;
                    if (sinks) {
                        const float s = sinks[h] * sink_scale;
                        mx = s > mx ? s : mx;
                        wo = exp2f(w.m[r] - mx);
                        sum = sum * wo + exp2f(s - mx);
                    }
                    const float f = wo / sum, *o = w.o + r * Dp;
                    float *dst = out + ((size_t)t * H + h) * D;
                    for (int d = 0; d < D; d++) dst[d] = o[d] * f;
                }
        }
        if (!scratch) free(w.q);
        if (pieces > 1) { /* merge each row's pieces: rescaled to the overall max, summed, normalized */
#pragma omp for schedule(static)
            for (int64_t th = 0; th < T * H; th++) {
                const int64_t h = th % H;
                float mx = sinks ? sinks[h] * sink_scale : -INFINITY, sum = 0.0f;
                for (int64_t c = 0; c < pieces; c++) {
                    const float mc = part[(size_t)c * stride + th];
                    mx = mc > mx ? mc : mx;
                }
                float *dst = out + (size_t)th * D;
                memset(dst, 0, (size_t)D * sizeof(float));
                for (int64_t c = 0; c < pieces; c++) {
                    const float *m = part + (size_t)c * stride, *l = m + T * H, *o = l + T * H + th * D;
                    if (l[th] == 0.0f) continue;
                    const float f = exp2f(m[th] - mx);
                    sum += f * l[th];
                    for (int d = 0; d < D; d++) dst[d] += f * o[d];
                }
                if (sinks) sum += exp2f(sinks[h] * sink_scale - mx);
                const float inv = 1.0f / sum;
                for (int d = 0; d < D; d++) dst[d] *= inv;
            }
        }
    }
    if (!scratch) free(part);
    return !failed;
}

static int attend_mt(int dtype, const uint8_t *k, const uint8_t *v, int64_t cap, int ring, int Hk, int D,
                     const float *q, int64_t T, int H, int64_t pos0, int64_t key_lo, int64_t window, float scale,
                     float softcap, const float *sinks, float *out, int threads) {
    return attend_in(dtype, k, v, cap, ring, Hk, D, q, T, H, pos0, key_lo, window, scale, softcap, sinks, out,
                     threads, NULL);
}
