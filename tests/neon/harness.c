/* The NEON int8 products (src/kvsession/kernels/csrc/dots.h) held to the portable build, without ARM hardware.
 *
 * tests/test_kernels_neon.py cross-compiles this with the kernels' builds (aarch64-linux-gnu-gcc -static, each
 * build with setup.py's flags) and runs it under qemu-aarch64. For every type with an int8 product, in every
 * NEON build the CPU runs (builds.c's own check, the one module.c makes), on random blocks:
 *
 *   exact     integer weights (every scale 1) and integer activations, 127 the largest magnitude of each 32, so
 *             that rounding them is the identity: each output is the integer sum, bit for bit;
 *   extremes  every byte of the blocks 0x00, 0x7F, 0x80 or 0xFF (scales 1), every activation +127 or -127: the
 *             largest sums there are, where a wrapped 16-bit pair sum would show, to float rounding;
 *   random    random scales and activations: within 1e-5 of the largest output, the float64 product of the
 *             generic build's dequantized weights (gguf's bit for bit: tests/test_kernels.py) with the
 *             activations rounded as the kernels round them (one scale a `rounds` values, half to even);
 *   tokens    a token's outputs the same, bit for bit, multiplied alone or beside others;
 *   builds    neon and neon_dotprod's outputs equal, bit for bit (their int32 lanes are the same).
 *
 * And attention (attend.h's flash attention, float32 products on every AArch64 build) in every build the CPU
 * runs, generic included, against float64 attention to 1e-5 of the largest value: one query whose keys are cut
 * among pieces, a prompt's chunk, a wrapped ring whose window crosses key tiles, soft-cap, sinks, GQA ratios 1 to
 * 8 and head sizes 64 to 256, on a float16 cache.
 *
 * It prints the builds the CPU runs, a line a failure and a summary, and exits 1 on any failure. */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "half.h"

/* the types with an int8 product, most used first: where each keeps its float16 scales (byte offsets; MXFP4's
 * one scale is an E8M0 byte at 0), and how block_size must say its activations are rounded */
typedef struct {
    int type;
    const char *name;
    int n_scales, scales[2];
    int rounds;
} type_t;

static const type_t TYPES[] = {
    {T_Q4_K, "q4_k", 2, {0, 2}, 256}, {T_Q6_K, "q6_k", 1, {208}, 256},  {T_Q8_0, "q8_0", 1, {0}, 32},
    {T_Q5_0, "q5_0", 1, {0}, 32},     {T_Q4_1, "q4_1", 2, {0, 2}, 32},  {T_IQ4_NL, "iq4_nl", 1, {0}, 32},
    {T_IQ4_XS, "iq4_xs", 1, {0}, 32}, {T_MXFP4, "mxfp4", 0, {0}, 32},
};
#define N_TYPES (int)(sizeof TYPES / sizeof TYPES[0])

static int failures, checks;

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    failures++;
}

static uint64_t state = 0x9E3779B97F4A7C15u;

static uint64_t next(void) { /* splitmix64 */
    uint64_t z = (state += 0x9E3779B97F4A7C15u);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9u;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBu;
    return z ^ (z >> 31);
}

static double uniform(void) { return (double)(next() >> 11) * 0x1.0p-53; }

static float normal(void) { return (float)(sqrt(-2.0 * log(1.0 - uniform())) * cos(6.283185307179586 * uniform())); }

/* rows of blocks: every byte `fill` (random where fill < 0), then the scales 1, or where random_scales uniform in
 * [0.001, 0.05] (MXFP4's power of two in 2^-64 .. 2^-1) */
static uint8_t *blocks(const type_t *t, int bytes, int n, int fill, int random_scales) {
    uint8_t *w = malloc((size_t)n * bytes);
    for (int i = 0; i < n * bytes; i++) w[i] = fill < 0 ? (uint8_t)next() : (uint8_t)fill;
    for (int i = 0; i < n; i++) {
        uint8_t *b = w + (size_t)i * bytes;
        if (t->type == T_MXFP4) b[0] = random_scales ? (uint8_t)(64 + next() % 64) : 128; /* 2^(e - 128) */
        for (int s = 0; s < t->n_scales; s++) {
            const uint16_t h = float_to_half(random_scales ? (float)(0.001 + 0.049 * uniform()) : 1.0f);
            memcpy(b + t->scales[s], &h, 2);
        }
    }
    return w;
}

