"""A Session: the one mutable timeline of a conversation, and its files.

It holds the exact token ids fed to the model, every layer's KV cache, the
logits that predict the next token, the sampler (with its generator state)
and free-form metadata (`meta`: a chat's messages, a title). CLI, chat and
server hand it tokens; only the session calls the model, and only the
session touches its caches.

Invariant: `tokens[i]` is stored at position i in every layer, and `logits`
is the model's output after the last token (None while the session is
empty).

Persistence. `save` writes the session file DESIGN.md describes (framing in
fileformat.py): a header with the model fingerprint, the KV dtype, each
layer's kind, window and live rows, the sampler state and `meta`; then the
sections tokens, logits, text (the rendered prefix) and one per layer (its
K rows, then its V rows, in logical order). `Session.load` reads and checks
all of it -- fingerprint field by field, sizes, every checksum -- into a new
session before returning it, and never runs the model: the stored logits
are the next step's. `format="raw"` writes the seed's headerless layout (the
layer blobs back to back) with a JSON manifest beside it.

A file is hostile input until checked: `check_session_header` type-checks
every header field and the section sizes they imply, with no model at hand
(inspect uses it too); `_check_against_model` then compares it with the
model, and the context bounds n_tokens, all before any allocation.

Named sessions live as NAME.kvs in a folder; `list_saved` and
`delete_saved` are the one listing and the one deletion of such a folder,
shared by the chat and the server.
"""
from __future__ import annotations

import base64
import json
import os
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterator, Sequence

import numpy as np
import torch

