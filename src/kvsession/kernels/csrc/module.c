/* kvsession._kernels: the CPU kernels behind kernels/__init__.py, for Python.
 *
 * GGUF blocks multiplied where they lie (the memory-mapped file itself, no dense copy of any weight), attention
 * read straight from the KV cache's rows, and the decode stack. The kernels themselves are built once per
 * instruction set (isa.h, kernels.h); this module checks each call's arguments, releases the GIL while the
 * kernels run, and picks the build when it loads: the best one the CPU runs (builds.c lists them and tells
 * which), or the one the environment's KVSESSION_ISA names (generic, avx2, avx512, avx512bf16; on AArch64
 * generic, neon, neon_dotprod). `use(name)` switches builds (the tests run each one the host can execute), `isa()` names the one in use and `isas()` those the CPU runs.
 *
 * Entry points (all take raw addresses; the caller keeps the arrays alive, kernels/__init__.py does):
 *   matmul(type, w, rows, cols, x, T, y, threads)    y[T, rows] = x[T, cols] . W^T, float32
 *   gemm(type, w, rows, cols, x, ldx, T, y, ldy, threads)   the same by the int8 GEMM, many tokens
 *   dequant(type, w, rows, cols, out, bf16, threads) W as float32 or bfloat16 [rows, cols]
 *   gather(type, w, cols, ids, n, out)               rows ids[0..n) of W as float32 [n, cols]
 *   gelu_mul(gu, T, d_ff, out, threads)              out = GELU(gate) * up, ggml's GELU
 *   attend(...)                                      softmax(q . K^T * scale) . V over cache rows
 *   stack(shape, layers), run(stack, ...)            every layer for a few tokens in one call
 *   block_size(type)                                 how the build in use multiplies the type
 *   peak(kind, n, threads)                           the product instructions' arithmetic peak (benchmarks)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static const kernels_t *K = &kernels_generic; /* the build in use */

static const kernels_t *build_named(const char *name) {
    for (int i = 0; i < n_kernel_builds; i++)
        if (!strcmp(kernel_builds[i]->name, name)) return kernel_builds[i];
    return NULL;
}

/* a build by name, or a ValueError (its message begins with `what`) that says which ones this CPU runs */
static const kernels_t *build_arg(const char *name, const char *what) {
    const kernels_t *k = build_named(name);
    if (k && build_runs(k)) return k;
    char all[64] = "", have[64] = "";
    for (int i = 0; i < n_kernel_builds; i++) {
        strcat(strcat(all, *all ? ", " : ""), kernel_builds[i]->name);
        if (build_runs(kernel_builds[i])) strcat(strcat(have, *have ? ", " : ""), kernel_builds[i]->name);
    }
    PyErr_Format(PyExc_ValueError, "%s%s: %s%s%s; this CPU runs %s", what, name,
                 k ? "not on this CPU" : "no such build (", k ? "" : all, k ? "" : ")", have);
    return NULL;
}

