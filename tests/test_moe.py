"""Mixtures of experts (moe.py): the router's choice as llama.cpp makes it, and only the chosen experts read."""
from __future__ import annotations

import gguf
import pytest
import torch
from tiny import TINY_TEXT, TinySpec

from kvsession.engine import Engine
from kvsession.kernels import BlockLinear
from kvsession.model.moe import Experts, swiglu_oai
from kvsession.session import advance

Q = gguf.GGMLQuantizationType
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


def test_softmax_weight_gating_takes_the_top_logits_then_a_softmax_over_them():
    # gpt-oss: the largest logits choose, and only the chosen are weighed against each other
    router = lambda h: torch.tensor([[0.0, 2.0, 1.0, -1.0]])  # noqa: E731
    ident = [lambda x: torch.cat([x, x], -1)] * 4
    weights, chosen = Experts(router, ident, [lambda x: x] * 4, used=2, gating="softmax_weight").route(torch.ones(1, 3))
    assert chosen.tolist() == [[1, 2]]
    torch.testing.assert_close(weights[0], torch.softmax(torch.tensor([2.0, 1.0]), 0))
    with pytest.raises(ValueError, match="gating"):
        Experts(router, ident, [lambda x: x] * 4, used=2, gating="sigmoid")


def test_swiglu_oai_clamps_as_ggml_does():
    gate = torch.tensor([-20.0, -1.0, 0.0, 3.0, 9.0])
    up = torch.tensor([-9.0, 0.5, 2.0, -1.0, 12.0])
    x = gate.double().clamp(max=7.0)
    want = x * torch.sigmoid(1.702 * x) * (up.double().clamp(-7.0, 7.0) + 1)
    torch.testing.assert_close(swiglu_oai(gate, up).double(), want, rtol=1e-6, atol=1e-6)


def test_gpt_oss_experts_are_read_in_their_mxfp4_blocks(tiny_factory):
    spec = TinySpec(arch="gpt-oss", expert_type="MXFP4", n_heads=4, head_dim=32, sliding_window=8, experts_used=4,
                    yarn=32.0, tied=False, seed=33)
    engine = Engine.load(tiny_factory(spec), device="cpu", precision="bf16")
    moe = engine.model.blocks[0].experts
    assert all(isinstance(p, BlockLinear) and p.qtype == Q.MXFP4 for f in moe.gate_up for p in f.parts)
    assert all(isinstance(f, BlockLinear) and f.bias is not None for f in moe.down)  # each expert's own bias row
    assert [s.kind for s in engine.config.layers] == ["sliding", "full"]


def test_a_step_reads_only_the_chosen_experts_and_a_chunk_each_expert_once(tiny_factory):
    engine = Engine.load(tiny_factory(SPEC), device="cpu", precision="bf16")
    engine.model.stack = None  # layer by layer, where the experts' calls can be counted
    moe = engine.model.blocks[0].experts
    moe.gate_up = [Counted(f) for f in moe.gate_up]
    moe.down = [Counted(f) for f in moe.down]
    moe.step = None  # the layer-by-layer decode, whose calls can be counted (the kernel's is held equal to it below)
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


GPT_OSS = TinySpec(arch="gpt-oss", expert_type="MXFP4", weight_type="Q8_0", n_heads=4, head_dim=32, sliding_window=8,
                   experts_used=4, yarn=32.0, tied=False, seed=34)


@pytest.mark.parametrize("spec", [SPEC, GPT_OSS], ids=["qwen3moe", "gpt-oss"])
def test_a_decode_steps_experts_in_one_kernel_call_are_the_layer_by_layer_ones(tiny_factory, spec):
    """Every decode step's experts, in one call of the kernels, against the same experts one by one on the same
    input. The two are the same products but not the same SiLU (C's expf, PyTorch's own), so an activation that
    the 8-bit products round to the next level now and then moves an output by ~1e-4 of its size (a whole
    decode compared at the logits once moved them by 1e-2 at one step of twenty, on the AVX-512 build without
    BF16); a wrong expert, weight or order moves it by its whole size."""
    engine = Engine.load(tiny_factory(spec), device="cpu", precision="bf16")
    engine.model.stack = None  # layer by layer: the step called from moe.Experts
    moes = [b.experts for b in engine.model.blocks]
    assert all(m.step is not None for m in moes)
    calls = []

    def recorded(m, step):
        def call(h, chosen, weights):
            out = step(h, chosen, weights)
            calls.append((m, h.clone(), chosen.copy(), weights.copy(), out.clone()))
            return out
        return call

    for m in moes:
        m.step = recorded(m, m.step)
    ids = engine.tokenizer.encode(TINY_TEXT)
    s = engine.session()
    s.prefill(ids[:20])
    for t in ids[20:40]:
        s.append(t)
    assert len(calls) == 20 * len(moes)
    exact = 0
    for m, h, chosen, weights, out in calls:
        plain = None
        for w, e in zip(weights.tolist(), chosen.tolist()):
            y = m.expert(e, h) * w
            plain = y if plain is None else plain + y
        size = plain.abs().max().item()
        assert size > 0 and (out - plain).abs().max().item() <= 1e-3 * size
        exact += (out - plain).abs().max().item() <= 1e-5 * size
    assert exact >= len(calls) * 3 // 4  # the rounding flips are the exception


@pytest.mark.parametrize("spec", [SPEC, GPT_OSS], ids=["qwen3moe", "gpt-oss"])
def test_a_mixture_decodes_through_the_stack(tiny_factory, spec):
    """The C decode stack routes each token (softmax, or gpt-oss's softmax over the top logits; its router's bias,
    its experts' biases, its attention's sinks and sliding windows) and runs its experts: the logits the
    layer-by-layer path gives, and two sequences decoded together get bit for bit what each gets alone. The two
    paths differ in float rounding (norms, softmax, sigmoid), and the 8-bit products of Q8_0 and MXFP4 round an
    activation to the next level now and then: a few steps of twenty move by ~1e-3, the rest by ~5e-6; a wrong
    expert, weight or order moves every step by ~1."""
    path = tiny_factory(spec)
    fast = Engine.load(path, device="cpu", precision="bf16")
    slow = Engine.load(path, device="cpu", precision="bf16")
    slow.model.stack = None
    assert fast.model.stack is not None
    ids = fast.tokenizer.encode(TINY_TEXT)
    a, b = fast.session(), slow.session()
    for s in (a, b):
        s.prefill(ids[:20])
    diffs = []
    for t in ids[20:40]:
        a.append(t)
        b.append(t)
        diffs.append((a.logits - b.logits).abs().max().item())
    assert max(diffs) <= 5e-2 and sum(d <= 5e-5 for d in diffs) >= 15, diffs
    c, lone = fast.session(), fast.session()
    for s in (c, lone):
        s.prefill(ids[:12])
    advance([(a, [ids[40]]), (c, [ids[12]])])
    lone.append(ids[12])
    assert torch.equal(c.logits, lone.logits)