from . import fileformat
from .errors import (
    ContextFull,
    CorruptSession,
    InvalidArgument,
    KvsessionError,
    ManifestError,
    MissingManifest,
    SessionFileError,
    SessionMismatch,
    SessionNotFound,
    SessionSaveError,
    TruncatedSession,
    UnreadableSession,
    UnsupportedVersion,
)
from .graph import GraphDecoder
from .jsonspec import AnyJSON, Bool, Either, Hex, Int, ListOf, Null, Num, Obj, OneOf, Str, check_json, short
from .kv import (
    GROW_ROWS,
    KV_DTYPES,
    RING_MARGIN,
    ROW_FORMATS,
    KVBoundsError,
    KVCache,
    decode_q8_into,
    encode_rows,
    encoded_row_bytes,
)
from .sampling import Sampler, SamplerParams
from .template import ChatPrompt
from .transfer import Downloads, Uploads, check_transfer

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
        initial_tokens: int = GROW_ROWS,
        ring_margin: int = RING_MARGIN,
    ):
        if kv_dtype not in KV_DTYPES:
            raise InvalidArgument(f"kv dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
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
        self._decoder: GraphDecoder | None = None  # engine.graphs: built at the first decode step

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
        if self.engine.config.ring_layers:
            chunk_size = min(chunk_size, self.ring_margin)
        self._room(len(tokens))
        done = 0
        for i in range(0, len(tokens), chunk_size):
            chunk = tokens[i : i + chunk_size]
            pos0 = len(self.tokens)
            if len(chunk) == 1 and self.engine.graphs:
                self.logits = self._graph_decoder().step(chunk[0], pos0)
            else:
                self.logits = self.engine.model.forward(chunk, range(pos0, pos0 + len(chunk)), self.cache)
            self.tokens.extend(chunk)
            done += len(chunk)
            if progress:
                progress(done, len(tokens))

    def _room(self, n: int) -> None:
        """Refuse n more tokens past the context; reserve the rows of several at once."""
        if len(self.tokens) + n > self.max_tokens:
            raise ContextFull(f"{len(self.tokens)} + {n} tokens exceed this session's context of {self.max_tokens}")
        need = len(self.tokens) + n
        if n > 1 and any(need > layer.capacity for layer in self.cache if not layer.ring):
            # room for the prompt and a first stretch of decoding, allocated once (not grown and copied chunk by
            # chunk: the copies were most of SmolLM2's peak memory over its KV)
            for layer in self.cache:
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
        """Drop every token from position n on; the logits are gone until the next prefill."""
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"truncate to {n}: the session holds {len(self.tokens)} tokens")
        if n == len(self.tokens):
            return
        self.cache.truncate(n)
        del self.tokens[n:]
        self.logits = None

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
        the session's exact tokens stay as they were generated). Otherwise the
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
        """Keep the first n tokens if the caches can go back that far, else none; returns how many were kept.

        A ring that has wrapped past position n no longer holds the window
        before it (see LayerCache.check_truncate): then the only consistent
        state is an empty session, and the caller prefills from the start.
        """
        try:
            self.truncate(n)
        except KVBoundsError:
            self.truncate(0)
            return 0
        return n

    def fork(self) -> "Session":
        """A second timeline from here: the rows copied with the row primitives (what a file would keep:
        every full layer's rows, each ring's window), the logits, the sampler's exact state, a copy of meta.
        What either session does next leaves the other as it was (the server's n > 1 choices)."""
        other = Session(self.engine, kv_dtype=self.kv_dtype, max_tokens=self.max_tokens,
                        initial_tokens=min(self.max_tokens, len(self.tokens) + GROW_ROWS),
                        ring_margin=self.ring_margin, sampler=Sampler.from_state(self.sampler.state()))
        for src, dst in zip(self.cache, other.cache):
            start, k, v = src.persisted_rows()
            dst.write_rows(start, k, v)
        other.tokens = list(self.tokens)
        other.logits = None if self.logits is None else self.logits.clone()
        other.meta = json.loads(json.dumps(self.meta))
        return other

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
        indices = list(range(len(self.cache))) if layers is None else sorted(set(layers))
        for i in indices:
            if not 0 <= i < len(self.cache):
                raise ValueError(f"layer {i}: the model has {len(self.cache)} layers")
        if format not in ("kvs", "raw"):
            raise ValueError(f"format {format!r}: choose kvs or raw")
        if row_format not in ROW_FORMATS or (format == "raw" and row_format != "exact"):
            raise ValueError(f"row format {row_format!r}: choose {' or '.join(ROW_FORMATS)} (raw files: exact)")
        for target in (path, _raw_manifest_path(path)) if format == "raw" else (path,):
            _check_target(target)
        check_transfer(transfer)
        self.check_meta(str(path))
        starts = {i: self.cache[i].persist_start for i in indices}
        fields = self._describe(starts, row_format)
        try:
            if format == "kvs":
                nbytes = self._save_kvs(path, fields, starts, row_format, transfer, durable, progress)
            else:
                rows = {i: self.cache[i].read_rows(start, self.cache[i].end - start) for i, start in starts.items()}
                nbytes = _save_raw(path, fields, self, rows, durable)
        except OSError as e:  # the temporary file is gone and the old file untouched (fileformat.atomic_write)
            raise SessionSaveError(f"{path}: cannot save: {e.strerror or e}") from None
        return SaveInfo(nbytes, time.perf_counter() - t0)

    def _save_kvs(self, path: Path, fields: dict, starts: dict[int, int], row_format: str, transfer: str,
                  durable: bool, progress: Callable[[int, int], None] | None) -> int:
        """The session file; each layer's rows leave the device while the layer before is written (transfer.py)."""
        dtype = KV_DTYPES[self.kv_dtype]
        runs = [self.cache[i].row_runs(start, self.cache[i].end - start) for i, start in starts.items()]
        row = encoded_row_bytes(self.cache[0].row_shape, dtype, row_format)
        with Downloads(runs, self.cache[0].k.device, transfer) as down:
            sections = [("tokens", [np.asarray(self.tokens, dtype="<i4")]),
                        ("logits", [self.logits_array()]),
                        ("text", [self.text.encode("utf-8")])]
            sections += [(f"layer.{i}", fileformat.Lazy(2 * row * (self.cache[i].end - start),
                                                        lambda j=j: encode_rows(*down.take(j), dtype, row_format)))
                         for j, (i, start) in enumerate(starts.items())]
            return fileformat.write_file(path, fields, sections, durable=durable, progress=progress)

    def check_meta(self, where: str, error: type[KvsessionError] = SessionSaveError) -> None:
        """Refuse to write a `meta` that no reader would accept (META_FIELDS): a file must load again."""
        check_json(self.meta, META_FIELDS, where, field="meta", what="session", error=error)

    def logits_array(self) -> np.ndarray:
        if self.logits is None:
            return np.zeros(0, dtype="<f4")
        return self.logits.detach().float().cpu().numpy().astype("<f4", copy=False)

    def _describe(self, starts: dict[int, int], row_format: str = "exact") -> dict:
        """The header fields: everything a loader checks before it reads a row (starts: layer -> first position)."""
        e = self.engine
        return {
            "kind": "session",
            "created": time.time(),
            "model": {"file": e.path.name, "fingerprint": e.fingerprint.to_dict()},
            "kv_dtype": self.kv_dtype,
            "row_format": row_format,
            "row_shape": list(self.cache[0].row_shape),
            "n_tokens": len(self.tokens),
            "vocab_size": e.config.vocab_size,
            "has_logits": self.logits is not None,
            "partial": len(starts) != len(self.cache),
            "layers": [{"index": i, "kind": self.cache[i].kind, "window": self.cache[i].window,
                        "start": start, "rows": self.cache[i].end - start} for i, start in starts.items()],
            "sampler": self.sampler.state(),
            "meta": self.meta,
        }

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
        if _is_raw(path):
            return _load_raw(path, engine, kv_dtype, max_tokens, ring_margin)
        with _checked_file(path, engine, kv_dtype) as (f, header):
            fields = header.fields
            if fields["partial"]:
                raise SessionMismatch("partial", "layers " + str([d["index"] for d in fields["layers"]]), "a full "
                                      "session", "load a partial file into a session holding its tokens with "
                                      "session.load_layers(path)")
            session = cls._empty_like(fields, engine, max_tokens, ring_margin)
            tokens = _read_tokens(f, header, engine, str(path))
            logits = _read_logits(f, header, str(path))
            fileformat.verify_section(f, header, "text", where=str(path))  # checked, never kept
            cache = session.cache
            with Uploads(engine.device, cache[0].row_shape, cache[0].k.dtype, transfer) as up:
                for d in fields["layers"]:
                    layer = cache[d["index"]]
                    _check_layer_fits(d, layer)
                    up.fill(layer, d["start"], d["rows"], _section_reader(f, header, f"layer.{d['index']}",
                                                                          fields, str(path)))
                    if progress:
                        progress(d["index"] + 1, len(fields["layers"]))
        session._finish_load(tokens, logits, fields)
        return session

    @classmethod
    def _empty_like(cls, fields: dict, engine: "Engine", max_tokens: int, ring_margin: int) -> "Session":
        """A session to load `fields` into; a file longer than the context is refused before anything is allocated."""
        n = fields["n_tokens"]
        if n > max_tokens:
            raise SessionMismatch("n_tokens", n, f"a context of {max_tokens}", "raise max_tokens")
        return cls(engine, kv_dtype=fields["kv_dtype"], max_tokens=max_tokens,
                   initial_tokens=min(max_tokens, n + GROW_ROWS), ring_margin=ring_margin)

    def _finish_load(self, tokens: list[int], logits: torch.Tensor | None, fields: dict) -> None:
        self.tokens = tokens
        self.logits = logits
        self.sampler = Sampler.from_state(fields["sampler"])
        self.meta = fields["meta"]

    def restore_rows(self, tokens: Sequence[int], rows: dict[int, list], logits: torch.Tensor | None, *,
                     keep: int, filled: dict[int, list] | None = None) -> None:
        """Become the timeline `tokens`, keeping rows [0, keep) of the full layers and writing `rows`.

        rows: {layer: [(start, k, v), ...]} host arrays in logical order,
        already checked (the store verifies before it calls this); filled:
        {layer: [(start, count), ...]} rows the store read in place past the
        layer's end (LayerCache.free_rows), made live here. Rings are
        refilled from scratch. Without logits the next call must prefill.
        """
        n = len(tokens)
        filled = filled or {}
        for i, layer in enumerate(self.cache):
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
        self.tokens = list(tokens)
        self.logits = logits

    def prefault(self, n_tokens: int) -> None:
        """Room for n_tokens in every layer, its memory touched now rather than by the first restore or
        prefill that needs it (LayerCache.prefault): for a server at start-up."""
        for layer in self.cache:
            layer.prefault(min(n_tokens, self.max_tokens))

    def load_layers(self, path: str | os.PathLike) -> list[int]:
        """Overwrite some layers from a partial file saved from this timeline; returns the layers.

        The file's tokens must be a prefix of this session's tokens. Every
        section is read and checked before any row is written.
        """
        path = Path(path)
        with _checked_file(path, self.engine, self.kv_dtype) as (f, header):
            fields = header.fields
            if not fields["partial"]:
                raise SessionMismatch("partial", "a full session", "a partial file",
                                      "load a full file with Session.load(path, engine)")
            if fields["n_tokens"] > len(self.tokens):
                raise SessionMismatch("n_tokens", fields["n_tokens"], len(self.tokens), "the session holds fewer tokens")
            tokens = _read_tokens(f, header, self.engine, str(path))
            i = common_prefix(tokens, self.tokens)
            if i < len(tokens):
                raise SessionMismatch(f"token {i}", tokens[i], self.tokens[i], "the file is from another timeline")
            staged = [(d, _read_layer(f, header, d, self, str(path))) for d in fields["layers"]]
        for d, (k, v) in staged:
            self.cache[d["index"]].write_rows(d["start"], k, v)
        return [d["index"] for d in fields["layers"]]


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
            raise ValueError("advance: the sessions of one engine, each with tokens")
        s._room(len(tokens))
    out = engine.model.forward_many([(list(t), range(len(s), len(s) + len(t)), s.cache) for s, t in feeds], keep)
    for (s, tokens), logits, k in zip(feeds, out, keep):
        s.tokens.extend(tokens)
        s.logits = logits[-1] if k else logits
    return out


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