/* x [T, cols] rounded as the kernels round it: one scale a `rounds` values, x * (127 / amax) half to even */
static void rounded(const float *x, int64_t n, int rounds, double *xr) {
    for (int64_t g = 0; g < n; g += rounds) {
        float amax = 0.0f;
        for (int j = 0; j < rounds; j++) amax = fmaxf(amax, fabsf(x[g + j]));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f, d = amax / 127.0f;
        for (int j = 0; j < rounds; j++) xr[g + j] = (double)nearbyintf(x[g + j] * id) * (double)d;
    }
}

/* want [T, rows] = xr [T, cols] . W^T in float64, W dequantized by the generic build */
static double *reference(const type_t *t, const uint8_t *w, int rows, int cols, const double *xr, int T) {
    float *deq = malloc(sizeof(float) * rows * cols);
    kernels_generic.dequant(t->type, w, rows, cols, deq, 0, 1);
    double *want = calloc((size_t)T * rows, sizeof(double));
    for (int s = 0; s < T; s++)
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) want[s * rows + r] += (double)deq[r * cols + c] * xr[s * cols + c];
    free(deq);
    return want;
}

/* integer weights and activations: outputs equal to the integer sums */
static void exact(const kernels_t *k, const type_t *t, int bytes, int values) {
    enum { rows = 16, cols = 512, T = 3 };
    uint8_t *w = blocks(t, bytes, rows * cols / values, -1, 0);
    float x[T * cols], got[T * rows];
    double xr[T * cols];
    for (int i = 0; i < T * cols; i++) x[i] = (float)((int)(next() % 255) - 127);
    for (int g = 0; g < T * cols; g += 32) x[g + next() % 32] = next() & 1 ? 127.0f : -127.0f;
    for (int i = 0; i < T * cols; i++) xr[i] = x[i];
    double *want = reference(t, w, rows, cols, xr, T);
    k->matmul(t->type, w, rows, cols, x, T, got, 1);
    for (int i = 0; i < T * rows; i++, checks++) {
        if (fabs(want[i]) >= 0x1p24 || want[i] != rint(want[i]))
            fail("%s %s exact: the sum %.17g is no integer below 2^24 (the test's data)", k->name, t->name, want[i]);
        else if ((double)got[i] != want[i])
            fail("%s %s exact: token %d row %d: %.9g, the integer sum is %.17g", k->name, t->name, i / rows, i % rows,
                 got[i], want[i]);
    }
    free(want);
    free(w);
}

/* the largest sums: every byte one value, every activation +-127 */
static void extremes(const kernels_t *k, const type_t *t, int bytes, int values) {
    enum { rows = 2, cols = 512 };
    static const int FILLS[] = {0x00, 0x7F, 0x80, 0xFF};
    for (int f = 0; f < 4; f++)
        for (int sign = -1; sign <= 1; sign += 2) {
            uint8_t *w = blocks(t, bytes, rows * cols / values, FILLS[f], 0);
            float x[cols], got[rows];
            double xr[cols];
            for (int i = 0; i < cols; i++) x[i] = (float)(127 * sign), xr[i] = x[i];
            double *want = reference(t, w, rows, cols, xr, 1);
            k->matmul(t->type, w, rows, cols, x, 1, got, 1);
            for (int r = 0; r < rows; r++, checks++)
                if (fabs(got[r] - want[r]) > 1e-6 * fmax(1.0, fabs(want[r])))
                    fail("%s %s extremes: bytes 0x%02X, activations %+d: %.9g, the integer sum is %.17g", k->name,
                         t->name, FILLS[f], 127 * sign, got[r], want[r]);
            free(want);
            free(w);
        }
}

