"""The transformer: forward(tokens, positions, caches) -> logits.

The model owns weights only. Its caller (a Session) owns the caches and
hands in one per layer; the model stores the new K/V rows through the cache's
`update_and_fetch` and attends to what the cache returns. It never keeps a
cache of its own.

Numerics. Norms, RoPE, softmax and the residual stream are float32. Matrix
products take one of two paths, chosen per weight when the model loads:

- on the CPU at precision bf16, every weight stays in its GGUF blocks, in
  the memory-mapped file (kernels.BlockLinear): decode is bound by the bytes
  it reads, and reads 4.5 to 8.5 bits a weight instead of 16. A few tokens
  at a time (decode) go through every layer in one call of the C kernels
  (kernels.Stack), with attention reading the float16 cache rows in place;
- every other weight, and every weight elsewhere, is dequantized to a dense
  matrix (bfloat16; float32 for a reference run).

The token embedding stays in the file too and only the rows a batch needs
are dequantized, exactly, in float32.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .. import kernels
from ..config import ModelConfig, RopeConfig
from ..kernels import BlockLinear, BlockLinears
from ..kv.cache import KVCache, LayerCache
from ..kv.recurrent import RecurrentCache
from .archs import rope_factors
from .gguf import GGUFFile, dequantize_rows
from .moe import Experts
from .rope import Rope
from .ssm import MIXERS, GatedDeltaNet, Mamba2
from .weights import WeightBuilder

log = logging.getLogger(__name__)


# Tokens of several sequences the decode stack takes in one pass (forward_many): its buffers are a few MB at this
# size, and past it the stack's products are still read once per 32 tokens (matmul_mt's chunk).
BATCH_TOKENS = 64


class Block:
    """One layer: its norm, its mixers -- attention, a recurrent layer (ssm.py), both side by side (Falcon-H1),
    or a feed-forward network alone (Nemotron-H's "mlp" layers) -- the residual, then its feed-forward network
    (a dense one, or experts) unless the model's layers are one mixer each (mixer_only)."""

    def __init__(self, cfg: ModelConfig, i: int, wb: WeightBuilder, rope: Rope):
        p = f"blk.{i}."
        t = wb.f.tensors
        self.cfg = cfg
        self.spec = cfg.layers[i]
        self.rope = rope
        self.attn_norm = wb.vector(p + "attn_norm.weight") if cfg.pre_norms else None
        self.mixer = MIXERS[self.spec.recurrent](cfg, p, wb) if self.spec.recurrent else None
        self.wqkv = self.wo = self.sinks = self.q_norm = self.k_norm = None
        if self.spec.attention:
            self._attention(cfg, p, wb)
        self.post_attn_norm = wb.vector(p + "post_attention_norm.weight") if cfg.post_norms else None
        self.post_ffn_norm = wb.vector(p + "post_ffw_norm.weight") if cfg.post_norms else None
        self.has_ffn = self.spec.kind == "mlp" or not cfg.mixer_only
        # the FFN's norm: ffn_norm, which gpt-oss's and Qwen3-Next's converters name after the attention it
        # follows, and llama.cpp 0.3.36 reads without its ".weight" for falcon-h1
        names = [p + "ffn_norm.weight", p + "ffn_norm", p + "post_attention_norm.weight"]
        norm = next((n for n in names if n in t), names[0])
        self.ffn_norm = wb.vector(norm) if cfg.pre_norms and self.has_ffn and self.spec.kind != "mlp" else None
        self.wgu = self.wdown = self.experts = self.shared = None
        if self.has_ffn:
            self._ffn(cfg, p, wb)
        self.act = ACTIVATIONS.get(cfg.activation)  # None: an activation only experts have (gpt-oss's)

    def _attention(self, cfg: ModelConfig, p: str, wb: WeightBuilder) -> None:
        qkv = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
        biases = [n.replace(".weight", ".bias") for n in qkv] if cfg.attn_bias else []
        fused = p + "attn_qkv.weight" in wb.f.tensors  # phi3: q, k and v in one tensor, gate and up in another
        q = cfg.n_heads * cfg.head_dim * (2 if cfg.attn_gate else 1)
        kv = cfg.n_kv_heads * cfg.head_dim
        self.wqkv = wb.split(p + "attn_qkv.weight", [q, kv, kv]) if fused else wb.linear(qkv, biases)
        self.wo = wb.linear([p + "attn_output.weight"], wb.present([p + "attn_output.bias"]))
        self.sinks = wb.vector(p + "attn_sinks.weight") if cfg.attn_sinks else None  # [n_heads]
        # [head_dim], or with qk_norm_full [n_heads * head_dim] and [n_kv_heads * head_dim]
        self.q_norm = wb.vector(p + "attn_q_norm.weight") if cfg.qk_norm else None
        self.k_norm = wb.vector(p + "attn_k_norm.weight") if cfg.qk_norm else None

    def _ffn(self, cfg: ModelConfig, p: str, wb: WeightBuilder) -> None:
        t = wb.f.tensors
        if cfg.n_experts:
            gate_up = [p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"]
            down = [p + "ffn_down_exps.weight"]
            self.experts = Experts(
                wb.linear([p + "ffn_gate_inp.weight"], wb.present([p + "ffn_gate_inp.bias"]), half=torch.float32),
                wb.experts(gate_up, wb.present([n.replace(".weight", ".bias") for n in gate_up])),
                wb.experts(down, wb.present([n.replace(".weight", ".bias") for n in down])),
                cfg.n_experts_used, norm=cfg.expert_norm, gating=cfg.expert_gating, activation=cfg.activation)
            if p + "ffn_up_shexp.weight" in t:  # a shared expert every token goes through (Qwen3-Next, Granite)
                self.shared = (wb.linear([p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"]),
                               wb.linear([p + "ffn_down_shexp.weight"]),
                               wb.vector(p + "ffn_gate_inp_shexp.weight") if p + "ffn_gate_inp_shexp.weight" in t
                               else None)  # [d_model]: its output times sigmoid(h . gate)
            return
        if cfg.activation == "relu_sqr":  # no gate: relu(up)^2 (Nemotron-H)
            self.wgu = wb.linear([p + "ffn_up.weight"])
        elif p + "ffn_gate.weight" not in t:  # phi3: gate and up in one tensor
            self.wgu = wb.split(p + "ffn_up.weight", [cfg.d_ff, cfg.d_ff])
        else:
            self.wgu = wb.linear([p + "ffn_gate.weight", p + "ffn_up.weight"])
        self.wdown = wb.linear([p + "ffn_down.weight"])

    def __call__(self, x: torch.Tensor, positions: range, cache: LayerCache | RecurrentCache,
                 state: RecurrentCache | None) -> torch.Tensor:
        # x: [T, d_model] f32
        h = self.norm(x)
        out = None
        if self.spec.attention:
            q, k, v, gate = self.qkv(h, positions)
            out = self.attn_out(self.attend(q, k, v, positions, cache), gate)
        return self.finish(x, self.mix(h, out, [(positions, state)]))

    def many(self, x: torch.Tensor, segments: list[tuple[range, LayerCache | RecurrentCache, RecurrentCache | None]]
             ) -> torch.Tensor:
        """The layer for several sequences' tokens x [T, d_model], one after another: segments (positions, cache,
        state) in order. Projections and the feed-forward see all T tokens at once; attention and the recurrent
        scans are each sequence's."""
        h = self.norm(x)
        out = None
        if self.spec.attention:
            pos = torch.cat([torch.arange(p.start, p.stop) for p, _, _ in segments]).to(x.device)
            self.rope.tables(max(p.stop for p, _, _ in segments))
            q, k, v, gate = self.qkv(h, pos)
            parts, at = [], 0
            for positions, cache, _ in segments:
                n = len(positions)
                parts.append(self.attend(q[at : at + n], k[at : at + n], v[at : at + n], positions, cache))
                at += n
            out = self.attn_out(torch.cat(parts), gate)
        return self.finish(x, self.mix(h, out, [(p, s) for p, _, s in segments]))

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.attn_norm, self.cfg.rms_eps) if self.attn_norm is not None else x

    def mix(self, h: torch.Tensor, attn: torch.Tensor | None, segments: list[tuple[range, RecurrentCache | None]]
            ) -> torch.Tensor:
        """What the layer adds to the residual stream, of the normed tokens h: the attention's output, the
        recurrent layer's (added to it where both run), or a feed-forward layer's."""
        if self.spec.kind == "mlp":  # its empty state counts the positions, as every layer's cache does
            for positions, state in segments:
                state.advance(len(positions))
            return self.feed_forward(h)
        if self.mixer is None:
            return attn
        out = self.mixer(h, segments)
        return out if attn is None else attn + out

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: range,
               cache: LayerCache) -> torch.Tensor:
        """One sequence's new rows into its cache, and its queries' attention over it: [T, H * D]."""
        cfg = self.cfg
        if kernels.attends_in_place(cache.k, cache.head_dim):  # flash attention over the rows where they lie
            cache.store_rows(positions.start, k, v)
            return kernels.attend(cache.k, cache.v, cache.ring, q, positions.start, cache.start, self.spec.window,
                                  cfg.query_scale, cfg.attn_softcap, self.sinks)
        keys, values, key_first = cache.update_and_fetch(positions.start, k, v)  # [Hk, S, D] f32
        return attention(q, keys, values, positions, key_first, self.spec.window, cfg.query_scale, cfg.attn_softcap,
                         self.sinks)

    def qkv(self, h: torch.Tensor, positions: range | torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q [T, H, D], k and v [T, Hk, D] (f32) of the normed tokens h [T, d_model]: projected, normed, rotated;
        and the gate [T, H * D] of each query head's output, where the model has one (else None)."""
        cfg = self.cfg
        T, H, Hk, D = h.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv = self.wqkv(h)  # [T, (H + 2Hk) * D], or with a gate [T, (2H + 2Hk) * D]
        gate = None
        if cfg.attn_gate:  # each head's query then its gate (Qwen3-Next)
            qg = qkv[:, : 2 * H * D].view(T, H, 2 * D)
            gate = qg[..., D:].reshape(T, H * D)
            qkv = torch.cat((qg[..., :D].reshape(T, H * D), qkv[:, 2 * H * D :]), dim=1)
        qk = qkv[:, : (H + Hk) * D].view(T, H + Hk, D)
        if self.q_norm is not None and cfg.qk_norm_full:
            qk = torch.cat((rms_norm(qkv[:, : H * D], self.q_norm, cfg.rms_eps),
                            rms_norm(qkv[:, H * D : (H + Hk) * D], self.k_norm, cfg.rms_eps)), dim=1).view(T, H + Hk, D)
        elif self.q_norm is not None:
            qk = torch.cat((rms_norm(qk[:, :H], self.q_norm, cfg.rms_eps),
                            rms_norm(qk[:, H:], self.k_norm, cfg.rms_eps)), dim=1)
        qk = self.rope(qk, positions)  # [T, H + Hk, D]
        return qk[:, :H], qk[:, H:], qkv[:, (H + Hk) * D :].view(T, Hk, D), gate

    def attn_out(self, attn: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The attention's output [T, H * D], gated where the model gates it, through the output projection."""
        return self.wo(attn if gate is None else attn * torch.sigmoid(gate))

    def finish(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The rest of the layer, from what its mixers add [T, d_model]: residuals and the feed-forward network."""
        cfg = self.cfg
        if self.post_attn_norm is not None:
            out = rms_norm(out, self.post_attn_norm, cfg.rms_eps)
        if cfg.residual_scale:
            out = out * cfg.residual_scale
        x = x + out
        if cfg.mixer_only:
            return x
        normed = rms_norm(x, self.ffn_norm, cfg.rms_eps) if self.ffn_norm is not None else x
        out = self.feed_forward(normed)
        if self.post_ffn_norm is not None:
            out = rms_norm(out, self.post_ffn_norm, cfg.rms_eps)
        if cfg.residual_scale:
            out = out * cfg.residual_scale
        return x + out

    def feed_forward(self, normed: torch.Tensor) -> torch.Tensor:
        """The experts (and their shared expert), or the dense FFN, of the normed residual stream [T, d_model]."""
        if self.experts is None:
            return self.ffn(normed)
        out = self.experts(normed)
        if self.shared is not None:
            gate_up, down, gate = self.shared
            g, u = gate_up(normed).chunk(2, dim=-1)
            shared = down(F.silu(g) * u)
            out = out + (shared if gate is None else shared * torch.sigmoid(normed @ gate[:, None]))
        return out

    def ffn(self, normed: torch.Tensor) -> torch.Tensor:
        """The dense feed-forward network of the normed residual stream [T, d_model]."""
        gu = self.wgu(normed)  # [T, 2 * d_ff]; [T, d_ff] ungated
        if self.act is relu_sqr:
            return self.wdown(relu_sqr(gu))
        if self.act is gelu_tanh and gu.device.type == "cpu" and gu.dtype == torch.float32 and kernels.available():
            h = kernels.gelu_mul(gu)
        elif self.act is F.silu:  # in gu's own rows: no [T, d_ff] temporaries (~3% of a 512-token prefill)
            g, u = gu.chunk(2, dim=-1)
            h = F.silu(g, inplace=True).mul_(u)
        else:
            g, u = gu.chunk(2, dim=-1)  # [T, d_ff] each
            h = self.act(g) * u
        return self.wdown(h)


def _in_place(caches: KVCache) -> bool:
    """Whether the decode stack reads every layer's KV rows where they lie (a short convolution's state always)."""
    return all(kernels.attends_in_place(c.k, c.head_dim) for c in caches.kv_layers)


def relu_sqr(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """ggml's CPU GELU: tanh approximation looked up in a float16 table (GGML_GELU_FP16), exact past +-10."""
    y = F.gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, y))


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh, "relu_sqr": relu_sqr}


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, w.shape, w, eps)


