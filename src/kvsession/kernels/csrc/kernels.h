#pragma once
/* What each instruction-set build of the kernels offers the Python module (module.c), and what they share.
 *
 * The kernels are compiled once per instruction set (isa_generic.c, isa_avx2.c, isa_avx512*.c, isa_neon*.c:
 * the same sources under each one's compiler flags, setup.py), and module.c picks the best build the CPU runs
 * when it loads (or the one KVSESSION_ISA names), so that one build runs on every x86-64 (or AArch64) machine. Each build is a
 * table of entry points over plain C arguments; module.c checks those arguments and holds the GIL's release.
 */
#ifndef KVSESSION_KERNELS_H
#define KVSESSION_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* ggml_type numbers */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23,
       T_BF16 = 30, T_MXFP4 = 39 };

/* the KV cache's row types; q8_0 as llama.cpp keeps it: blocks of KV_QBLOCK numbers along a row, each a float16
 * scale (the block's largest magnitude / 127) then KV_QBLOCK int8 */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_Q8_0 = 3 };
#define KV_QBLOCK 32
#define KV_QBYTES 34

/* bytes of n numbers of a cache row (n a multiple of KV_QBLOCK for q8_0) */
static inline size_t kv_bytes(int dtype, int64_t n) {
    return dtype == KV_Q8_0 ? (size_t)(n / KV_QBLOCK) * KV_QBYTES : (size_t)n * (dtype == KV_F32 ? 4 : 2);
}

/* n numbers (a multiple of KV_QBLOCK) as q8_0 blocks, as ggml's quantize_row_q8_0_ref rounds them (builds.c) */
void q8_0_row(const float *x, uint8_t *out, int64_t n);
#define MAX_HEAD_DIM 256
#define MAX_HEADS 256

/* --- a stack of layers for a few tokens (decode) ----------------------------------------------------------
 *
 * One call runs T tokens through every layer: norms, projections, RoPE, the cache's new rows, attention, the
 * feed-forward, the residual stream. What model/transformer.py's Block does with some thirty PyTorch operations a layer,
 * each a few microseconds of dispatch that a 135M model's decode step cannot afford, done in one pass with
 * the same arithmetic (float32, ggml's GELU on float16-rounded inputs). The weights are the same blocks, the
 * cache the same rows: model/transformer.py describes both once (kernels.Stack) and calls this only where every weight
 * has a kernel. A hybrid's short-convolution layers (LFM2), Mamba2 layers (Granite 4.0-H, Nemotron-H) and gated
 * DeltaNet layers (Qwen3.5, Qwen3-Next), beside the attention layers or beside the attention in one layer
 * (Falcon-H1), and a mixture of experts in place of a feed-forward network (each token routed, its chosen experts
 * run, a shared expert added) run here too, their states read and written in place (kv/recurrent.py's layout: conv float32
 * [channels, conv_k - 1], oldest input first; Mamba2's scan float32 [heads, inner / heads, state], DeltaNet's
 * [heads, inner / heads, state]: one row of keys a value). */

typedef struct {
    int type; /* ggml_type */
    const uint8_t *w;
    int64_t rows, cols;
    const float *bias; /* [rows] or NULL */
} mat_t;

