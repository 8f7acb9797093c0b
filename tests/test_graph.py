"""graph.GraphDecoder: the fixed-shape decode step a CUDA graph captures. It runs eagerly on the CPU, where these
tests hold it to Model.forward; the tests marked gpu capture and replay it."""
from __future__ import annotations

import pytest
import torch
from tiny import TinySpec

from kvsession.engine import Engine
from kvsession.generate import generate_tokens
from kvsession.model.cuda_graph import GraphDecoder
from kvsession.sampling import GREEDY
from kvsession.session import Session

CUDA = torch.cuda.is_available()
SPECS = {
    "llama": TinySpec(),
    "qwen2-bias": TinySpec(arch="qwen2", seed=2),
    "gemma3-rings": TinySpec(arch="gemma3", n_layers=4, n_heads=4, n_kv_heads=1, head_dim=32, sliding_window=8,
                             rope_base=1e6, seed=7),
}
PROMPT = list(range(3, 23))


def engine_for(tiny_factory, name: str, device: str = "cpu", graphs: bool = False) -> Engine:
    return Engine.load(tiny_factory(SPECS[name]), device=device, precision="f32", graphs=graphs)


# f32: sums in another order; Gemma's GELU rounds its input to f16 (ggml's table), which turns a last-bit
# difference into ~1e-4 now and then
@pytest.mark.parametrize("kv_dtype, tol", [("f32", 1e-3), ("f16", 2e-2)])
@pytest.mark.parametrize("prompt", [2, len(PROMPT)], ids=["rings-not-yet-full", "rings-wrapped"])
@pytest.mark.parametrize("name", SPECS)
def test_the_static_step_is_the_forward_pass(tiny_factory, name, kv_dtype, tol, prompt):
    engine = engine_for(tiny_factory, name)
    ref = engine.session(kv_dtype=kv_dtype, ring_margin=4, max_tokens=128)
    out = engine.session(kv_dtype=kv_dtype, ring_margin=4, max_tokens=128)
    ref.prefill(PROMPT[:prompt])
    out.prefill(PROMPT[:prompt])
    decoder = GraphDecoder(engine.model, out.cache, out.max_tokens, min_span=16)
    for i, token in enumerate(range(40, 80)):  # to position 59: spans 16, 32 and 64; rings wrapped many times
        pos = prompt + i
        want = engine.model.forward([token], range(pos, pos + 1), ref.cache)
        got = decoder.step(token, pos)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert [c.end for c in out.cache] == [c.end for c in ref.cache]
    assert decoder.fits()


def test_a_rewound_session_attends_to_none_of_the_rows_it_dropped(tiny_factory):
    engine = engine_for(tiny_factory, "gemma3-rings", graphs=True)
    s = engine.session(sampler=GREEDY, ring_margin=4, max_tokens=128)
    s.prefill(PROMPT)
    list(generate_tokens(s, 10, ignore_eos=True))
    s.truncate(len(s.tokens) - 3)  # the rings (margin 4) still hold the window before it
    s.prefill([50])
    fresh = engine.session(sampler=GREEDY, ring_margin=4, max_tokens=128)
    fresh.prefill(PROMPT + s.tokens[len(PROMPT):])
    torch.testing.assert_close(s.logits, fresh.logits, rtol=2e-2, atol=2e-2)
    assert list(generate_tokens(s, 8, ignore_eos=True)) == list(generate_tokens(fresh, 8, ignore_eos=True))


@pytest.mark.parametrize("name", ["llama", "gemma3-rings"])
def test_a_session_resumed_on_the_graph_path_continues_bit_for_bit(tiny_factory, name, tmp_path):
    engine = engine_for(tiny_factory, name, graphs=True)
    whole = engine.session(sampler=GREEDY, ring_margin=4)
    whole.prefill(PROMPT)
    expected = list(generate_tokens(whole, 30, ignore_eos=True))
    first = engine.session(sampler=GREEDY, ring_margin=4)
    first.prefill(PROMPT)
    head = list(generate_tokens(first, 12, ignore_eos=True))
    first.save(tmp_path / "s.kvs")
    t = Session.load(tmp_path / "s.kvs", engine, ring_margin=4)  # a ring that starts late: `first` > 0
    assert torch.equal(t.logits, first.logits)
    tail = []
    for token in generate_tokens(t, 18, ignore_eos=True):
        tail.append(token)
    assert head + tail == expected
    assert torch.equal(t.logits, whole.logits)


def test_a_grown_cache_gets_a_new_decoder(tiny_factory):
    engine = engine_for(tiny_factory, "llama", graphs=True)
    s = engine.session(sampler=GREEDY, max_tokens=512)
    s.prefill(PROMPT)
    s.append(5)
    decoder = s._decoder
    assert decoder is not None and all(c.capacity == 512 for c in s.cache)  # the whole context, fixed
    s.cache[0].k = s.cache[0].k.clone()  # as a cache replaced under the decoder would be
    assert not decoder.fits()
    s.append(6)
    assert s._decoder is not decoder and s._decoder.fits()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", SPECS)
def test_replayed_graphs_decode_as_the_eager_step(tiny_factory, name):
    eager = engine_for(tiny_factory, name, device="cuda", graphs=False)
    graphs = engine_for(tiny_factory, name, device="cuda", graphs=True)
    a = eager.session(sampler=GREEDY, ring_margin=4, max_tokens=1024)
    b = graphs.session(sampler=GREEDY, ring_margin=4, max_tokens=1024)
    a.prefill(PROMPT)
    b.prefill(PROMPT)
    for i in range(300):  # teacher-forced, across the 256-row span
        token = 3 + (7 * i) % 250
        a.append(token)
        b.append(token)
        torch.testing.assert_close(b.logits, a.logits, rtol=3e-2, atol=3e-2)
    assert sorted(b._decoder.graphs) == [256, 512] and graphs.model.n_forward == eager.model.n_forward
