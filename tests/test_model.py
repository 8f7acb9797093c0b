"""The forward pass: tiny models against llama.cpp's logits, chunked prefill, precisions."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from conftest import VECTORS
from tiny import TINY_REFERENCE_SPECS, TINY_TEXT, TinySpec

from kvsession.engine import Engine
from kvsession.errors import InvalidArgument
from kvsession.kv.cache import KVCache

REFERENCE = json.loads((VECTORS / "tiny.json").read_text())["tiny"]


def _logits(engine: Engine, ids: list[int]) -> np.ndarray:
    cache = KVCache.for_model(engine.config)
    return engine.model.forward(ids, range(len(ids)), cache, all_logits=True).numpy()


@pytest.mark.parametrize("ref", REFERENCE, ids=[r["name"] for r in REFERENCE])
def test_tiny_models_match_llama_cpp(ref, tiny_factory):
    path = tiny_factory(TINY_REFERENCE_SPECS[ref["name"]])
    import hashlib

    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["sha256"], (
        "tests/tiny.py now writes other bytes than the reference was made from; "
        "rerun tools/llamacpp_reference.py --tiny"
    )
    expected = np.frombuffer(base64.b64decode(ref["logits_f32_base64"]), dtype="<f4").reshape(len(ref["ids"]), -1)
    engine = Engine.load(path, device="cpu", precision="f32")
    assert engine.tokenizer.encode(TINY_TEXT) == ref["ids"]
    got = _logits(engine, ref["ids"])
    diff = np.abs(got - expected).max()
    if ref["name"].startswith(("gemma2", "gemma3")):
        # float weights, but ggml's GELU rounds its input and output to float16 (a lookup table):
        # we do the same, and a 1e-7 difference upstream sometimes lands on the other side of
        # a float16 rounding step
        assert diff < 2e-3, diff
        assert (got.argmax(-1) == expected.argmax(-1)).all()
    elif ref["name"].endswith(("_f32", "_f32_untied_mqa")):
        # same float arithmetic up to summation order
        assert diff < 1e-4, diff
    elif ref["name"].startswith(("qwen3moe", "gpt_oss")):
        # as below, and a token whose router scores two experts within that rounding of each other may take the
        # other one in llama.cpp: its row moves by a whole expert's output (1 or 2 of 61 rows here)
        assert (np.abs(got - expected).max(-1) >= 0.25).mean() <= 0.05, np.abs(got - expected).max(-1)
        assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.9
    else:
        # llama.cpp rounds activations to f16 / 8-bit blocks before each product; we do not
        assert diff < 0.25, diff
        assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.9


def test_bf16_path_stays_close_to_f32(tiny_factory):
    path = tiny_factory(TinySpec(weight_type="Q5_1", seed=5))  # float products (Q4_0's round to 8 bits)
    fast = Engine.load(path, device="cpu", precision="bf16")
    ref = Engine.load(path, device="cpu", precision="f32")
    # the weights really stay in their blocks on the fast path
    assert type(fast.model.blocks[0].wqkv).__name__ == "BlockLinears"
    assert {type(p).__name__ for p in fast.model.blocks[0].wqkv.parts} == {"BlockLinear"}
    assert type(ref.model.blocks[0].wqkv).__name__ == "DenseLinear"
    ids = ref.tokenizer.encode(TINY_TEXT)
    a, b = _logits(fast, ids), _logits(ref, ids)
    assert np.abs(a - b).max() < 0.1
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunked_prefill_equals_one_shot(tiny_engine, chunk):
    ids = tiny_engine.tokenizer.encode(TINY_TEXT)
    one = tiny_engine.session()
    one.prefill(ids, chunk_size=len(ids))
    chunked = tiny_engine.session()
    chunked.prefill(ids, chunk_size=chunk)
    # other GEMM shapes sum in another order: equal to float rounding, not bit for bit
    torch.testing.assert_close(chunked.logits, one.logits, rtol=1e-4, atol=1e-4)
    for layer_a, layer_b in zip(one.cache, chunked.cache):
        torch.testing.assert_close(layer_a.k[: len(ids)].float(), layer_b.k[: len(ids)].float(), rtol=1e-3, atol=1e-3)


def test_prefill_chunks_stop_at_multiples_of_stops(tiny_engine):
    """stops: a chunk also ends at every absolute multiple of it (a hybrid's snapshot frontiers), counted from
    position 0 whatever the session held before; the same logits as any other cuts."""
    ids = tiny_engine.tokenizer.encode(TINY_TEXT)[:40]
    s = tiny_engine.session()
    s.prefill(ids[:3])
    ends = []
    s.prefill(ids[3:], chunk_size=8, stops=10, progress=lambda done, total: ends.append(3 + done))
    assert ends == [10, 18, 20, 28, 30, 38, 40]
    whole = tiny_engine.session()
    whole.prefill(ids)
    torch.testing.assert_close(s.logits, whole.logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(InvalidArgument, match="stops"):
        s.prefill([1], stops=-1)


def test_forward_rejects_mismatched_arguments(tiny_engine):
    cache = KVCache.for_model(tiny_engine.config)
    with pytest.raises(ValueError, match="positions"):
        tiny_engine.model.forward([1, 2, 3], range(0, 2), cache)
    with pytest.raises(ValueError, match="caches"):
        tiny_engine.model.forward([1], range(0, 1), KVCache(cache.layers[:1]))
    with pytest.raises(ValueError, match="token id"):
        tiny_engine.model.forward([tiny_engine.config.vocab_size], range(0, 1), cache)


def test_forward_counter(tiny_engine):
    s = tiny_engine.session()
    before = tiny_engine.model.n_forward
    s.prefill(list(range(10)), chunk_size=4)
    assert tiny_engine.model.n_forward - before == 3
