"""Tiny random-weight GGUF models, written with gguf.GGUFWriter.

The same spec and seed always give the same bytes, so reference vectors made
from these files with llama.cpp (tools/llamacpp_reference.py --tiny) stay
valid for the files the tests write again. The vocabulary is GPT-2's 256
byte-level tokens, a handful of merges and ChatML's control tokens, enough
for llama.cpp to load the file and for our tokenizer to round-trip text.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t", "e n", "Ġ o", "Ġ w", "o r", "i s"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokens() -> list[str]:
    """GPT-2's bytes_to_unicode table: the printable stand-in of every byte, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def vocabulary() -> tuple[list[str], list[int]]:
    tokens = byte_tokens() + [m.replace(" ", "") for m in MERGES]
    types = [1] * len(tokens)
    tokens += SPECIALS
    types += [3] * len(SPECIALS)
    pad = 288 - len(tokens)  # a multiple of 16 keeps every projection packable
    tokens += [f"<|unused{i}|>" for i in range(pad)]
    types += [5] * pad
    return tokens, types


@dataclass(frozen=True)
class TinySpec:
    arch: str = "llama"  # llama qwen2 qwen3 qwen3moe gemma2 gemma3 smollm3 granite olmo2 phi3 gpt-oss
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 128
    context: int = 512
    rope_base: float = 10000.0
    weight_type: str = "F32"  # type of the projection matrices: F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1
    tied: bool = True
    seed: int = 0
    weight_scale: float = 0.25  # std of the random weights (large enough for peaked logits)
    head_dim: int = 0  # 0: d_model // n_heads (gemma3 sets its own)
    sliding_window: int = 0  # gemma3: window of the sliding layers
    swa_pattern: int = 2  # gemma3: every n-th layer is global
    vocab: int = 0  # 0: the 288 tokens of vocabulary(); more: padded with unused tokens (a real model's head size)
    rope_freqs: bool = False  # a rope_freqs tensor, as the converter writes Llama 3.1's "llama3" rope scaling
    rope_dim: int = 0  # values of a head RoPE rotates (0: all of them; fewer: Phi-4-mini's partial rotary)
    experts: int = 8  # qwen3moe, gpt-oss: experts a layer, of which experts_used a token, each of d_ff_expert
    experts_used: int = 3
    d_ff_expert: int = 32
    expert_type: str = ""  # the expert tensors' type ("": weight_type; gpt-oss's files: MXFP4)
    yarn: float = 0.0  # > 0: YaRN rope scaling of this factor, from a trained context of context // 8 (gpt-oss)
    pre: str = "smollm"  # the pre-tokenizer (gpt-oss: "gpt-4o")
    longrope: bool = False  # phi3's LongRoPE: long and short factors, trained for context // 8, an attention factor
    noise: bool = False  # every block type as random blocks of modest scale (the speed shapes: writes in seconds)
    specials: tuple[str, ...] = ()  # more control tokens, after the vocabulary (gpt-oss's harmony markers)
    template: str = TEMPLATE  # tokenizer.chat_template (the server tests give other families' templates)

    def replace(self, **kw) -> "TinySpec":
        return dataclasses.replace(self, **kw)


