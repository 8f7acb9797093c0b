"""Mixtures of experts (moe.py): the router's choice as llama.cpp makes it, and only the chosen experts read."""
from __future__ import annotations

import pytest
import torch

from kvsession.engine import Engine
from kvsession.moe import Experts
from tiny import TINY_TEXT, TinySpec

SPEC = TinySpec(arch="qwen3moe", weight_type="Q4_0", n_heads=4, head_dim=32, experts=8, experts_used=3, seed=31)


class Counted:
    """A linear that counts its calls and the tokens it multiplied."""

    def __init__(self, inner):
        self.inner, self.calls, self.tokens = inner, 0, 0

    def __call__(self, x):
        self.calls += 1
        self.tokens += x.shape[0]
        return self.inner(x)


def test_the_router_weights_the_top_experts_and_normalises_them():
    router = lambda h: torch.tensor([[0.0, 2.0, 1.0, -1.0]])  # noqa: E731
    ident = [lambda x: torch.cat([x, x], -1)] * 4  # gate = up = x
    e = Experts(router, ident, [lambda x: x] * 4, used=2, norm=True)
    weights, chosen = e.route(torch.ones(1, 3))
    p = torch.softmax(torch.tensor([0.0, 2.0, 1.0, -1.0]), 0)
    assert chosen.tolist() == [[1, 2]]
    torch.testing.assert_close(weights[0], torch.stack([p[1], p[2]]) / (p[1] + p[2]))
    raw, _ = Experts(router, ident, [lambda x: x] * 4, used=2, norm=False).route(torch.ones(1, 3))
    torch.testing.assert_close(raw[0], torch.stack([p[1], p[2]]))  # unnormalised: the probabilities themselves
    with pytest.raises(ValueError):
        Experts(router, ident, [lambda x: x] * 4, used=5, norm=True)


def test_a_step_reads_only_the_chosen_experts_and_a_chunk_each_expert_once(tiny_factory):
    engine = Engine.load(tiny_factory(SPEC), device="cpu", precision="bf16")
    assert engine.model.stack is None  # the decode stack has no experts: layer by layer
    moe = engine.model.blocks[0].experts
    moe.gate_up = [Counted(f) for f in moe.gate_up]
    moe.down = [Counted(f) for f in moe.down]
    ids = engine.tokenizer.encode(TINY_TEXT)
    s = engine.session()
    s.prefill(ids)  # one chunk: each expert chosen by some token multiplies all of its tokens at once
    calls = [f.calls for f in moe.gate_up]
    assert max(calls) == 1 and sum(f.tokens for f in moe.gate_up) == len(ids) * SPEC.experts_used
    before = [f.calls for f in moe.down]
    s.append(int(torch.argmax(s.logits)))  # a decode step: experts_used of them, no other
    assert sum(f.calls - b for f, b in zip(moe.down, before)) == SPEC.experts_used


def test_a_mixture_keeps_a_dense_models_kv(tiny_factory):
    moe = Engine.load(tiny_factory(SPEC), device="cpu", precision="bf16")
    dense = Engine.load(tiny_factory(SPEC.replace(arch="qwen3")), device="cpu", precision="bf16")
    assert moe.config.kv_shape() == dense.config.kv_shape() | {"arch": "qwen3moe"}
