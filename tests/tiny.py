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
    arch: str = "llama"  # llama qwen2 qwen3 qwen3moe gemma2 gemma3 smollm3 granite olmo2 phi3 gpt-oss, and the
    # hybrids: lfm2 granitehybrid nemotron_h falcon-h1 qwen3next qwen35 qwen35moe
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
    vocab: int = 0  # 0: the 288 tokens of vocabulary(); more: padded with ordinary tokens (a real model's head size)
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
    # the hybrids: each layer's kind, one letter a layer -- A attention, C short convolution (lfm2), M Mamba2,
    # D gated DeltaNet, F a feed-forward layer alone (nemotron_h); falcon-h1 runs Mamba2 beside every attention
    layers: str = ""
    ssm_conv: int = 4  # the convolution's kernel (lfm2: shortconv.l_cache)
    ssm_state: int = 16  # Mamba2's d_state; DeltaNet's key (and value) head size
    ssm_heads: int = 8  # Mamba2's heads; DeltaNet's value heads
    ssm_groups: int = 2  # Mamba2's groups of B and C; DeltaNet's key heads
    ssm_head_dim: int = 16  # Mamba2's values a head
    legacy_ssm_in: bool = False  # qwen3next: the older ssm_in tensor (each key head's q, k, v, z) for attn_qkv/gate
    recurrent_marks: bool = False  # qwen3next, qwen35: attention.recurrent_layers, not full_attention_interval
    shared_expert: int = 0  # qwen3next, qwen35moe, granitehybrid: a shared expert of this width beside the routed
    sections: tuple[int, ...] = ()  # qwen35: interleaved M-RoPE's pairs per axis (rope.dimension_sections)
    mtp: int = 0  # multi-token-prediction blocks after the trunk, as the converters append them (nextn_predict_layers)

    def replace(self, **kw) -> "TinySpec":
        return dataclasses.replace(self, **kw)


