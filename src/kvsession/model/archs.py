"""The architectures: one table, each entry how llama.cpp rotates its heads and what its file adds to the
llama graph.

A GGUF file's metadata (keys `{arch}.*`, as llama.cpp's llama-model.cpp reads
them) becomes one ModelConfig here. What every architecture shares is read
once (`model_config`: sizes, context, RoPE, vocabulary); what one adds is its
entry's `extras`, a small function of the file and the shared part returning
ModelConfig's fields beyond the llama graph (its layers' kinds, norms,
multipliers, experts). The transformer (transformer.py) reads only the
config, never the architecture's name, so adding an architecture is a row in
ARCHS and, where it brings a new mechanism, a flag on ModelConfig.

`f` is a GGUFFile (gguf.py), read through its meta / require / tensor /
tensors / path; this module imports no reader.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..config import LayerSpec, ModelConfig, RopeConfig, RopeKind, SSMConfig, YarnConfig
from ..errors import CorruptModelFile, UnsupportedArchitecture

# SmolLM3 leaves RoPE out of every fourth layer (llama.cpp: n_no_rope_layer_step, not in the file)
SMOLLM3_NO_ROPE_STEP = 4


@dataclass(frozen=True)
class Shared:
    """What model_config read for every architecture, handed to an entry's extras."""

    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    head_dim: int
    rope: RopeConfig
    kv_heads: tuple[int, ...]  # each layer's KV heads: 0 where a hybrid's layer does not attend
    d_ffs: tuple[int, ...]  # each layer's feed-forward width (Nemotron-H: 0 but in its "mlp" layers)

    def full_layers(self, rope: RopeConfig | None = None) -> tuple[LayerSpec, ...]:
        return tuple(LayerSpec("full", 0, rope or self.rope) for _ in range(self.n_layers))

    def attention_or(self, kind: str, rope: RopeConfig | None = None) -> tuple[LayerSpec, ...]:
        """A hybrid's layers as its per-layer KV head counts mark them: attention where a layer has KV heads,
        else `kind` (a recurrent layer)."""
        return tuple(LayerSpec("full", 0, rope or self.rope) if n else LayerSpec(kind, 0, rope or self.rope)
                     for n in self.kv_heads)


@dataclass(frozen=True)
class Arch:
    rope: RopeKind  # how llama.cpp rotates the heads (llama_model_rope_type)
    extras: Callable[[Any, Shared], dict] = lambda f, s: {}  # ModelConfig's fields beyond the llama graph


def _qwen3(f, s: Shared) -> dict:  # qwen2 without biases, each head of q and k RMS-normed before RoPE (qwen3.cpp)
    return dict(qk_norm=True)


def _experts(f, s: Shared) -> dict:
    n_experts, used = int(f.require(f"{s.arch}.expert_count")), int(f.require(f"{s.arch}.expert_used_count"))
    if not 0 < used <= n_experts:
        raise CorruptModelFile(f"{f.path}: {used} of {n_experts} experts used a token")
    # an expert's width is its tensors' (expert_feed_forward_length says it again)
    return dict(n_experts=n_experts, n_experts_used=used)


def _qwen3moe(f, s: Shared) -> dict:  # qwen3's attention; routed experts, softmax gating, top-k weights normalised
    return dict(qk_norm=True, expert_norm=True, **_experts(f, s))


def _smollm3(f, s: Shared) -> dict:  # the layers (i + 1) % 4 == 0 attend without RoPE (models/smollm3.cpp)
    plain = dataclasses.replace(s.rope, base=0.0)
    layers = tuple(LayerSpec("full", 0, plain if (i + 1) % SMOLLM3_NO_ROPE_STEP == 0 else s.rope)
                   for i in range(s.n_layers))
    return dict(layers=layers, attn_scale=float(f.meta("smollm3.attention.scale", 0.0)))


def _olmo2(f, s: Shared) -> dict:  # no norm before attention or the FFN, one after each; q and k normed across heads
    window = int(f.meta("olmo2.attention.sliding_window", 0) or 0)
    extra = {}
    if window > 0:  # OLMo 3: three of four layers slide, with a plain RoPE of the global base (olmo2.cpp)
        rope = s.rope
        extra["layers"] = _sliding(f, s, f.meta("olmo2.attention.sliding_window_pattern", 4), window,
                                   RopeConfig(rope.kind, rope.base, rope.dim), rope)
    return dict(qk_norm=True, qk_norm_full=True, post_norms=True, pre_norms=False, **extra)


