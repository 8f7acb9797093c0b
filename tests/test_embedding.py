"""Embeddings (kvsession.embedding): the outputs the head reads, pooled and normalized as llama.cpp does it.
The server's routes (`serve --embeddings`) are tested with llama-server's API in test_llama_server.py."""
from __future__ import annotations

import pytest
import torch

from kvsession.embedding import default_pooling, embedding_of, normalized
from kvsession.errors import InvalidArgument


@pytest.fixture(scope="module")
def tokens(tiny_engine):
    return tiny_engine.tokenizer.encode("an embedding of a short text, in a few chunks", add_bos=False)


def test_the_rows_are_what_the_head_reads(tiny_engine, tokens):
    rows = embedding_of(tiny_engine, tokens, "none")
    logits = tiny_engine.session(max_tokens=len(tokens) + 1).score(tokens)
    assert rows.shape == (len(tokens), tiny_engine.config.d_model)
    assert torch.allclose(tiny_engine.model.output(rows), logits, atol=1e-5)


def test_pooling_and_chunks(tiny_engine, tokens):
    rows = embedding_of(tiny_engine, tokens, "none")
    assert torch.allclose(embedding_of(tiny_engine, tokens, "none", chunk=3), rows, atol=1e-5)
    assert torch.allclose(embedding_of(tiny_engine, tokens, "mean", chunk=5), rows.mean(dim=0), atol=1e-5)
    assert torch.equal(embedding_of(tiny_engine, tokens, "cls"), rows[0])
    assert torch.allclose(embedding_of(tiny_engine, tokens, "last", chunk=7), rows[-1], atol=1e-5)
    with pytest.raises(InvalidArgument, match="pooling 'rank'"):
        embedding_of(tiny_engine, tokens, "rank")
    with pytest.raises(InvalidArgument, match="no tokens"):
        embedding_of(tiny_engine, [], "last")


def test_normalizations_as_llama_cpp_names_them():
    v = torch.tensor([3.0, -4.0, 0.0])
    assert torch.equal(normalized(v, -1), v)
    assert torch.allclose(normalized(v, 2), torch.tensor([0.6, -0.8, 0.0]))
    assert torch.allclose(normalized(v, 1), v / 7)
    assert torch.allclose(normalized(v, 0), v / 4 * 32760)
    assert torch.allclose(normalized(v, 3), v / (27 + 64) ** (1 / 3))
    assert torch.equal(normalized(torch.zeros(3), 2), torch.zeros(3))


def test_the_default_pooling_is_the_files_else_last(tiny_engine):
    assert default_pooling(tiny_engine.file) == "last"