def _check_target(path: Path) -> None:
    """Saving renames a new file over `path`: refuse when that would replace a folder, a FIFO, a device."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # nothing there (or a dangling link): the write itself says what is wrong, if anything
        return
    if not stat.S_ISREG(mode):
        raise SessionSaveError(f"{path}: not a regular file ({fileformat.file_kind(mode)}); left as it is")


@contextmanager
def _checked_file(path: Path, engine: "Engine", kv_dtype: str | None) -> Iterator[tuple[BinaryIO, fileformat.Header]]:
    """A session file open for reading, its header past every check, the model's included.

    An I/O error while the caller reads it becomes UnreadableSession.
    """
    where = str(path)
    with fileformat.open_regular(path, where) as f:
        try:
            header = fileformat.read_header(f, where)
            check_session_header(header, where)
            _check_against_model(header.fields, engine, kv_dtype, where)
            yield f, header
        except OSError as e:
            raise UnreadableSession(f"{where}: {e.strerror}") from None


# --- what a header must hold ----------------------------------------------------------

MAX_TIME = 253402214400  # 9999-12-31 00:00 UTC: a day short of datetime's end, for every time zone
LAYER_FIELDS = Obj({"index": Int(), "kind": OneOf("full", "sliding"), "window": Int(), "start": Int(), "rows": Int()})
FINGERPRINT_FIELDS = Obj({"kv_shape": Obj({"arch": Str(), "n_layers": Int(1), "n_kv_heads": Int(1),
                                           "head_dim": Int(1), "layers": ListOf(Obj({}))}),
                          "weights": Str()})
SAMPLER_FIELDS = Obj({
    # closed: the params become SamplerParams(**params), which takes no other field
    "params": Obj({"temperature": Num(), "top_k": Int(), "top_p": Num(), "min_p": Num(),
                   "seed": Either(Null(), Int())}, closed=True),
    "rng": Obj({"bit_generator": OneOf("PCG64"),
                "state": Obj({"state": Int(0, 2 ** 128 - 1), "inc": Int(0, 2 ** 128 - 1)}),
                "has_uint32": Int(0, 1), "uinteger": Int(0, 2 ** 32 - 1)}),
})
# meta is free-form JSON, but what the chat and `run --session` read from it has a shape
MESSAGE_FIELDS = Obj({"role": Str(), "content": Either(Str(), ListOf(AnyJSON()), Null())}, extra=AnyJSON())
META_FIELDS = Obj({}, {"messages": ListOf(MESSAGE_FIELDS), "title": Str(), "turns": ListOf(Int())},
                  extra=AnyJSON())
SESSION_FIELDS = Obj({
    "created": Num(0, MAX_TIME, "a Unix time"),
    "model": Obj({"file": Str(), "fingerprint": FINGERPRINT_FIELDS}),
    "kv_dtype": OneOf(*KV_DTYPES), "row_shape": ListOf(Int(1), length=2), "n_tokens": Int(), "vocab_size": Int(1),
    "has_logits": Bool(), "partial": Bool(), "layers": ListOf(LAYER_FIELDS), "sampler": SAMPLER_FIELDS,
    "meta": META_FIELDS,
}, {"row_format": OneOf(*ROW_FORMATS)})  # from format 1.1; absent: exact


def check_session_header(header: fileformat.Header, where: str) -> None:
    """Everything a session file's header must be, whatever the model: each field's type, then the
    section sizes those fields imply. Raises CorruptSession naming the field or section.
    """
    fields = header.fields
    check_row_format(fields, where)
    _check_structure(fields, SESSION_FIELDS, "session", where)
    n = fields["n_tokens"]
    header.section("text")
    header.check_lengths({"tokens": 4 * n, "logits": 4 * fields["vocab_size"] if fields["has_logits"] else 0,
                          **{f"layer.{d['index']}": 2 * d["rows"] * row_bytes(fields) for d in fields["layers"]}},
                         where)


def row_bytes(fields: dict) -> int:
    """Bytes of one token's K (or V) row in a file whose checked header gives row_shape, kv_dtype and
    (from format 1.1) row_format."""
    return encoded_row_bytes(fields["row_shape"], KV_DTYPES[fields["kv_dtype"]], fields.get("row_format", "exact"))


def check_row_format(fields: dict, where: str) -> None:
    """A row format this kvsession does not know is refused as a later version's file, not misread."""
    fmt = fields.get("row_format", "exact")
    if not isinstance(fmt, str) or fmt not in ROW_FORMATS:
        raise UnsupportedVersion(f"{where}: row format {short(fmt)}; this kvsession reads "
                                 f"{', '.join(ROW_FORMATS)}")