def _gpt_oss(f, s: Shared) -> dict:  # models/openai-moe.cpp: every other layer slides; sinks; biased, clamped experts
    layers = _sliding(f, s, f.meta(f"{s.arch}.attention.sliding_window_pattern", 2),
                      int(f.require(f"{s.arch}.attention.sliding_window")), s.rope, s.rope)
    return dict(layers=layers, expert_gating="softmax_weight", activation="swiglu_oai", attn_sinks=True,
                **_experts(f, s))


def _granite(f, s: Shared) -> dict:  # four multipliers on the llama graph (models/granite.cpp)
    a = s.arch  # granite's file must give its logit scale; Granite 4.0-H's may leave it out (no scaling)
    logit_scale = f.require(f"{a}.logit_scale") if a == "granite" else f.meta(f"{a}.logit_scale", 0.0)
    return dict(embed_scale=float(f.meta(f"{a}.embedding_scale", 0.0)) or 1.0,
                attn_scale=float(f.meta(f"{a}.attention.scale", 0.0)),
                residual_scale=float(f.meta(f"{a}.residual_scale", 0.0)),
                logit_scale=float(logit_scale) or 1.0)


def _ssm(f, s: Shared, kind: str) -> SSMConfig:
    """The recurrent layers' sizes ({arch}.ssm.*: llama.cpp's ssm_d_conv, d_inner, d_state, dt_rank, n_group)."""
    a = s.arch
    conv, inner, state, heads, groups = (int(f.require(f"{a}.ssm.{k}")) for k in
                                         ("conv_kernel", "inner_size", "state_size", "time_step_rank", "group_count"))
    if min(conv, inner, state, heads, groups) < 1 or inner % heads or heads % groups:
        raise CorruptModelFile(f"{f.path}: ssm sizes conv {conv}, inner {inner}, state {state}, heads {heads}, "
                               f"groups {groups}")
    if kind == "deltanet" and inner // heads != state:  # llama.cpp's delta net asserts S_k == S_v
        raise UnsupportedArchitecture(f"{f.path}: value heads of {inner // heads} beside key heads of {state}")
    return SSMConfig(kind, conv, inner + 2 * groups * state, inner, state, heads, groups)


def _lfm2(f, s: Shared) -> dict:
    """LFM2 (models/lfm2.cpp): gated short convolutions where head_count_kv is 0, attention with q/k norms
    elsewhere; the convolution's state keeps l_cache - 1 inputs."""
    if int(f.meta("lfm2.attention.sliding_window", 0) or 0) > 0:
        raise UnsupportedArchitecture(f"{f.path}: LFM2 with sliding-window attention is not supported")
    conv = int(f.require("lfm2.shortconv.l_cache"))
    if conv < 2:
        raise CorruptModelFile(f"{f.path}: lfm2.shortconv.l_cache {conv}: must be >= 2")
    return dict(layers=s.attention_or("conv"), qk_norm=True, ssm=SSMConfig("conv", conv, s.d_model))


def _granite_hybrid(f, s: Shared) -> dict:
    """Granite 4.0-H (models/granite-hybrid.cpp): Mamba2 where head_count_kv is 0, attention elsewhere -- without
    RoPE unless rope.scaling.finetuned says so (Bamba) -- with Granite's multipliers; experts and a shared one
    where the file has them."""
    rope = s.rope if f.meta("granitehybrid.rope.scaling.finetuned", True) else dataclasses.replace(s.rope, base=0.0)
    experts = dict(expert_norm=True, **_experts(f, s)) if f.meta("granitehybrid.expert_count", 0) else {}
    return dict(layers=s.attention_or("mamba2", rope), ssm=_ssm(f, s, "mamba2"), **_granite(f, s), **experts)


