#pragma once
#include "blocks.h" /* what this file uses; each header stands alone */
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

/* block b's scale d, and its two 16-value halves' code sums sa and sc times it */
static inline void xq_scales32(xq_t *o, int64_t b, float d, float sa, float sc) {
    o->d[b] = d;
    o->s16[2 * b] = d * sa;
    o->s16[2 * b + 1] = d * sc;
    o->s32[b] = d * (sa + sc);
}

static xq_t xq_at(char *m, int64_t cols) {
    const int64_t g = cols / 32;
    float *f = (float *)(m + 2 * cols);
    int16_t *bk = (int16_t *)(f + 4 * g + cols / 256);
    return (xq_t){(int8_t *)m, f, f + g, f + 2 * g, (int8_t *)(m + cols), f + 4 * g, bk, bk + g};
}

#endif

#include "x86/dots_vnni.h"
#include "x86/dots_avx2.h"
#include "arm/dots_neon.h"

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
DOTS(q4_0)
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
    case T_Q4_0: return dots_q4_0;
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

