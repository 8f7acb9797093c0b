"""Typed model configuration: one frozen dataclass per concept.

Everything the rest of the engine needs to know about a model's shape lives
here, read once from GGUF metadata by `model/gguf.py`. Nothing in this module
touches a file or a tensor, so every other module can import it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

# How RoPE pairs the values of a head, as llama.cpp names it: "norm" rotates
# consecutive pairs (x[2i], x[2i+1]) -- llama's converter permutes Q/K so that
# this matches the HF model -- and "neox" rotates x[i] with x[i + n_rot/2].
RopeKind = Literal["norm", "neox"]

# A layer either attends to every earlier token ("full") or only to the last
# `window` tokens ("sliding"); the KV cache of a sliding layer is a ring. The
# hybrids' other layers carry a fixed-size recurrent state instead of a KV
# cache (kv/recurrent.py): a gated short convolution ("conv", LFM2), a Mamba2
# selective scan ("mamba2": Granite 4.0-H, Nemotron-H, Falcon-H1) or gated
# DeltaNet linear attention ("deltanet": Qwen3-Next, Qwen3.5); Nemotron-H's
# "mlp" layers hold neither (a feed-forward network alone).
LayerKind = Literal["full", "sliding", "conv", "mamba2", "deltanet", "mlp"]
ATTENTION_KINDS = ("full", "sliding")
RECURRENT_KINDS = ("conv", "mamba2", "deltanet")


@dataclass(frozen=True)
class YarnConfig:
    """YaRN context extension, as ggml's rope_yarn does it: each frequency a mix of the interpolated one (divided
    by the scale) and the original, by a ramp between two correction dimensions, and every rotated value scaled
    by 1 + 0.1 ln scale (on top of RopeConfig.attn_factor)."""

    orig_context: int  # the context the frequencies were trained for
    beta_fast: float = 32.0  # rotations at which the ramp starts ...
    beta_slow: float = 1.0  # ... and ends
    ext_factor: float = 1.0  # how much of the original frequency the ramp mixes in


@dataclass(frozen=True)
class RopeConfig:
    kind: RopeKind
    base: float  # theta base of the frequencies; 0: no rotation at all (SmolLM3's every fourth layer)
    dim: int  # how many leading values of each head are rotated (<= head_dim)
    linear_scale: float = 1.0  # positions are divided by this ("linear" scaling; YaRN's scale too)
    has_freq_factors: bool = False  # a tensor divides each frequency (llama 3.1's rope_freqs, phi3's LongRoPE)
    yarn: YarnConfig | None = None  # YaRN scaling (gpt-oss, long-context Qwen files)
    attn_factor: float = 1.0  # every rotated value is multiplied by this (rope.scaling.attn_factor: LongRoPE's)
    # interleaved M-RoPE (Qwen3.5's IMROPE): pairs per section (time, height, width, extra); a text token's
    # position is the same on the first three axes and 0 on the fourth, so the pairs of none of the first three
    # are not rotated at all
    sections: tuple[int, ...] = ()


@dataclass(frozen=True)
class LayerSpec:
    kind: LayerKind
    window: int  # 0 for full attention; the attention window for sliding layers
    rope: RopeConfig
    beside: str = ""  # a recurrent kind run beside the attention on the same input, outputs added (Falcon-H1)

    @property
    def attention(self) -> bool:
        return self.kind in ATTENTION_KINDS

    @property
    def recurrent(self) -> str:
        """The layer's recurrent kind ("" for none): its own, or the one beside its attention."""
        return self.kind if self.kind in RECURRENT_KINDS else self.beside


