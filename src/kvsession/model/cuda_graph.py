"""Decode a token as one CUDA graph: the step's kernels replayed without Python.

At batch 1 on a GPU a small model's step is launch overhead: Model.forward
issues ~30 kernels a layer, ~900 a token on Qwen2.5-Coder-1.5B, each paying
Python and a launch (5-10 us), against ~0.7 ms of weight reads at an
H200's bandwidth. Here every shape of the step is fixed -- the position is
a tensor on the device, the new K/V row lands by index_copy_, attention
reads a fixed span of the cache's rows and masks those past the position --
so the step is captured once and replayed, one launch a token.

A graph holds the addresses of everything it reads, so a decoder belongs to
one session (its caches) and fixes them first: full layers are reserved to
the session's context, the RoPE tables grown to it (and kept alive here).
Spans: a full layer's attention reads its first `span` rows, the next
power of two above the position (at least `min_span`), so a short chat does
not read its whole context each step; a session captures at most
log2(context / min_span) + 1 graphs. A ring is read whole.

Masked rows still pass through the products (0 * NaN is NaN), so rows no
token ever wrote are zeroed when the decoder is built.

The step runs eagerly on any device (`run`): the CPU tests check it against
Model.forward. Capture and replay need CUDA. Its numbers differ from
Model.forward's in the last bits (attention in the cache's dtype over a
span, not float32 over the live rows), so a session decodes with one or the
other throughout (Engine.graphs), and a saved session resumed on the same
path continues bit for bit.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..kv.cache import KVCache

if TYPE_CHECKING:
    from .transformer import Model

MIN_SPAN = 256


class GraphDecoder:
    def __init__(self, model: "Model", cache: KVCache, max_tokens: int, *, min_span: int = MIN_SPAN):
        self.model = model
        self.cache = cache
        self.max_tokens = max_tokens
        self.min_span = min_span
        self.device = model.device
        self.cuda = self.device.type == "cuda"
        with torch.inference_mode():
            for c in cache:
                if c.ring:
                    unwritten = torch.ones(c.capacity, dtype=torch.bool)
                    unwritten[torch.arange(c.start, c.end) % c.capacity] = False
                    c.k[unwritten.to(c.k.device)] = 0
                    c.v[unwritten.to(c.v.device)] = 0
                else:
                    c.prefault(max_tokens)  # the whole context now, rows past the end zeroed: addresses fixed
            for r in model.ropes:
                r.tables(max_tokens)
        self.tables = [(r.cos, r.sin, r.cis) for r in model.ropes]  # what captured graphs read stays alive
        self.addresses = self._addresses()
        d = model.config.d_model
        self.x = torch.zeros(1, d, device=self.device)  # the token's embedding
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.first = torch.zeros(len(cache), dtype=torch.long, device=self.device)  # a ring's first position
        self.firsts = [0] * len(cache)
        self.rows = torch.arange(max(c.capacity for c in cache), device=self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _addresses(self) -> list[int]:
        return [p for c in self.cache for p in (c.k.data_ptr(), c.v.data_ptr())]

    def fits(self) -> bool:
        """Whether the caches still lie where this decoder's graphs read them (a cache replaced or grown:
        build a new decoder)."""
        return self._addresses() == self.addresses

    def span(self, pos: int) -> int:
        return min(self.max_tokens, max(self.min_span, 1 << pos.bit_length()))

    def run(self, span: int) -> torch.Tensor:
        """The step, eagerly: logits [vocab] f32 of self.x at position self.pos, its K/V rows written.

        Every full layer reads the same span under the same mask, made once. A query's G heads that share
        a KV head are its G "query positions" against that head ([1, Hk, G, D]): plain attention, which the
        fused kernels take, where grouped-query attention fell back to repeating every key G times."""
        cfg = self.model.config
        H, Hk, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        x, pos = self.x, self.pos
        full_masks: dict[int, torch.Tensor] = {}
        for i, (block, c) in enumerate(zip(self.model.blocks, self.cache)):
            q, k, v, gate = block.qkv(block.norm(x), pos)  # [1, H, D], [1, Hk, D] x2, None
            n = c.capacity if c.ring else min(span, c.capacity)
            row = torch.remainder(pos, n) if c.ring else pos
            c.k.index_copy_(0, row, k.to(c.k.dtype))
            c.v.index_copy_(0, row, v.to(c.v.dtype))
            r = self.rows[:n]
            if c.ring:  # row r holds position p = pos - ((pos - r) mod n)
                p = pos - torch.remainder(pos - r, n)
                mask = ((p >= self.first[i]) & (p > pos - c.window)).view(1, 1, 1, n)
            else:
                if n not in full_masks:
                    full_masks[n] = (r <= pos).view(1, 1, 1, n)
                mask = full_masks[n]
            keys = c.k[:n].transpose(0, 1).unsqueeze(0)  # [1, Hk, n, D]
            values = c.v[:n].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(q.to(c.k.dtype).view(1, Hk, H // Hk, D), keys, values,
                                                 attn_mask=mask, scale=cfg.query_scale)  # [1, Hk, G, D]
            x = block.finish(x, block.attn_out(out.reshape(1, H * D).float(), gate))
        return self.model.head(x)[0]

    def _capture(self, span: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: this very step, so the row it writes is the right one
            self.run(span)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # a server's other threads go on
            out = self.run(span)
        return graph, out

    @torch.inference_mode()
    def step(self, token: int, pos: int) -> torch.Tensor:
        """Token `token` at position `pos`, through every layer: its rows stored, logits [vocab] returned."""
        saved = [(c.end, c.first) for c in self.cache]
        try:
            for c in self.cache:
                c.claim(pos, 1)
            for i, c in enumerate(self.cache):
                if c.first != self.firsts[i]:
                    self.first[i] = self.firsts[i] = c.first
            self.x.copy_(self.model.embed([token]))
            self.pos.fill_(pos)
            span = self.span(pos)
            self.model.n_forward += 1
            if not self.cuda:
                return self.run(span)
            if span not in self.graphs:
                self.graphs[span] = self._capture(span)
            graph, out = self.graphs[span]
            graph.replay()
            return out.clone()
        except BaseException:
            for c, (end, first) in zip(self.cache, saved):
                c.end, c.first = end, first
            raise
