#pragma once
/* The kernels, compiled once per instruction set: isa_generic.c, isa_avx2.c, isa_avx512*.c and isa_neon*.c each
 * define KERNELS_NAME and include this file under their own compiler flags (setup.py), and the instruction set's
 * macros (__AVX2__, __AVX512F__, __AVX512VNNI__, __ARM_FEATURE_DOTPROD, ...) choose each operation's variant;
 * NEON, which every AArch64 compiler assumes, is chosen by isa_neon*.c's NEON_DOTS. What each file holds:
 *
 *   blocks.h  one block to floats per type (ggml's dequantize_row_*), the float products, the type table
 *   dots.h    the int8 products of a few tokens (decode: AVX512-VNNI, AVX2 or NEON), and matmul_mt over them
 *   gemm.h    prefill's int8 GEMM (AVX512-VNNI or AVX2)
 *   attend.h  flash attention over the cache's rows (a prompt's chunk, decode)
 *   stack.h   every layer for a few tokens in one call (decode)
 *   peak.h    the product instructions' arithmetic peak (the benchmark's yardstick)
 *
 * Every block type dequantizes to exactly the values ggml's dequantize_row_* gives (same formulas, same float
 * operations in the same order); tests/test_kernels.py holds each against gguf.quants, under every build the
 * host can run. Threads come from the OpenMP runtime PyTorch has already loaded (the same libgomp.so.1). */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"
#include "half.h"

#define QK 32
#define QKK 256

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}


/* Threads: at most `threads`, and no more than one per `grain` rows, so that a small matrix is not cut
 * into pieces that cost more to hand out than to multiply. */
static inline int team(int threads, int64_t rows, int64_t grain) {
    int64_t most = rows / grain;
    if (most < 1) most = 1;
    return (int)(threads < most ? threads : most);
}


#include "blocks.h"
#include "dots.h"
#include "attend.h"
#include "gemm.h"
#include "stack.h"
#include "peak.h"

/* --- the entry points (kernels.h) ------------------------------------------------------------------------ */

static int k_block_size(int type, int *values, int *bytes, int *rounds, int *gemm) {
    const block_type *bt = find_type(type);
    if (!bt) return 0;
    *values = bt->values, *bytes = bt->bytes;
#ifdef INT8_DOTS
    *rounds = rounds_of(type);
#else
    *rounds = 0;
#endif
#ifdef INT8_GEMM
    *gemm = find_gemm(type) != NULL;
#else
    *gemm = 0;
#endif
    return 1;
}

static void k_matmul(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x, int64_t T, float *y,
                     int threads) {
    matmul_mt(find_type(type), w, rows, cols, x, T, y, threads);
}

static int k_gemm(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x, int64_t ldx, int64_t T,
                  float *y, int64_t ldy, int threads) {
#ifdef INT8_GEMM
    return gemm_i8(find_type(type), find_gemm(type), w, rows, cols, x, ldx, T, y, ldy, threads);
#else
    (void)type, (void)w, (void)rows, (void)cols, (void)x, (void)ldx, (void)T, (void)y, (void)ldy, (void)threads;
    return 0; /* module.c calls it only for types whose block_size says gemm */
#endif
}

static void k_dequant(int type, const uint8_t *w, int64_t rows, int64_t cols, void *out, int bf16, int threads) {
    const block_type *bt = find_type(type);
#pragma omp parallel for num_threads(team(threads, rows, 64)) schedule(static)
    for (int64_t r = 0; r < rows; r += 16) bt->dequant(w, r, r + 16 < rows ? r + 16 : rows, cols, out, bf16);
}

static void k_gather(int type, const uint8_t *w, int64_t cols, const int64_t *ids, int64_t n, float *out) {
    const block_type *bt = find_type(type);
    const size_t row_bytes = (size_t)(cols / bt->values) * bt->bytes;
    for (int64_t i = 0; i < n; i++) bt->dequant(w + ids[i] * row_bytes, 0, 1, cols, out + i * cols, 0);
}

/* prefill's FFN (decode's stack does the same in activate) */
static void k_gelu_mul(const float *gu, int64_t T, int64_t dff, float *out, int threads) {
#pragma omp parallel for num_threads(team(threads, T, 4)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + 2 * dff * t, *u = g + dff;
        float *o = out + dff * t;
        for (int64_t i = 0; i < dff; i++) o[i] = gelu(g[i]) * u[i];
    }
}

const kernels_t KERNELS_NAME = {
    .name = KERNELS_ISA,
    .block_size = k_block_size,
#ifdef INT8_DOTS
    .token_tiles = MAX_NT > 1,
#else
    .token_tiles = 0,
#endif
#ifdef FA_BF16
    .attend_bf16 = 1,
#endif
#ifdef FA_I8
    .attend_int8 = 1,
#endif
    .matmul = k_matmul,
    .gemm = k_gemm,
    .dequant = k_dequant,
    .gather = k_gather,
    .gelu_mul = k_gelu_mul,
    .attend = attend_mt,
    .run = stack_run,
    .experts = experts_step,
    .peak = peak_run,
};