typedef struct {
    mat_t q, k, v, o, gate, up, down; /* a short-convolution layer: q its in_proj [3 d_model, d_model], o its
                                         out_proj; k and v unused */
    mat_t alpha; /* a DeltaNet layer's alpha projection [heads, d_model]; unused elsewhere */
    mat_t ssm_in, ssm_out; /* a Mamba2 layer beside the attention, on the same normed input, its output added to
                              the attention's (Falcon-H1): its in_proj and out_proj (conv, conv_k and the Mamba2
                              vectors are its); empty elsewhere */
    int form;    /* FORM_BOTH: a mixer (attention or a recurrent layer), then a feed-forward network after ffn_norm;
                    FORM_MIXER: the mixer alone; FORM_FFN: the feed-forward network alone, after attn_norm
                    (Nemotron-H's layers). A feed-forward network without gate is relu(up)^2 */
    const float *attn_norm, *ffn_norm, *q_norm, *k_norm, *post_attn_norm, *post_ffn_norm; /* NULL: none */
    int64_t window; /* 0: full attention */
    int rope;       /* which of the two RoPE tables */
    const float *conv; /* NULL: attention; else a recurrent layer's causal convolution, its kernel [channels, conv_k]:
                          LFM2's gated short convolution, or a Mamba2 layer's (mamba) */
    int conv_k;
    int ssm; /* SSM_MAMBA2: a Mamba2 layer (the stack's ssm sizes): q its in_proj [2 inner + 2 groups state +
                heads, d_model], o its out_proj [d_model, inner]. SSM_DELTA: a gated DeltaNet layer (heads value
                heads of inner / heads, groups key heads of state): q its qkv [2 groups state + inner, d_model], k
                its output gate z [inner, d_model], v its beta [heads, d_model], alpha its alpha, o its out_proj.
                0: neither */
    const float *conv_bias, *dt_bias, *ssm_a, *ssm_d, *ssm_norm; /* Mamba2's vectors (conv_bias, ssm_norm may be
                                                                    NULL); DeltaNet's dt_bias, a and norm [inner /
                                                                    heads] */
    const float *sinks; /* [H]: one more logit in each head's softmax (gpt-oss), or NULL */
    /* a mixture of experts in place of the feed-forward network (gate, up and down empty): the router's logits
     * [n, d_model] choose `used` experts (GATE_SOFTMAX: the most probable, weighed by their probabilities;
     * GATE_SOFTMAX_WEIGHT: the largest logits, weighed by a softmax over them), their weights divided by their sum
     * where norm_weights says so; a shared expert every token goes through (sh_gate, sh_up, sh_down, SiLU), its
     * output times sigmoid(h . sh_inp) where sh_inp is not NULL. experts NULL: a dense network */
    const struct experts *experts;
    mat_t router, sh_gate, sh_up, sh_down;
    const float *sh_inp;
    int used, gating, norm_weights;
} layer_t;

enum { GATE_SOFTMAX = 0, GATE_SOFTMAX_WEIGHT = 1 };
#define MAX_USED 64

enum { SSM_MAMBA2 = 1, SSM_DELTA = 2 };
enum { FORM_BOTH = 0, FORM_MIXER = 1, FORM_FFN = 2 };

typedef struct {
    int n_layers, d_model, H, Hk, D, d_ff;
    int gelu;       /* 0: SiLU, 1: ggml's GELU (tanh) */
    int neox;       /* RoPE pairs (i, i + dim/2) instead of (2i, 2i + 1) */
    int rope_dim;   /* leading dimensions of a head that rotate */
    float eps, scale;
    float residual; /* 0: none; else attention's and the FFN's outputs times this before the residual add */
    float softcap;  /* 0: none; else each attention score is softcap * tanh(score / softcap) (Gemma 2) */
    int convs;      /* some layers are short convolutions (LFM2) */
    int64_t ssm_inner, ssm_heads, ssm_groups, ssm_state; /* Mamba2's or DeltaNet's sizes (0 where no layer is one) */
    int attn_gate;  /* attention's q projection gives each head its query then a gate of its output (Qwen3-Next):
                       q [2 H D, d_model], the output times sigmoid(gate) */
    int qk_tile;    /* DeltaNet's value head h reads key head h % groups (Qwen3.5), else h / (heads / groups) */
    layer_t layers[];
} stack_t;

/* --- a mixture of experts for one token (decode) ------------------------------------------------------------
 * The chosen experts' gated FFNs and their weighted sum in one call, where moe.py would make some twenty PyTorch
 * calls an expert: the same products (matmul_mt), the same activation arithmetic as ggml's. */

enum { GLU_SILU = 0, GLU_OAI = 1 }; /* silu(gate) * up; gpt-oss's clamped form (ggml_swiglu_oai, alpha 1.702, 7) */

typedef struct {
    mat_t gate, up, down; /* [d_ff, d_model], [d_ff, d_model], [d_model, d_ff] */
} expert_t;