def _check_structure(fields: dict, spec: Obj, kind: str, where: str, error=CorruptSession) -> None:
    """The checks a session header and a raw manifest share: kind, types, and how the fields hang together."""
    if fields.get("kind") != kind:
        raise error(f"{where}: header kind {short(fields.get('kind'))}, expected {kind!r}")
    check_json(fields, spec, where, error=error)
    n = fields["n_tokens"]
    check_json(fields["meta"].get("turns", []), ListOf(Int(0, n)), where, field="meta.turns", error=error)
    seen = set()
    for d in fields["layers"]:
        if d["index"] in seen:
            raise error(f"{where}: layer index {d['index']} appears twice")
        seen.add(d["index"])
        if d["start"] + d["rows"] != n:
            raise error(f"{where}: layer {d['index']} holds rows [{d['start']}, {d['start'] + d['rows']}) "
                        f"of {n} tokens")
    try:
        Sampler.from_state(fields["sampler"])
    except ValueError as e:  # SamplerParams refuses a value its type allows (top_p 3)
        raise error(f"{where}: header field sampler.params: {e}") from None


def _check_against_model(fields: dict, engine: "Engine", kv_dtype: str | None, where: str) -> None:
    """Refuse a file made for another model, dtype or shape, naming the first field that differs.

    The fields have passed _check_structure: each has its type.
    """
    compare_fingerprint(fields["model"]["fingerprint"], engine.fingerprint.to_dict())
    if kv_dtype is not None and fields["kv_dtype"] != kv_dtype:
        raise SessionMismatch("kv_dtype", fields["kv_dtype"], kv_dtype)
    c = engine.config
    if fields["row_shape"] != [c.n_kv_heads, c.head_dim]:
        raise SessionMismatch("row_shape", fields["row_shape"], [c.n_kv_heads, c.head_dim])
    if fields["vocab_size"] != c.vocab_size:
        raise SessionMismatch("vocab_size", fields["vocab_size"], c.vocab_size)
    n = fields["n_tokens"]
    for d in fields["layers"]:
        i = d["index"]
        if i >= c.n_layers:
            raise CorruptSession(f"{where}: layer index {i}, the model has {c.n_layers} layers")
        spec = c.layers[i]
        if d["kind"] != spec.kind or d["window"] != spec.window:
            raise SessionMismatch(f"layer {i} kind", f"{d['kind']}/{d['window']}", f"{spec.kind}/{spec.window}")
        want_rows = n if spec.kind == "full" else min(n, spec.window)
        if d["rows"] != want_rows:
            raise CorruptSession(f"{where}: layer {i} holds rows [{d['start']}, {n}) of {n} tokens, "
                                 f"expected the last {want_rows}")
    if not fields["partial"] and len(fields["layers"]) != c.n_layers:
        raise CorruptSession(f"{where}: {len(fields['layers'])} layers in a full session of a {c.n_layers}-layer model")


