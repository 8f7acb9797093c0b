"""Tokenizer and chat template on the tiny vocabulary (SmolLM2's ids are in test_agreement)."""
from __future__ import annotations

import json

import pytest
from conftest import VECTORS
from tiny import TINY_PRE_TOKENIZER_SPECS, TinySpec

from kvsession.errors import TemplateError
from kvsession.model.gguf import GGUFFile
from kvsession.text.template import ChatTemplate
from kvsession.text.tokenizer import Tokenizer

SPLITS = json.loads((VECTORS / "tiny.json").read_text())["pre_tokenizers"]

TEXTS = ["hello there", "the cat sat on the mat", "  spaces\t\ttabs\n\nnewlines ", "Café 日本 😀 👨‍👩‍👧", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tiny_engine, text):
    tk = tiny_engine.tokenizer
    assert tk.decode(tk.encode(text)) == text


def test_merges_apply(tiny_engine):
    tk = tiny_engine.tokenizer
    ids = tk.encode(" the")
    assert [tk.tokens[i] for i in ids] == ["Ġthe"]


def test_control_tokens_are_parsed_and_found_as_eog(tiny_engine):
    tk = tiny_engine.tokenizer
    ids = tk.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tk.tokens.index("<|im_start|>") and ids[-1] == tk.tokens.index("<|im_end|>")
    assert tk.tokens.index("<|im_end|>") in tk.eog_ids
    assert tk.tokens.index("<|endoftext|>") in tk.eog_ids
    assert tk.decode(ids, skip_special=True) == "user\nhi"


def test_stream_never_splits_utf8(tiny_engine):
    tk = tiny_engine.tokenizer
    text = "a😀b日本語é👨‍👩‍👧"
    ids = tk.encode(text)
    assert len(ids) > len(text)  # multi-byte characters really are split across byte tokens
    stream = tk.stream()
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) == text
    for p in pieces:
        p.encode("utf-8")  # every delta is whole characters (a lone surrogate or U+FFFD would show here)
        assert "\ufffd" not in p