/* random scales and activations, against float64; each token alone; returns the outputs [T, rows] */
static float *random_case(const kernels_t *k, const type_t *t, int bytes, int values, int *n) {
    enum { rows = 37, cols = 768, T = 5 }; /* 5 tokens: one tile of MAX_NT (4) and one alone */
    state = 1000 + (uint64_t)t->type; /* the same blocks and activations in every build, so that they compare */
    uint8_t *w = blocks(t, bytes, rows * cols / values, -1, 1);
    float x[T * cols], *got = malloc(sizeof(float) * T * rows), one[rows];
    double xr[T * cols];
    for (int i = 0; i < T * cols; i++) x[i] = normal();
    rounded(x, T * cols, t->rounds, xr);
    double *want = reference(t, w, rows, cols, xr, T);
    k->matmul(t->type, w, rows, cols, x, T, got, 1);
    double scale = 0.0, err = 0.0;
    for (int i = 0; i < T * rows; i++) scale = fmax(scale, fabs(want[i])), err = fmax(err, fabs(got[i] - want[i]));
    checks++;
    if (!(err <= 1e-5 * scale)) fail("%s %s random: off by %.3g, more than 1e-5 of %.6g", k->name, t->name, err, scale);
    for (int s = 0; s < T; s++, checks++) {
        k->matmul(t->type, w, rows, cols, x + s * cols, 1, one, 1);
        if (memcmp(one, got + s * rows, sizeof one))
            fail("%s %s tokens: token %d's outputs alone differ from its outputs beside %d others", k->name, t->name,
                 s, T - 1);
    }
    free(want);
    free(w);
    *n = T * rows;
    return got;
}

/* one attention case: H query heads over Hk KV heads of D numbers, T queries from pos0, a float16 cache of cap
 * rows (a ring: row p % cap) holding keys key_lo.. */
typedef struct {
    int H, Hk, D, T, pos0, ring, window, cap, key_lo;
    float softcap, qscale;
    int sinks;
} attn_case_t;

static const attn_case_t ATTN[] = {
    {8, 2, 64, 1, 1000, 0, 0, 1001, 0, 0.0f, 1.0f, 0}, /* decode: its keys cut into pieces */
    {6, 2, 128, 70, 200, 0, 0, 270, 0, 0.0f, 1.0f, 0}, /* a prompt's chunk, off the tiles' edges */
    {8, 1, 80, 3, 997, 0, 0, 1000, 0, 0.0f, 1.0f, 0},  /* 8 heads a KV head, half a register's tail */
    {8, 2, 64, 130, 4870, 1, 100, 612, 4488, 0.0f, 1.0f, 0}, /* a wrapped ring, the window across tiles */
    {8, 4, 256, 40, 650, 1, 128, 640, 0, 2.0f, 4.0f, 0},     /* soft-cap, scores well past it */
    {8, 8, 64, 20, 500, 0, 0, 520, 0, 0.0f, 1.0f, 1},        /* sinks, one head a KV head */
};
#define N_ATTN (int)(sizeof ATTN / sizeof ATTN[0])

/* got [T, H, D] against float64 attention: within 1e-5 of the largest value */
static void check_attention(const kernels_t *k, const attn_case_t *c, const uint16_t *kc, const uint16_t *vc,
                            const float *q, const float *sinks, float scale, const float *got) {
    const int H = c->H, Hk = c->Hk, D = c->D, T = c->T, G = H / Hk;
    const size_t nkv = (size_t)c->cap * Hk * D;
    double err = 0.0, vmax = 0.0;
    for (size_t i = 0; i < nkv; i++) vmax = fmax(vmax, fabs(half_to_float(vc[i])));
    double *s = malloc(sizeof(double) * (c->pos0 + T)), *o = malloc(sizeof(double) * D);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            const int p = c->pos0 + t, hk = h / G;
            int first = c->window ? p - c->window + 1 : 0;
            first = first > c->key_lo ? first : c->key_lo;
            double m = c->sinks ? sinks[h] : -INFINITY, sum = 0.0;
            for (int j = first; j <= p; j++) {
                const uint16_t *kr = kc + ((size_t)(c->ring ? j % c->cap : j) * Hk + hk) * D;
                double x = 0.0;
                for (int d = 0; d < D; d++) x += (double)q[((size_t)t * H + h) * D + d] * half_to_float(kr[d]);
                x *= scale;
                if (c->softcap > 0.0f) x = c->softcap * tanh(x / c->softcap);
                s[j] = x, m = fmax(m, x);
            }
            memset(o, 0, sizeof(double) * D);
            for (int j = first; j <= p; j++) {
                const uint16_t *vr = vc + ((size_t)(c->ring ? j % c->cap : j) * Hk + hk) * D;
                const double e = exp(s[j] - m);
                sum += e;
                for (int d = 0; d < D; d++) o[d] += e * half_to_float(vr[d]);
            }
            if (c->sinks) sum += exp(sinks[h] - m);
            for (int d = 0; d < D; d++) err = fmax(err, fabs(got[((size_t)t * H + h) * D + d] - o[d] / sum));
        }
    if (!(err <= 1e-5 * vmax))
        fail("%s attention case %d: off by %.3g, more than 1e-5 of %.3g", k->name, (int)(c - ATTN), err, vmax);
    free(s);
    free(o);
}