def write_tiny(path: str | Path, spec: TinySpec = TinySpec()) -> Path:
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    tokens, types = vocabulary()
    tokens += list(spec.specials)
    types += [3] * len(spec.specials)
    pad = max(0, spec.vocab - len(tokens))
    # ordinary tokens, each its own word: a random-weight model samples them, and every engine must show them as
    # text (llama.cpp shows an "unused" token as nothing, which left a server's stream without content)
    tokens += [f"xtra{i}" for i in range(pad)]
    types += [1] * pad
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
    if spec.layers:
        _hybrid_metadata(w, spec)
    if a in ("qwen3moe", "gpt-oss") or (spec.layers and spec.experts and a in MOE_HYBRIDS):
        w.add_expert_count(spec.experts)
        w.add_expert_used_count(spec.experts_used)
        w.add_expert_feed_forward_length(spec.d_ff_expert)
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.d_model)
    w.add_block_count(spec.n_layers + spec.mtp)
    if spec.mtp:
        w.add_uint32(f"{a}.nextn_predict_layers", spec.mtp)
    if a == "nemotron_h":  # only its feed-forward layers have a width, only its attention layers KV heads
        w.add_feed_forward_length([spec.d_ff if k == "F" else 0 for k in spec.layers])
    else:
        w.add_feed_forward_length(spec.d_ff)
    w.add_head_count(spec.n_heads)
    if a in ("lfm2", "granitehybrid", "nemotron_h"):
        w.add_head_count_kv([spec.n_kv_heads if k == "A" else 0 for k in spec.layers])
    else:
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
    if spec.layers:
        _hybrid_layers(spec, head_dim, matrix, vector, experts, w.add_tensor, rng)
    for i in range(0 if spec.layers else spec.n_layers):
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
    vector("token_embd_norm.weight" if a == "lfm2" else "output_norm.weight", spec.d_model)
    if spec.longrope:  # the short factors near 1, the long ones growing to 40 over the pairs
        half = (spec.rope_dim or head_dim) // 2
        w.add_tensor("rope_factors_long.weight", np.geomspace(1.0, 40.0, half).astype(np.float32))
        w.add_tensor("rope_factors_short.weight", np.linspace(1.0, 1.5, half).astype(np.float32))
    if spec.rope_freqs:  # what convert_hf_to_gguf.py computes for rope_type "llama3": factors from 1 to 8
        w.add_tensor("rope_freqs.weight", np.geomspace(1.0, 8.0, head_dim // 2).astype(np.float32))
    if not spec.tied:  # float32 in the test files; in the speed shapes, the projections' type
        matrix("output.weight", vocab, spec.d_model, spec.weight_type if spec.noise else "F32")
    for i in range(spec.n_layers, spec.n_layers + spec.mtp):  # drawn last: the trunk's weights stay as they were
        vector(f"blk.{i}.attn_norm.weight", spec.d_model)
        matrix(f"blk.{i}.nextn.eh_proj.weight", spec.d_model, 2 * spec.d_model)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


MOE_HYBRIDS = ("qwen3next", "qwen35moe", "granitehybrid")  # the hybrids whose FFN may be experts
QWEN_HYBRIDS = ("qwen3next", "qwen35", "qwen35moe")


def _hybrid_metadata(w: gguf.GGUFWriter, spec: TinySpec) -> None:
    """The hybrids' keys, as their converters write them (llama.cpp's conversion/lfm2.py, granite.py,
    nemotron.py, falcon_h1.py, qwen.py)."""
    a = spec.arch
    if len(spec.layers) != spec.n_layers:
        raise ValueError(f"{len(spec.layers)} layer kinds for {spec.n_layers} layers")
    if a == "lfm2":
        w.add_shortconv_l_cache(spec.ssm_conv)
        return
    w.add_ssm_conv_kernel(spec.ssm_conv)
    w.add_ssm_inner_size(spec.ssm_heads * (spec.ssm_state if a in QWEN_HYBRIDS else spec.ssm_head_dim))
    w.add_ssm_state_size(spec.ssm_state)
    w.add_ssm_time_step_rank(spec.ssm_heads)
    w.add_ssm_group_count(spec.ssm_groups)
    if a == "granitehybrid":  # Granite's multipliers; no RoPE in its attention (rope.scaling.finetuned false)
        w.add_float32("granitehybrid.embedding_scale", 12.0)
        w.add_float32("granitehybrid.residual_scale", 0.22)
        w.add_float32("granitehybrid.attention.scale", 0.0078125 * 16)
        w.add_float32("granitehybrid.logit_scale", 2.5)
        w.add_rope_scaling_finetuned(False)
    if a == "nemotron_h":
        w.add_layer_norm_eps(1e-5)
    if a in QWEN_HYBRIDS:
        if spec.recurrent_marks:  # gguf-py 0.19 has no constant for this key (llama.cpp reads it first)
            w.add_array(f"{a}.attention.recurrent_layers", [k == "D" for k in spec.layers])
        else:
            w.add_full_attention_interval(spec.layers.index("A") + 1)
        if spec.sections:
            w.add_rope_dimension_sections(list(spec.sections))
    if a in MOE_HYBRIDS and spec.experts and spec.shared_expert:
        w.add_expert_shared_feed_forward_length(spec.shared_expert)


def _hybrid_layers(spec: TinySpec, head_dim: int, matrix, vector, experts, add_tensor, rng) -> None:
    """The hybrids' layers, with the tensor names and shapes llama.cpp's load_arch_tensors reads."""
    a, d = spec.arch, spec.d_model
    kv = spec.n_kv_heads * head_dim
    qwen = a in QWEN_HYBRIDS
    for i, kind in enumerate(spec.layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", d)
        if kind == "A" or a == "falcon-h1":
            matrix(p + "attn_q.weight", spec.n_heads * head_dim * (2 if qwen else 1), d)  # qwen: each head's gate
            matrix(p + "attn_k.weight", kv, d)
            matrix(p + "attn_v.weight", kv, d)
            matrix(p + "attn_output.weight", d, spec.n_heads * head_dim)
            if a == "lfm2" or qwen:
                vector(p + "attn_q_norm.weight", head_dim)
                vector(p + "attn_k_norm.weight", head_dim)
        if kind == "C":  # lfm2: in_proj -> B, C, x; a depthwise kernel [d, l_cache]
            matrix(p + "shortconv.in_proj.weight", 3 * d, d)
            add_tensor(p + "shortconv.conv.weight", (rng.standard_normal((d, spec.ssm_conv)) * 0.5).astype(np.float32))
            matrix(p + "shortconv.out_proj.weight", d, d)
        if kind == "M" or a == "falcon-h1":
            _mamba2(spec, p, matrix, vector, add_tensor, rng)
        if kind == "D":
            _deltanet(spec, p, matrix, vector, add_tensor, rng)
        if a == "nemotron_h":  # one mixer a layer: the feed-forward layers' up and down, squared ReLU
            if kind == "F":
                matrix(p + "ffn_up.weight", spec.d_ff, d)
                matrix(p + "ffn_down.weight", d, spec.d_ff)
            continue
        # llama.cpp 0.3.36 loads falcon-h1's FFN norm by a name without ".weight" (falcon-h1.cpp: tn(FFN_NORM, i))
        vector(p + ("post_attention_norm.weight" if qwen else "ffn_norm" if a == "falcon-h1" else "ffn_norm.weight"), d)
        if a in MOE_HYBRIDS and spec.experts:
            matrix(p + "ffn_gate_inp.weight", spec.experts, d, "F32")
            experts(p + "ffn_gate_exps.weight", spec.d_ff_expert, d)
            experts(p + "ffn_up_exps.weight", spec.d_ff_expert, d)
            experts(p + "ffn_down_exps.weight", d, spec.d_ff_expert)
            if spec.shared_expert:
                if a != "granitehybrid":  # its output through a sigmoid gate of its own
                    vector(p + "ffn_gate_inp_shexp.weight", d, 0.0, 0.5)
                matrix(p + "ffn_gate_shexp.weight", spec.shared_expert, d)
                matrix(p + "ffn_up_shexp.weight", spec.shared_expert, d)
                matrix(p + "ffn_down_shexp.weight", d, spec.shared_expert)
            continue
        matrix(p + "ffn_gate.weight", spec.d_ff, d)
        matrix(p + "ffn_up.weight", spec.d_ff, d)
        matrix(p + "ffn_down.weight", d, spec.d_ff)


def _mamba2(spec: TinySpec, p: str, matrix, vector, add_tensor, rng) -> None:
    """A Mamba2 mixer: in_proj [z | xBC | dt], conv1d over xBC, A = -exp(A_log) and D [H, 1], the grouped norm
    [G, inner / G] (the converter's shapes), out_proj."""
    H, G, N = spec.ssm_heads, spec.ssm_groups, spec.ssm_state
    inner = H * spec.ssm_head_dim
    channels = inner + 2 * G * N
    matrix(p + "ssm_in.weight", 2 * inner + 2 * G * N + H, spec.d_model)
    add_tensor(p + "ssm_conv1d.weight", (rng.standard_normal((channels, spec.ssm_conv)) * 0.5).astype(np.float32))
    vector(p + "ssm_conv1d.bias", channels, 0.0, 0.2)
    vector(p + "ssm_dt.bias", H, -1.0, 0.5)
    add_tensor(p + "ssm_a", -np.exp(rng.uniform(0.0, 2.0, (H, 1))).astype(np.float32))
    add_tensor(p + "ssm_d", rng.uniform(0.5, 1.5, (H, 1)).astype(np.float32))
    add_tensor(p + "ssm_norm.weight", (1 + 0.1 * rng.standard_normal((G, inner // G))).astype(np.float32))
    matrix(p + "ssm_out.weight", spec.d_model, inner)


def _deltanet(spec: TinySpec, p: str, matrix, vector, add_tensor, rng) -> None:
    """A gated DeltaNet mixer: q, k, v (and z) as attn_qkv + attn_gate or the older ssm_in; beta and alpha as
    ssm_ba (qwen3next: each key head's, side by side) or ssm_beta + ssm_alpha (qwen35); conv1d; A, dt bias;
    the head norm; out_proj."""
    Hv, Hk, D = spec.ssm_heads, spec.ssm_groups, spec.ssm_state
    qk, v = 2 * Hk * D, Hv * D
    if spec.legacy_ssm_in:
        matrix(p + "ssm_in.weight", qk + 2 * v, spec.d_model)
    else:
        matrix(p + "attn_qkv.weight", qk + v, spec.d_model)
        matrix(p + "attn_gate.weight", v, spec.d_model)
    if spec.arch == "qwen3next":
        matrix(p + "ssm_ba.weight", 2 * Hv, spec.d_model)
    else:
        matrix(p + "ssm_beta.weight", Hv, spec.d_model)
        matrix(p + "ssm_alpha.weight", Hv, spec.d_model)
    add_tensor(p + "ssm_conv1d.weight", (rng.standard_normal((qk + v, spec.ssm_conv)) * 0.5).astype(np.float32))
    vector(p + "ssm_dt.bias", Hv, 0.0, 0.5)
    add_tensor(p + "ssm_a", -np.exp(rng.uniform(-1.0, 1.0, Hv)).astype(np.float32))
    vector(p + "ssm_norm.weight", D)
    matrix(p + "ssm_out.weight", spec.d_model, v)


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

# The hybrids' tiny models, recorded apart (tests/vectors/hybrid.json): llama.cpp's logits on TINY_HYBRID_TEXT in
# one batch, and how far they move in several, the tolerance tests/test_hybrid.py holds our logits to. The text
# runs past 64 tokens, so that the chunked scans (ours and llama.cpp's) cross a chunk's end.
TINY_HYBRID_TEXT = TINY_TEXT + "\n" + TINY_TEXT
TINY_HYBRID_SPECS = {
    "lfm2_f32": TinySpec(arch="lfm2", n_layers=4, layers="CCAC", ssm_conv=3, seed=40),
    "granitehybrid_f32": TinySpec(arch="granitehybrid", n_layers=4, layers="MMAM", experts=0, ssm_heads=8,
                                  ssm_head_dim=16, ssm_groups=1, seed=41),
    "granitehybrid_moe_f32": TinySpec(arch="granitehybrid", n_layers=4, layers="MAMM", d_ff=32, experts=8,
                                      experts_used=2, shared_expert=32, ssm_heads=8, ssm_head_dim=16, ssm_groups=1,
                                      seed=42),
    "nemotron_h_f32": TinySpec(arch="nemotron_h", n_layers=6, layers="MFMAMF", ssm_heads=8, ssm_head_dim=8,
                               ssm_groups=2, seed=43),
    "falcon_h1_f32": TinySpec(arch="falcon-h1", n_layers=3, layers="AAA", ssm_heads=4, ssm_head_dim=16,
                              ssm_groups=1, tied=False, seed=44),
    "qwen3next_f32": TinySpec(arch="qwen3next", n_layers=4, layers="DDDA", head_dim=32, rope_dim=8, ssm_heads=4,
                              ssm_groups=2, experts=8, experts_used=2, shared_expert=32, rope_base=1e6, seed=45),
    "qwen3next_ssm_in_f32": TinySpec(arch="qwen3next", n_layers=4, layers="DADA", head_dim=32, rope_dim=8,
                                     ssm_heads=4, ssm_groups=2, experts=8, experts_used=2, shared_expert=32,
                                     legacy_ssm_in=True, recurrent_marks=True, seed=46),
    "qwen35_f32": TinySpec(arch="qwen35", n_layers=4, layers="DDDA", head_dim=32, rope_dim=12, sections=(2, 2, 1, 1),
                           ssm_heads=4, ssm_groups=2, rope_base=1e6, seed=47),
    "qwen35moe_f32": TinySpec(arch="qwen35moe", n_layers=4, layers="DADD", head_dim=32, rope_dim=16,
                              sections=(3, 3, 2, 0), ssm_heads=4, ssm_groups=2, experts=8, experts_used=2,
                              shared_expert=32, recurrent_marks=True, seed=48),
}
