"""The generation loop: EOS, max tokens, stop strings, streaming."""
from __future__ import annotations

import pytest
import torch

from kvsession.generate import Stats, generate, generate_tokens, stream
from kvsession.sampling import GREEDY, SamplerParams


def test_max_tokens_and_session_growth(tiny_engine):
    s = tiny_engine.session(sampler=GREEDY)
    prompt = tiny_engine.tokenizer.encode("hello")
    stats = Stats()
    out = list(stream(s, prompt, max_tokens=7, stats=stats))
    assert stats.finish_reason in ("length", "stop")
    if stats.finish_reason == "length":
        assert stats.generated_tokens == 7
    assert len(s) == len(prompt) + stats.generated_tokens
    assert "".join(d.text for d in out) == tiny_engine.tokenizer.decode(s.tokens[len(prompt):], skip_special=True)


def test_eog_stops_without_feeding_it(tiny_engine):
    s = tiny_engine.session(sampler=GREEDY)
    s.prefill(tiny_engine.tokenizer.encode("hi"))
    eos = tiny_engine.tokenizer.tokens.index("<|im_end|>")
    forced = iter([5, 6, eos, 7])
    s.sampler = lambda logits: next(forced)
    stats = Stats()
    assert list(generate_tokens(s, 10, stats)) == [5, 6]
    assert stats.finish_reason == "stop" and s.tokens[-2:] == [5, 6]


def test_stop_string_cuts_the_text(tiny_engine):
    s = tiny_engine.session(sampler=GREEDY)
    tk = tiny_engine.tokenizer
    script = iter(tk.encode("one two STOP three"))
    s.sampler = lambda logits: next(script)
    stats = Stats()
    text = generate(s, tk.encode("x"), max_tokens=50, stop=["STOP"], stats=stats)
    assert text == "one two " and stats.finish_reason == "stop"


def test_seeded_generation_is_reproducible(tiny_engine):
    prompt = tiny_engine.tokenizer.encode("the sea")

    def run(seed):
        s = tiny_engine.session(sampler=SamplerParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed))
        s.prefill(prompt)
        return list(generate_tokens(s, 30))

    assert run(123) == run(123)
    assert run(123) != run(124)


def test_generation_on_smollm2_answers(smollm2):
    s = smollm2.session(sampler=GREEDY)
    # a question SmolLM2 answers by a clear margin (test_cli)
    prompt = smollm2.chat_tokens([{"role": "user", "content": "What is the capital of France? Answer in English."}])
    assert "Paris" in generate(s, prompt, max_tokens=20)


def test_empty_session_cannot_sample(tiny_engine):
    from kvsession.errors import KvsessionError

    with pytest.raises(KvsessionError, match="empty"):
        tiny_engine.session().sample()


def test_rewind_keeps_a_prefix_and_valid_logits(tiny_engine):
    ids = tiny_engine.tokenizer.encode("the cat sat on the mat")
    full = tiny_engine.session()
    full.prefill(ids[:4])
    s = tiny_engine.session()
    s.prefill(ids)
    s.rewind(4)
    assert s.tokens == ids[:4]
    # the rows of positions 0..2 came from a prefill of all the ids (bfloat16 products) and those of `full` from
    # one of 4 tokens (float32 products, kernels.KERNEL_TOKENS): equal to that rounding, as chunked prefills are
    torch.testing.assert_close(s.logits, full.logits, rtol=1e-4, atol=2e-4)