def compare_fingerprint(file_fp: dict, model_fp: dict) -> None:
    fa, ma = file_fp["kv_shape"], model_fp["kv_shape"]
    for key in ("arch", "n_layers", "n_kv_heads", "head_dim"):
        if fa.get(key) != ma.get(key):
            raise SessionMismatch(key, fa.get(key), ma.get(key))
    for i, (a, b) in enumerate(zip(fa["layers"], ma["layers"])):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                raise SessionMismatch(f"layer {i} {key}", a.get(key), b.get(key))
    if file_fp["weights"] != model_fp["weights"]:
        raise SessionMismatch("weights", file_fp["weights"][:16], model_fp["weights"][:16],
                              "the file was saved with other weights")


def _read_tokens(f, header, engine: "Engine", where: str) -> list[int]:
    ids = np.frombuffer(fileformat.read_section(f, header, "tokens", where=where), dtype="<i4")
    if ids.size and (ids.min() < 0 or ids.max() >= engine.config.vocab_size):
        raise CorruptSession(f"{where}: token id outside the vocabulary of {engine.config.vocab_size}")
    return ids.tolist()


def _read_logits(f, header, where: str) -> torch.Tensor | None:
    buf = fileformat.read_section(f, header, "logits", where=where)
    return torch.from_numpy(np.frombuffer(buf, dtype="<f4").copy()) if buf.nbytes else None


