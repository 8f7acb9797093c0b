#pragma once
#include "blocks.h" /* what this file uses; each header stands alone */
#include "dots.h"
/* Attention of a few queries over the cache's rows, read as they are stored (float16, bfloat16 or float32,
 * token-major, a ring or not), each row once per group of query heads sharing it: no float32 copy of the cache.
 * Included by isa.h. */

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