@dataclass(frozen=True)
class SSMConfig:
    """The recurrent layers' sizes, as llama.cpp names them ({arch}.ssm.*, shortconv.l_cache).

    conv: the causal convolution's kernel, over `channels` (its state keeps the last conv - 1 inputs);
    mamba2: `heads` heads of `inner / heads` values, `groups` groups of B and C of `state` values each;
    deltanet: `heads` value heads of `inner / heads` values, `groups` key heads of `state` values."""

    kind: str  # "conv", "mamba2" or "deltanet": the recurrent kind of every recurrent layer of the model
    conv: int  # kernel width
    channels: int  # values convolved a token
    inner: int = 0
    state: int = 0
    heads: int = 0
    groups: int = 0

    @property
    def head_dim(self) -> int:
        return self.inner // self.heads

    def state_shape(self) -> tuple[int, ...]:
        """The scan's state of one sequence: mamba2 [heads, head_dim, state], deltanet [heads, value, key] (as
        llama.cpp lays them out, float32); () for a convolution alone."""
        return () if self.kind == "conv" else (self.heads, self.head_dim, self.state)


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    context_length: int  # the context the model was trained for
    rms_eps: float
    layers: tuple[LayerSpec, ...]  # one per layer
    tied_embeddings: bool  # the output projection reuses token_embd
    attn_bias: bool  # q/k/v projections carry biases (qwen2)
    # what differs across architectures (defaults: the llama family)
    attn_scale: float = 0.0  # queries are scaled by this before attention; 0 means 1/sqrt(head_dim)
    embed_scale: float = 1.0  # token embeddings are multiplied by this (gemma: sqrt(d_model))
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (gemma3)
    post_norms: bool = False  # RMSNorm after attention and after the FFN, before the residual add (gemma3)
    pre_norms: bool = True  # RMSNorm before attention and before the FFN (all but olmo2, which has post norms only)
    qk_norm_full: bool = False  # the q and k norms span all heads of a token, not each head (olmo2)
    activation: str = "silu"  # FFN gate: "silu" or "gelu_tanh"; "relu_sqr": relu(up)^2, ungated (Nemotron-H)
    final_softcap: float = 0.0  # logits = c * tanh(logits / c) when > 0
    attn_softcap: float = 0.0  # each attention score = c * tanh(score / c) before the softmax when > 0 (gemma2)
    residual_scale: float = 0.0  # attention and FFN outputs are multiplied by this before the residual add (granite)
    logit_scale: float = 1.0  # logits are divided by this (granite)
    # a mixture of experts in place of the FFN (qwen3moe): a router picks n_experts_used of n_experts per token
    n_experts: int = 0  # 0: a dense FFN
    n_experts_used: int = 0
    expert_norm: bool = False  # the chosen experts' weights are divided by their sum
    # how the router's logits weigh the chosen experts: "softmax" over all experts, then the top k (qwen3moe);
    # "softmax_weight": the top k logits, then a softmax over those k (gpt-oss)
    expert_gating: str = "softmax"
    attn_sinks: bool = False  # each head has a learned logit that joins every query's softmax, no value (gpt-oss)
    # the hybrids (LayerSpec.recurrent): their recurrent layers' sizes, and what else their graphs do
    ssm: SSMConfig | None = None
    attn_gate: bool = False  # q carries a gate per head: attention's output times sigmoid(gate) (Qwen3-Next)
    qk_heads: str = "interleave"  # deltanet: value head h reads key head h // r ("interleave") or h % k ("tile")
    mixer_only: bool = False  # each layer is one mixer and its residual, no FFN after it (Nemotron-H)

    def __post_init__(self) -> None:
        if len(self.layers) != self.n_layers:
            raise ValueError(f"{len(self.layers)} layer specs for {self.n_layers} layers")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if any(spec.recurrent for spec in self.layers) and self.ssm is None:
            raise ValueError("recurrent layers without their sizes (ssm)")

    @property
    def recurrent(self) -> bool:
        """Whether any layer carries a recurrent state (a hybrid)."""
        return any(spec.recurrent for spec in self.layers)

    @property
    def query_scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    @property
    def ring_layers(self) -> bool:
        return any(spec.kind == "sliding" for spec in self.layers)

    @property
    def kv_row_values(self) -> int:
        """Values in one token's K (or V) row of one layer: n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    def kv_shape(self) -> dict:
        """Every hyperparameter that shapes the KV cache, as plain JSON-able values.

        Two models whose kv_shape() differ cannot share a cache row, whatever
        their weights; session files store this to refuse such a load field by
        field.
        """
        shape = {
            "arch": self.arch,
            "n_layers": self.n_layers,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "layers": [_layer_shape(spec) for spec in self.layers],
        }
        if self.ssm is not None:  # the recurrent states' shapes: only the hybrids' fingerprints carry them
            shape["ssm"] = dataclasses.asdict(self.ssm)
        return shape


def _layer_shape(spec: LayerSpec) -> dict:
    """A layer's spec as JSON; a RoPE without YaRN, an attention factor or sections, and a layer with nothing
    beside its attention, read as they did before those were known, so that the sessions of every other model
    keep their fingerprints."""
    d = dataclasses.asdict(spec)
    for key, default in (("yarn", None), ("attn_factor", 1.0), ("sections", ())):
        if d["rope"][key] == default:
            del d["rope"][key]
    if not d["beside"]:
        del d["beside"]
    if "sections" in d["rope"]:
        d["rope"]["sections"] = list(d["rope"]["sections"])  # as JSON reads it back, so a file's compares equal
    return d