static void attention(const kernels_t *k, const attn_case_t *c) {
    const int H = c->H, Hk = c->Hk, D = c->D, T = c->T;
    state = 2000 + (uint64_t)(c - ATTN);
    const size_t nkv = (size_t)c->cap * Hk * D;
    uint16_t *kc = malloc(2 * nkv), *vc = malloc(2 * nkv);
    float *q = malloc(sizeof(float) * T * H * D), *got = malloc(sizeof(float) * T * H * D), sinks[256];
    for (size_t i = 0; i < nkv; i++) kc[i] = float_to_half(normal()), vc[i] = float_to_half(normal());
    for (int i = 0; i < T * H * D; i++) q[i] = c->qscale * normal();
    for (int h = 0; h < H; h++) sinks[h] = 3.0f * normal();
    const float scale = 1.0f / sqrtf((float)D);
    checks++;
    if (!k->attend(KV_F16, (const uint8_t *)kc, (const uint8_t *)vc, c->cap, c->ring, Hk, D, q, T, H, c->pos0,
                   c->key_lo, c->window, scale, c->softcap, c->sinks ? sinks : NULL, got, 2))
        fail("%s attention case %d: out of memory", k->name, (int)(c - ATTN));
    else
        check_attention(k, c, kc, vc, q, sinks, scale, got);
    free(kc);
    free(vc);
    free(q);
    free(got);
}

int main(void) {
    tables_init();
    printf("builds this CPU runs:");
    for (int i = 0; i < n_kernel_builds; i++)
        if (build_runs(kernel_builds[i])) printf(" %s", kernel_builds[i]->name);
    printf("\n");
    float *first[N_TYPES] = {0}; /* the first NEON build's random outputs, each type */
    const char *first_name = NULL;
    for (int i = 0; i < n_kernel_builds; i++) {
        const kernels_t *k = kernel_builds[i];
        if (strncmp(k->name, "neon", 4) || !build_runs(k)) continue;
        char checked[256] = "";
        for (int j = 0; j < N_TYPES; j++) {
            const type_t *t = &TYPES[j];
            int values, bytes, rounds, gemm, n;
            checks++;
            if (!k->block_size(t->type, &values, &bytes, &rounds, &gemm) || rounds != t->rounds) {
                fail("%s %s: no int8 product with one scale a %d values", k->name, t->name, t->rounds);
                continue;
            }
            exact(k, t, bytes, values);
            extremes(k, t, bytes, values);
            float *got = random_case(k, t, bytes, values, &n);
            checks++;
            if (!first[j])
                first[j] = got;
            else if (memcmp(first[j], got, sizeof(float) * n))
                fail("%s %s builds: the outputs differ from %s's", k->name, t->name, first_name);
            if (got != first[j]) free(got);
            strcat(strcat(checked, " "), t->name);
        }
        printf("%s:%s\n", k->name, checked);
        if (!first_name) first_name = k->name;
    }
    printf("attention:");
    for (int i = 0; i < n_kernel_builds; i++) {
        const kernels_t *k = kernel_builds[i];
        if (!build_runs(k)) continue;
        for (int c = 0; c < N_ATTN; c++) attention(k, &ATTN[c]);
        printf(" %s", k->name);
    }
    printf("\n");
    printf("%d checks, %d failures\n", checks, failures);
    return failures ? 1 : 0;
}
