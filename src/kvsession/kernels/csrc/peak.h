#pragma once
#include "blocks.h" /* what this file uses; each header stands alone */
#include "dots.h"
/* The arithmetic peak of the build's product instructions, for the benchmark's ratios (bench/attention.py): each
 * thread runs n rounds of 12 independent ones (more than their latency times their throughput, so that nothing
 * waits) on registers zeroed first (no denormal or NaN to slow any of them), the whole loop one piece of assembly
 * that no compiler folds away. Included by isa.h.
 *
 * Kinds: PEAK_F32 (FMAs: 2 floating-point operations a lane), PEAK_BF16 (vdpbf16ps: 4 a 32-bit lane),
 * PEAK_INT8 (vpdpbusd: 8 a lane). Returns the operations done by all threads, 0 where the build has no such
 * instruction (the AVX2 build's int8 products take three instructions, vpmaddubsw, vpmaddwd and vpaddd, and have
 * no single one to count). */

enum { PEAK_F32 = 0, PEAK_BF16 = 1, PEAK_INT8 = 2 };

#if defined(__x86_64__) && (defined(VNNI) || defined(AVX2_DOTS))
#if defined(VNNI)
#define PEAK_REG "zmm"
#define PEAK_LANES 16
#define PEAK_ZERO(i) "vpxord %%zmm" #i ", %%zmm" #i ", %%zmm" #i "\n"
#else
#define PEAK_REG "ymm"
#define PEAK_LANES 8
#define PEAK_ZERO(i) "vpxor %%ymm" #i ", %%ymm" #i ", %%ymm" #i "\n"
#endif
#define PEAK_ONE(op, i) op " %%" PEAK_REG "12, %%" PEAK_REG "13, %%" PEAK_REG #i "\n"
#define PEAK_12(f, x)                                                                                        \
    f(x, 0) f(x, 1) f(x, 2) f(x, 3) f(x, 4) f(x, 5) f(x, 6) f(x, 7) f(x, 8) f(x, 9) f(x, 10) f(x, 11)
#define PEAK_ZERO_X(x, i) PEAK_ZERO(i)
#define PEAK_LOOP(op)                                                                                        \
    __asm__ volatile(PEAK_12(PEAK_ZERO_X, _) PEAK_ZERO(12) PEAK_ZERO(13)                                      \
                     "1:\n" PEAK_12(PEAK_ONE, op) "dec %0\n"                                                  \
                     "jnz 1b\n"                                                                              \
                     : "+r"(left)::"cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",  \
                       "xmm9", "xmm10", "xmm11", "xmm12", "xmm13")

static double peak_run(int kind, int64_t n, int threads) {
    double per = 0.0; /* operations a round of 12 */
    if (kind == PEAK_F32) per = 12.0 * PEAK_LANES * 2;
#if defined(__AVX512BF16__)
    if (kind == PEAK_BF16) per = 12.0 * PEAK_LANES * 4;
#endif
#if defined(VNNI)
    if (kind == PEAK_INT8) per = 12.0 * PEAK_LANES * 8;
#endif
    if (per == 0.0 || n < 1) return 0.0;
    double done = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : done)
    {
        int64_t left = n;
        done += per * (double)n;
        if (kind == PEAK_F32) PEAK_LOOP("vfmadd231ps");
#if defined(__AVX512BF16__)
        if (kind == PEAK_BF16) PEAK_LOOP("vdpbf16ps");
#endif
#if defined(VNNI)
        if (kind == PEAK_INT8) PEAK_LOOP("vpdpbusd");
#endif
    }
    return done;
}
#else
static double peak_run(int kind, int64_t n, int threads) {
    (void)kind, (void)n, (void)threads;
    return 0.0;
}
#endif