def _nemotron_h(f, s: Shared) -> dict:
    """Nemotron-H (models/nemotron-h.cpp): each layer one mixer and its residual -- Mamba2 where neither
    head_count_kv nor feed_forward_length is set, attention without RoPE where head_count_kv is, a squared-ReLU
    feed-forward network where feed_forward_length is."""
    plain = dataclasses.replace(s.rope, base=0.0)
    layers = tuple(LayerSpec("mlp" if ff else "full" if kv else "mamba2", 0, plain)
                   for kv, ff in zip(s.kv_heads, s.d_ffs))
    eps = f.meta("nemotron_h.attention.layer_norm_rms_epsilon", None)
    return dict(layers=layers, ssm=_ssm(f, s, "mamba2"), mixer_only=True, activation="relu_sqr",
                rms_eps=float(eps if eps is not None else f.require("nemotron_h.attention.layer_norm_epsilon")))


def _falcon_h1(f, s: Shared) -> dict:  # models/falcon-h1.cpp: attention and Mamba2 side by side in every layer
    return dict(layers=tuple(LayerSpec("full", 0, s.rope, beside="mamba2") for _ in range(s.n_layers)),
                ssm=_ssm(f, s, "mamba2"))


def _qwen3next(f, s: Shared) -> dict:
    """Qwen3-Next and Qwen3.5 (models/qwen3next.cpp, qwen35.cpp, qwen35moe.cpp): gated DeltaNet layers, and
    every full_attention_interval-th layer (or as attention.recurrent_layers marks them) gated full attention
    with q/k norms and partial RoPE; the FFN, named after the attention, dense or routed experts with a gated
    shared one. Qwen3.5's converter orders the value heads so that head h reads key head h % n_k (tile), its
    RoPE is interleaved M-RoPE (text positions: sections); Qwen3-Next's head h reads key head h // r."""
    a = s.arch
    marks = f.meta(f"{a}.attention.recurrent_layers", None)
    if marks is None:
        interval = int(f.meta(f"{a}.full_attention_interval", 4))
        marks = [(i + 1) % interval != 0 for i in range(s.n_layers)]
    rope = s.rope
    if a != "qwen3next":
        sections = f.require(f"{a}.rope.dimension_sections")
        rope = dataclasses.replace(rope, sections=tuple(int(x) for x in sections))
    layers = tuple(LayerSpec("deltanet" if marks[i] else "full", 0, rope) for i in range(s.n_layers))
    experts = dict(expert_norm=True, **_experts(f, s)) if a != "qwen35" else {}
    if a == "qwen3next" and not experts.get("n_experts"):
        raise CorruptModelFile(f"{f.path}: a qwen3next model without experts")
    return dict(layers=layers, ssm=_ssm(f, s, "deltanet"), qk_norm=True, attn_gate=True,
                qk_heads="interleave" if a == "qwen3next" else "tile", **experts)


def _gemma(f, s: Shared) -> dict:
    """What llama.cpp's gemma2 and gemma3 graphs do beyond the llama family (models/gemma2.cpp, gemma3.cpp):
    sliding-window layers (gemma2: every other one, a window of 4096 by default), post-norms, scaled
    embeddings, GELU; gemma3 norms q and k, gemma2 soft-caps the attention scores."""
    a, rope = s.arch, s.rope
    two = a == "gemma2"
    window = int(f.meta(f"{a}.attention.sliding_window", 4096 if two else 0) or 0)
    local_rope = RopeConfig("neox", float(f.meta(f"{a}.rope.freq_base_swa", rope.base if two else 10000.0)), rope.dim)
    layers = _sliding(f, s, f.meta(f"{a}.attention.sliding_window_pattern", 2 if two else 6), window, local_rope, rope)
    # gemma_pytorch scales queries by 1/sqrt(d_model / n_heads) in the 27B models only
    attn_scale = (s.d_model / s.n_heads) ** -0.5 if s.n_layers == (46 if two else 62) else s.head_dim ** -0.5
    softcaps = dict(final_softcap=float(f.meta(f"{a}.final_logit_softcapping", 30.0 if two else 0.0) or 0.0),
                    attn_softcap=float(f.meta(f"{a}.attn_logit_softcapping", 50.0) or 0.0) if two else 0.0)
    return dict(layers=layers, attn_scale=attn_scale, embed_scale=float(np.sqrt(np.float32(s.d_model))),
                qk_norm=not two, post_norms=True, activation="gelu_tanh", **softcaps)