def _check_layer_fits(d: dict, layer) -> None:
    if layer.ring and d["rows"] > layer.capacity:
        raise SessionMismatch(f"layer {d['index']} rows", d["rows"], f"a ring of {layer.capacity}")


def _read_layer(f, header, d: dict, session: Session, where: str) -> tuple[np.ndarray, np.ndarray]:
    """One layer's K and V rows [rows, H, D] as host arrays, checksum verified."""
    layer = session.cache[d["index"]]
    _check_layer_fits(d, layer)
    k, v = layer.host_rows(d["rows"])
    _section_reader(f, header, f"layer.{d['index']}", header.fields, where)(k, v)
    return k, v


def _section_reader(f, header, section: str, fields: dict, where: str) -> Callable[[np.ndarray, np.ndarray], None]:
    """fill(k, v): a layer section's rows, checksum verified, into host rows [n, H, D] of the file's KV dtype,
    decoded from 8-bit blocks when the file holds those."""
    if fields.get("row_format", "exact") == "exact":
        return lambda k, v: fileformat.read_section(f, header, section, into=[k, v], where=where)

    def fill(k: np.ndarray, v: np.ndarray) -> None:
        decode_q8_into(fileformat.read_section(f, header, section, where=where), k, v, KV_DTYPES[fields["kv_dtype"]])

    return fill


