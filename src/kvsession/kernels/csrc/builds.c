/* Every build of the kernels made for this architecture, whether this CPU runs each, and the tables they all
 * read: plain C without Python, so that module.c and a standalone harness (tests/neon/harness.c) pick builds and
 * fill the tables the same way. */
#include <math.h>
#include <string.h>
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

#include "kernels.h"
#include "half.h"

float gelu_table[65536];
float e8m0_half_table[256];

const kernels_t *const kernel_builds[] = {
#if defined(__x86_64__) || defined(_M_X64)
    &kernels_avx512bf16, &kernels_avx512, &kernels_avx2,
#endif
#if defined(__aarch64__)
    &kernels_neon_dotprod, &kernels_neon,
#endif
    &kernels_generic,
};
const int n_kernel_builds = sizeof kernel_builds / sizeof kernel_builds[0];

int build_runs(const kernels_t *k) {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    if (k == &kernels_avx512bf16) return build_runs(&kernels_avx512) && __builtin_cpu_supports("avx512bf16");
    if (k == &kernels_avx512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("bmi2");
    if (k == &kernels_avx2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2");
#endif
#if defined(__aarch64__)
    if (k == &kernels_neon) return 1; /* NEON is in every AArch64 CPU */
#if defined(__linux__) /* elsewhere (macOS) the neon build: this is the only check made here */
    if (k == &kernels_neon_dotprod) return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#endif
#endif
    return k == &kernels_generic;
}

void q8_0_row(const float *x, uint8_t *out, int64_t n) {
    for (int64_t b = 0; b < n; b += KV_QBLOCK, out += KV_QBYTES) {
        float amax = 0.0f;
        for (int j = 0; j < KV_QBLOCK; j++) amax = fabsf(x[b + j]) > amax ? fabsf(x[b + j]) : amax;
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const uint16_t h = float_to_half(d);
        memcpy(out, &h, 2);
        for (int j = 0; j < KV_QBLOCK; j++) out[2 + j] = (uint8_t)(int8_t)roundf(x[b + j] * id);
    }
}

void tables_init(void) {
    for (int e = 0; e < 256; e++) {
        const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
        memcpy(&e8m0_half_table[e], &bits, 4);
    }
    for (int i = 0; i < 65536; i++) {
        const float xh = half_to_float((uint16_t)i); /* ggml_gelu_f32, as ggml writes it, rounded to float16 */
        gelu_table[i] = half_to_float(float_to_half(
            0.5f * xh * (1.0f + tanhf(0.79788456080286535587989211986876f * xh * (1.0f + 0.044715f * xh * xh)))));
    }
}