# Mistral's GGUF files are written with general.architecture = "llama", and so are Llama 3.1's and 3.2's,
# whose "llama3" rope scaling the converter writes as a rope_freqs tensor. phi3: fused q|k|v and gate|up
# tensors (weights.py splits them), partial RoPE where dim < head; llama.cpp ignores phi3's sliding window
# (llama-model.cpp: "Phi SWA is currently disabled"), so do we.
ARCHS: dict[str, Arch] = {
    "llama": Arch("norm"),
    "qwen2": Arch("neox"),
    "qwen3": Arch("neox", _qwen3),
    "qwen3moe": Arch("neox", _qwen3moe),
    "gemma2": Arch("neox", _gemma),
    "gemma3": Arch("neox", _gemma),
    "smollm3": Arch("norm", _smollm3),
    "granite": Arch("norm", _granite),
    "olmo2": Arch("neox", _olmo2),
    "phi3": Arch("neox"),
    "gpt-oss": Arch("neox", _gpt_oss),
    "lfm2": Arch("neox", _lfm2),
    "granitehybrid": Arch("norm", _granite_hybrid),
    "nemotron_h": Arch("neox", _nemotron_h),
    "falcon-h1": Arch("neox", _falcon_h1),
    "qwen3next": Arch("neox", _qwen3next),
    "qwen35": Arch("neox", _qwen3next),
    "qwen35moe": Arch("neox", _qwen3next),
}
HYBRID_ARCHS = ("lfm2", "granitehybrid", "nemotron_h", "falcon-h1", "qwen3next", "qwen35", "qwen35moe")
SUPPORTED_ARCHS = tuple(ARCHS)


def check_arch(arch: str, where: str) -> None:
    if arch not in ARCHS:
        raise UnsupportedArchitecture(f"{where}: architecture {arch!r} is not supported; supported: "
                                      f"{', '.join(SUPPORTED_ARCHS)}")


