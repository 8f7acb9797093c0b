"""SmolLM2 against llama.cpp's reference vectors (tests/vectors, made by tools/llamacpp_reference.py).

What the thresholds rest on. Tokenization must be identical. The logits
cannot be: llama.cpp rounds every matmul input to 8-bit blocks (Q8_1 for
Q4_1 weights) and its own valid configurations disagree with each other on
this model -- on the teacher-forced text below llama.cpp with flash attention
picks another argmax than llama.cpp without it at 4.6% of the positions, and
with an f16 KV cache instead of f32 at 5.5%. We require at least 95%
argmax agreement (what llama.cpp reaches with itself), llama.cpp's argmax
inside our top-5 everywhere, and along llama.cpp's greedy continuations our
argmax equal to its token at 90% of the steps.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import VECTORS

from kvsession.engine import Engine
from kvsession.kv.cache import KVCache

REF = json.loads((VECTORS / "smollm2-135m-instruct-q4_1.json").read_text())


@pytest.fixture(scope="module", params=["bf16", "f32"])
def engine(request, smollm2, smollm2_path):
    return smollm2 if request.param == "bf16" else Engine.load(smollm2_path, device="cpu", precision="f32")


def _logits(engine: Engine, ids: list[int]) -> np.ndarray:
    cache = KVCache.for_model(engine.config)
    return engine.model.forward(ids, range(len(ids)), cache, all_logits=True).numpy()


def test_reference_is_for_this_file(smollm2_path):
    import hashlib

    h = hashlib.sha256(smollm2_path.read_bytes()).hexdigest()
    assert h == REF["model"]["sha256"]


@pytest.mark.parametrize("case", REF["tokenize"], ids=lambda c: repr(c["text"][:20]))
def test_tokenization_identical(smollm2, case):
    assert smollm2.tokenizer.encode(case["text"]) == case["ids"]


def test_teacher_forced_argmax(engine):
    tf = REF["teacher_forced"]
    assert len(tf["ids"]) >= 512
    assert engine.tokenizer.encode(tf["text"]) == tf["ids"]
    logits = _logits(engine, tf["ids"])
    top5 = np.array(tf["top5"])
    ours = logits.argmax(-1)
    agree = float((ours == top5[:, 0]).mean())
    print(f"{engine.model.precision}: argmax agreement {agree:.4f} over {len(ours)} positions")
    assert agree >= 0.95
    our_top5 = np.argsort(-logits, axis=1)[:, :5]
    assert all(top5[i, 0] in our_top5[i] for i in range(len(ours)))


def test_greedy_continuations(engine):
    identical, steps, agree = 0, 0, 0
    for case in REF["greedy"]:
        prompt, cont = case["prompt_ids"], case["continuation"]
        assert engine.tokenizer.encode(case["prompt"]) == prompt
        # teacher-force llama.cpp's continuation through our model
        logits = _logits(engine, prompt + cont)[len(prompt) - 1 : len(prompt) - 1 + len(cont)]
        ours = logits.argmax(-1).tolist()
        agree += sum(int(a == b) for a, b in zip(ours, cont))
        steps += len(cont)
        top5 = np.argsort(-logits, axis=1)[:, :5]
        assert all(t in top5[i] for i, t in enumerate(cont)), case["prompt"]
        identical += int(ours == cont)
    print(f"{engine.model.precision}: {identical}/5 continuations identical, per-step agreement {agree / steps:.3f}")
    assert agree / steps >= 0.9


def test_teacher_forced_argmax_through_a_q8_0_cache(smollm2):
    """Keys and values kept as 8-bit blocks (--kv-dtype q8_0), attended to where they lie: llama.cpp's own q8_0
    cache picks the argmax of its f32 reference at 95.4% of these positions, its f16 cache at 94.6%
    (BENCHMARKS.md); ours 95.7% (K.Q in bfloat16 or float32) or 96.9% (in int8 against the queries quantized as
    llama.cpp quantizes them, the avx512 build)."""
    tf = REF["teacher_forced"]
    logits = smollm2.session(kv_dtype="q8_0").score(tf["ids"]).numpy()
    top5 = np.array(tf["top5"])
    agree = float((logits.argmax(-1) == top5[:, 0]).mean())
    print(f"q8_0 KV: argmax agreement {agree:.4f} over {len(logits)} positions")
    assert agree >= 0.945
    our_top5 = np.argsort(-logits, axis=1)[:, :5]
    assert all(top5[i, 0] in our_top5[i] for i in range(len(logits)))
