"""A Session: the one mutable timeline of a conversation.

It holds the exact token ids fed to the model, every layer's KV cache, the
logits that predict the next token, the sampler (with its generator state)
and free-form metadata (`meta`: a chat's messages, a title). CLI, chat and
server hand it tokens; only the session calls the model, and only the
session touches its caches.

Invariant: `tokens[i]` is stored at position i in every layer, and `logits`
is the model's output after the last token (None while the session is
empty).

Persistence. `save` writes the session file (session_file.py, framed by
framing.py) or, with `format="raw"`, the seed's headerless layout with a
JSON manifest beside it (raw_file.py). `Session.load` has the file checked
completely -- fingerprint field by field, sizes, every checksum -- into a
new session before returning it, and never runs the model: the stored
logits are the next step's. `load_layers` overwrites some layers of this
timeline from a partial file; `restore_rows` is how the store's chunks
become a timeline.

Marks. A recurrent layer's state cannot be cut back, so a hybrid's
session keeps a few copies of its states, with the logits, at points it may
come back to (`mark`: the server marks each prompt's end and each turn's
end, speculative decoding the point before a verifying pass): truncate,
cut_back, state and fork then go back to a mark exactly, nothing
recomputed. Any other model's rows truncate anywhere, and a mark keeps only
the logits there: the same prompt sent again samples from the logits its
prefill made, not from a step that recomputes its last token (which rounds
differently from a prefill). At most MAX_MARKS are kept, the earliest
dropped first; they count in memory_bytes.

Named sessions (NAME.kvs files in a folder, listed and deleted for the chat
and the server) are named.py's.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from . import kernels
from .errors import (
    ContextFull,
    InvalidArgument,
    KvsessionError,
    SessionMismatch,
    SessionSaveError,
)
from .files import framing, raw_file, session_file
from .files.fields import check_json
from .kv.cache import (
    GROW_ROWS,
    KV_DTYPES,
    RING_MARGIN,
    KVBoundsError,
    KVCache,
    LayerCache,
)
from .kv.rows import ROW_FORMATS
from .kv.state import LayerState, RecurrentState, SessionState, copy_meta
from .kv.transfer import check_transfer
from .model.cuda_graph import GraphDecoder
from .sampling import Sampler, SamplerParams
from .text.template import ChatPrompt

if TYPE_CHECKING:
    from .engine import Engine

DEFAULT_CHUNK = 512
MAX_MARKS = 8  # llama-server's --ctx-checkpoints default


class Session:
    def __init__(
        self,
        engine: "Engine",
        *,
        kv_dtype: str = "f16",
        max_tokens: int | None = None,
        sampler: SamplerParams | Sampler = SamplerParams(),
        initial_tokens: int = GROW_ROWS,
        ring_margin: int = RING_MARGIN,
    ):
        if kv_dtype not in KV_DTYPES:
            raise InvalidArgument(f"kv dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
        if kv_dtype == "q8_0" and (engine.device.type != "cpu"
                                   or not kernels.attends(KV_DTYPES[kv_dtype], engine.config.head_dim)):
            raise InvalidArgument(f"kv dtype q8_0 runs on the CPU's kernels, for heads of a multiple of 32 numbers "
                                  f"(this model's: {engine.config.head_dim}, device {engine.device.type}); "
                                  f"use f16 or bf16")
        self.engine = engine
        self.kv_dtype = kv_dtype
        self.max_tokens = _context(max_tokens, engine)
        self.cache = KVCache.for_model(
            engine.config, dtype=KV_DTYPES[kv_dtype], device=engine.device, max_tokens=self.max_tokens,
            initial_tokens=initial_tokens, ring_margin=ring_margin,
        )
        self.ring_margin = ring_margin
        self.tokens: list[int] = []
        self.logits: torch.Tensor | None = None  # [vocab] f32, predicts tokens[len(tokens)]
        self.sampler = sampler if isinstance(sampler, Sampler) else Sampler(sampler)
        self.meta: dict[str, Any] = {}  # JSON-able; saved with the session
        # after a context shift (shift()), the length of the prefix that is still what a prefill of its tokens
        # would hold; None: all of it is
        self.shifted: int | None = None
        self.marks: dict[int, torch.Tensor | None] = {}  # position -> the logits there (and a hybrid's states)
        self._decoder: GraphDecoder | None = None  # engine.graphs: built at the first decode step

    def __len__(self) -> int:
        return len(self.tokens)

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        chunk_size: int = DEFAULT_CHUNK,
        progress: Callable[[int, int], None] | None = None,
        stops: int = 0,
    ) -> None:
        """Append tokens, running them through the model `chunk_size` at a time. stops > 0: a chunk also ends
        at every position that is a multiple of it (a hybrid's snapshot frontiers: progress runs there, and a
        run restored from such a point computes what this one did from it)."""
        tokens = list(tokens)
        if not tokens:
            return
        if chunk_size < 1:
            raise InvalidArgument(f"chunk size must be >= 1, got {chunk_size}")
        if stops < 0:
            raise InvalidArgument(f"stops must be >= 0, got {stops}")
        if self.engine.config.ring_layers:
            chunk_size = min(chunk_size, self.ring_margin)
        self._room(len(tokens))
        i = 0
        while i < len(tokens):
            chunk = tokens[i : i + chunk_length(len(self.tokens), chunk_size, stops)]
            i += len(chunk)
            pos0 = len(self.tokens)
            if len(chunk) == 1 and self.engine.graphs:
                self.logits = self._graph_decoder().step(chunk[0], pos0)
            else:
                self.logits = self.engine.model.forward(chunk, range(pos0, pos0 + len(chunk)), self.cache)
            self.tokens.extend(chunk)
            if progress:
                progress(i, len(tokens))

    def score(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append tokens in one forward pass and return the logits after each of them, [T, vocab] f32 (what a
        perplexity or an agreement measure reads); the session's logits are the last row's."""
        logits = self._every_row(tokens, "score", hidden=False)
        self.logits = logits[-1]
        return logits

    def states(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append tokens in one forward pass and return each one's output of the last layer after the final norm,
        [T, d_model] f32 (what an embedding pools). No logits come of it: the session has none to sample from
        after (an embedding's input is never continued)."""
        h = self._every_row(tokens, "states", hidden=True)
        self.logits = None
        return h

    def _every_row(self, tokens: Sequence[int], what: str, *, hidden: bool) -> torch.Tensor:
        """Append tokens in one forward pass: every token's logits, or with hidden its output (score, states)."""
        tokens = list(tokens)
        if not tokens:
            raise InvalidArgument(f"{what}: no tokens")
        self._room(len(tokens))
        pos0 = len(self.tokens)
        out = self.engine.model.forward(tokens, range(pos0, pos0 + len(tokens)), self.cache, all_logits=not hidden,
                                        hidden=hidden)
        self.tokens.extend(tokens)
        return out

    def _room(self, n: int) -> None:
        """Refuse n more tokens past the context; reserve the rows of several at once."""
        if len(self.tokens) + n > self.max_tokens:
            raise ContextFull(f"{len(self.tokens)} + {n} tokens exceed this session's context of {self.max_tokens}")
        need = len(self.tokens) + n
        if n > 1 and any(need > layer.capacity for layer in self.cache.kv_layers if not layer.ring):
            # room for the prompt and a first stretch of decoding, allocated once (not grown and copied chunk by
            # chunk: the copies were most of SmolLM2's peak memory over its KV)
            for layer in self.cache.kv_layers:
                layer.reserve(min(self.max_tokens, need + GROW_ROWS))

    def _graph_decoder(self) -> GraphDecoder:
        if self._decoder is None or not self._decoder.fits():
            self._decoder = GraphDecoder(self.engine.model, self.cache, self.max_tokens)
        return self._decoder

    def append(self, token: int) -> None:
        self.prefill([token])

    def sample(self) -> int:
        if self.logits is None:
            raise KvsessionError("the session is empty: prefill a prompt before sampling")
        return self.sampler(self.logits)

    def truncate(self, n: int) -> None:
        """Drop every token from position n on; the logits are gone until the next prefill, unless n is a mark. A
        hybrid's recurrent state goes back only to 0 or a mark (KVBoundsError otherwise: see cut_back)."""
        if not 0 <= n <= len(self.tokens):
            raise InvalidArgument(f"truncate to {n}: the session holds {len(self.tokens)} tokens")
        if n == len(self.tokens):
            return
        self.cache.truncate(n)
        del self.tokens[n:]
        logits = self.marks.get(n)
        self.logits = logits.clone() if logits is not None else None
        self.marks = {p: x for p, x in self.marks.items() if p <= n}
        if self.shifted is not None and n <= self.shifted:
            self.shifted = None

    def shift(self, keep: int, discard: int) -> None:
        """A context shift, as llama-server's --context-shift makes one: forget tokens [keep, keep + discard); the
        later ones move down, their keys rotated to their new positions (Model.shift_keys), the logits kept. Not
        exact: what follows `keep` was computed with the dropped tokens in view, so from there the session is no
        longer what a prefill of its tokens would hold (`shifted` says where that ends)."""
        if self.engine.config.ring_layers:
            raise InvalidArgument("context shift: this model's sliding-window layers cannot shift")
        if self.engine.config.recurrent:  # a recurrent state holds every token it read: none can be dropped
            raise InvalidArgument("context shift: this model's recurrent layers cannot shift")
        if keep < 0 or discard <= 0 or keep + discard > len(self.tokens):
            raise InvalidArgument(f"context shift: keep {keep}, discard {discard} of {len(self.tokens)} tokens")
        self.engine.model.shift_keys(self.cache, keep, discard)
        del self.tokens[keep : keep + discard]
        self.marks = {p: x for p, x in self.marks.items() if p <= keep}  # the later ones' positions moved
        self.shifted = keep if self.shifted is None else min(self.shifted, keep)

    def rewind(self, n: int) -> None:
        """Keep only the first n tokens, with valid logits: one forward pass, for token n-1."""
        if n == len(self.tokens) and (self.logits is not None or n == 0):
            return
        last = self.tokens[n - 1] if 0 < n <= len(self.tokens) else None
        self.truncate(max(0, n - 1) if last is not None else n)
        if last is not None:
            self.append(last)

    def reuse_prefix(self, prompt: ChatPrompt) -> list[int]:
        """Make this session a prefix of `prompt` (a whole rendered conversation); return the tokens to prefill.

        When the prompt's text starts with the session's rendered text, every
        token is kept and only the rest is tokenized (ds4's text-prefix match:
        the session's exact tokens stay as they were generated, a U+FFFD of a
        character they cut included: the history is the session's own, as
        `run` and `chat` keep it, not a client's copy of it; the server's
        routes stop at one, see tokenizer.matching_text). Otherwise the
        session is cut back to the longest common token prefix with the
        prompt's tokens. Either way text a user typed never becomes control
        tokens (the prompt's literals). The tokens returned are never empty,
        unless the session is already exactly the prompt.
        """
        prefix = self.text
        if self.tokens and prompt.text.startswith(prefix):
            return prompt.tokens_from(self.engine.tokenizer, len(prefix))
        ids = prompt.tokens
        keep = common_prefix(ids, self.tokens)
        if keep == len(ids) and keep == len(self.tokens):
            return []
        keep = self.cut_back(min(keep, len(ids) - 1))  # at least one token to prefill, for fresh logits
        return ids[keep:]

    def cut_back(self, n: int) -> int:
        """Keep the first n tokens if the caches can go back that far, else the most they can (a hybrid's latest
        mark before n, or none); returns how many were kept.

        A ring that has wrapped past position n no longer holds the window
        before it (see LayerCache.check_truncate), nor does a recurrent
        layer hold its state at n (RecurrentCache.check_truncate) unless n
        is a mark: then the caller prefills from the point kept.
        """
        keep = self.reach(n)
        try:
            self.truncate(keep)
        except KVBoundsError:
            self.truncate(0)
            return 0
        return keep

    def reach(self, n: int) -> int:
        """The most of the first n tokens this session can go back to (holds): n itself, else a hybrid's latest
        mark before n, else 0."""
        return next((m for m in (n, *sorted((m for m in self.marks if m < n), reverse=True)) if self.holds(m)), 0)

    def mark(self) -> None:
        """Keep this point of the timeline -- its logits, and a hybrid's recurrent states -- to come back to
        (truncate, cut_back, state, fork) with nothing recomputed."""
        n = len(self.tokens)
        if n == 0 or n in self.marks:
            return
        self.cache.mark()
        self.marks[n] = self.logits.clone() if self.logits is not None else None
        while len(self.marks) > MAX_MARKS:
            self.unmark(min(self.marks))

    def unmark(self, n: int) -> None:
        self.cache.unmark(n)
        self.marks.pop(n, None)

    def fork(self, n: int | None = None) -> "Session":
        """A second timeline from here (or from its first n tokens, which it must hold), made from this one's
        state (state()): every full layer's rows, each ring's window, each recurrent layer's state, the logits,
        the sampler's exact state, a copy of meta. What either session does next leaves the other as it was (the
        server's n > 1 choices, a live session shared by another conversation)."""
        state = self.state(n)
        other = Session(self.engine, kv_dtype=self.kv_dtype, max_tokens=self.max_tokens,
                        initial_tokens=min(self.max_tokens, len(self.tokens) + GROW_ROWS),
                        ring_margin=self.ring_margin)
        for src, dst in zip(state.layers, other.state().layers):
            dst.cache.write_rows(src.start, *src.read())
        other.adopt(state)
        if n is not None and n < len(self.tokens) and self.marks.get(n) is not None:
            other.logits = self.marks[n].clone()
        # after a context shift only its first `shifted` tokens are exact: all of a fork that ends before
        other.shifted = None if n is not None and self.shifted is not None and n <= self.shifted else self.shifted
        return other

    # --- state: what files, the store and forks read and write -------------------

    def state(self, n: int | None = None, *, layers: Sequence[int] | None = None) -> SessionState:
        """This session at its first n tokens (all by default) as one snapshot (kv/state.py): the tokens, the
        logits when n is the whole timeline, the sampler, a copy of meta, the model's identity, what each
        attention layer (or each of `layers`) keeps at n -- a full layer's positions [0, n), a ring's last window
        before n, which it must still hold -- and each recurrent layer's state (a hybrid's), which exists at the
        timeline's end and at its marks (holds(n) says whether a state at n can be made)."""
        n = len(self.tokens) if n is None else n
        if not 0 <= n <= len(self.tokens):
            raise InvalidArgument(f"a state of {n} tokens: the session holds {len(self.tokens)}")
        indices = list(range(len(self.cache))) if layers is None else sorted(set(layers))
        for i in indices:
            if not 0 <= i < len(self.cache):
                raise InvalidArgument(f"layer {i}: the model has {len(self.cache)} layers")
        if not self.holds(n):
            raise KVBoundsError(f"a state of {n} tokens of {len(self.tokens)}: a sliding layer no longer holds its "
                                "window there, or a recurrent layer's state is past it")
        whole = n == len(self.tokens)
        e, cache = self.engine, self.cache
        layer_states, recurrent = [], []
        for i in indices:
            layer = cache[i]
            if isinstance(layer, LayerCache):
                start = (layer.persist_start if whole else max(0, n - layer.window)) if layer.ring else 0
                layer_states.append(LayerState(i, layer.kind, layer.window, start, n - start, layer))
            state = cache.states[i]
            if state is not None and state.arrays:
                recurrent.append(RecurrentState(i, state.kind, state.read_state(n)))
        logits = self.logits_array().copy() if whole else np.zeros(0, dtype="<f4")
        return SessionState(
            tokens=list(self.tokens[:n]), logits=logits, sampler=self.sampler.state(), meta=copy_meta(self.meta),
            kv_dtype=self.kv_dtype, row_shape=[e.config.n_kv_heads, e.config.head_dim],
            vocab_size=e.config.vocab_size, n_layers=len(cache), model_file=e.path.name,
            fingerprint=e.fingerprint.to_dict(), device=e.device, dtype=KV_DTYPES[self.kv_dtype],
            layers=layer_states, recurrent=recurrent, decode=e.tokenizer.decode,
            partial=layers is not None and indices != list(range(len(cache))))

    def holds(self, n: int) -> bool:
        """Whether a state at n tokens can be made: every sliding layer still holds the window before n, and a
        recurrent layer's state is at n (the timeline's end, or a mark)."""
        return (all(layer.start <= max(0, n - layer.window) for layer in self.cache.kv_layers if layer.ring)
                and (n == len(self.tokens) or not self.cache.recurrent or n in self.marks))

    def adopt(self, state: SessionState) -> None:
        """Become the timeline of a state whose rows were written into this session's layers (a load, a fork):
        its recurrent layers' states, tokens, logits, sampler and meta."""
        for r in state.recurrent:
            self.cache.states[r.index].write_state(r.arrays, state.n_tokens)
        self.tokens = list(state.tokens)
        self.marks = {}  # the recurrent layers' went with write_state
        self.logits = self._on_device(torch.from_numpy(state.logits.copy()) if state.has_logits else None)
        self.sampler = Sampler.from_state(state.sampler)
        self.meta = copy_meta(state.meta)

    def _on_device(self, logits: torch.Tensor | None) -> torch.Tensor | None:
        """Logits read from a file or a store, where the model's own are (a GPU's): the sampler and a batched
        step stack them with the live sessions'."""
        return logits.to(self.engine.device) if logits is not None else None

    @property
    def text(self) -> str:
        """The rendered prefix: every token as text, control tokens included."""
        return self.engine.tokenizer.decode(self.tokens)

    # --- files -------------------------------------------------------------------

    def save(self, path: str | os.PathLike, *, layers: Sequence[int] | None = None, durable: bool = True,
             format: str = "kvs", row_format: str = "exact", transfer: str = "auto",
             progress: Callable[[int, int], None] | None = None) -> "SaveInfo":
        """Write the session to `path` (crash-safe; fsynced when durable).

        layers: save only these layers (a partial file, for load_layers);
        format: "kvs" (the session file) or "raw" (blobs plus `path.json`);
        row_format: "exact" (the cache's dtype, bit for bit) or "q8" (8-bit blocks: about half the bytes
        of f16; a loaded session then continues almost, not exactly, as this one would; kvs only);
        transfer: how rows leave the device (transfer.TRANSFERS; the file is the same byte for byte);
        progress(done, total): bytes written, after each section.
        """
        t0 = time.perf_counter()
        path = Path(path)
        state = self.state(layers=layers)
        if format not in ("kvs", "raw"):
            raise InvalidArgument(f"format {format!r}: choose kvs or raw")
        if row_format not in ROW_FORMATS or (format == "raw" and row_format != "exact"):
            raise InvalidArgument(f"row format {row_format!r}: choose {' or '.join(ROW_FORMATS)} (raw files: exact)")
        for target in (path, raw_file.manifest_path(path)) if format == "raw" else (path,):
            framing.check_target(target)
        check_transfer(transfer)
        self.check_meta(str(path))
        fields = session_file.describe(state, row_format)
        try:
            if format == "kvs":
                nbytes = session_file.write(state, path, fields, row_format=row_format, transfer=transfer,
                                            durable=durable, progress=progress)
            else:
                nbytes = raw_file.write(state, path, fields, durable=durable)
        except OSError as e:  # the temporary file is gone and the old file untouched (framing.atomic_write)
            raise SessionSaveError(f"{path}: cannot save: {e.strerror or e}") from None
        return SaveInfo(nbytes, time.perf_counter() - t0)

    def check_meta(self, where: str, error: type[KvsessionError] = SessionSaveError) -> None:
        """Refuse to write a `meta` that no reader would accept (session_file.META_FIELDS): a file must load again."""
        check_json(self.meta, session_file.META_FIELDS, where, field="meta", what="session", error=error)

    def logits_array(self) -> np.ndarray:
        if self.logits is None:
            return np.zeros(0, dtype="<f4")
        return self.logits.detach().float().cpu().numpy().astype("<f4", copy=False)

    @classmethod
    def load(cls, path: str | os.PathLike, engine: "Engine", *, kv_dtype: str | None = None,
             max_tokens: int | None = None, ring_margin: int = RING_MARGIN, transfer: str = "auto",
             progress: Callable[[int, int], None] | None = None) -> "Session":
        """A new session from a file, checked completely first; runs no forward pass.

        Rings are allocated with `ring_margin` rows beyond their window, whatever
        the ring the file was saved from: files keep only the window.
        transfer: how rows reach the device (transfer.TRANSFERS);
        progress(done, total): layers read, after each one.
        """
        check_transfer(transfer)
        path = Path(path)
        max_tokens = _context(max_tokens, engine)
        if raw_file.is_raw(path):
            raw = raw_file.read(path, engine, kv_dtype)
            session = cls._empty_like(raw.fields, engine, max_tokens, ring_margin)
            raw.fill(session.state())
            session._finish_load(raw.tokens, raw.logits, raw.fields, raw.states())
            return session
        with session_file.open_checked(path, engine, kv_dtype) as file:
            fields = file.fields
            if fields["partial"]:
                raise SessionMismatch("partial", "layers " + str([d["index"] for d in fields["layers"]]), "a full "
                                      "session", "load a partial file into a session holding its tokens with "
                                      "session.load_layers(path)")
            session = cls._empty_like(fields, engine, max_tokens, ring_margin)
            tokens = file.tokens()
            logits = file.logits()
            file.fill(session.state(), transfer, progress)
            states = file.states(session._host_states())
        session._finish_load(tokens, logits, fields, states)
        return session

    @classmethod
    def _empty_like(cls, fields: dict, engine: "Engine", max_tokens: int, ring_margin: int) -> "Session":
        """A session to load `fields` into; a file longer than the context is refused before anything is allocated."""
        n = fields["n_tokens"]
        if n > max_tokens:
            raise SessionMismatch("n_tokens", n, f"a context of {max_tokens}", "raise max_tokens")
        return cls(engine, kv_dtype=fields["kv_dtype"], max_tokens=max_tokens,
                   initial_tokens=min(max_tokens, n + GROW_ROWS), ring_margin=ring_margin)

    def _host_states(self) -> dict[int, dict[str, np.ndarray]]:
        """The recurrent states' arrays where a file can read straight into them (the CPU's), by layer."""
        return {i: {name: t.numpy() for name, t in st.arrays.items()} for i, st in enumerate(self.cache.states)
                if st is not None and st.arrays and st.conv.device.type == "cpu"}

    def _finish_load(self, tokens: list[int], logits: torch.Tensor | None, fields: dict,
                     states: dict[int, dict[str, np.ndarray]]) -> None:
        for i, st in enumerate(self.cache.states):
            if st is not None:  # a recurrent layer's state after the last token (none of its own: an "mlp" layer)
                st.write_state(states.get(i, {}), len(tokens))
        self.tokens = tokens
        self.logits = self._on_device(logits)
        self.sampler = Sampler.from_state(fields["sampler"])
        self.meta = fields["meta"]

    def restore_rows(self, tokens: Sequence[int], rows: dict[int, list], logits: torch.Tensor | None, *,
                     keep: int, filled: dict[int, list] | None = None,
                     states: dict[int, dict[str, np.ndarray]] | None = None) -> None:
        """Become the timeline `tokens`, keeping rows [0, keep) of the full layers and writing `rows`.

        rows: {layer: [(start, k, v), ...]} host arrays in logical order,
        already checked (the store verifies before it calls this); filled:
        {layer: [(start, count), ...]} rows the store read in place past the
        layer's end (LayerCache.free_rows), made live here; states: {layer:
        arrays} every recurrent layer's state after the last token (a
        hybrid's; RecurrentCache.read_state's). Rings are refilled from
        scratch. Without logits the next call must prefill.
        """
        n = len(tokens)
        filled = filled or {}
        states = states or {}
        missing = [i for i, st in enumerate(self.cache.states) if st is not None and st.arrays and i not in states]
        if missing:
            raise KvsessionError(f"restore of {n} tokens without the state of recurrent layers {missing}")
        for i, layer in enumerate(self.cache):
            if not isinstance(layer, LayerCache):
                continue
            if layer.ring:
                layer.reset()
            else:
                layer.truncate(min(keep, layer.end))
                if layer.capacity < n:
                    layer.reserve(n + GROW_ROWS)
            spans = [(start, k, v) for start, k, v in rows.get(i, [])] + [(s, None, c) for s, c in filled.get(i, [])]
            for start, k, v in sorted(spans, key=lambda r: r[0]):
                if k is None:
                    layer.adopt_rows(start, v)
                else:
                    layer.write_rows(start, k, v)
            if layer.end != n:
                raise KvsessionError(f"restore left layer {i} at {layer.end} rows of {n}")
        for i, st in enumerate(self.cache.states):
            if st is not None:
                st.write_state(states.get(i, {}), n)
        self.tokens = list(tokens)
        self.marks = {}
        self.logits = self._on_device(logits)

    def reserve(self, n_tokens: int) -> None:
        """Room for n_tokens in every layer, allocated now: growing moves a layer's rows, so a restore that reads
        rows in place past the end (the store's) reserves before it reads any."""
        for layer in self.cache.kv_layers:
            if layer.capacity < n_tokens:
                layer.reserve(n_tokens + GROW_ROWS)

    def prefault(self, n_tokens: int, layers: Sequence[int] | None = None) -> None:
        """Room for n_tokens in every layer (or in `layers`), its memory touched now rather than by the first
        restore or prefill that needs it (LayerCache.prefault): for a server at start-up."""
        for i in range(len(self.cache)) if layers is None else layers:
            if isinstance(self.cache[i], LayerCache):
                self.cache[i].prefault(min(n_tokens, self.max_tokens))

    def limit_context(self, n_tokens: int) -> None:
        """This session's context from now on: at least its tokens; the full layers grow no further."""
        if n_tokens < len(self.tokens):
            raise InvalidArgument(f"a context of {n_tokens}: the session holds {len(self.tokens)} tokens")
        self.max_tokens = n_tokens
        for layer in self.cache.kv_layers:
            if not layer.ring:
                layer.max_capacity = n_tokens

    @property
    def n_layers(self) -> int:
        return len(self.cache)

    @property
    def memory_bytes(self) -> int:
        """What the session's caches hold in memory: every layer's K and V at their capacity, and a hybrid's
        recurrent states, and the marks."""
        return sum(layer.memory_bytes for layer in self.cache) + sum(
            s.memory_bytes for s in self.cache.states if s is not None and s not in self.cache.layers) + sum(
            s.marks_bytes for s in self.cache.recurrent_states) + sum(
            x.numel() * x.element_size() for x in self.marks.values() if x is not None)

    @property
    def kv_bytes(self) -> int:
        """The bytes of the K and V rows (and recurrent states) a session file of it keeps."""
        return sum(layer.row_nbytes * 2 * (layer.end - layer.persist_start) for layer in self.cache.kv_layers) + sum(
            s.memory_bytes for s in self.cache.states if s is not None)

    def load_layers(self, path: str | os.PathLike) -> list[int]:
        """Overwrite some layers from a partial file saved from this timeline; returns the layers.

        The file's tokens must be a prefix of this session's tokens. Every
        section is read and checked before any row is written.
        """
        with session_file.open_checked(Path(path), self.engine, self.kv_dtype) as file:
            fields = file.fields
            if not fields["partial"]:
                raise SessionMismatch("partial", "a full session", "a partial file",
                                      "load a full file with Session.load(path, engine)")
            if fields["n_tokens"] > len(self.tokens):
                raise SessionMismatch("n_tokens", fields["n_tokens"], len(self.tokens), "the session holds fewer tokens")
            tokens = file.tokens()
            i = common_prefix(tokens, self.tokens)
            if i < len(tokens):
                raise SessionMismatch(f"token {i}", tokens[i], self.tokens[i], "the file is from another timeline")
            staged = file.read_layers(self.state())
            states = file.states()
            if states and fields["n_tokens"] != len(self.tokens):
                raise SessionMismatch("n_tokens", fields["n_tokens"], len(self.tokens), "a recurrent layer's state "
                                      "is only good at the end of the timeline it was saved from")
        for d, k, v in staged:
            self.cache[d["index"]].write_rows(d["start"], k, v)
        for i, arrays in states.items():
            self.cache.states[i].write_state(arrays, len(self.tokens))
        return [d["index"] for d in fields["layers"]] + sorted(states)


@dataclass(frozen=True)
class SaveInfo:
    bytes: int
    seconds: float


def advance(feeds: Sequence[tuple["Session", Sequence[int]]], keep: Sequence[bool] | None = None
            ) -> list[torch.Tensor]:
    """Several sessions of one engine each take their tokens, in one pass through the model (Model.forward_many:
    each weight read once for all of them). A session alone goes through `prefill` (its graph decoder where
    the engine has one). Returns each session's logits: [vocab] after its last token, or [T, vocab] after each
    token where keep says so (verifying a speculative draft). A failure (a full context) leaves every session
    as it was."""
    keep = list(keep) if keep is not None else [False] * len(feeds)
    if len(feeds) == 1 and not keep[0]:
        s, tokens = feeds[0]
        s.prefill(tokens)
        return [s.logits]
    engine = feeds[0][0].engine
    for s, tokens in feeds:
        if s.engine is not engine or not tokens:
            raise InvalidArgument("advance: the sessions of one engine, each with tokens")
        s._room(len(tokens))
    out = engine.model.forward_many([(list(t), range(len(s), len(s) + len(t)), s.cache) for s, t in feeds], keep)
    for (s, tokens), logits, k in zip(feeds, out, keep):
        s.tokens.extend(tokens)
        s.logits = logits[-1] if k else logits
    return out


def chunk_length(held: int, size: int, stops: int) -> int:
    """Tokens of the next prefill chunk after `held` positions: `size`, ended early at the next multiple of
    `stops` (0: none) -- a hybrid's snapshot frontiers, where a restored run and an uninterrupted one cut alike."""
    return min(size, stops - held % stops) if stops else size


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _context(max_tokens: int | None, engine: "Engine") -> int:
    """A session's context in tokens: the model's when None, else a whole number >= 1."""
    if max_tokens is None:
        return engine.config.context_length
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidArgument(f"max_tokens must be a whole number >= 1 (or None: the model's context of "
                              f"{engine.config.context_length}), got {max_tokens!r}")
    return max_tokens