# Scores the by-hand attention (soft-capped, or with sinks) holds at once: 64 MB of float32, a chunk of a
# prompt's queries at a time (gpt-oss's 64 heads over 20,000 keys would be 2.6 GB for a 512-token chunk)
SCORES_AT_ONCE = 16 << 20


def attention(
    q: torch.Tensor,  # [T, H, D] f32
    keys: torch.Tensor,  # [Hk, S, D] f32
    values: torch.Tensor,  # [Hk, S, D] f32
    positions: range,  # the T query positions
    key_first: int,  # keys hold positions key_first .. key_first+S-1
    window: int,  # 0: full attention; else a key k is visible to query p when p - window < k <= p
    scale: float,  # applied to q.k
    softcap: float = 0.0,  # > 0: each score is softcap * tanh(score / softcap) before the softmax (gemma2)
    sinks: torch.Tensor | None = None,  # [H]: a logit of each head's that joins its softmax with no value (gpt-oss)
) -> torch.Tensor:  # [T, H * D] f32
    T, H, D = q.shape
    S = keys.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
    kh = keys.unsqueeze(0)  # [1, Hk, S, D]
    vh = values.unsqueeze(0)
    mask, causal = None, False
    if T > 1:  # one query sees every key it is given: caches hand out exactly its window
        if key_first == positions.start and S == T and (window == 0 or T <= window):
            causal = True
        else:
            qp = torch.arange(positions.start, positions.stop, device=q.device)[:, None]
            kp = torch.arange(key_first, key_first + S, device=q.device)[None, :]
            mask = kp <= qp
            if window:
                mask &= kp > qp - window
    if softcap or sinks is not None:  # SDPA has neither: the scores by hand, each KV head repeated for its queries
        G = H // keys.shape[0]
        kr, vr = kh.repeat_interleave(G, dim=1), vh.repeat_interleave(G, dim=1)  # [1, H, S, D]
        if causal:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
        # a few queries' scores at a time, so that a long prompt's [H, T, S] never exists at once
        step = max(1, SCORES_AT_ONCE // (H * S))
        parts = []
        for a in range(0, T, step):
            scores = qh[:, :, a : a + step] @ kr.transpose(-1, -2) * scale  # [1, H, rows, S]
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            if mask is not None:
                scores = scores.masked_fill(~mask[a : a + step], float("-inf"))
            if sinks is not None:  # one more logit in each row's softmax, dropped after it
                rows = scores.shape[2]
                scores = torch.cat((scores, sinks.view(1, H, 1, 1).expand(1, H, rows, 1)), dim=-1)
                probs = torch.softmax(scores, dim=-1)[..., :S]
            else:
                probs = torch.softmax(scores, dim=-1)
            parts.append(probs @ vr)
        out = torch.cat(parts, dim=2)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=scale,
                                             enable_gqa=True)
    return out[0].transpose(0, 1).reshape(T, H * D)