static int shape_arg(int type, long long rows, long long cols) {
    int values, bytes, rounds, gemm;
    if (!K->block_size(type, &values, &bytes, &rounds, &gemm)) {
        PyErr_Format(PyExc_ValueError, "no kernel for GGML type %d", type);
        return 0;
    }
    if (rows < 0 || cols <= 0 || cols % values) {
        PyErr_Format(PyExc_ValueError, "%lld x %lld is not a whole number of %d-value blocks", rows, cols, values);
        return 0;
    }
    return 1;
}

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    int type, threads;
    Py_ssize_t w, x, y;
    long long rows, cols, T;
    if (!PyArg_ParseTuple(args, "inLLnLni", &type, &w, &rows, &cols, &x, &T, &y, &threads)) return NULL;
    if (!shape_arg(type, rows, cols)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    K->matmul(type, (const uint8_t *)w, rows, cols, (const float *)x, T, (float *)y, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* gemm(type, w, rows, cols, x, ldx, T, y, ldy, threads): y[t * ldy + r] = x[t * ldx ...] . W[r], the int8 GEMM */
static PyObject *py_gemm(PyObject *self, PyObject *args) {
    int type, threads, values, bytes, rounds, gemm = 0, ok;
    Py_ssize_t w, x, y;
    long long rows, cols, ldx, T, ldy;
    if (!PyArg_ParseTuple(args, "inLLnLLnLi", &type, &w, &rows, &cols, &x, &ldx, &T, &y, &ldy, &threads)) return NULL;
    if (!shape_arg(type, rows, cols)) return NULL;
    K->block_size(type, &values, &bytes, &rounds, &gemm);
    if (!gemm || T < 0 || ldx < cols || ldy < rows) {
        PyErr_Format(PyExc_ValueError, "gemm: no int8 GEMM for type %d here, or a bad shape", type);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    ok = K->gemm(type, (const uint8_t *)w, rows, cols, (const float *)x, ldx, T, (float *)y, ldy, threads);
    Py_END_ALLOW_THREADS
    if (!ok) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static int attend_args_ok(int dtype, int Hk, int H, int D, long long T, long long cap, long long key_lo,
                          long long pos0) {
    if (Hk <= 0 || H % Hk || H > MAX_HEADS || D <= 0 || D > MAX_HEAD_DIM || D % 16 || T <= 0 || cap <= 0 ||
        key_lo < 0 || key_lo > pos0 || dtype < KV_F32 || dtype > KV_Q8_0 || (dtype == KV_Q8_0 && D % KV_QBLOCK)) {
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
    ok = K->attend(dtype, (const uint8_t *)k, (const uint8_t *)v, cap, ring, Hk, D, (const float *)q, T, H, pos0,
                   key_lo, window, scale, softcap, (const float *)sinks, (float *)out, threads);
    Py_END_ALLOW_THREADS
    if (!ok) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* quantize_q8_0(x, out, n): n float32 numbers (a multiple of 32) as q8_0 blocks, n / 32 * 34 bytes */
static PyObject *py_quantize_q8_0(PyObject *self, PyObject *args) {
    Py_ssize_t x, out;
    long long n;
    if (!PyArg_ParseTuple(args, "nnL", &x, &out, &n)) return NULL;
    if (n < 0 || n % KV_QBLOCK) return PyErr_Format(PyExc_ValueError, "quantize_q8_0: %lld numbers", n);
    Py_BEGIN_ALLOW_THREADS
    q8_0_row((const float *)x, (uint8_t *)out, n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static const char *STACK = "kvsession._kernels.stack";

static void stack_free(PyObject *capsule) { free(PyCapsule_GetPointer(capsule, STACK)); }

static int mat_arg(PyObject *t, mat_t *m, int64_t rows, int64_t cols) {
    int type;
    Py_ssize_t w, bias;
    long long r, c;
    if (!PyArg_ParseTuple(t, "inLLn", &type, &w, &r, &c, &bias)) return 0;
    if (!shape_arg(type, r, c)) return 0;
    if (r != rows || c != cols) {
        PyErr_Format(PyExc_ValueError, "a %lld x %lld weight where %lld x %lld belongs", r, c, (long long)rows,
                     (long long)cols);
        return 0;
    }
    m->type = type, m->w = (const uint8_t *)w, m->rows = r, m->cols = c, m->bias = (const float *)bias;
    return 1;
}

static const char *EXPERTS = "kvsession._kernels.experts";

/* a mixture in place of a layer's feed-forward network: (experts, router, used, gating, norm_weights, shared gate,
 * shared up, shared down, shared gate vector's address or 0), experts a capsule of experts(), the shared expert's
 * matrices None where it has none */
static int moe_arg(PyObject *t, layer_t *l, int64_t dm) {
    PyObject *capsule, *router, *sg, *su, *sd;
    Py_ssize_t inp;
    if (!PyArg_ParseTuple(t, "OOiiiOOOn", &capsule, &router, &l->used, &l->gating, &l->norm_weights, &sg, &su, &sd,
                          &inp))
        return 0;
    const experts_t *e = PyCapsule_GetPointer(capsule, EXPERTS);
    if (!e) return 0;
    l->experts = e, l->sh_inp = (const float *)inp;
    const int shared = sd != Py_None;
    if (e->d_model != dm || l->used < 1 || l->used > e->n || l->used > MAX_USED ||
        (l->gating != GATE_SOFTMAX && l->gating != GATE_SOFTMAX_WEIGHT)) {
        PyErr_Format(PyExc_ValueError, "a mixture of %d experts of width %lld choosing %d (at most %d), gating %d, "
                     "where d_model is %lld", e->n, (long long)e->d_model, l->used, MAX_USED, l->gating,
                     (long long)dm);
        return 0;
    }
    if ((sg != Py_None) != shared || (su != Py_None) != shared || (!shared && inp)) {
        PyErr_Format(PyExc_ValueError, "a shared expert takes its gate, up and down (and a gate vector only with them)");
        return 0;
    }
    if (!mat_arg(router, &l->router, e->n, dm)) return 0;
    if (!shared) return 1;
    const long long sw = PyTuple_Check(su) && PyTuple_GET_SIZE(su) == 5 ? PyLong_AsLongLong(PyTuple_GET_ITEM(su, 2))
                                                                         : -1;
    if (sw <= 0) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "a shared expert's up projection is a matrix");
        return 0;
    }
    return mat_arg(sg, &l->sh_gate, sw, dm) && mat_arg(su, &l->sh_up, sw, dm) && mat_arg(sd, &l->sh_down, dm, sw);
}

/* a matrix that the layer's form may leave out: None leaves m empty (m->w NULL) */
static int opt_mat_arg(PyObject *t, mat_t *m, int64_t rows, int64_t cols) {
    return t == Py_None || mat_arg(t, m, rows, cols);
}

/* stack((n_layers, d_model, H, Hk, D, d_ff, gelu, neox, rope_dim, eps, scale, residual, softcap, ssm_inner,
 *        ssm_heads, ssm_groups, ssm_state, attn_gate, qk_tile), [layer, ...]) -> capsule
 * layer: (q, k, v, o, gate, up, down, alpha, ssm_in, ssm_out, attn_norm, ffn_norm, q_norm, k_norm,
 *         post_attn_norm, post_ffn_norm, window, rope, conv, conv_k, ssm, form, sinks, moe), a matrix (type, address, rows,
 *         cols, bias address or 0) or None, a norm an address or 0; conv: 0 for attention, else the address of a
 *         recurrent layer's convolution kernel float32 [channels, conv_k], with q its in_proj, o its out_proj;
 *         ssm: None for LFM2's short convolution (channels d_model, q [3 d_model, d_model], k and v None), else
 *         (kind, conv_bias, dt_bias, a, d, norm): SSM_MAMBA2 (k and v None) or SSM_DELTA (k its z, v its beta,
 *         alpha its alpha; conv_bias and d 0) and the vectors' addresses over the stack's ssm sizes (conv_bias and
 *         Mamba2's norm may be 0). alpha is None but for DeltaNet. ssm_in and ssm_out: None, or a Mamba2 layer's
 *         in_proj and out_proj beside the attention of q, k, v, o (Falcon-H1; conv and ssm its). form
 *         (kernels.h): FORM_MIXER leaves gate, up, down and ffn_norm out, FORM_FFN q, k, v, o, conv and ssm; gate
 *         None: relu(up)^2. sinks: the address of the attention's sinks float32 [H], or 0. moe: None, or a
 *         mixture in place of gate, up and down (moe_arg). The caller keeps every array alive as long as the
 *         capsule. */
static PyObject *py_stack(PyObject *self, PyObject *args) {
    int L, dm, H, Hk, D, dff, gelu, neox, rope_dim;
    float eps, scale, residual, softcap;
    long long si, sh, sg, sn;
    int attn_gate, qk_tile;
    PyObject *layers;
    if (!PyArg_ParseTuple(args, "(iiiiiiiiiffffLLLLii)O!", &L, &dm, &H, &Hk, &D, &dff, &gelu, &neox, &rope_dim,
                          &eps, &scale, &residual, &softcap, &si, &sh, &sg, &sn, &attn_gate, &qk_tile, &PyList_Type,
                          &layers))
        return NULL;
    if (L <= 0 || PyList_GET_SIZE(layers) != L || dm <= 0 || dff <= 0 || rope_dim > D || rope_dim % 2 ||
        !attend_args_ok(KV_F16, Hk, H, D, 1, 1, 0, 0) || si < 0 || sh < 0 || sg < 0 || sn < 0 ||
        (sh && (si % sh || sh % (sg ? sg : 1) || !sg || !sn || si % sg)))
        return PyErr_Format(PyExc_ValueError, "stack: bad shape");
    stack_t *s = calloc(1, sizeof(stack_t) + (size_t)L * sizeof(layer_t));
    if (!s) return PyErr_NoMemory();
    *s = (stack_t){L, dm, H, Hk, D, dff, gelu, neox, rope_dim, eps, scale, residual, softcap, 0, si, sh, sg, sn,
                   attn_gate != 0, qk_tile != 0};
    const int64_t mamba_rows = 2 * si + 2 * sg * sn + sh, delta_rows = 2 * sg * sn + si;
    for (int i = 0; i < L; i++) {
        layer_t *l = &s->layers[i];
        PyObject *q, *k, *v, *o, *g, *u, *d, *a, *si_, *so_, *ssm, *moe;
        Py_ssize_t n[6], conv, mv[5] = {0}, sinks;
        long long window;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(layers, i), "OOOOOOOOOOnnnnnnLiniOinO", &q, &k, &v, &o, &g, &u, &d,
                              &a, &si_, &so_, &n[0], &n[1], &n[2], &n[3], &n[4], &n[5], &window, &l->rope, &conv,
                              &l->conv_k, &ssm, &l->form, &sinks, &moe) ||
            (ssm != Py_None && !PyArg_ParseTuple(ssm, "innnnn", &l->ssm, &mv[0], &mv[1], &mv[2], &mv[3], &mv[4])) ||
            (moe != Py_None && !moe_arg(moe, l, dm))) {
            free(s);
            return NULL;
        }
        l->conv = (const float *)conv, l->sinks = (const float *)sinks;
        l->conv_bias = (const float *)mv[0], l->dt_bias = (const float *)mv[1], l->ssm_a = (const float *)mv[2];
        l->ssm_d = (const float *)mv[3], l->ssm_norm = (const float *)mv[4];
        const int delta = l->ssm == SSM_DELTA, mixer = l->form != FORM_FFN, ffn = l->form != FORM_MIXER;
        const int beside = si_ != Py_None;
        if (beside != (so_ != Py_None) ||
            (beside && (l->ssm != SSM_MAMBA2 || !conv || !mixer || !mat_arg(si_, &l->ssm_in, mamba_rows, dm) ||
                        !mat_arg(so_, &l->ssm_out, dm, si)))) {
            free(s);
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "stack: layer %d: a Mamba2 layer beside attention takes its in_proj, "
                             "out_proj, kernel and vectors", i);
            return NULL;
        }
        if (l->form < FORM_BOTH || l->form > FORM_FFN ||
            (mixer ? o == Py_None : (q != Py_None || k != Py_None || v != Py_None || o != Py_None || conv)) ||
            (ffn && !l->experts ? (u == Py_None || d == Py_None) : (g != Py_None || u != Py_None || d != Py_None)) ||
            (l->experts && !ffn) || (sinks && (!mixer || conv))) {
            const int form = l->form; /* l lies in s */
            free(s);
            return PyErr_Format(PyExc_ValueError, "stack: layer %d: its matrices do not match its form %d", i, form);
        }
        if ((ssm != Py_None && l->ssm != SSM_MAMBA2 && !delta) || (a != Py_None) != delta ||
            (conv && !beside && (((k != Py_None) != delta) || ((v != Py_None) != delta))) || (conv && l->conv_k < 2)) {
            free(s);
            return PyErr_Format(PyExc_ValueError, "stack: layer %d: a recurrent layer takes no k or v but DeltaNet "
                                "(z, beta and alpha), and a kernel of 2 taps or more", i);
        }
        if (l->ssm && (!conv || !sh || !l->dt_bias || !l->ssm_a || (delta ? !l->ssm_norm : !l->ssm_d))) {
            free(s);
            return PyErr_Format(PyExc_ValueError, "stack: layer %d: a Mamba2 or DeltaNet layer needs its kernel, the "
                                "stack's ssm sizes, dt_bias, a, and Mamba2's d or DeltaNet's norm", i);
        }
        s->convs |= conv != 0 && !l->ssm;
        const int attention = !conv || beside;
        const int64_t q_rows = attention ? (int64_t)H * D * (attn_gate ? 2 : 1) : l->ssm == SSM_MAMBA2 ? mamba_rows
                                   : delta ? delta_rows : 3 * (int64_t)dm,
                      o_cols = attention ? (int64_t)H * D : l->ssm ? si : (int64_t)dm;
        const int qkv_ok = !mixer || (delta ? mat_arg(k, &l->k, si, dm) && mat_arg(v, &l->v, sh, dm) &&
                                                  mat_arg(a, &l->alpha, sh, dm)
                                            : !attention || (mat_arg(k, &l->k, (int64_t)Hk * D, dm) &&
                                                             mat_arg(v, &l->v, (int64_t)Hk * D, dm)));
        if ((mixer && (!mat_arg(q, &l->q, q_rows, dm) || !mat_arg(o, &l->o, dm, o_cols))) || !qkv_ok ||
            !opt_mat_arg(g, &l->gate, dff, dm) || !opt_mat_arg(u, &l->up, dff, dm) ||
            !opt_mat_arg(d, &l->down, dm, dff)) {
            free(s);
            return NULL;
        }
        l->attn_norm = (const float *)n[0], l->ffn_norm = (const float *)n[1], l->q_norm = (const float *)n[2];
        l->k_norm = (const float *)n[3], l->post_attn_norm = (const float *)n[4];
        l->post_ffn_norm = (const float *)n[5], l->window = window;
        if (!l->attn_norm || !l->ffn_norm != (l->form != FORM_BOTH) || (l->rope != 0 && l->rope != 1) || window < 0) {
            free(s);
            return PyErr_Format(PyExc_ValueError, "stack: layer %d is incomplete", i);
        }
    }
    PyObject *capsule = PyCapsule_New(s, STACK, stack_free);
    if (!capsule) free(s);
    return capsule;
}

/* run(stack, x, T, segments, S, caches, kv_dtype, cos0, sin0, cos1, sin1, threads, done): x [T, d_model] float32, in
 * place: the tokens of S sequences one after another. segments: int64 [S, 2] = (tokens, first position) of each
 * sequence, the tokens adding up to T; caches: int64 [S, n_layers, 7] = (k address, v address, capacity, ring,
 * first visible position, conv state's address, scan state's address) of each sequence's caches, which already
 * hold room for its positions (zeros where a layer has none: a recurrent layer no rows, a short convolution no
 * scan, float32 [d_model, conv_k - 1] its conv state); cos/sin: the
 * two RoPE tables [positions, rope_dim / 2]. The projections read each weight once for all T tokens (decode of
 * several sequences at once: a step's bytes shared by all of them); RoPE, the new rows and attention are each
 * sequence's own. A token's result does not depend on the others (matmul_mt), so a sequence decodes here
 * exactly as it does alone. done: an int64 set to 1 when the run went through, 0 when it failed for memory (taken
 * before anything is written, so then no cache has changed). */
static PyObject *py_run(PyObject *self, PyObject *args) {
    PyObject *capsule;
    Py_ssize_t xa, sa, ca, c0, s0, c1, s1, da;
    long long T, S;
    int dtype, threads, ok;
    if (!PyArg_ParseTuple(args, "OnLnLninnnnin", &capsule, &xa, &T, &sa, &S, &ca, &dtype, &c0, &s0, &c1, &s1,
                          &threads, &da))
        return NULL;
    const stack_t *s = PyCapsule_GetPointer(capsule, STACK);
    if (!s) return NULL;
    const int64_t *segs = (const int64_t *)sa;
    long long total = 0;
    for (long long i = 0; i < S; i++) {
        if (segs[2 * i] <= 0 || segs[2 * i + 1] < 0) return PyErr_Format(PyExc_ValueError, "run: bad segment %lld", i);
        total += segs[2 * i];
    }
    if (T <= 0 || S <= 0 || total != T || threads < 1 || dtype < KV_F32 || dtype > KV_Q8_0 || (dtype == KV_Q8_0 && s->D % KV_QBLOCK))
        return PyErr_Format(PyExc_ValueError, "run: bad arguments");
    const float *const tables[2][2] = {{(const float *)c0, (const float *)s0}, {(const float *)c1, (const float *)s1}};
    Py_BEGIN_ALLOW_THREADS
    ok = K->run(s, (float *)xa, T, segs, S, (const int64_t *)ca, dtype, tables, threads);
    Py_END_ALLOW_THREADS
    *(int64_t *)da = ok;
    if (!ok) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static void experts_free(PyObject *capsule) { free(PyCapsule_GetPointer(capsule, EXPERTS)); }

/* experts(d_model, d_ff, glu, [(gate, up, down), ...]) -> capsule; a matrix as stack() takes it. The caller keeps
 * every array alive as long as the capsule. */
static PyObject *py_experts(PyObject *self, PyObject *args) {
    long long dm, dff;
    int glu;
    PyObject *list;
    if (!PyArg_ParseTuple(args, "LLiO!", &dm, &dff, &glu, &PyList_Type, &list)) return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(list);
    if (dm <= 0 || dff <= 0 || n <= 0 || (glu != GLU_SILU && glu != GLU_OAI))
        return PyErr_Format(PyExc_ValueError, "experts: bad shape");
    experts_t *e = calloc(1, sizeof(experts_t) + (size_t)n * sizeof(expert_t));
    if (!e) return PyErr_NoMemory();
    *e = (experts_t){(int)n, glu, dm, dff};
    for (Py_ssize_t i = 0; i < n; i++) {
        expert_t *x = &e->experts[i];
        PyObject *g, *u, *d;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(list, i), "OOO", &g, &u, &d) || !mat_arg(g, &x->gate, dff, dm) ||
            !mat_arg(u, &x->up, dff, dm) || !mat_arg(d, &x->down, dm, dff)) {
            free(e);
            return NULL;
        }
    }
    PyObject *capsule = PyCapsule_New(e, EXPERTS, experts_free);
    if (!capsule) free(e);
    return capsule;
}

/* experts_run(experts, chosen, weights, n, x, out, threads): chosen int64 [n], weights float32 [n], x and out
 * float32 [d_model] */
static PyObject *py_experts_run(PyObject *self, PyObject *args) {
    PyObject *capsule;
    Py_ssize_t chosen, weights, x, out;
    int n, threads, ok;
    if (!PyArg_ParseTuple(args, "Onninni", &capsule, &chosen, &weights, &n, &x, &out, &threads)) return NULL;
    const experts_t *e = PyCapsule_GetPointer(capsule, EXPERTS);
    if (!e) return NULL;
    const int64_t *ids = (const int64_t *)chosen;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= e->n) return PyErr_Format(PyExc_ValueError, "experts_run: no expert %lld",
                                                              (long long)ids[i]);
    if (n <= 0) return PyErr_Format(PyExc_ValueError, "experts_run: %d experts", n);
    Py_BEGIN_ALLOW_THREADS
    ok = K->experts(e, ids, (const float *)weights, n, (const float *)x, (float *)out, threads);
    Py_END_ALLOW_THREADS
    if (!ok) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_dequant(PyObject *self, PyObject *args) {
    int type, bf16, threads;
    Py_ssize_t w, out;
    long long rows, cols;
    if (!PyArg_ParseTuple(args, "inLLnpi", &type, &w, &rows, &cols, &out, &bf16, &threads)) return NULL;
    if (!shape_arg(type, rows, cols)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    K->dequant(type, (const uint8_t *)w, rows, cols, (void *)out, bf16, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* gelu_mul(gu, T, d_ff, out, threads): out[t, i] = GELU(gu[t, i]) * gu[t, d_ff + i] */
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
    K->gelu_mul((const float *)gu, T, dff, (float *)out, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_gather(PyObject *self, PyObject *args) {
    int type;
    Py_ssize_t w, ids, out;
    long long cols, n;
    if (!PyArg_ParseTuple(args, "inLnLn", &type, &w, &cols, &ids, &n, &out)) return NULL;
    if (!shape_arg(type, 1, cols)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    K->gather(type, (const uint8_t *)w, cols, (const int64_t *)ids, n, (float *)out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_block_size(PyObject *self, PyObject *args) {
    int type, values, bytes, rounds, gemm;
    if (!PyArg_ParseTuple(args, "i", &type)) return NULL;
    if (!K->block_size(type, &values, &bytes, &rounds, &gemm)) Py_RETURN_NONE;
    return Py_BuildValue("(iiii)", values, bytes, rounds, gemm);
}

static PyObject *py_token_tiles(PyObject *self, PyObject *args) { return PyBool_FromLong(K->token_tiles); }

static PyObject *py_attend_bf16(PyObject *self, PyObject *args) { return PyBool_FromLong(K->attend_bf16); }
static PyObject *py_attend_int8(PyObject *self, PyObject *args) { return PyBool_FromLong(K->attend_int8); }

static PyObject *py_peak(PyObject *self, PyObject *args) {
    int kind, threads;
    long long n;
    double done;
    if (!PyArg_ParseTuple(args, "iLi", &kind, &n, &threads)) return NULL;
    if (kind < 0 || kind > 2 || n < 0 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "peak: kind 0 (f32), 1 (bf16) or 2 (int8), n >= 0, threads >= 1");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    done = K->peak(kind, n, threads);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(done);
}

static PyObject *py_isa(PyObject *self, PyObject *args) { return PyUnicode_FromString(K->name); }

static PyObject *py_isas(PyObject *self, PyObject *args) {
    PyObject *out = PyList_New(0);
    for (int i = 0; out && i < n_kernel_builds; i++)
        if (build_runs(kernel_builds[i])) {
            PyObject *name = PyUnicode_FromString(kernel_builds[i]->name);
            if (!name || PyList_Append(out, name) < 0) Py_CLEAR(out);
            Py_XDECREF(name);
        }
    return out;
}

static PyObject *py_use(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    const kernels_t *k = build_arg(name, "kernels ");
    if (!k) return NULL;
    K = k;
    Py_RETURN_NONE;
}

static PyMethodDef METHODS[] = {
    {"matmul", py_matmul, METH_VARARGS, "matmul(type, w, rows, cols, x, T, y, threads): y = x . W^T"},
    {"gemm", py_gemm, METH_VARARGS, "gemm(type, w, rows, cols, x, ldx, T, y, ldy, threads): y[t, :rows] = x[t] . W^T, int8"},
    {"dequant", py_dequant, METH_VARARGS, "dequant(type, w, rows, cols, out, bf16, threads)"},
    {"gather", py_gather, METH_VARARGS, "gather(type, w, cols, ids, n, out): rows ids of W as float32"},
    {"gelu_mul", py_gelu_mul, METH_VARARGS, "gelu_mul(gu, T, d_ff, out, threads): out = GELU(gate) * up, ggml's GELU"},
    {"attend", py_attend, METH_VARARGS,
     "attend(kv_dtype, k, v, capacity, ring, Hk, D, q, T, H, pos0, key_lo, window, scale, softcap, sinks, out, threads)"},
    {"quantize_q8_0", py_quantize_q8_0, METH_VARARGS, "quantize_q8_0(x, out, n): n float32 numbers as q8_0 blocks"},
    {"stack", py_stack, METH_VARARGS, "stack(shape, layers) -> a layer stack for run (see kernels.h)"},
    {"run", py_run, METH_VARARGS, "run(stack, x, T, segments, S, caches, kv_dtype, cos0, sin0, cos1, sin1, threads, done)"},
    {"experts", py_experts, METH_VARARGS, "experts(d_model, d_ff, glu, [(gate, up, down), ...]) -> a mixture's experts"},
    {"experts_run", py_experts_run, METH_VARARGS,
     "experts_run(experts, chosen, weights, n, x, out, threads): one token through its chosen experts, weighted"},
    {"block_size", py_block_size, METH_VARARGS,
     "block_size(type) -> (values, bytes, rounds, gemm), or None; rounds: a few tokens' activations are rounded to 8 "
     "bits with one scale a `rounds` values (0: they are not); gemm: many tokens have the int8 GEMM"},
    {"token_tiles", py_token_tiles, METH_NOARGS,
     "token_tiles() -> whether the int8 products unpack a block once for several tokens (prefill can use them)"},
    {"peak", py_peak, METH_VARARGS,
     "peak(kind, n, threads) -> operations done by n rounds of the build's float32 (0), bfloat16 (1) or int8 (2) "
     "product instruction on each thread (0.0 where the build has none)"},
    {"attend_bf16", py_attend_bf16, METH_NOARGS,
     "attend_bf16() -> whether attention multiplies in bfloat16 against float16 and bfloat16 caches"},
    {"attend_int8", py_attend_int8, METH_NOARGS,
     "attend_int8() -> whether attention's K.Q is an int8 product against a q8_0 cache"},
    {"isa", py_isa, METH_NOARGS, "isa() -> the name of the kernels' build in use"},
    {"isas", py_isas, METH_NOARGS, "isas() -> the builds this CPU runs, best first"},
    {"use", py_use, METH_VARARGS, "use(name): switch to the build of that name (generic, avx2, avx512, avx512bf16; neon, neon_dotprod)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_kernels", "CPU kernels (see src/kvsession/csrc/module.c)", -1, METHODS, NULL, NULL, NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    tables_init();
    for (int i = 0; i < n_kernel_builds; i++)
        if (build_runs(kernel_builds[i])) {
            K = kernel_builds[i];
            break;
        }
    const char *want = getenv("KVSESSION_ISA");
    if (want && *want) {
        const kernels_t *k = build_arg(want, "KVSESSION_ISA=");
        if (!k) return NULL; /* the ValueError names the builds this CPU runs */
        K = k;
    }
    return PyModule_Create(&MODULE);
}