typedef struct experts {
    int n, glu;
    int64_t d_model, d_ff;
    expert_t experts[];
} experts_t;

/* one instruction set's kernels; every entry point takes raw addresses and checked shapes */
typedef struct {
    const char *name;
    /* the type's block (values, bytes), and how this build multiplies it: a few tokens' activations rounded to
     * 8 bits with one scale a `rounds` values (0: float32 products), `gemm` many tokens by the int8 GEMM;
     * 0 where the type has no kernel */
    int (*block_size)(int type, int *values, int *bytes, int *rounds, int *gemm);
    int token_tiles; /* the int8 products unpack a block once for several tokens (prefill can use them) */
    int attend_bf16; /* attention multiplies in bfloat16 against float16 and bfloat16 caches (float32 elsewhere) */
    int attend_int8; /* attention's K.Q is an int8 product against a q8_0 cache */
    /* y[T, rows] = x[T, cols] . W^T, float32 */
    void (*matmul)(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x, int64_t T, float *y,
                   int threads);
    /* y[t * ldy + r] = x[t * ldx ...] . W[r] by the int8 GEMM; 0 when out of memory */
    int (*gemm)(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x, int64_t ldx, int64_t T,
                float *y, int64_t ldy, int threads);
    /* W as float32 or bfloat16 [rows, cols] */
    void (*dequant)(int type, const uint8_t *w, int64_t rows, int64_t cols, void *out, int bf16, int threads);
    /* rows ids[0..n) of W as float32 [n, cols] */
    void (*gather)(int type, const uint8_t *w, int64_t cols, const int64_t *ids, int64_t n, float *out);
    /* out[t, i] = GELU(gu[t, i]) * gu[t, d_ff + i] */
    void (*gelu_mul)(const float *gu, int64_t T, int64_t d_ff, float *out, int threads);
    /* softmax(q . K^T * scale) . V for T queries at positions pos0.. over the cache's rows (flash attention, attend.h);
     * 0 when out of memory */
    int (*attend)(int dtype, const uint8_t *k, const uint8_t *v, int64_t cap, int ring, int Hk, int D, const float *q,
                  int64_t T, int H, int64_t pos0, int64_t key_lo, int64_t window, float scale, float softcap,
                  const float *sinks, float *out, int threads);
    /* x [T, d_model] through every layer of s, in place (module.c's run() says the rest); 0 when out of memory */
    int (*run)(const stack_t *s, float *x, int64_t T, const int64_t *segs, int64_t S, const int64_t *caches,
               int dtype, const float *const tables[2][2], int threads);
    /* n rounds of the build's product instruction of one kind (peak.h) on `threads` threads: the operations done, 0
     * where the build has none */
    double (*peak)(int kind, int64_t n, int threads);
    /* out[d_model] = sum over i < n of weights[i] * expert chosen[i] of x [d_model], added in that order; 0 when
     * out of memory */
    int (*experts)(const experts_t *e, const int64_t *chosen, const float *weights, int n, const float *x,
                   float *out, int threads);
} kernels_t;

extern const kernels_t kernels_generic;
#if defined(__x86_64__) || defined(_M_X64)
extern const kernels_t kernels_avx2;
extern const kernels_t kernels_avx512;
extern const kernels_t kernels_avx512bf16;
#endif
#if defined(__aarch64__)
extern const kernels_t kernels_neon;
extern const kernels_t kernels_neon_dotprod;
#endif

/* every build made for this architecture, best first, and whether this CPU (and its OS, for the wider
 * registers' state) runs one (builds.c) */
extern const kernels_t *const kernel_builds[];
extern const int n_kernel_builds;
int build_runs(const kernels_t *k);

/* ggml's CPU GELU (GGML_GELU_FP16) of every float16 value, by its bits, and MXFP4's scale of every E8M0 byte
 * (ggml_e8m0_to_fp32_half): filled once by tables_init (builds.c), before any kernel runs */
extern float gelu_table[65536];
extern float e8m0_half_table[256];
void tables_init(void);

#endif
