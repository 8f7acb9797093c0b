"""A Session: the one mutable timeline of a conversation.

It holds the exact token ids fed to the model, every layer's KV cache, the
logits that predict the next token, and the sampler (with its generator
state). CLI, chat and server hand it tokens; only the session calls the
model, and only the session touches its caches.

Invariant: `tokens[i]` is stored at position i in every layer, and `logits`
is the model's output after the last token (None while the session is
empty).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

from .errors import ContextFull, KvsessionError
from .kv import KV_DTYPES, KVCache
from .sampling import Sampler, SamplerParams

if TYPE_CHECKING:
    from .engine import Engine

DEFAULT_CHUNK = 512


class Session:
    def __init__(
        self,
        engine: "Engine",
        *,
        kv_dtype: str = "f16",
        max_tokens: int | None = None,
        sampler: SamplerParams | Sampler = SamplerParams(),
    ):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
        self.engine = engine
        self.kv_dtype = kv_dtype
        self.max_tokens = max_tokens or engine.config.context_length
        self.cache = KVCache.for_model(
            engine.config, dtype=KV_DTYPES[kv_dtype], device=engine.device, max_tokens=self.max_tokens
        )
        self.tokens: list[int] = []
        self.logits: torch.Tensor | None = None  # [vocab] f32, predicts tokens[len(tokens)]
        self.sampler = sampler if isinstance(sampler, Sampler) else Sampler(sampler)

    def __len__(self) -> int:
        return len(self.tokens)

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        chunk_size: int = DEFAULT_CHUNK,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """Append tokens, running them through the model `chunk_size` at a time."""
        tokens = list(tokens)
        if not tokens:
            return
        if chunk_size < 1:
            raise ValueError(f"chunk size must be >= 1, got {chunk_size}")
        if len(self.tokens) + len(tokens) > self.max_tokens:
            raise ContextFull(
                f"{len(self.tokens)} + {len(tokens)} tokens exceed this session's context of {self.max_tokens}"
            )
        done = 0
        for i in range(0, len(tokens), chunk_size):
            chunk = tokens[i : i + chunk_size]
            pos0 = len(self.tokens)
            self.logits = self.engine.model.forward(chunk, range(pos0, pos0 + len(chunk)), self.cache)
            self.tokens.extend(chunk)
            done += len(chunk)
            if progress:
                progress(done, len(tokens))

    def append(self, token: int) -> None:
        self.prefill([token])

    def sample(self) -> int:
        if self.logits is None:
            raise KvsessionError("the session is empty: prefill a prompt before sampling")
        return self.sampler(self.logits)

    def rewind(self, n: int) -> None:
        """Keep only the first n tokens (0 < n <= len); costs one forward pass for the logits."""
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"rewind to {n}: the session holds {len(self.tokens)} tokens")
        if n == len(self.tokens):
            return
        last = self.tokens[n - 1] if n else None
        self.cache.truncate(max(0, n - 1))
        del self.tokens[max(0, n - 1) :]
        self.logits = None
        if last is not None:
            self.append(last)