def model_config(f) -> ModelConfig:
    """The file's ModelConfig: what every architecture shares, then its entry's extras."""
    a = f.arch
    check_arch(a, str(f.path))
    d_model = int(f.require(f"{a}.embedding_length"))
    n_heads = int(f.require(f"{a}.attention.head_count"))
    n_all = int(f.require(f"{a}.block_count"))
    # llama.cpp's n_layer(): the multi-token-prediction blocks a converter appends (Qwen3.5, Qwen3-Next) are a
    # draft head, not run by the model's own pass
    n_layers = n_all - int(f.meta(f"{a}.nextn_predict_layers", 0))
    if not 0 < n_layers <= n_all:
        raise CorruptModelFile(f"{f.path}: {a}.nextn_predict_layers leaves {n_layers} of {n_all} layers")
    kv_heads = _per_layer(f, f"{a}.attention.head_count_kv", n_all, n_heads)[:n_layers]
    # per-layer counts: 0 marks a hybrid's layer without attention; the attending layers' count is one
    counts = sorted(set(kv_heads) - ({0} if a in HYBRID_ARCHS else set()))
    if len(counts) != 1 or counts[0] < 1:
        raise UnsupportedArchitecture(f"{f.path}: per-layer kv head counts {sorted(set(kv_heads))}")
    n_kv_heads = counts[0]
    d_ffs = _per_layer(f, f"{a}.feed_forward_length", n_all, None)[:n_layers]
    head_dim = int(f.meta(f"{a}.attention.key_length", d_model // n_heads))
    value_dim = int(f.meta(f"{a}.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise UnsupportedArchitecture(f"{f.path}: key length {head_dim} != value length {value_dim}")
    context_length = int(f.meta(f"{a}.context_length", 2048))
    rope = RopeConfig(
        kind=ARCHS[a].rope,
        base=float(f.meta(f"{a}.rope.freq_base", 10000.0)),
        dim=int(f.meta(f"{a}.rope.dimension_count", head_dim)),
        **_rope_scaling(f, context_length),
        has_freq_factors=rope_factors(f) is not None,
        attn_factor=float(f.meta(f"{a}.rope.scaling.attn_factor", 1.0)),
    )
    tokens = f.meta("tokenizer.ggml.tokens")
    vocab = int(f.meta(f"{a}.vocab_size", len(tokens) if tokens else 0))
    emb = f.tensor("token_embd.weight")
    if int(emb.shape[0]) != d_model or int(emb.shape[1]) != vocab:
        raise CorruptModelFile(f"{f.path}: token_embd.weight is {list(map(int, emb.shape))}, expected "
                               f"[{d_model}, {vocab}]")
    shared = Shared(a, n_layers, d_model, n_heads, head_dim, rope, kv_heads, d_ffs)
    fields = dict(
        arch=a,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(n_kv_heads),
        head_dim=head_dim,
        d_ff=max(d_ffs),
        vocab_size=vocab,
        context_length=context_length,
        rms_eps=float(f.meta(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        tied_embeddings="output.weight" not in f.tensors,
        attn_bias="blk.0.attn_q.bias" in f.tensors,
        layers=shared.full_layers(),
    )
    fields.update(ARCHS[a].extras(f, shared))
    return ModelConfig(**fields)


def _per_layer(f, key: str, n_layers: int, default: int | None) -> tuple[int, ...]:
    """A hyperparameter a file gives once or once a layer (llama.cpp's get_key_or_arr), one value a layer."""
    value = f.meta(key, default) if default is not None else f.require(key)
    values = [int(x) for x in value] if isinstance(value, list) else [int(value)] * n_layers
    if len(values) != n_layers:
        raise CorruptModelFile(f"{f.path}: {key} has {len(values)} values for {n_layers} layers")
    return tuple(values)


def _sliding(f, s: Shared, pattern: Any, window: int, local: RopeConfig, rope: RopeConfig) -> tuple[LayerSpec, ...]:
    """Layer specs where some layers attend to the last `window` tokens only (with their own RoPE): as
    llama.cpp's load_swa_pattern reads the file's pattern, a per-layer flag list or every n-th layer global."""
    if isinstance(pattern, list):
        sliding = [bool(x) for x in pattern][: s.n_layers]
    else:  # every n-th layer is global, the others slide (set_swa_pattern)
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(s.n_layers)]
    return tuple(LayerSpec("sliding", window, local) if window > 0 and sliding[i] else LayerSpec("full", 0, rope)
                 for i in range(s.n_layers))


def _rope_scaling(f, context_length: int) -> dict:
    """RopeConfig's linear_scale and yarn, as llama.cpp reads rope.scaling.* (llama-model.cpp, -context.cpp)."""
    a = f.arch
    kind = f.meta(f"{a}.rope.scaling.type", "none")
    if kind in ("none", ""):
        return dict(linear_scale=float(f.meta(f"{a}.rope.scale_linear", 1.0)))
    if kind == "linear":
        return dict(linear_scale=float(f.require(f"{a}.rope.scaling.factor")))
    if kind == "yarn":  # llama.cpp reads no beta or ext_factor from a file: its defaults are YarnConfig's
        if f.meta(f"{a}.rope.scaling.yarn_log_multiplier"):
            raise UnsupportedArchitecture(f"{f.path}: YaRN with a log multiplier (DeepSeek's) is not "
                                          "supported; plain YaRN is")
        yarn = YarnConfig(orig_context=int(f.meta(f"{a}.rope.scaling.original_context_length", context_length)))
        return dict(linear_scale=float(f.meta(f"{a}.rope.scaling.factor", 0.0) or 1.0), yarn=yarn)
    raise UnsupportedArchitecture(f"{f.path}: rope scaling {kind!r} is not supported; linear and yarn are")


def rope_factors(f) -> str | None:
    """The tensor that divides each RoPE frequency, if the file has one: Llama 3's rope_freqs, or of LongRoPE's
    two (phi3) the long factors where the model's context passes the one they were trained for, as llama.cpp
    chooses them for a context of the model's full length (get_rope_factors), else the short ones."""
    if "rope_freqs.weight" in f.tensors:
        return "rope_freqs.weight"
    if "rope_factors_long.weight" not in f.tensors:
        return None
    a = f.arch
    context = int(f.meta(f"{a}.context_length", 2048))
    long = context > int(f.meta(f"{a}.rope.scaling.original_context_length", context))
    return "rope_factors_long.weight" if long else "rope_factors_short.weight"
