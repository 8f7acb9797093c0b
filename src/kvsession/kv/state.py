"""A session's state as one snapshot: what the session files, the raw export, the disk cache and forks read
and write, instead of reaching into a Session.

A Session produces it (`Session.state(n)`): the first n token ids, the logits
after them (when n is the whole timeline), the sampler's exact state, `meta`,
the KV dtype and row shape, the model's file name and fingerprint, and one
LayerState per layer saying which rows that layer keeps -- every position of
a full layer, the last `window` of a ring -- over the layer's cache. The
metadata is copied when the state is made; the rows are read from where they
lie only when a writer asks for them (a session file streams them off the
device layer by layer; the store copies the chunks it does not hold yet), so
a state of a 30,000-token session costs nothing until it is written.

A Session consumes one the same way (`Session.load`, `Session.fork`, the
store's restore): the file or the store fills the LayerStates of a session
that nobody reads yet, then the session adopts tokens, logits and sampler.

The rows are the kv layer's own primitives (cache.py: read_rows, row_runs,
host_rows, write_rows, fill_rows and the in-place restore), so no module
above kv/ needs a Session's caches, and none touches a Session's fields.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .cache import LayerCache


@dataclass(frozen=True)
class LayerState:
    """One layer of a snapshot: positions [start, start + rows) of `cache`, in logical order."""

    index: int
    kind: str  # "full" | "sliding"
    window: int  # 0 for a full layer
    start: int  # the first position this layer keeps
    rows: int
    cache: LayerCache = field(repr=False, compare=False)

    @property
    def ring(self) -> bool:
        return self.cache.ring

    @property
    def end(self) -> int:
        return self.start + self.rows

    def describe(self) -> dict:
        """The layer's entry in a session file's header and a raw manifest."""
        return {"index": self.index, "kind": self.kind, "window": self.window, "start": self.start,
                "rows": self.rows}

    def runs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The kept rows as runs of the cache's own rows, on its device (for transfer.Downloads)."""
        return self.cache.row_runs(self.start, self.rows)

    def read(self, start: int | None = None, count: int | None = None, *, copy: bool = False
             ) -> tuple[np.ndarray, np.ndarray]:
        """Host arrays [n, H, D] of positions [start, start + count) (default: the kept rows): views of a CPU
        cache unless `copy` (rows another thread writes out later must not change with the session)."""
        start = self.start if start is None else start
        count = self.end - start if count is None else count
        k, v = self.cache.read_rows(start, count)
        if copy and self.cache.k.device.type == "cpu":
            return np.array(k, copy=True), np.array(v, copy=True)
        return k, v


@dataclass(frozen=True)
class SessionState:
    """A session at n tokens (see the module's docstring). Fields are the session's at the time it was made."""

    tokens: list[int]  # [n]
    logits: np.ndarray  # f32 [vocab] after tokens[-1], or [0] (none: a prefix, or an empty session)
    sampler: dict  # Sampler.state(): params and the generator's exact state
    meta: dict  # JSON-able; a deep copy
    kv_dtype: str  # "f32" | "f16" | "bf16"
    row_shape: list[int]  # [n_kv_heads, head_dim]
    vocab_size: int
    n_layers: int  # the model's; `layers` may hold fewer (a partial file)
    model_file: str  # the GGUF file's name
    fingerprint: dict  # Fingerprint.to_dict()
    device: torch.device
    dtype: torch.dtype  # the cache's
    layers: list[LayerState]
    decode: Callable[[list[int]], str] = field(repr=False, compare=False)  # the tokenizer's, for `text`
    _texts: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def has_logits(self) -> bool:
        return self.logits.size > 0

    @property
    def partial(self) -> bool:
        return len(self.layers) != self.n_layers

    def text(self, n: int | None = None) -> str:
        """The rendered text of the first n tokens (all by default), control tokens included; decoded once."""
        n = self.n_tokens if n is None else n
        if n not in self._texts:
            self._texts[n] = self.decode(self.tokens[:n])
        return self._texts[n]


def copy_meta(meta: dict) -> dict:
    """A deep copy of JSON-able metadata: what a snapshot keeps, so later edits of the session's do not show."""
    return json.loads(json.dumps(meta))
