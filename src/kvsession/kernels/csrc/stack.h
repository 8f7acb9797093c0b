#pragma once
#include "blocks.h" /* what this file uses; each header stands alone */
#include "dots.h"
#include "attend.h"
#include "gemm.h"
/* Every layer for a few tokens in one call (decode; kernels.h says what a stack is). Included by isa.h. */

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
    matmul_mt(find_type(m->type), m->w, m->rows, m->cols, x, T, y, threads);
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

/* ggml's CPU GELU (GGML_GELU_FP16): the tanh form of every float16 value, rounded to float16, looked up by the
 * input rounded to float16 (gelu_table, module.c); exact past +-10 */
static inline float gelu(float x) {
    if (x <= -10.0f) return 0.0f;
    if (x >= 10.0f) return x;
    return gelu_table[float_to_half(x)];
}

/* g = act(g) * u over n values, on the threads the products use (each value the same arithmetic wherever it is
 * computed): at several tokens a step the scalar SiLU was a fifth of a small model's step on one core */
static void activate(float *g, const float *u, int64_t n, int gelu_, int threads) {
#pragma omp parallel for num_threads(team(threads, n, 4096)) schedule(static)
    for (int64_t i = 0; i < n; i++) g[i] = gelu_ ? gelu(g[i]) * u[i] : g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void store_row(int dtype, float *src, uint8_t *dst, int64_t n) {
    if (dtype == KV_F16) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = float_to_half(src[i]);
    } else if (dtype == KV_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = to_bf16(src[i]);
    } else if (dtype == KV_Q8_0) {
        q8_0_row(src, dst, n);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* one input of a depthwise causal convolution over C channels (w [C, k]): out = the taps of [state, in] summed
 * oldest first, as ggml_ssm_conv (and ssm.causal_conv) sums them, then the bias where there is one; the state
 * [C, k - 1] moves on by one input. out may be in. */
static void conv_step(const float *w, int k, const float *bias, float *state, const float *in, float *out, int64_t C) {
    for (int64_t i = 0; i < C; i++) {
        float *st = state + i * (k - 1);
        const float *wi = w + i * k, x = in[i];
        float acc = st[0] * wi[0];
        for (int j = 1; j < k - 1; j++) acc += st[j] * wi[j];
        acc += x * wi[k - 1];
        for (int j = 0; j < k - 2; j++) st[j] = st[j + 1];
        st[k - 2] = x;
        out[i] = bias ? acc + bias[i] : acc;
    }
}

/* LFM2's gated short convolution of one token, bcx [3 d] = (B, C, x) of its in_proj: y = C * conv([state, B * x]) */
static void short_conv(const float *w, int k, float *state, const float *bcx, float *y, int64_t d) {
    const float *B = bcx, *C = bcx + d, *X = bcx + 2 * d;
    for (int64_t i = 0; i < d; i++) y[i] = B[i] * X[i];
    conv_step(w, k, NULL, state, y, y, d);
    for (int64_t i = 0; i < d; i++) y[i] *= C[i];
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* ggml's softplus (ggml_compute_softplus_f32, ssm.softplus): the input itself above 20 */
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* one row of Mamba2's state, s [N] = s dA + dx b, and its output s . c */
static inline float scan_row(float *s, int64_t N, float dA, float dx, const float *b, const float *c) {
    const vf va = vset(dA), vx = vset(dx);
    vf acc = vzero();
    int64_t n = 0;
    for (; n + VL <= N; n += VL) {
        const vf sn = vfmadd(vx, vloadu(b + n), vmul(vloadu(s + n), va));
        vstoreu(s + n, sn);
        acc = vfmadd(sn, vloadu(c + n), acc);
    }
    float out = vsum(acc);
    for (; n < N; n++) {
        s[n] = s[n] * dA + dx * b[n];
        out += s[n] * c[n];
    }
    return out;
}

/* Mamba2 for one token (ssm.Mamba2 with ssd_step; ggml_ssm_conv and ggml_ssm_scan's loop): p = (z, xBC, dt) of its
 * in_proj, xBC convolved in place; y [inner] the gated, group-normed output for out_proj; the states (conv
 * [I + 2 G N, k - 1], ssm [H, I / H, N]) move on by one token */
static void mamba2_step(const stack_t *s, const layer_t *l, float *cstate, float *sstate, float *p, float *y,
                        int threads) {
    const int64_t I = s->ssm_inner, H = s->ssm_heads, G = s->ssm_groups, N = s->ssm_state, P = I / H, r = H / G;
    const int64_t C = I + 2 * G * N;
    float *z = p, *xbc = p + I;
    const float *dt = p + I + C;
    conv_step(l->conv, l->conv_k, l->conv_bias, cstate, xbc, xbc, C);
    for (int64_t i = 0; i < C; i++) xbc[i] = silu(xbc[i]);
    const float *x = xbc, *B = xbc + I, *Cm = xbc + I + G * N;
#pragma omp parallel for num_threads(team(threads, H * P * N, 32768)) schedule(static)
    for (int64_t h = 0; h < H; h++) {
        const float d = softplus(dt[h] + l->dt_bias[h]), dA = expf(d * l->ssm_a[h]);
        const float *b = B + (h / r) * N, *c = Cm + (h / r) * N;
        for (int64_t i = h * P; i < (h + 1) * P; i++)
            y[i] = scan_row(sstate + i * N, N, dA, d * x[i], b, c) + x[i] * l->ssm_d[h];
    }
    for (int64_t i = 0; i < I; i++) y[i] *= silu(z[i]);
    if (l->ssm_norm)
        for (int64_t g = 0; g < G; g++)
            rms_norm(y + g * (I / G), l->ssm_norm + g * (I / G), y + g * (I / G), I / G, s->eps);
}

static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* one row of DeltaNet's state for its value v, s [N] (keys): s = eg s; s += beta (v - s . k) k; returns s . q */
static inline float delta_row(float *s, int64_t N, float eg, float v, float beta, const float *k, const float *q) {
    const vf ve = vset(eg);
    vf acc = vzero();
    int64_t n = 0;
    for (; n + VL <= N; n += VL) {
        const vf sn = vmul(vloadu(s + n), ve);
        vstoreu(s + n, sn);
        acc = vfmadd(sn, vloadu(k + n), acc);
    }
    float sk = vsum(acc);
    for (; n < N; n++) {
        s[n] *= eg;
        sk += s[n] * k[n];
    }
    const float d = (v - sk) * beta;
    const vf vd = vset(d);
    acc = vzero();
    for (n = 0; n + VL <= N; n += VL) {
        const vf sn = vfmadd(vd, vloadu(k + n), vloadu(s + n));
        vstoreu(s + n, sn);
        acc = vfmadd(sn, vloadu(q + n), acc);
    }
    float out = vsum(acc);
    for (; n < N; n++) {
        s[n] += d * k[n];
        out += s[n] * q[n];
    }
    return out;
}

/* x / sqrt(sum x^2 + eps) times scale, over n values in place (ssm.l2_norm) */
static void l2_norm(float *x, int64_t n, float eps, float scale) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float r = scale / sqrtf((float)ss + eps);
    for (int64_t i = 0; i < n; i++) x[i] *= r;
}

/* gated DeltaNet for one token (ssm.GatedDeltaNet with delta_step; llama.cpp's build_delta_net_autoregressive):
 * qkv [2 Hk Dk + Hv Dv] of its projection, convolved in place, z [Hv Dv] its output gate, beta and alpha [Hv]; y
 * [Hv Dv] the normed, gated output for out_proj; the states (conv [2 Hk Dk + Hv Dv, k - 1], ssm [Hv, Dv, Dk]) move
 * on by one token */
static void delta_step(const stack_t *s, const layer_t *l, float *cstate, float *sstate, float *qkv, const float *z,
                       const float *beta, const float *alpha, float *y, int threads) {
    const int64_t Hv = s->ssm_heads, Hk = s->ssm_groups, Dk = s->ssm_state, Dv = s->ssm_inner / Hv, r = Hv / Hk;
    const int64_t C = 2 * Hk * Dk + Hv * Dv;
    conv_step(l->conv, l->conv_k, NULL, cstate, qkv, qkv, C);
    for (int64_t i = 0; i < C; i++) qkv[i] = silu(qkv[i]);
    float *q = qkv, *k = qkv + Hk * Dk;
    const float *v = qkv + 2 * Hk * Dk;
    for (int64_t j = 0; j < Hk; j++) {
        l2_norm(q + j * Dk, Dk, s->eps, 1.0f / sqrtf((float)Dk));
        l2_norm(k + j * Dk, Dk, s->eps, 1.0f);
    }
#pragma omp parallel for num_threads(team(threads, Hv * Dv * Dk, 32768)) schedule(static)
    for (int64_t h = 0; h < Hv; h++) {
        const int64_t kh = s->qk_tile ? h % Hk : h / r;
        const float eg = expf(softplus(alpha[h] + l->dt_bias[h]) * l->ssm_a[h]), b = sigmoid(beta[h]);
        for (int64_t i = h * Dv; i < (h + 1) * Dv; i++)
            y[i] = delta_row(sstate + i * Dk, Dk, eg, v[i], b, k + kh * Dk, q + kh * Dk);
        rms_norm(y + h * Dv, l->ssm_norm, y + h * Dv, Dv, s->eps);
        for (int64_t i = h * Dv; i < (h + 1) * Dv; i++) y[i] *= silu(z[i]);
    }
}

/* --- the chosen experts of one token ------------------------------------------------------------------------ */

static inline float glu_oai(float gate, float up) {
    const float x = gate < 7.0f ? gate : 7.0f, y = up < -7.0f ? -7.0f : up > 7.0f ? 7.0f : up;
    return x / (1.0f + expf(1.702f * -x)) * (y + 1.0f);
}

/* out [d_model] = the weighted sum of the chosen experts of x, added in the order chosen; buf room for 2 d_ff + d_model
 * floats */
static void experts_into(const experts_t *e, const int64_t *chosen, const float *weights, int n, const float *x,
                         float *out, float *buf, int threads) {
    const int64_t dm = e->d_model, dff = e->d_ff;
    float *g = buf, *u = g + dff, *y = u + dff;
    for (int i = 0; i < n; i++) {
        const expert_t *ex = &e->experts[chosen[i]];
        project(&ex->gate, x, 1, g, threads);
        project(&ex->up, x, 1, u, threads);
        if (e->glu == GLU_OAI)
            for (int64_t j = 0; j < dff; j++) g[j] = glu_oai(g[j], u[j]);
        else
            activate(g, u, dff, 0, threads);
        project(&ex->down, g, 1, y, threads);
        for (int64_t j = 0; j < dm; j++) out[j] = i ? out[j] + y[j] * weights[i] : y[j] * weights[i];
    }
}

static int experts_step(const experts_t *e, const int64_t *chosen, const float *weights, int n, const float *x,
                        float *out, int threads) {
    float *buf = malloc(sizeof(float) * (size_t)(2 * e->d_ff + e->d_model));
    if (!buf) return 0;
    experts_into(e, chosen, weights, n, x, out, buf, threads);
    free(buf);
    return 1;
}

/* a token's router logits [n] -> its `used` experts, most probable first (the lower number first among equals),
 * and their weights, as moe.Experts.route computes them */
static void route(const layer_t *l, const float *logits, int64_t n, int64_t *chosen, float *w) {
    float p[MAX_USED], top = logits[0];
    const int k = l->used;
    for (int64_t j = 1; j < n; j++) top = logits[j] > top ? logits[j] : top;
    for (int i = 0; i < k; i++) { /* by logit: the same order as by probability */
        int64_t best = -1;
        for (int64_t j = 0; j < n; j++) {
            int taken = 0;
            for (int m = 0; m < i && !taken; m++) taken = chosen[m] == j;
            if (!taken && (best < 0 || logits[j] > logits[best])) best = j;
        }
        chosen[i] = best;
    }
    float sum = 0.0f;
    if (l->gating == GATE_SOFTMAX_WEIGHT) { /* a softmax over the chosen logits */
        for (int i = 0; i < k; i++) sum += p[i] = expf(logits[chosen[i]] - logits[chosen[0]]);
        for (int i = 0; i < k; i++) w[i] = p[i] / sum;
    } else { /* each one's probability among all */
        for (int64_t j = 0; j < n; j++) sum += expf(logits[j] - top);
        for (int i = 0; i < k; i++) w[i] = expf(logits[chosen[i]] - top) / sum;
    }
    if (l->norm_weights) {
        float total = 0.0f;
        for (int i = 0; i < k; i++) total += w[i];
        total = total < 6.103515625e-5f ? 6.103515625e-5f : total; /* moe.MIN_WEIGHT_SUM */
        for (int i = 0; i < k; i++) w[i] /= total;
    }
}

/* the mixture of the normed tokens h [T, d_model] into y [T, d_model]: each token's chosen experts, then the shared
 * expert's output added (g, u room for T x its width, y2 for T x d_model); logits room for T x n experts, ebuf for
 * experts_into */
static void mixture(const stack_t *s, const layer_t *l, const float *h, int64_t T, float *logits, float *ebuf,
                    float *g, float *u, float *y, float *y2, int threads) {
    const int64_t dm = s->d_model, n = l->experts->n;
    int64_t chosen[MAX_USED];
    float w[MAX_USED];
    project(&l->router, h, T, logits, threads);
    for (int64_t t = 0; t < T; t++) {
        route(l, logits + t * n, n, chosen, w);
        experts_into(l->experts, chosen, w, l->used, h + t * dm, y + t * dm, ebuf, threads);
    }
    if (!l->sh_down.w) return;
    const int64_t sw = l->sh_up.rows;
    project(&l->sh_gate, h, T, g, threads);
    project(&l->sh_up, h, T, u, threads);
    activate(g, u, T * sw, 0, threads);
    project(&l->sh_down, g, T, y2, threads);
    for (int64_t t = 0; t < T; t++) {
        float gate = 1.0f;
        if (l->sh_inp) {
            float dot = 0.0f;
            for (int64_t i = 0; i < dm; i++) dot += h[t * dm + i] * l->sh_inp[i];
            gate = sigmoid(dot);
        }
        for (int64_t i = 0; i < dm; i++) y[t * dm + i] += l->sh_inp ? y2[t * dm + i] * gate : y2[t * dm + i];
    }
}

/* layer li's recurrent layer, its input projection `in`, over the normed tokens h [T, d_model]: each sequence's
 * tokens through its state (caches' columns 5 and 6, CACHE_COLS a layer); p room for the projections of the T
 * tokens (stack_run's q), out [T, ...] the output for out_proj */
#define CACHE_COLS 7
static void recurrent_run(const stack_t *s, const layer_t *l, const mat_t *in, const float *h, int64_t T,
                          const int64_t *segs, int64_t S, const int64_t *caches, int64_t li, float *p, float *out,
                          int threads) {
    const int64_t dm = s->d_model, L = s->n_layers, I = s->ssm_inner, GN = s->ssm_groups * s->ssm_state;
    const int64_t Hs = s->ssm_heads, C = 2 * GN + I;
    float *z = p + T * C, *beta = z + T * I, *alpha = beta + T * Hs; /* DeltaNet's four projections */
    project(in, h, T, p, threads);
    if (l->ssm == SSM_DELTA) {
        project(&l->k, h, T, z, threads);
        project(&l->v, h, T, beta, threads);
        project(&l->alpha, h, T, alpha, threads);
    }
    for (int64_t si = 0, t0 = 0; si < S; t0 += segs[2 * si], si++) {
        const int64_t *c = caches + CACHE_COLS * (si * L + li);
        float *state = (float *)c[5], *ssm = (float *)c[6];
        for (int64_t t = t0; t < t0 + segs[2 * si]; t++)
            if (l->ssm == SSM_DELTA)
                delta_step(s, l, state, ssm, p + t * C, z + t * I, beta + t * Hs, alpha + t * Hs, out + t * I, threads);
            else if (l->ssm == SSM_MAMBA2)
                mamba2_step(s, l, state, ssm, p + t * (2 * I + 2 * GN + Hs), out + t * I, threads);
            else
                short_conv(l->conv, l->conv_k, state, p + t * 3 * dm, out + t * dm, dm);
    }
}

/* x [T, d_model] float32, in place: the tokens of S sequences one after another. segments: int64 [S, 2] = (tokens, first position) of each
 * sequence, the tokens adding up to T; caches: int64 [S, n_layers, CACHE_COLS] = (k address, v address, capacity,
 * ring, first visible position, conv state's address, scan state's address) of each sequence's caches, which
 * already hold room for its positions (zeros where the layer has no such cache: a recurrent layer has no rows, a
 * short convolution no scan); cos/sin: the
 * two RoPE tables [positions, rope_dim / 2]. The projections read each weight once for all T tokens (decode of
 * several sequences at once: a step's bytes shared by all of them); RoPE, the new rows and attention are each
 * sequence's own. A token's result does not depend on the others (matmul_mt), so a sequence decodes here
 * exactly as it does alone. */
static int stack_run(const stack_t *s, float *x, int64_t T, const int64_t *segs, int64_t S, const int64_t *caches,
                     int dtype, const float *const tables[2][2], int threads) {
    const int64_t dm = s->d_model, H = s->H, Hk = s->Hk, D = s->D, dff = s->d_ff, L = s->n_layers;
    const size_t row = kv_bytes(dtype, Hk * D), half = s->rope_dim / 2;
    /* q, k, v one after another (a short convolution's B, C, x, a Mamba2 layer's z, xBC, dt, a DeltaNet layer's
     * qkv, z, beta, alpha in the same room); att the mixer's output; qg a gated attention's queries and gates */
    const int64_t I = s->ssm_inner, GN = s->ssm_groups * s->ssm_state, Hs = s->ssm_heads;
    const int64_t mw = 2 * I + 2 * GN + 2 * Hs, qgw = s->attn_gate ? 2 * H * D : 0;
    int64_t qkv = (H + 2 * Hk) * D, aw = H * D;
    if (s->convs && 3 * dm > qkv) qkv = 3 * dm;
    if (s->convs && dm > aw) aw = dm;
    if (mw > qkv) qkv = mw;
    if (I > aw) aw = I;
    /* fw the widest feed-forward (a shared expert may be wider than d_ff); a mixture's router logits and experts */
    int64_t fw = dff, ne = 0, ew = 0;
    for (int64_t li = 0; li < L; li++) {
        const layer_t *l = &s->layers[li];
        if (!l->experts) continue;
        if (l->sh_up.w && l->sh_up.rows > fw) fw = l->sh_up.rows;
        if (l->experts->n > ne) ne = l->experts->n;
        if (2 * l->experts->d_ff + dm > ew) ew = 2 * l->experts->d_ff + dm;
    }
    /* every byte the run needs is taken here, attention's scratch too, so that a failure comes before a state or a
     * row is written (a recurrent state cannot be put back without a copy of it) */
    size_t scratch_bytes = 64;
    for (int64_t si = 0; si < S && Hk > 0; si++) {
        const size_t b = attend_scratch_bytes((int)Hk, (int)D, segs[2 * si], (int)H, segs[2 * si + 1], threads);
        if (b > scratch_bytes) scratch_bytes = b;
    }
    float *buf = malloc(sizeof(float) * ((size_t)T * (dm + qkv + aw + 2 * fw + dm + qgw + dm + ne) + ew));
    char *scratch = aligned_alloc(64, (scratch_bytes + 63) / 64 * 64);
    if (!buf || !scratch) {
        free(buf);
        free(scratch);
        return 0;
    }
    int ok = 1;
    float *h = buf, *q = h + T * dm, *k = q + T * H * D, *v = k + T * Hk * D, *att = q + T * qkv,
          *g = att + T * aw, *u = g + T * fw, *y = u + T * fw, *qg = y + T * dm, *y2 = qg + T * qgw,
          *logits = y2 + T * dm, *ebuf = logits + T * ne;
    for (int li = 0; li < L && ok; li++) {
        const layer_t *l = &s->layers[li];
        for (int64_t t = 0; t < T; t++) rms_norm(x + t * dm, l->attn_norm, h + t * dm, dm, s->eps);
        if (l->form == FORM_FFN) {
            /* no mixer: the feed-forward network of the normed tokens h */
        } else if (l->conv && !l->ssm_in.w) {
            recurrent_run(s, l, &l->q, h, T, segs, S, caches, li, q, att, threads);
        } else {
            if (s->attn_gate) { /* each head's query, then its gate: the queries to q, the gates stay in qg */
                project(&l->q, h, T, qg, threads);
                for (int64_t t = 0; t < T; t++)
                    for (int64_t j = 0; j < H; j++)
                        memcpy(q + (t * H + j) * D, qg + t * qgw + j * 2 * D, sizeof(float) * (size_t)D);
            } else {
                project(&l->q, h, T, q, threads);
            }
            project(&l->k, h, T, k, threads);
            project(&l->v, h, T, v, threads);
            for (int64_t si = 0, t0 = 0; si < S && ok; t0 += segs[2 * si], si++) {
                const int64_t n = segs[2 * si], pos0 = segs[2 * si + 1];
                const int64_t *c = caches + CACHE_COLS * (si * L + li);
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
                    store_row(dtype, kt, kc + (size_t)r * row, Hk * D);
                    store_row(dtype, v + t * Hk * D, vc + (size_t)r * row, Hk * D);
                }
                ok = attend_in(dtype, kc, vc, cap, (int)ring, (int)Hk, (int)D, q + t0 * H * D, n, (int)H, pos0,
                               key_lo, l->window, s->scale, s->softcap, l->sinks, att + t0 * H * D, threads, scratch);
            }
            if (s->attn_gate)
                for (int64_t t = 0; t < T; t++)
                    for (int64_t j = 0; j < H; j++)
                        for (int64_t i = 0; i < D; i++)
                            att[(t * H + j) * D + i] *= sigmoid(qg[t * qgw + j * 2 * D + D + i]);
        }
        if (l->form != FORM_FFN) {
            project(&l->o, att, T, y, threads);
            if (l->ssm_in.w) { /* a Mamba2 layer beside the attention, on the same input: the outputs added */
                recurrent_run(s, l, &l->ssm_in, h, T, segs, S, caches, li, q, att, threads);
                project(&l->ssm_out, att, T, y2, threads);
                for (int64_t i = 0; i < T * dm; i++) y[i] += y2[i];
            }
            for (int64_t t = 0; t < T; t++) {
                if (l->post_attn_norm) rms_norm(y + t * dm, l->post_attn_norm, y + t * dm, dm, s->eps);
                if (s->residual != 0.0f)
                    for (int64_t i = 0; i < dm; i++) y[t * dm + i] *= s->residual;
                for (int64_t i = 0; i < dm; i++) x[t * dm + i] += y[t * dm + i];
                if (l->form == FORM_BOTH) rms_norm(x + t * dm, l->ffn_norm, h + t * dm, dm, s->eps);
            }
        }
        if (l->form == FORM_MIXER) continue;
        if (l->experts) {
            mixture(s, l, h, T, logits, ebuf, g, u, y, y2, threads);
        } else {
            if (l->gate.w) {
                project(&l->gate, h, T, g, threads);
                project(&l->up, h, T, u, threads);
                activate(g, u, T * dff, s->gelu, threads);
            } else { /* relu(up)^2 (Nemotron-H) */
                project(&l->up, h, T, g, threads);
                for (int64_t i = 0; i < T * dff; i++) g[i] = g[i] > 0.0f ? g[i] * g[i] : 0.0f;
            }
            project(&l->down, g, T, y, threads);
        }
        for (int64_t t = 0; t < T; t++) {
            if (l->post_ffn_norm) rms_norm(y + t * dm, l->post_ffn_norm, y + t * dm, dm, s->eps);
            if (s->residual != 0.0f)
                for (int64_t i = 0; i < dm; i++) y[t * dm + i] *= s->residual;
            for (int64_t i = 0; i < dm; i++) x[t * dm + i] += y[t * dm + i];
        }
    }
    free(buf);
    free(scratch);
    return ok;
}
