"""The text every benchmark reads: the bundled corpus (license texts, the same text PEERS.md measured
llama.cpp on), and the first n tokens of it."""
from __future__ import annotations

from pathlib import Path

from ..engine import Engine
from ..errors import KvsessionError

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


def corpus_tokens(engine: Engine, n: int | None) -> list[int]:
    """The first n tokens of the corpus (None: all of them)."""
    ids = engine.tokenizer.encode(CORPUS.read_text(encoding="utf-8"), add_bos=False)
    if n is None:
        return ids
    if len(ids) < n:
        raise KvsessionError(f"the bench corpus has {len(ids)} tokens, {n} requested")
    return ids[:n]