class Model:
    """Weights and forward(). Build with `Model(gguf_file, device=..., precision=...)`."""

    def __init__(self, f: GGUFFile, *, device: torch.device | str = "cpu", precision: str = "bf16"):
        self.config = cfg = f.config
        self.device = torch.device(device)
        self.precision = precision
        wb = WeightBuilder(f, self.device, precision)
        self.embedding = f.tensor("token_embd.weight")  # memory-mapped, [vocab, d_model] quantized rows
        self.embedding_blocks = wb.blocks("token_embd.weight")  # its rows through the block kernels, if on
        factors = rope_factors(f)
        freq_factors = wb.vector(factors) if factors else None
        ropes: dict[RopeConfig, Rope] = {}
        for spec in cfg.layers:
            if spec.rope not in ropes:
                ropes[spec.rope] = Rope(spec.rope, self.device, freq_factors)
        self.blocks = [Block(cfg, i, wb, ropes[cfg.layers[i].rope]) for i in range(cfg.n_layers)]
        # LFM2's converter names the final norm after the embedding (llama.cpp: LLM_TENSOR_OUTPUT_NORM_LFM2)
        self.output_norm = wb.vector("output_norm.weight" if "output_norm.weight" in f.tensors
                                     else "token_embd_norm.weight")
        # the output projection only ever sees one row per step, where a float16
        # matrix-vector product is faster on the CPU than a bfloat16 one, and rounds less
        self.output = wb.linear(["token_embd.weight" if cfg.tied_embeddings else "output.weight"], half=torch.float16)
        self.n_forward = 0  # forward passes run; a restored session must not add any
        self.ropes = list(ropes.values())
        self.stack = self._stack()  # decode's one-call path, where every weight has a kernel

    def _stack(self) -> kernels.Stack | None:
        cfg = self.config
        first = self.ropes[0].cfg
        # of the recurrent layers, LFM2's short convolutions, Mamba2's and DeltaNet's layers beside attention layers
        # or beside the attention in one layer (Falcon-H1), their states in place, each layer a mixer and a
        # feed-forward network or one of them (Nemotron-H); models without attention decode layer by layer
        if cfg.recurrent and not any(s.attention for s in cfg.layers):
            return None
        if not cfg.pre_norms or cfg.qk_norm_full:  # nor olmo2's norms: it decodes layer by layer too
            return None
        if len(self.ropes) > 2 or any((r.cfg.kind, r.cfg.dim) != (first.kind, first.dim) for r in self.ropes):
            return None
        layers = []
        for b in self.blocks:
            # the feed-forward network: gate and up, up alone (relu(up)^2), or none (a mixer alone)
            gu = [None] * 2 if b.wgu is None else b.wgu.parts if isinstance(b.wgu, BlockLinears) else [None, b.wgu]
            if b.wgu is not None and (len(gu) != 2 or gu[1].out_features != cfg.d_ff):
                return None
            form = "ffn" if b.spec.kind == "mlp" else "both" if b.has_ffn else "mixer"
            m, ssm, conv = b.mixer, None, None
            # (q, k, v, o) and (alpha, ssm_in, ssm_out): the attention's, or a recurrent layer's in their place
            attention = [*(b.wqkv.parts if isinstance(b.wqkv, BlockLinears) else [b.wqkv]), b.wo] \
                if b.spec.attention else [None] * 4
            extra = [None] * 3
            if form == "ffn":
                mixer = [None] * 4
            elif isinstance(m, Mamba2):  # in_proj and out_proj where q and o go, or beside the attention's
                conv, ssm = m.conv, ("mamba2", (m.conv_bias, m.dt_bias, m.a, m.d_skip, m.norm))
                if b.spec.attention:
                    mixer, extra = attention, [None, m.in_proj, m.out_proj]
                else:
                    mixer = [m.in_proj, None, None, m.out_proj]
            elif isinstance(m, GatedDeltaNet):  # qkv, z, beta, alpha where q, k, v and alpha go
                if not isinstance(m.in_proj, BlockLinears) or len(m.in_proj.parts) != 4:
                    return None
                qkv, z, beta, alpha = m.in_proj.parts
                mixer, extra = [qkv, z, beta, m.out_proj], [alpha, None, None]
                conv, ssm = m.conv, ("deltanet", (None, m.dt_bias, m.a, None, m.norm))
            elif m is not None:  # a short convolution, the same way
                mixer, conv = [m.in_proj, None, None, m.out_proj], m.weight
            else:
                mixer = attention
            mats = [*mixer, *gu, b.wdown, *extra]
            if conv is not None:
                conv = conv.contiguous()
            moe = self._mixture(b) if b.experts is not None else None
            if len(mats) != 10 or not all(isinstance(m, BlockLinear) for m in mats if m is not None) or \
                    not kernels.attends(torch.float16, cfg.head_dim) or (b.experts is not None and moe is None) or \
                    (b.experts is None and b.act is not ACTIVATIONS.get(cfg.activation)) or \
                    (gu[0] is None and b.wgu is not None and cfg.activation != "relu_sqr"):
                return None
            if ssm is not None:
                ssm = (ssm[0], tuple(None if t is None else t.float().contiguous() for t in ssm[1]))
            norms = (b.attn_norm, b.ffn_norm, b.q_norm, b.k_norm, b.post_attn_norm, b.post_ffn_norm)
            layers.append((mats, norms, b.spec.window, self.ropes.index(b.rope), conv, ssm, form, b.sinks, moe))
        ssm = cfg.ssm if cfg.recurrent and cfg.ssm.kind != "conv" else None
        shape = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, max(cfg.d_ff, 1),
                 cfg.activation == "gelu_tanh", first.kind == "neox", first.dim, cfg.rms_eps, cfg.query_scale,
                 cfg.residual_scale, cfg.attn_softcap,
                 *((ssm.inner, ssm.heads, ssm.groups, ssm.state) if ssm else (0, 0, 0, 0)), cfg.attn_gate,
                 cfg.qk_heads == "tile")
        return kernels.Stack(shape, layers)

    @staticmethod
    def _mixture(b: Block) -> tuple | None:
        """A layer's experts as the stack takes them (kernels.Stack's moe), or None where some weight has no
        kernel: its experts in one ExpertsStep, a router in blocks, a shared expert of gate and up in blocks."""
        e, shared, inp = b.experts, None, None
        if e.step is None or not isinstance(e.router, BlockLinear):
            return None
        if b.shared is not None:
            gate_up, down, inp = b.shared
            if not isinstance(gate_up, BlockLinears) or len(gate_up.parts) != 2 or not isinstance(down, BlockLinear):
                return None
            shared = (*gate_up.parts, down)
            inp = None if inp is None else inp.float().contiguous()
        return e.step, e.router, e.used, e.gating, e.norm, shared, inp

    def embed(self, tokens: Sequence[int]) -> torch.Tensor:  # -> [T, d_model] f32
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"token id out of range [0, {self.config.vocab_size}): {ids.min()}..{ids.max()}")
        if self.embedding_blocks is not None:
            rows = self.embedding_blocks.rows(ids)
        else:
            rows = dequantize_rows(self.embedding.data[ids], self.embedding.tensor_type)
        x = torch.from_numpy(np.asarray(rows, dtype=np.float32)).to(self.device)
        return x * self.config.embed_scale if self.config.embed_scale != 1.0 else x

    @torch.inference_mode()
    def forward(
        self,
        tokens: Sequence[int],
        positions: range,
        caches: KVCache,
        *,
        all_logits: bool = False,
        hidden: bool = False,
    ) -> torch.Tensor:
        """Run tokens at positions [start, stop) through every layer.

        Stores each layer's K/V rows in `caches` (a recurrent layer folds the
        tokens into its state there) and returns float32 logits: [T, vocab]
        with all_logits, else [vocab] for the last token only; with hidden, no
        logits but every token's output after the final norm, [T, d_model]
        (what an embedding pools).
        """
        if len(tokens) != len(positions) or positions.step != 1:
            raise ValueError(f"{len(tokens)} tokens for positions {positions}")
        if len(caches) != len(self.blocks):
            raise ValueError(f"{len(caches)} caches for {len(self.blocks)} layers")
        self.n_forward += 1
        x = self.embed(tokens)
        if self.stack is not None and len(tokens) <= kernels.KERNEL_TOKENS and _in_place(caches):
            self.stack.run(x, positions.start, caches, [r.tables(positions.stop) for r in self.ropes])
        else:
            for block, cache, state in zip(self.blocks, caches, caches.states):
                x = block(x, positions, cache, state)
        if hidden:
            return self.final_norm(x)
        logits = self.head(x if all_logits else x[-1:])
        return logits if all_logits else logits[0]

    @torch.inference_mode()
    def shift_keys(self, caches: Sequence[LayerCache], keep: int, discard: int) -> None:
        """A context shift of every layer (LayerCache.shift): the moved keys rotated back `discard` positions with
        their layer's RoPE."""
        for block, cache in zip(self.blocks, caches):
            cache.shift(keep, discard, lambda k, rope=block.rope: rope.shift(k, -discard))

    @torch.inference_mode()
    def forward_many(self, segments: Sequence[tuple[Sequence[int], range, KVCache]],
                     keep: Sequence[bool] | None = None) -> list[torch.Tensor]:
        """Several sequences through every layer in one pass: each segment is (tokens, positions, caches) as
        forward takes them. Returns each segment's logits: [vocab] of its last token, or [T, vocab] of all its
        tokens where keep says so (a speculative draft's verification).

        On the CPU with every weight in blocks, the decode stack takes segments of a few tokens all at once (up
        to BATCH_TOKENS): each weight is read once for every token, and each sequence's logits are bit for bit
        what forward gives it alone. Otherwise (prompts' chunks, dense weights, a hybrid's layers) the linear
        layers see every token at once -- weights in blocks multiply a few tokens each as alone; a dense GEMM of
        several rows may round a row otherwise than of one (float32 tiny hybrids: 1e-6, not bit for bit) -- and
        attention and the recurrent scans run per sequence, each over its own state."""
        keep = list(keep) if keep is not None else [False] * len(segments)
        for tokens, positions, caches in segments:
            if len(tokens) != len(positions) or positions.step != 1 or len(caches) != len(self.blocks):
                raise ValueError(f"{len(tokens)} tokens for positions {positions}, {len(caches)} caches")
        if len(segments) == 1 and not keep[0]:
            t, p, c = segments[0]
            return [self.forward(t, p, c)]
        self.n_forward += 1
        sizes = [len(t) for t, _, _ in segments]
        x = self.embed([tok for t, _, _ in segments for tok in t])
        # the stack where each segment would take it alone (a few tokens; a draft, verified by the stack alone
        # too): a longer prompt's chunk goes through the GEMMs, here as alone
        if (self.stack is not None and x.shape[0] <= BATCH_TOKENS
                and all(len(t) <= kernels.KERNEL_TOKENS or k for (t, _, _), k in zip(segments, keep))
                and all(_in_place(caches) for _, _, caches in segments)):
            stop = max(p.stop for _, p, _ in segments)
            self.stack.run_many(x, [(p.start, len(t), c) for t, p, c in segments],
                                [r.tables(stop) for r in self.ropes])
        else:
            for i, block in enumerate(self.blocks):
                x = block.many(x, [(p, c[i], c.states[i]) for _, p, c in segments])
        ends = np.cumsum(sizes)
        rows = [torch.arange(e - n, e) if k else torch.tensor([e - 1]) for n, e, k in zip(sizes, ends, keep)]
        logits = self.head(x[torch.cat(rows)], per_token=True)
        out, at = [], 0
        for r, k in zip(rows, keep):
            part = logits[at : at + len(r)]
            out.append(part if k else part[0])
            at += len(r)
        return out

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output x [T, d_model] through the model's final norm, as the output head reads it."""
        return rms_norm(x, self.output_norm, self.config.rms_eps)

    def head(self, x: torch.Tensor, *, per_token: bool = False) -> torch.Tensor:
        """Logits [T, vocab] f32 of the last layer's output x [T, d_model]; per_token: each row as it is alone
        (where the output weights are in blocks)."""
        h = self.final_norm(x)
        logits = self.output(h, per_token=True) if per_token and isinstance(self.output, BlockLinear) \
            else self.output(h)
        if self.config.final_softcap:
            c = self.config.final_softcap
            logits = torch.tanh(logits / c) * c
        if self.config.logit_scale != 1.0:  # as ggml_scale does it: times the float32 reciprocal
            logits = logits * float(np.float32(1.0 / self.config.logit_scale))
        return logits