# --- the seed's raw format -----------------------------------------------------


MAX_RAW_MANIFEST = 64 << 20  # a raw manifest carries the tokens, the text and the logits as JSON
RAW_LAYER_FIELDS = Obj({**LAYER_FIELDS.required, "k": ListOf(Int(), length=2), "v": ListOf(Int(), length=2)},
                       {"xxh3": Hex(16)})
RAW_FIELDS = Obj({**SESSION_FIELDS.required, "layers": ListOf(RAW_LAYER_FIELDS), "blob_bytes": Int(),
                  "n_layers": Int(1), "n_kv_heads": Int(1), "head_dim": Int(1), "tokens": ListOf(Int()),
                  "logits_f32_base64": Str(), "text": Str()})


def _is_raw(path: Path) -> bool:
    """A regular file that does not start with the session magic is treated as a raw blob."""
    try:
        with fileformat.open_regular(path) as f:
            head = f.read(len(fileformat.MAGIC))
    except (SessionFileError, OSError):  # the session-file path opens it again and says what is wrong
        return False
    return len(head) > 0 and not fileformat.MAGIC.startswith(head)


def _raw_manifest_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _save_raw(path: Path, fields: dict, session: Session, rows: dict, durable: bool) -> int:
    """Layer blobs back to back (K rows then V rows, logical order), and the manifest `path.json`."""
    layers, offset = [], 0
    for d in fields["layers"]:
        k, v = rows[d["index"]]
        layers.append({**d, "k": [offset, k.nbytes], "v": [offset + k.nbytes, v.nbytes],
                       "xxh3": f"{fileformat.checksum([k, v]):016x}"})
        offset += k.nbytes + v.nbytes
    manifest = {
        **fields, "kind": "raw", "version": 1, "layers": layers, "blob_bytes": offset,
        "n_layers": len(session.cache), "n_kv_heads": fields["row_shape"][0], "head_dim": fields["row_shape"][1],
        "tokens": session.tokens,
        "logits_f32_base64": base64.b64encode(session.logits_array().tobytes()).decode(),
        "text": session.text,
    }

    def write_blob(f) -> None:
        for d in fields["layers"]:
            for a in rows[d["index"]]:
                f.write(fileformat.as_bytes(np.ascontiguousarray(a)))

    fileformat.atomic_write(path, write_blob, durable=durable)
    # the manifest goes last: a blob without one is refused, never misread
    fileformat.atomic_write(_raw_manifest_path(path), lambda f: f.write(json.dumps(manifest).encode()),
                            durable=durable)
    return offset