def write_tiny(path: str | Path, spec: TinySpec = TinySpec()) -> Path:
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    tokens, types = vocabulary()
    tokens += list(spec.specials)
    types += [3] * len(spec.specials)
    pad = max(0, spec.vocab - len(tokens))
    tokens += [f"<|extra{i}|>" for i in range(pad)]
    types += [5] * pad
    vocab = len(tokens)
    head_dim = spec.head_dim or spec.d_model // spec.n_heads
    a = spec.arch
    w = gguf.GGUFWriter(str(path), a)
    if a == "gemma3" or head_dim != spec.d_model // spec.n_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if a == "gemma3":
        if spec.sliding_window:
            w.add_sliding_window(spec.sliding_window)
            w.add_uint32("gemma3.attention.sliding_window_pattern", spec.swa_pattern)
    if a == "gemma2":  # every other layer slides (llama.cpp's default pattern); caps small enough to bite
        w.add_sliding_window(spec.sliding_window or 4096)
        w.add_float32("gemma2.attn_logit_softcapping", 1.5)
        w.add_float32("gemma2.final_logit_softcapping", 3.0)
    if a == "granite":  # its four multipliers, away from 1 so that each one shows in the logits
        w.add_float32("granite.embedding_scale", 12.0)
        w.add_float32("granite.residual_scale", 0.22)
        w.add_float32("granite.attention.scale", 0.0078125 * 16)
        w.add_float32("granite.logit_scale", 2.5)
    if a == "gpt-oss":
        w.add_sliding_window(spec.sliding_window or 128)
    if a == "olmo2" and spec.sliding_window:  # OLMo 3
        w.add_sliding_window(spec.sliding_window)
    if spec.longrope:  # as conversion/phi.py writes it for the 128k models
        w.add_rope_scaling_orig_ctx_len(spec.context // 8)
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(8) / np.log(spec.context // 8))))
    if spec.yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(spec.yarn)
        w.add_rope_scaling_orig_ctx_len(spec.context // 8)
    if a in ("qwen3moe", "gpt-oss"):
        w.add_expert_count(spec.experts)
        w.add_expert_used_count(spec.experts_used)
        w.add_expert_feed_forward_length(spec.d_ff_expert)
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.d_model)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(spec.d_ff)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(spec.rope_dim or head_dim)
    w.add_rope_freq_base(spec.rope_base)
    w.add_vocab_size(vocab)
    w.add_file_type(1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(spec.pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(spec.template)

    def weights(shape: tuple[int, ...], qtype: str) -> np.ndarray:
        if random(Q[qtype]):  # random blocks of their own: the values are not drawn (a shape only)
            return np.zeros(shape, np.float32)
        return (rng.standard_normal(shape) * spec.weight_scale / np.sqrt(shape[-1]) * 4).astype(np.float32)

    def random(t: Q) -> bool:
        return t in RANDOM_BLOCKS or (spec.noise and t in NOISE_BLOCKS)

    def matrix(name: str, rows: int, cols: int, qtype: str = spec.weight_type) -> None:
        _add(w, name, weights((rows, cols), qtype), qtype, random(Q[qtype]))

    def experts(name: str, rows: int, cols: int) -> None:
        qtype = spec.expert_type or spec.weight_type
        _add(w, name, weights((spec.experts, rows, cols), qtype), qtype, random(Q[qtype]))

    def vector(name: str, n: int, mean: float = 1.0, std: float = 0.1) -> None:
        w.add_tensor(name, (mean + std * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", vocab, spec.d_model, "Q8_0" if spec.weight_type != "F32" else "F32")
    kv = spec.n_kv_heads * head_dim
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        if a != "olmo2":  # olmo2 norms after attention and the FFN only
            vector(p + "attn_norm.weight", spec.d_model)
        if a == "phi3":  # q, k and v fused in one tensor
            matrix(p + "attn_qkv.weight", spec.n_heads * head_dim + 2 * kv, spec.d_model)
        else:
            matrix(p + "attn_q.weight", spec.n_heads * head_dim, spec.d_model)
            matrix(p + "attn_k.weight", kv, spec.d_model)
            matrix(p + "attn_v.weight", kv, spec.d_model)
        if a in ("gemma3", "qwen3", "qwen3moe"):
            vector(p + "attn_q_norm.weight", head_dim)
            vector(p + "attn_k_norm.weight", head_dim)
        if a == "olmo2":  # q and k normed across all heads
            vector(p + "attn_q_norm.weight", spec.n_heads * head_dim)
            vector(p + "attn_k_norm.weight", kv)
        if a in ("gemma2", "gemma3", "olmo2"):
            vector(p + "post_attention_norm.weight", spec.d_model)
            vector(p + "post_ffw_norm.weight", spec.d_model)
        if a == "gpt-oss":  # biases everywhere, one sink logit a head
            vector(p + "attn_q.bias", spec.n_heads * head_dim, 0.0, 0.5)
            vector(p + "attn_k.bias", kv, 0.0, 0.5)
            vector(p + "attn_v.bias", kv, 0.0, 0.5)
            vector(p + "attn_output.bias", spec.d_model, 0.0, 0.5)
            vector(p + "attn_sinks.weight", spec.n_heads, 0.0, 2.0)
        if a == "qwen2":
            vector(p + "attn_q.bias", spec.d_model, 0.0, 0.5)
            vector(p + "attn_k.bias", kv, 0.0, 0.5)
            vector(p + "attn_v.bias", kv, 0.0, 0.5)
        matrix(p + "attn_output.weight", spec.d_model, spec.n_heads * head_dim)
        if a == "gpt-oss":  # the FFN's norm, named after the attention it follows
            vector(p + "post_attention_norm.weight", spec.d_model)
        elif a != "olmo2":
            vector(p + "ffn_norm.weight", spec.d_model)
        if a in ("qwen3moe", "gpt-oss"):  # the router in float32, as the converter leaves it; experts [n, rows, cols]
            matrix(p + "ffn_gate_inp.weight", spec.experts, spec.d_model, "F32")
            experts(p + "ffn_gate_exps.weight", spec.d_ff_expert, spec.d_model)
            experts(p + "ffn_up_exps.weight", spec.d_ff_expert, spec.d_model)
            experts(p + "ffn_down_exps.weight", spec.d_model, spec.d_ff_expert)
            if a == "gpt-oss":  # [n_experts, rows] each
                w.add_tensor(p + "ffn_gate_inp.bias", (0.5 * rng.standard_normal(spec.experts)).astype(np.float32))
                for name, rows in (("gate", spec.d_ff_expert), ("up", spec.d_ff_expert), ("down", spec.d_model)):
                    w.add_tensor(p + f"ffn_{name}_exps.bias",
                                 (0.5 * rng.standard_normal((spec.experts, rows))).astype(np.float32))
            continue
        if a == "phi3":  # gate and up fused, gate first
            matrix(p + "ffn_up.weight", 2 * spec.d_ff, spec.d_model)
        else:
            matrix(p + "ffn_gate.weight", spec.d_ff, spec.d_model)
            matrix(p + "ffn_up.weight", spec.d_ff, spec.d_model)
        matrix(p + "ffn_down.weight", spec.d_model, spec.d_ff)
    vector("output_norm.weight", spec.d_model)
    if spec.longrope:  # the short factors near 1, the long ones growing to 40 over the pairs
        half = (spec.rope_dim or head_dim) // 2
        w.add_tensor("rope_factors_long.weight", np.geomspace(1.0, 40.0, half).astype(np.float32))
        w.add_tensor("rope_factors_short.weight", np.linspace(1.0, 1.5, half).astype(np.float32))
    if spec.rope_freqs:  # what convert_hf_to_gguf.py computes for rope_type "llama3": factors from 1 to 8
        w.add_tensor("rope_freqs.weight", np.geomspace(1.0, 8.0, head_dim // 2).astype(np.float32))
    if not spec.tied:  # float32 in the test files; in the speed shapes, the projections' type
        matrix("output.weight", vocab, spec.d_model, spec.weight_type if spec.noise else "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add(w: gguf.GGUFWriter, name: str, m: np.ndarray, qtype: str, noise: bool) -> None:
    t = Q[qtype]
    if t == Q.F32:
        w.add_tensor(name, m)
    elif t == Q.F16:
        w.add_tensor(name, m.astype(np.float16))
    elif noise:
        w.add_tensor(name, random_blocks(m, t), raw_shape=gguf.quant_shape_to_byte_shape(m.shape, t), raw_dtype=t)
    else:
        w.add_tensor(name, gguf.quants.quantize(m, t), raw_shape=gguf.quant_shape_to_byte_shape(m.shape, t),
                     raw_dtype=t)


# Types gguf.quants cannot quantize (the K-quants): random blocks whose float16 scales (byte offsets in a block)
# are set to give weights of about 0.03, for the speed shapes of tools/random_model.py; their values are noise
RANDOM_BLOCKS = {Q.Q4_K: ((0, 2), 1e-4), Q.Q5_K: ((0, 2), 5e-5), Q.Q6_K: ((208,), 2e-5)}
# and those gguf.quants quantizes too slowly for a 10 GB file, random where a spec asks for noise (MXFP4: its
# power-of-two scale byte, 2^(121 - 128))
NOISE_BLOCKS = {Q.Q8_0: ((0,), 5e-4), Q.Q4_0: ((0,), 7.5e-3), Q.MXFP4: ((), 0.0)}


def random_blocks(m: np.ndarray, t: Q) -> np.ndarray:
    values, nbytes = gguf.GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(m.size)
    blocks = rng.integers(0, 256, (m.size // values, nbytes), dtype=np.uint8)
    offsets, scale = RANDOM_BLOCKS.get(t) or NOISE_BLOCKS[t]
    for at in offsets:
        blocks[:, at : at + 2] = np.full(len(blocks), scale, np.float16).view(np.uint8).reshape(-1, 2)
    if t == Q.MXFP4:
        blocks[:, 0] = 121
    return blocks.reshape(*m.shape[:-1], m.shape[-1] // values * nbytes)


# The tiny models tools/llamacpp_reference.py --tiny records llama.cpp's logits
# for (tests/vectors/tiny.json): float models compare at float precision,
# quantized ones (llama.cpp quantizes activations too) by tolerance.
TINY_REFERENCE_SPECS = {
    "llama_f32": TinySpec(),
    "llama_f32_untied_mqa": TinySpec(n_kv_heads=1, tied=False, seed=1, rope_base=500.0),
    "qwen2_f32": TinySpec(arch="qwen2", seed=2),
    "llama_f16": TinySpec(weight_type="F16", seed=3),
    "llama_q8_0": TinySpec(weight_type="Q8_0", seed=4),
    "llama_q4_0": TinySpec(weight_type="Q4_0", seed=5),
    "llama_q4_1": TinySpec(weight_type="Q4_1", seed=6),
    "gemma3_f32": TinySpec(arch="gemma3", n_layers=4, n_heads=4, n_kv_heads=1, head_dim=32, sliding_window=8,
                           rope_base=1e6, seed=7),
    "llama3_f32": TinySpec(rope_freqs=True, rope_base=5e5, tied=False, seed=8),
    "qwen3_f32": TinySpec(arch="qwen3", n_heads=4, head_dim=32, rope_base=1e6, seed=9),
    "smollm3_f32": TinySpec(arch="smollm3", n_layers=4, seed=10),
    "granite_f32": TinySpec(arch="granite", seed=11),
    "qwen3_q8_0": TinySpec(arch="qwen3", n_heads=4, head_dim=32, weight_type="Q8_0", seed=12),
    "qwen3moe_f32": TinySpec(arch="qwen3moe", n_heads=4, head_dim=32, seed=13),
    "qwen3moe_q8_0": TinySpec(arch="qwen3moe", n_heads=4, head_dim=32, weight_type="Q8_0", seed=14),
    "olmo2_f32": TinySpec(arch="olmo2", tied=False, seed=15),
    "gemma2_f32": TinySpec(arch="gemma2", n_layers=4, n_kv_heads=1, head_dim=32, sliding_window=8, seed=16),
    "phi3_f32": TinySpec(arch="phi3", seed=17),
    "phi3_partial_rope_f32": TinySpec(arch="phi3", n_heads=2, n_kv_heads=2, rope_dim=24, tied=False, seed=18),
    "phi3_longrope_f32": TinySpec(arch="phi3", rope_dim=12, longrope=True, seed=36),
    "olmo3_f32": TinySpec(arch="olmo2", n_layers=4, sliding_window=8, yarn=8.0, tied=False, seed=34),
    "gpt_oss_f32": TinySpec(arch="gpt-oss", n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, sliding_window=8,
                            experts=8, experts_used=4, rope_base=150000.0, yarn=32.0, tied=False, seed=19),
    "gpt_oss_mxfp4": TinySpec(arch="gpt-oss", n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, sliding_window=8,
                              experts=8, experts_used=4, rope_base=150000.0, yarn=32.0, tied=False, expert_type="MXFP4",
                              seed=20),
}

# Pre-tokenizers proven on tiny files of their own: tools/llamacpp_reference.py --tiny records how llama.cpp
# splits its TEXTS (and TINY_SPLIT_TEXTS) with each
TINY_PRE_TOKENIZER_SPECS = {"gpt-4o": TinySpec(pre="gpt-4o")}
TINY_SPLIT_TEXTS = ["HelloWorld CamelCaseWords ABCdef don'T I'LL", "path/to/file\r\n/x", "12345678 x1y22z333",
                    "ÉCOLE école ÀÉÎ ΣΊΣΥΦΟΣ"]

TINY_TEXT = "<|im_start|>user\nHello there, the world is on a string of words in the sea.<|im_end|>\n" \
            "<|im_start|>assistant\nOr is it?"