def test_template_renders_chatml(tiny_engine):
    text = tiny_engine.template.render([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_template_rejects_bad_messages():
    t = ChatTemplate(None)
    with pytest.raises(TemplateError, match="message 0"):
        t.render([{"role": "wizard", "content": "x"}])
    with pytest.raises(TemplateError, match="message 1"):
        t.render([{"role": "user", "content": "x"}, {"role": "user"}])


def test_template_raise_exception_and_bad_source():
    t = ChatTemplate("{{ raise_exception('only user turns') }}")
    with pytest.raises(TemplateError, match="only user turns"):
        t.render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_smollm2_chat_tokens(smollm2):
    ids = smollm2.chat_tokens([{"role": "user", "content": "Hi"}])
    text = smollm2.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert smollm2.tokenizer.add_bos is False and ids[0] == smollm2.tokenizer.tokens.index("<|im_start|>")


def test_special_false_reads_control_text_as_text(tiny_engine):
    tk = tiny_engine.tokenizer
    text = "hi<|im_end|>there"
    assert tk.tokens.index("<|im_end|>") in tk.encode(text)
    plain = tk.encode(text, special=False)
    assert not set(plain) & tk.control and tk.decode(plain) == text


def test_encode_guarded_only_inside_the_spans(tiny_engine):
    tk = tiny_engine.tokenizer
    text = "<|im_start|>user\nx<|im_end|>y<|im_end|>\n"
    typed = (text.index("x") + 1, text.index("y"))  # the first <|im_end|> was typed by a user
    ids = tk.encode_guarded(text, [typed])
    im_start, im_end = tk.tokens.index("<|im_start|>"), tk.tokens.index("<|im_end|>")
    assert [t for t in ids if t in tk.control] == [im_start, im_end]
    assert tk.decode(ids) == text
    assert tk.encode_guarded(text, []) == tk.encode(text)
    assert tk.encode_guarded(text, [(0, 5)]) == tk.encode(text)  # no whole control text inside: as encode


def test_token_bytes(tiny_engine, smollm2):
    for tk in (tiny_engine.tokenizer, smollm2.tokenizer):
        text = "héllo wörld 日本 😀\n\t x"
        assert b"".join(tk.token_bytes[i] for i in tk.encode(text, add_bos=False)) == text.encode()
        assert all(tk.token_bytes[i] == b"" for i in tk.control)


def test_sentencepiece_merges_are_cached_and_a_bad_cache_is_rebuilt(tmp_path, monkeypatch):
    """The merges derived from a SentencePiece vocabulary are cached by a digest of tokens and scores; a cache
    file that is damaged or names ids outside the vocabulary is derived again, with the same result."""
    import numpy as np

    from kvsession.text import tokenizer

    monkeypatch.setenv("KVSESSION_CACHE_DIR", str(tmp_path))
    tokens = ["a", "b", "c", "ab", "bc", "abc", "ca"]
    scores = [-1.0, -1.0, -1.0, -0.5, -0.7, -0.2, -3.0]
    vocab = {t: i for i, t in enumerate(tokens)}
    first = tokenizer._sentencepiece_merges(tokens, scores, vocab)
    # best first: abc = ab+c and a+bc (score -0.2), then ab = a+b (-0.5), bc = b+c (-0.7), ca = c+a (-3.0)
    assert first.tolist() == [[0, 4], [3, 2], [0, 1], [1, 2], [2, 0]]
    (cached,) = (tmp_path / "merges").iterdir()
    assert np.load(cached).tolist() == first.tolist()
    assert tokenizer._sentencepiece_merges(tokens, scores, vocab).tolist() == first.tolist()
    for damage in (b"not a numpy file", None):
        if damage is None:
            np.save(cached, np.array([[0, 99]], dtype=np.int32))  # an id outside the vocabulary
        else:
            cached.write_bytes(damage)
        assert tokenizer._sentencepiece_merges(tokens, scores, vocab).tolist() == first.tolist()
    other = tokenizer._sentencepiece_merges(tokens, [-1.0] * 7, vocab)  # other scores: another cache entry
    assert len(list((tmp_path / "merges").iterdir())) == 2 and other.tolist() != first.tolist()


def test_agreeing_prefix_keeps_sampled_ids_as_far_as_their_text_agrees(tiny_engine):
    tk = tiny_engine.tokenizer
    text = "a the b the c"
    canonical = tk.encode(text, add_bos=False)
    sampled = [b for ch in text for b in tk.encode(ch, add_bos=False)]  # " the" byte by byte, not the merge
    assert sampled != canonical and tk.decode(sampled) == text
    ids = next(i for i, (x, y) in enumerate(zip(sampled, canonical)) if x != y)
    # the text agrees up to "the c" -> "the d": every sampled id before the last character's
    n, chars = tk.agreeing_prefix(sampled, "a the b the d", at_least=ids)
    assert (n, chars) == (len(sampled) - 1, len(text) - 1)
    assert tk.agreeing_prefix(sampled, text + " and more") == (len(sampled), len(text))
    assert tk.agreeing_prefix(sampled, "z") == (0, 0)
    # a character of several bytes is never split: ids inside it do not count
    word = "aé"
    split = [b for ch in word.encode() for b in [ch]]  # one byte token per byte
    assert tk.decode(split) == word
    assert tk.agreeing_prefix(split, "aèx") == (1, 1)


@pytest.mark.parametrize("pre", sorted(SPLITS))
def test_pre_tokenizers_split_as_llama_cpp_does(tiny_factory, pre):
    tk = Tokenizer(GGUFFile(tiny_factory(TINY_PRE_TOKENIZER_SPECS[pre])))
    for case in SPLITS[pre]:
        assert tk.encode(case["text"]) == case["ids"], case["text"]


def test_harmony_markers_are_rendered_and_end_ends_a_message_not_the_reply(tiny_factory):
    # as llama.cpp's vocabulary does for gpt-oss: the markers reach the reply's text (its parser reads them), and
    # with <|return|> and <|call|> in the vocabulary <|end|> closes one message of several
    harmony = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>")
    tk = Tokenizer(GGUFFile(tiny_factory(TinySpec(specials=harmony))))
    ids = {t: tk.tokens.index(t) for t in harmony}
    text = "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>hi"
    assert tk.decode(tk.encode(text), skip_special=True) == text
    stream = tk.stream()
    assert "".join(stream.step(i) for i in tk.encode(text)) + stream.finish() == text
    assert {ids["<|return|>"], ids["<|call|>"]} <= tk.eog_ids and ids["<|end|>"] not in tk.eog_ids
    plain = Tokenizer(GGUFFile(tiny_factory(TinySpec(specials=("<|end|>",)))))  # no harmony: <|end|> ends a reply
    assert plain.tokens.index("<|end|>") in plain.eog_ids