def read_raw_manifest(path: Path) -> dict:
    """The manifest beside a raw blob, every field checked and the byte ranges it gives the layers too.

    Needs no model (inspect reads raw files with it). Raises ManifestError (MissingManifest when there is none).
    """
    mpath = _raw_manifest_path(path)
    where = str(mpath)
    try:
        m = json.loads(fileformat.read_small(mpath, MAX_RAW_MANIFEST))
    except SessionNotFound:
        raise MissingManifest(f"{path}: not a session file, and no raw-format manifest {mpath.name} "
                              "beside it") from None
    except SessionFileError as e:
        raise ManifestError(str(e)) from None
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{where}: unreadable manifest ({e!r})") from None
    if not isinstance(m, dict):
        raise ManifestError(f"{where}: not a kvsession raw manifest")
    _check_structure(m, RAW_FIELDS, "raw", where, error=ManifestError)
    if m.get("row_format", "exact") != "exact":
        raise ManifestError(f"{where}: row format {short(m['row_format'])}: raw files hold exact rows")
    if len(m["tokens"]) != m["n_tokens"]:
        raise ManifestError(f"{where}: {len(m['tokens'])} tokens, n_tokens says {m['n_tokens']}")
    row = row_bytes(m)
    expect = 0
    for d in m["layers"]:
        (ko, kn), (vo, vn) = d["k"], d["v"]
        if ko != expect or kn != d["rows"] * row or vo != ko + kn or vn != kn:
            raise ManifestError(f"{where}: layer {d['index']} byte ranges {d['k']} {d['v']} do not match "
                                f"{d['rows']} rows of {row} bytes at offset {expect}")
        expect = vo + vn
    if expect != m["blob_bytes"]:
        raise ManifestError(f"{where}: the layers take {expect} bytes, blob_bytes says {m['blob_bytes']}")
    return m


def open_raw_blob(path: Path, m: dict) -> BinaryIO:
    """The blob a checked manifest describes, open, once it holds exactly blob_bytes really written bytes."""
    f = fileformat.open_regular(path)
    try:
        size = os.fstat(f.fileno()).st_size
        if size != m["blob_bytes"]:
            raise TruncatedSession(f"{path}: blob has {size} bytes, the manifest says {m['blob_bytes']}")
        hole = fileformat.first_hole(f, 0, size)
        if hole is not None:
            raise CorruptSession(f"{path}: a hole at byte {hole}: a sparse file, not one kvsession wrote")
        return f
    except BaseException:
        f.close()
        raise


def _load_raw(path: Path, engine: "Engine", kv_dtype: str | None, max_tokens: int, ring_margin: int) -> Session:
    where = str(path)
    m = read_raw_manifest(path)
    c = engine.config
    for key, want in (("n_layers", c.n_layers), ("n_kv_heads", c.n_kv_heads), ("head_dim", c.head_dim)):
        if m[key] != want:
            raise SessionMismatch(key, m[key], want)
    _check_against_model(m, engine, kv_dtype, where)
    if m["partial"]:
        raise SessionMismatch("partial", "a partial raw file", "a full session")
    if any(not 0 <= t < c.vocab_size for t in m["tokens"]):
        raise ManifestError(f"{_raw_manifest_path(path)}: a token id outside the vocabulary of {c.vocab_size}")
    try:
        logits = np.frombuffer(base64.b64decode(m["logits_f32_base64"], validate=True), dtype="<f4")
    except ValueError as e:
        raise ManifestError(f"{_raw_manifest_path(path)}: logits_f32_base64: {e}") from None
    if logits.size != (c.vocab_size if m["has_logits"] else 0):
        raise ManifestError(f"{_raw_manifest_path(path)}: {logits.size} logits, expected {c.vocab_size}")
    session = Session._empty_like(m, engine, max_tokens, ring_margin)
    staged = []
    with open_raw_blob(path, m) as f:
        try:
            for d in m["layers"]:
                k, v = session.cache[d["index"]].host_rows(d["rows"])
                f.seek(d["k"][0])
                if f.readinto(fileformat.as_bytes(k)) != k.nbytes or f.readinto(fileformat.as_bytes(v)) != v.nbytes:
                    raise TruncatedSession(f"{where}: layer {d['index']} is cut short")
                if "xxh3" in d and fileformat.checksum([k, v]) != int(d["xxh3"], 16):
                    raise CorruptSession(f"{where}: layer {d['index']}: checksum mismatch")
                staged.append((d, k, v))
        except OSError as e:
            raise UnreadableSession(f"{where}: {e.strerror}") from None
    for d, k, v in staged:
        session.cache[d["index"]].write_rows(d["start"], k, v)
    session._finish_load(list(m["tokens"]), torch.from_numpy(logits.copy()) if logits.size else None, m)
    return session
