"""The hybrids' recurrent layers: LFM2's gated short convolution, Mamba2's selective scan, gated DeltaNet.

Each is a mixer in place of a layer's attention (or beside it: Falcon-H1):
normed tokens [T, d_model] in, [T, d_model] out, reading and updating each
sequence's RecurrentCache (kv/recurrent.py) as llama.cpp's graphs do
(models/lfm2.cpp; mamba-base.cpp build_mamba2_layer; qwen3next.cpp and
qwen35.cpp build_layer_attn_linear over delta-net-base.cpp).

A prompt's chunk is scanned CHUNK tokens at a time in a few matrix products,
with no Python loop over its tokens: Mamba2 in the SSD form (within a chunk,
C.B attention masked causally and decayed; across chunks, the state), DeltaNet
in the WY form (one triangular solve a chunk, as llama.cpp's
build_delta_net_chunking). A decode step is the recurrence itself, one token.
The projections see every token of every sequence at once (segments: batched
decode); the scans run sequence by sequence, each over its own state.

All of it is PyTorch, in float32 but for the chunked scans' arithmetic (WIDE,
below). The decode steps of the hybrids without experts skip it: the C decode
stack (kernels.Stack) runs their short convolutions, Mamba2 and DeltaNet layers
with the attention, reading and writing each state in place with the arithmetic
of ShortConv, ssd_step and delta_step. In the mixtures a decode step is these
PyTorch recurrences, layer by layer.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..errors import CorruptModelFile
from ..kv.recurrent import RecurrentCache
from .weights import WeightBuilder

# Tokens a chunk of the scans covers: their masks and decays are [CHUNK, CHUNK] a head (llama.cpp's DeltaNet
# chunk is 64 too)
CHUNK = 64

# The chunked forms' arithmetic: in float32 they strayed from llama.cpp's logits by up to 5 times llama.cpp's own
# batch-split noise on the tiny test files (the WY solve, exps of cumulative decays), in float64 by 1-2.5 times,
# as far as the float32 projections around them do anyway. A decode step is the recurrence itself, in float32
# (ssd_step, delta_step); the state is stored in float32 in between, as llama.cpp keeps it.
WIDE = torch.float64

# ggml's softplus passes its input through above this (ggml_compute_softplus_f32)
SOFTPLUS_LINEAR = 20.0

Segments = Sequence[tuple[range, RecurrentCache]]  # each sequence's positions and state, in x's order


def softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > SOFTPLUS_LINEAR, x, torch.log1p(torch.exp(x.clamp(max=SOFTPLUS_LINEAR))))


def chunked(scan, inputs: Sequence[torch.Tensor], state: torch.Tensor) -> torch.Tensor:
    """scan(*inputs' chunk, s) over CHUNK tokens of the inputs [T, ...] at a time, s the state (updated in place),
    in WIDE arithmetic; its outputs [T, ...] in float32."""
    s = state.to(WIDE)
    out = torch.cat([scan(*(t[a : a + CHUNK].to(WIDE) for t in inputs), s)
                     for a in range(0, inputs[0].shape[0], CHUNK)])
    state.copy_(s)
    return out.float()


def causal_conv(x: torch.Tensor, state: RecurrentCache, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """The depthwise causal convolution of x [T, C] after the state's last K-1 inputs (weight [C, K]), as
    ggml_ssm_conv sums it (tap by tap, oldest first); the state keeps x's last K-1 inputs."""
    T, K = x.shape[0], weight.shape[1]
    xin = torch.cat((state.conv.t(), x), dim=0)  # [K-1+T, C]
    out = xin[:T] * weight[:, 0]
    for j in range(1, K):  # the kernel's taps (3 or 4), not the tokens
        out = out + xin[j : j + T] * weight[:, j]
    state.conv.copy_(xin[T:].t())
    return out if bias is None else out + bias


class Mixer:
    """What the recurrent layers share: one projection of every token, then each sequence through its state."""

    def __call__(self, h: torch.Tensor, segments: Segments) -> torch.Tensor:  # h: [T, d_model] f32, normed
        for positions, state in segments:  # every sequence checked before any state changes
            state.check_next(positions.start, type(self).__name__)
        proj = self.project(h)
        outs, at = [], 0
        for positions, state in segments:
            n = len(positions)
            outs.append(self.scan(proj[at : at + n], state))
            state.advance(n)
            at += n
        return self.output(torch.cat(outs), proj)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def scan(self, proj: torch.Tensor, state: RecurrentCache) -> torch.Tensor:
        raise NotImplementedError

    def output(self, y: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class ShortConv(Mixer):
    """LFM2's gated short convolution: in_proj -> B, C, x; y = C * conv([state, B * x]); out_proj."""

    def __init__(self, cfg: ModelConfig, p: str, wb: WeightBuilder):
        self.d = cfg.d_model
        self.in_proj = wb.linear([p + "shortconv.in_proj.weight"])  # [3 d] out
        self.weight = wb.vector(p + "shortconv.conv.weight")  # [d, K]
        self.out_proj = wb.linear([p + "shortconv.out_proj.weight"])

    def project(self, h: torch.Tensor) -> torch.Tensor:
        return self.in_proj(h)  # [T, 3 d]: B, C, x

    def scan(self, proj: torch.Tensor, state: RecurrentCache) -> torch.Tensor:
        d = self.d
        return causal_conv(proj[:, :d] * proj[:, 2 * d :], state, self.weight)

    def output(self, y: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
        return self.out_proj(proj[:, self.d : 2 * self.d] * y)


class Mamba2(Mixer):
    """Mamba2 (build_mamba2_layer): in_proj -> z, xBC, dt; causal conv1d + SiLU on xBC; the selective scan with a
    decay exp(dt A) a head, dt = softplus(dt + bias), groups of B and C shared by heads; y + D x; gated by SiLU(z);
    RMS-normed in groups; out_proj."""

    def __init__(self, cfg: ModelConfig, p: str, wb: WeightBuilder):
        s = cfg.ssm
        self.inner, self.heads, self.groups, self.n = s.inner, s.heads, s.groups, s.state
        self.eps = cfg.rms_eps
        self.in_proj = wb.linear([p + "ssm_in.weight"])  # [2 inner + 2 G N + H] out
        self.conv = wb.vector(p + "ssm_conv1d.weight")  # [C, K]
        self.conv_bias = wb.vector(p + "ssm_conv1d.bias") if p + "ssm_conv1d.bias" in wb.f.tensors else None
        self.dt_bias = wb.vector(p + "ssm_dt.bias")  # [H]
        self.a = wb.vector(p + "ssm_a").reshape(-1)  # [H]: -exp(A_log), as the converter stores it
        self.d_skip = wb.vector(p + "ssm_d").reshape(-1)  # [H]
        self.norm = wb.vector(p + "ssm_norm.weight").reshape(-1) if p + "ssm_norm.weight" in wb.f.tensors else None
        self.out_proj = wb.linear([p + "ssm_out.weight"])
        want = 2 * s.inner + 2 * s.groups * s.state + s.heads
        if self.in_proj.out_features != want or self.a.numel() != s.heads:
            raise CorruptModelFile(f"{wb.f.path}: {p}ssm_in has {self.in_proj.out_features} rows, expected {want}")

    def project(self, h: torch.Tensor) -> torch.Tensor:
        return self.in_proj(h)  # [T, z | xBC | dt]

    def scan(self, proj: torch.Tensor, state: RecurrentCache) -> torch.Tensor:
        T, I, G, N, H = proj.shape[0], self.inner, self.groups, self.n, self.heads
        xbc = F.silu(causal_conv(proj[:, I : 2 * I + 2 * G * N], state, self.conv, self.conv_bias))
        x = xbc[:, :I].reshape(T, H, I // H)  # [T, H, P]
        b = xbc[:, I : I + G * N].reshape(T, G, N)
        c = xbc[:, I + G * N :].reshape(T, G, N)
        dt = softplus(proj[:, 2 * I + 2 * G * N :] + self.dt_bias)  # [T, H]
        if T == 1:
            y = ssd_step(x[0], dt[0], self.a, b[0], c[0], state.ssm)[None]
        else:
            y = chunked(lambda *chunk: ssd_chunk(*chunk[:2], self.a, *chunk[2:]), (x, dt, b, c), state.ssm)
        return (y + x * self.d_skip[:, None]).reshape(T, I)

    def output(self, y: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
        y = y * F.silu(proj[:, : self.inner])
        if self.norm is not None:  # RMS norm over each group's inner / G values
            T, G = y.shape[0], self.groups
            y = F.rms_norm(y.view(T, G, -1), (self.inner // G,), None, self.eps).reshape(T, -1) * self.norm
        return self.out_proj(y)


def ssd_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             s: torch.Tensor) -> torch.Tensor:
    """One token of Mamba2's scan (a decode step: ggml_ssm_scan's loop): x [H, P], dt [H], b and c [G, N];
    s [H, P, N] in place: s = exp(dt a) s + dt x b^T. Returns y = s c [H, P]."""
    r = x.shape[0] // b.shape[0]
    s.mul_(torch.exp(dt * a)[:, None, None])
    s.baddbmm_((dt[:, None] * x)[:, :, None], b.repeat_interleave(r, 0)[:, None, :])  # += outer products, in place
    return torch.bmm(s, c.repeat_interleave(r, 0)[:, :, None])[..., 0]


def ssd_chunk(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
              s: torch.Tensor) -> torch.Tensor:
    """One chunk of Mamba2's scan (state-space duality): x [L, H, P], dt [L, H] (after softplus), a [H] (< 0),
    b and c [L, G, N]; the state s [H, P, N] is updated in place. Returns y [L, H, P] (without D x).

    Token by token: s_t = exp(dt_t a) s_{t-1} + dt_t x_t b_t^T, y_t = s_t c_t. With l_t the decay's cumulative
    log within the chunk, y_t = exp(l_t) s_0 c_t + sum_{u <= t} exp(l_t - l_u) dt_u (c_t . b_u) x_u."""
    H, G = x.shape[1], b.shape[1]
    l = torch.cumsum(dt * a.to(dt.dtype), dim=0)  # [L, H]
    causal = torch.ones(x.shape[0], x.shape[0], dtype=torch.bool, device=x.device).tril()  # [t, u]
    decay = torch.exp((l[:, None, :] - l[None, :, :]).masked_fill(~causal[..., None], float("-inf")))  # [t, u, H]
    cb = torch.einsum("tgn,ugn->tug", c, b).repeat_interleave(H // G, dim=2)  # [t, u, H]
    y = torch.einsum("tuh,uhp->thp", cb * decay * dt[None], x)
    ch = c.repeat_interleave(H // G, dim=1)  # [L, H, N]
    y = y + torch.exp(l)[..., None] * torch.einsum("hpn,thn->thp", s, ch)
    last = l[-1]  # [H]
    w = torch.exp(last[None] - l) * dt  # [L, H]
    s.mul_(torch.exp(last)[:, None, None]).add_(
        torch.einsum("uh,uhp,uhn->hpn", w, x, b.repeat_interleave(H // G, dim=1)))
    return y


class GatedDeltaNet(Mixer):
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): q, k, v from one projection, causal conv1d + SiLU, q and k
    L2-normed; each value head's state decays by exp(g), g = -exp(A_log) softplus(alpha + dt_bias), and learns
    the delta rule with rate beta = sigmoid(b); the output RMS-normed a head and gated by SiLU(z); out_proj.

    The projections come as llama.cpp reads them: attn_qkv + attn_gate, or the older ssm_in holding each key
    head's q, k, v and z side by side; beta and alpha as ssm_ba (each key head's, side by side: Qwen3-Next) or
    ssm_beta + ssm_alpha (Qwen3.5)."""

    def __init__(self, cfg: ModelConfig, p: str, wb: WeightBuilder):
        s = cfg.ssm
        self.hk, self.hv, self.dk, self.dv = s.groups, s.heads, s.state, s.head_dim
        self.eps = cfg.rms_eps
        self.tile = cfg.qk_heads == "tile"
        t = wb.f.tensors
        self.qk, self.v = 2 * self.hk * self.dk, self.hv * self.dv
        Hk, Dk, r, Dv = self.hk, self.dk, self.hv // self.hk, self.dv
        if p + "attn_qkv.weight" in t:
            qkvz = wb.linear([p + "attn_qkv.weight", p + "attn_gate.weight"])
        else:  # ssm_in: each key head's [q, k, v (r heads), z (r heads)], its rows regrouped as q, k, v, z of all
            width = 2 * Dk + 2 * r * Dv
            heads = np.arange(Hk)[:, None] * width
            order = np.concatenate([(heads + a + np.arange(n)).ravel()
                                    for a, n in ((0, Dk), (Dk, Dk), (2 * Dk, r * Dv), (2 * Dk + r * Dv, r * Dv))])
            qkvz = wb.split(p + "ssm_in.weight", [self.qk + self.v, self.v], order)
        if p + "ssm_ba.weight" in t:  # each key head's [beta (r), alpha (r)], regrouped as beta, alpha of all
            heads = np.arange(Hk)[:, None] * 2 * r
            order = np.concatenate([(heads + np.arange(r)).ravel(), (heads + r + np.arange(r)).ravel()])
            ba = wb.split(p + "ssm_ba.weight", [self.hv, self.hv], order)
        else:
            ba = wb.linear([p + "ssm_beta.weight", p + "ssm_alpha.weight"])
        self.in_proj = wb.side_by_side([qkvz, ba])  # [T, q | k | v | z | beta | alpha], heads in llama.cpp's order
        self.conv = wb.vector(p + "ssm_conv1d.weight")  # [C, K]
        self.dt_bias = wb.vector(p + "ssm_dt.bias")  # [Hv]
        self.a = wb.vector(p + "ssm_a").reshape(-1)  # [Hv]: -exp(A_log)
        self.norm = wb.vector(p + "ssm_norm.weight")  # [Dv]
        self.out_proj = wb.linear([p + "ssm_out.weight"])
        want = self.qk + 2 * self.v + 2 * self.hv
        if self.in_proj.out_features != want:
            raise CorruptModelFile(f"{wb.f.path}: {p} linear attention projects to {self.in_proj.out_features} "
                                   f"values a token, expected {want}")

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """[T, q | k | v | z | beta | alpha] of the normed tokens, heads in llama.cpp's order."""
        return self.in_proj(h)

    def scan(self, proj: torch.Tensor, state: RecurrentCache) -> torch.Tensor:
        T, Hk, Hv, Dk = proj.shape[0], self.hk, self.hv, self.dk
        qkv = F.silu(causal_conv(proj[:, : self.qk + self.v], state, self.conv))
        q = l2_norm(qkv[:, : Hk * Dk].reshape(T, Hk, Dk), self.eps)
        k = l2_norm(qkv[:, Hk * Dk : self.qk].reshape(T, Hk, Dk), self.eps)
        v = qkv[:, self.qk :].reshape(T, Hv, self.dv)
        if Hv != Hk:  # each value head reads key head h // r (Qwen3-Next) or h % Hk (Qwen3.5's reordered heads)
            q, k = (t.repeat(1, Hv // Hk, 1) if self.tile else t.repeat_interleave(Hv // Hk, dim=1) for t in (q, k))
        at = self.qk + 2 * self.v
        beta = torch.sigmoid(proj[:, at : at + Hv])  # [T, Hv]
        g = softplus(proj[:, at + Hv :] + self.dt_bias) * self.a  # [T, Hv], <= 0
        q = q * Dk ** -0.5
        if T == 1:
            return delta_step(q[0], k[0], v[0], g[0], beta[0], state.ssm)[None]
        return chunked(delta_chunk, (q, k, v, g, beta), state.ssm)  # [T, Hv, Dv]

    def output(self, y: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
        T = y.shape[0]
        z = proj[:, self.qk + self.v : self.qk + 2 * self.v].reshape(T, self.hv, self.dv)
        y = F.rms_norm(y, (self.dv,), self.norm, self.eps) * F.silu(z)
        return self.out_proj(y.reshape(T, -1))


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (build_gdn_l2_norm: an RMS norm of eps / n, over sqrt n)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               s: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule (a decode step: build_delta_net_autoregressive): q, k [H, Dk], v [H, Dv],
    g and beta [H]; s [H, Dv, Dk] in place. Returns o [H, Dv]."""
    s.mul_(torch.exp(g)[:, None, None])
    d = (v - torch.bmm(s, k[:, :, None])[..., 0]) * beta[:, None]  # [H, Dv]
    s.baddbmm_(d[:, :, None], k[:, None, :])  # += outer products, in place
    return torch.bmm(s, q[:, :, None])[..., 0]


def delta_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                s: torch.Tensor) -> torch.Tensor:
    """One chunk of the gated delta rule: q, k [L, H, Dk] (q scaled), v [L, H, Dv], g and beta [L, H]; the
    state s [H, Dv, Dk] (llama.cpp's layout: o = s q) is updated in place. Returns o [L, H, Dv].

    Token by token: s = exp(g_t) s; s += beta_t (v_t - s k_t) k_t^T; o_t = s q_t. Over a chunk (the WY form):
    with gc the cumulative g and A[t, u] = beta_t (k_t . k_u) exp(gc_t - gc_u) for u < t, the corrections
    u = (I + A)^-1 beta v and w = (I + A)^-1 beta k exp(gc) give the new values v' = u - w s_0^T."""
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, L, D]
    gc = torch.cumsum(g, dim=0).t()  # [H, L]
    bh = beta.t()[..., None]  # [H, L, 1]
    L = q.shape[0]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp((gc[:, :, None] - gc[:, None, :]).masked_fill(~causal, float("-inf")))  # [H, t, u]
    a = (bh * (kh @ kh.transpose(1, 2)) * decay).tril(-1)
    eg = torch.exp(gc)[..., None]  # [H, L, 1]
    rhs = torch.cat((bh * vh, bh * kh * eg), dim=-1)
    sol = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)  # (I + a) sol = rhs
    u, w = sol[..., : vh.shape[-1]], sol[..., vh.shape[-1] :]
    st = s.transpose(1, 2)  # [H, Dk, Dv]
    v_new = u - w @ st  # [H, L, Dv]
    o = (qh * eg) @ st + ((qh @ kh.transpose(1, 2)) * decay) @ v_new
    last = gc[:, -1:]  # [H, 1]
    s.mul_(torch.exp(last)[..., None]).add_(v_new.transpose(1, 2) @ (kh * torch.exp(last - gc)[..., None]))
    return o.transpose(0, 1)


MIXERS = {"conv": ShortConv, "mamba2": Mamba2, "deltanet": GatedDeltaNet}
