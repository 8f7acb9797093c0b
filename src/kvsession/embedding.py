"""Embeddings: an input's last-layer outputs after the final norm, pooled and normalized as llama.cpp does it
(its --pooling and embd_normalize), for `serve --embeddings`."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .errors import InvalidArgument

POOLINGS = ("none", "mean", "cls", "last")  # llama.cpp's --pooling choices (its "rank" needs a reranker's head)


def default_pooling(file) -> str:
    """The pooling a GGUF file names (`{arch}.pooling_type`, an embedding model's), else "last": a causal model's
    last token is the one that has read the whole input."""
    code = file.meta(f"{file.meta('general.architecture')}.pooling_type")
    return {0: "none", 1: "mean", 2: "cls", 3: "last"}.get(code, "last") if isinstance(code, int) else "last"


def embedding_of(engine, tokens: Sequence[int], pooling: str, chunk: int = 256,
                 on_pass: Callable[[int], None] | None = None) -> torch.Tensor:
    """The input's embedding as llama.cpp pools it: the last layer's outputs after the final norm, averaged
    ("mean"), the first's ("cls") or the last's ("last"), [d_model]; "none": every token's, [T, d_model]. A scratch
    session, a chunk of positions at a time (within a ring's margin); on_pass: told each pass's tokens."""
    if pooling not in POOLINGS:
        raise InvalidArgument(f"pooling {pooling!r}: one of {', '.join(POOLINGS)}")
    if not tokens:
        raise InvalidArgument("an embedding of no tokens")
    scratch = engine.session(max_tokens=len(tokens) + 1)
    chunk = min(chunk, scratch.ring_margin) if engine.config.ring_layers else chunk
    rows = []
    for i in range(0, len(tokens), chunk):
        rows.append(scratch.states(tokens[i : i + chunk]).float().cpu())
        if on_pass is not None:
            on_pass(len(rows[-1]))
    if pooling == "cls":
        return rows[0][0]
    if pooling == "last":
        return rows[-1][-1]
    h = torch.cat(rows)
    return h.mean(dim=0) if pooling == "mean" else h


def normalized(v: torch.Tensor, norm: int) -> torch.Tensor:
    """A pooled embedding normalized as llama.cpp's embd_normalize says: -1 not at all, 0 its largest magnitude to
    32760 (int16's range), 1 taxicab, 2 Euclidean (the default), p > 2 the p-norm."""
    if norm < 0:
        return v
    total = float(v.abs().max()) / 32760.0 if norm == 0 else float(v.abs().double().pow(norm).sum() ** (1.0 / norm))
    return v / total if total > 0 else v
