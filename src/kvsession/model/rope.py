"""Rotary position embeddings: the cos/sin tables of one RopeConfig (plain, linear, YaRN, LongRoPE), as ggml
computes them, and their application to queries and keys."""
from __future__ import annotations

import numpy as np
import torch

from ..config import RopeConfig


class Rope:
    """cos/sin tables for one RopeConfig, grown on demand; applied in float32.

    The angles are computed the way ggml computes them (ggml_rope_cache_init):
    in float32, theta_0 = position and theta_{i+1} = theta_i * base^(-2/dim),
    one rounded multiplication at a time. At a position of a few hundred that
    recurrence is off from the exact angle by ~1e-3 radians; doing exactly
    what llama.cpp does keeps our logits equal to its logits.
    """

    def __init__(self, cfg: RopeConfig, device: torch.device, freq_factors: torch.Tensor | None):
        self.cfg = cfg
        self.device = device
        half = cfg.dim // 2
        self.theta_scale = np.power(np.float32(cfg.base or 1), np.float32(-2.0) / np.float32(cfg.dim), dtype=np.float32)
        self.freq_factors = (np.ones(half, np.float32) if freq_factors is None
                             else freq_factors.float().cpu().numpy().astype(np.float32))
        self.freq_scale = np.float32(1.0 / cfg.linear_scale)
        self.cos = self.sin = torch.empty(0, half)
        self._grow(4096)

    def _grow(self, n: int) -> None:
        half = self.cfg.dim // 2
        theta = np.empty((n, half), np.float32)  # [n, dim/2]
        theta[:, 0] = np.arange(n, dtype=np.float32)
        for i in range(1, half):
            theta[:, i] = theta[:, i - 1] * self.theta_scale
        extrap = theta / self.freq_factors
        theta = self.freq_scale * extrap
        mscale = np.float32(self.cfg.attn_factor)
        if self.cfg.yarn is not None and self.cfg.yarn.ext_factor:
            mix = self._yarn_ramp() * np.float32(self.cfg.yarn.ext_factor)  # [dim/2]
            theta = theta * (np.float32(1) - mix) + extrap * mix
            mscale = mscale * (np.float32(1) + np.float32(0.1) * np.log(np.float32(1) / self.freq_scale,
                                                                          dtype=np.float32))
        if self.cfg.base == 0:  # a layer without RoPE: the identity's tables (cos 1, sin 0 rotate exactly nothing)
            theta[:] = 0.0
        if self.cfg.sections:  # M-RoPE of a text token: the pairs of the fourth axis sit at position 0
            theta[:, ~self._text_pairs()] = 0.0
        t = torch.from_numpy(theta)
        self.cos = t.cos()  # [n, dim/2]
        self.sin = t.sin()
        if mscale != 1:  # YaRN and LongRoPE scale every rotated value, as ggml does: in the tables
            self.cos, self.sin = self.cos * float(mscale), self.sin * float(mscale)
        norm = self.cfg.kind == "norm"
        self.mscale = float(mscale)
        self.cis = torch.polar(torch.full_like(t, float(mscale)), t).to(self.device) if norm else None
        self.cos, self.sin = self.cos.to(self.device), self.sin.to(self.device)

    def _text_pairs(self) -> np.ndarray:
        """Interleaved M-RoPE (ggml_mrope_cache_init, is_imrope): which pairs [dim/2] turn with a text token's
        position, the same on the time, height and width axes; the others take the fourth axis's, 0."""
        t, h, w = self.cfg.sections[:3]
        sector = np.arange(self.cfg.dim // 2) % sum(self.cfg.sections)
        axis = sector % 3
        return ((axis == 0) & (sector < 3 * t)) | ((axis == 1) & (sector < 3 * h)) | ((axis == 2) & (sector < 3 * w))

    def _yarn_ramp(self) -> np.ndarray:
        """YaRN's ramp over the pairs [dim/2]: 1 (the original frequency) below the fast correction dimension, 0
        (the interpolated one) past the slow one; ggml_rope_yarn_corr_dims and rope_yarn_ramp, in float32."""
        y, f32 = self.cfg.yarn, np.float32
        dim, base = f32(self.cfg.dim), f32(self.cfg.base)

        def corr_dim(rotations: float) -> np.float32:
            return dim * np.log(f32(y.orig_context) / (f32(rotations) * f32(2) * f32(np.pi)), dtype=f32) / (
                f32(2) * np.log(base, dtype=f32))

        low = max(f32(0), np.floor(corr_dim(y.beta_fast)))
        high = min(dim - f32(1), np.ceil(corr_dim(y.beta_slow)))
        i = np.arange(self.cfg.dim // 2, dtype=f32)  # i0 / 2 of ggml's loop
        ramp = (i - low) / max(f32(0.001), high - low)
        return (f32(1) - np.minimum(f32(1), np.maximum(f32(0), ramp))).astype(f32)

    def tables(self, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [positions, dim/2] covering positions [0, stop)."""
        if stop > self.cos.shape[0]:
            self._grow(max(stop, 2 * self.cos.shape[0]))
        return self.cos, self.sin

    def __call__(self, x: torch.Tensor, positions: range | torch.Tensor) -> torch.Tensor:
        # x: [T, heads, head_dim] f32, the last dim contiguous; positions: a range, or [T] on the device (a
        # captured decode step, whose tables were grown before capture: model/cuda_graph.py)
        if isinstance(positions, range):
            self.tables(positions.stop)
            p = slice(positions.start, positions.stop)
        else:
            p = positions
        if self.cfg.kind == "norm":
            return self._rotate(x, cis=self.cis[p, None, :])
        return self._rotate(x, cos=self.cos[p, None, :], sin=self.sin[p, None, :])

    def shift(self, x: torch.Tensor, delta: int) -> torch.Tensor:
        """x [T, heads, head_dim] f32, already rotated to its positions, rotated `delta` positions further (a
        context shift moves keys back: delta < 0). The angles grow linearly with the position, so this is the
        rotation to position + delta, up to rounding (ggml's K-shift does the same); YaRN's and LongRoPE's scale
        is in the tables and is taken out, as the keys carry it already."""
        d = abs(delta)
        self.tables(d + 1)
        if self.cfg.kind == "norm":
            cis = self.cis[d] / self.mscale
            return self._rotate(x, cis=(cis if delta >= 0 else cis.conj())[None, None, :])
        sign = 1.0 if delta >= 0 else -1.0
        return self._rotate(x, cos=(self.cos[d] / self.mscale)[None, None, :],
                            sin=(self.sin[d] * (sign / self.mscale))[None, None, :])

    def _rotate(self, x: torch.Tensor, *, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                cis: torch.Tensor | None = None) -> torch.Tensor:
        # cos, sin: [T or 1, 1, dim/2] (neox); cis: [T or 1, 1, dim/2] complex (norm)
        d = self.cfg.dim
        rot, rest = x[..., :d], x[..., d:]
        if cis is not None:  # pairs (2i, 2i+1): one complex product per pair
            pairs = torch.view_as_complex(rot.unflatten(-1, (d // 2, 2)))  # [T, heads, dim/2]
            out = torch.view_as_real(pairs * cis).flatten(-2)
        else:  # neox: pairs (i, i + d/2)
            x0, x1 = rot[..., : d // 2], rot[..., d // 2 :]
            out = torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)
