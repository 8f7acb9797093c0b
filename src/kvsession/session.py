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
"""
from __future__ import annotations

import base64
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from . import fileformat
from .errors import (
    ContextFull,
    CorruptSession,
    KvsessionError,
    ManifestError,
    MissingManifest,
    NotASessionFile,
    SessionMismatch,
    TruncatedSession,
)
from .kv import GROW_ROWS, KV_DTYPES, RING_MARGIN, KVBoundsError, KVCache, numpy_dtype
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
        initial_tokens: int = GROW_ROWS,
        ring_margin: int = RING_MARGIN,
    ):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
        self.engine = engine
        self.kv_dtype = kv_dtype
        self.max_tokens = max_tokens or engine.config.context_length
        self.cache = KVCache.for_model(
            engine.config, dtype=KV_DTYPES[kv_dtype], device=engine.device, max_tokens=self.max_tokens,
            initial_tokens=initial_tokens, ring_margin=ring_margin,
        )
        self.ring_margin = ring_margin
        self.tokens: list[int] = []
        self.logits: torch.Tensor | None = None  # [vocab] f32, predicts tokens[len(tokens)]
        self.sampler = sampler if isinstance(sampler, Sampler) else Sampler(sampler)
        self.meta: dict[str, Any] = {}  # JSON-able; saved with the session

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

    def reuse_prefix(self, text: str) -> list[int]:
        """Make this session a prefix of `text` (a whole rendered conversation); return the tokens to prefill.

        When `text` starts with the session's rendered text, every token is
        kept and only the rest is tokenized (ds4's text-prefix match: the
        session's exact tokens stay as they were generated). Otherwise the
        session is cut back to the longest common token prefix with a fresh
        tokenization of `text`. The tokens returned are never empty, unless
        the session is already exactly `text`.
        """
        tk = self.engine.tokenizer
        prefix = self.text
        if self.tokens and text.startswith(prefix):
            return tk.encode(text[len(prefix):], add_bos=False)
        ids = tk.encode(text)
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

    @property
    def text(self) -> str:
        """The rendered prefix: every token as text, control tokens included."""
        return self.engine.tokenizer.decode(self.tokens)

    # --- files -------------------------------------------------------------------

    def save(self, path: str | os.PathLike, *, layers: Sequence[int] | None = None, durable: bool = True,
             format: str = "kvs", progress: Callable[[int, int], None] | None = None) -> "SaveInfo":
        """Write the session to `path` (crash-safe; fsynced when durable).

        layers: save only these layers (a partial file, for load_layers);
        format: "kvs" (the session file) or "raw" (blobs plus `path.json`);
        progress(done, total): bytes written, after each section.
        """
        t0 = time.perf_counter()
        indices = list(range(len(self.cache))) if layers is None else sorted(set(layers))
        for i in indices:
            if not 0 <= i < len(self.cache):
                raise ValueError(f"layer {i}: the model has {len(self.cache)} layers")
        persisted = {i: self.cache[i].persisted_rows() for i in indices}
        rows = {i: (k, v) for i, (_, k, v) in persisted.items()}
        fields = self._describe({i: start for i, (start, _, _) in persisted.items()})
        if format == "kvs":
            sections = [("tokens", [np.asarray(self.tokens, dtype="<i4")]),
                        ("logits", [self.logits_array()]),
                        ("text", [self.text.encode("utf-8")])]
            sections += [(f"layer.{i}", [rows[i][0], rows[i][1]]) for i in indices]
            nbytes = fileformat.write_file(path, fields, sections, durable=durable, progress=progress)
        elif format == "raw":
            nbytes = _save_raw(Path(path), fields, self, rows, durable)
        else:
            raise ValueError(f"format {format!r}: choose kvs or raw")
        return SaveInfo(nbytes, time.perf_counter() - t0)

    def logits_array(self) -> np.ndarray:
        if self.logits is None:
            return np.zeros(0, dtype="<f4")
        return self.logits.detach().float().cpu().numpy().astype("<f4", copy=False)

    def _describe(self, starts: dict[int, int]) -> dict:
        """The header fields: everything a loader checks before it reads a row (starts: layer -> first position)."""
        e = self.engine
        return {
            "kind": "session",
            "created": time.time(),
            "model": {"file": e.path.name, "fingerprint": e.fingerprint.to_dict()},
            "kv_dtype": self.kv_dtype,
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
             max_tokens: int | None = None, ring_margin: int = RING_MARGIN,
             progress: Callable[[int, int], None] | None = None) -> "Session":
        """A new session from a file, checked completely first; runs no forward pass.

        Rings are allocated with `ring_margin` rows beyond their window, whatever
        the ring the file was saved from: files keep only the window.
        progress(done, total): layers read, after each one.
        """
        path = Path(path)
        raw = _raw_manifest_path(path) if _is_raw(path) else None
        if raw is not None:
            return _load_raw(path, raw, engine, kv_dtype, max_tokens, ring_margin)
        with _open(path) as f:
            header = fileformat.read_header(f, str(path))
            fields = header.fields
            _check_fields(fields, engine, kv_dtype, str(path))
            if fields["partial"]:
                raise SessionMismatch("partial", "layers " + str([d["index"] for d in fields["layers"]]), "a full "
                                      "session", "load a partial file into a session holding its tokens with "
                                      "session.load_layers(path)")
            tokens = _read_tokens(f, header, fields, engine, str(path))
            logits = _read_logits(f, header, fields, str(path))
            fileformat.read_section(f, header, "text", where=str(path))
            session = cls._empty_like(fields, engine, max_tokens, ring_margin, str(path))
            for d in fields["layers"]:
                layer = session.cache[d["index"]]
                _check_layer_fits(d, layer)
                section = f"layer.{d['index']}"
                layer.fill_rows(d["start"], d["rows"], lambda k, v: fileformat.read_section(
                    f, header, section, into=[k, v], where=str(path)))
                if progress:
                    progress(d["index"] + 1, len(fields["layers"]))
        session._finish_load(tokens, logits, fields)
        return session

    @classmethod
    def _empty_like(cls, fields: dict, engine: "Engine", max_tokens: int | None, ring_margin: int,
                    where: str) -> "Session":
        n = fields["n_tokens"]
        max_tokens = max_tokens or engine.config.context_length
        if n > max_tokens:
            raise SessionMismatch("n_tokens", n, f"a context of {max_tokens}", "raise max_tokens")
        return cls(engine, kv_dtype=fields["kv_dtype"], max_tokens=max_tokens,
                   initial_tokens=min(max_tokens, n + GROW_ROWS), ring_margin=ring_margin)

    def _finish_load(self, tokens: list[int], logits: torch.Tensor | None, fields: dict) -> None:
        self.tokens = tokens
        self.logits = logits
        self.sampler = Sampler.from_state(fields["sampler"])
        self.meta = fields.get("meta") or {}

    def restore_rows(self, tokens: Sequence[int], rows: dict[int, list], logits: torch.Tensor | None, *,
                     keep: int) -> None:
        """Become the timeline `tokens`, keeping rows [0, keep) of the full layers and writing `rows`.

        rows: {layer: [(start, k, v), ...]} host arrays in logical order,
        already checked (the store verifies before it calls this). Rings are
        refilled from scratch. Without logits the next call must prefill.
        """
        n = len(tokens)
        for i, layer in enumerate(self.cache):
            if layer.ring:
                layer.reset()
            else:
                layer.truncate(min(keep, layer.end))
                layer.reserve(n + GROW_ROWS)
            for start, k, v in sorted(rows.get(i, []), key=lambda r: r[0]):
                layer.write_rows(start, k, v)
            if layer.end != n:
                raise KvsessionError(f"restore left layer {i} at {layer.end} rows of {n}")
        self.tokens = list(tokens)
        self.logits = logits

    def load_layers(self, path: str | os.PathLike) -> list[int]:
        """Overwrite some layers from a partial file saved from this timeline; returns the layers.

        The file's tokens must be a prefix of this session's tokens. Every
        section is read and checked before any row is written.
        """
        path = Path(path)
        with _open(path) as f:
            header = fileformat.read_header(f, str(path))
            fields = header.fields
            _check_fields(fields, self.engine, self.kv_dtype, str(path))
            if not fields["partial"]:
                raise SessionMismatch("partial", "a full session", "a partial file",
                                      "load a full file with Session.load(path, engine)")
            tokens = _read_tokens(f, header, fields, self.engine, str(path))
            i = common_prefix(tokens, self.tokens)
            if i < min(len(tokens), len(self.tokens)):
                raise SessionMismatch(f"token {i}", tokens[i], self.tokens[i], "the file is from another timeline")
            if len(tokens) > len(self.tokens):
                raise SessionMismatch("n_tokens", len(tokens), len(self.tokens), "the session holds fewer tokens")
            staged = [(d, _read_layer(f, header, d, self, str(path))) for d in fields["layers"]]
        for d, (k, v) in staged:
            self.cache[d["index"]].write_rows(d["start"], k, v)
        return [d["index"] for d in fields["layers"]]


@dataclass(frozen=True)
class SaveInfo:
    bytes: int
    seconds: float


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _open(path: Path):
    if path.is_dir():
        raise NotASessionFile(f"{path}: is a folder, not a session file")
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise NotASessionFile(f"{path}: no such file") from None


def _check_fields(fields: dict, engine: "Engine", kv_dtype: str | None, where: str) -> None:
    """Refuse a file made for another model, dtype or shape, naming the first field that differs."""
    try:
        if fields.get("kind") != "session":
            raise CorruptSession(f"{where}: header kind {fields.get('kind')!r}, expected 'session'")
        compare_fingerprint(fields["model"]["fingerprint"], engine.fingerprint.to_dict())
        if fields["kv_dtype"] not in KV_DTYPES:
            raise CorruptSession(f"{where}: unknown kv dtype {fields['kv_dtype']!r}")
        if kv_dtype is not None and fields["kv_dtype"] != kv_dtype:
            raise SessionMismatch("kv_dtype", fields["kv_dtype"], kv_dtype)
        c = engine.config
        if fields["row_shape"] != [c.n_kv_heads, c.head_dim]:
            raise SessionMismatch("row_shape", fields["row_shape"], [c.n_kv_heads, c.head_dim])
        if fields["vocab_size"] != c.vocab_size:
            raise SessionMismatch("vocab_size", fields["vocab_size"], c.vocab_size)
        n = fields["n_tokens"]
        if not isinstance(n, int) or n < 0:
            raise CorruptSession(f"{where}: n_tokens {n!r}")
        seen = set()
        for d in fields["layers"]:
            i = d["index"]
            if not isinstance(i, int) or not 0 <= i < c.n_layers or i in seen:
                raise CorruptSession(f"{where}: layer index {i!r}")
            seen.add(i)
            spec = c.layers[i]
            if d["kind"] != spec.kind or d["window"] != spec.window:
                raise SessionMismatch(f"layer {i} kind", f"{d['kind']}/{d['window']}", f"{spec.kind}/{spec.window}")
            want_rows = n if spec.kind == "full" else min(n, spec.window)
            if d["start"] + d["rows"] != n or d["rows"] != want_rows or d["start"] < 0:
                raise CorruptSession(f"{where}: layer {i} holds rows [{d['start']}, {d['start'] + d['rows']}) "
                                     f"of {n} tokens, expected the last {want_rows}")
        if not fields["partial"] and len(seen) != c.n_layers:
            raise CorruptSession(f"{where}: {len(seen)} layers in a full session of a {c.n_layers}-layer model")
        Sampler.from_state(fields["sampler"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptSession(f"{where}: header field missing or malformed ({e!r})") from None


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


def _read_tokens(f, header, fields: dict, engine: "Engine", where: str) -> list[int]:
    buf = fileformat.read_section(f, header, "tokens", where=where)
    if buf.nbytes != 4 * fields["n_tokens"]:
        raise CorruptSession(f"{where}: tokens section holds {buf.nbytes // 4} ids, header says {fields['n_tokens']}")
    ids = np.frombuffer(buf, dtype="<i4")
    if ids.size and (ids.min() < 0 or ids.max() >= engine.config.vocab_size):
        raise CorruptSession(f"{where}: token id outside the vocabulary of {engine.config.vocab_size}")
    return ids.tolist()


def _read_logits(f, header, fields: dict, where: str) -> torch.Tensor | None:
    buf = fileformat.read_section(f, header, "logits", where=where)
    want = fields["vocab_size"] if fields["has_logits"] else 0
    if buf.nbytes != 4 * want:
        raise CorruptSession(f"{where}: logits section holds {buf.nbytes // 4} values, expected {want}")
    return torch.from_numpy(np.frombuffer(buf, dtype="<f4").copy()) if want else None


def _check_layer_fits(d: dict, layer) -> None:
    if layer.ring and d["rows"] > layer.capacity:
        raise SessionMismatch(f"layer {d['index']} rows", d["rows"], f"a ring of {layer.capacity}")


def _read_layer(f, header, d: dict, session: Session, where: str) -> tuple[np.ndarray, np.ndarray]:
    """One layer's K and V rows [rows, H, D] as host arrays, checksum verified."""
    layer = session.cache[d["index"]]
    _check_layer_fits(d, layer)
    k, v = layer.host_rows(d["rows"])
    fileformat.read_section(f, header, f"layer.{d['index']}", into=[k, v], where=where)
    return k, v


# --- the seed's raw format -----------------------------------------------------


def _is_raw(path: Path) -> bool:
    """A file that does not start with the session magic is treated as a raw blob."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        head = f.read(len(fileformat.MAGIC))
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


def _load_raw(path: Path, manifest_path: Path, engine: "Engine", kv_dtype: str | None,
              max_tokens: int | None, ring_margin: int) -> Session:
    where = str(path)
    try:
        m = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MissingManifest(f"{path}: not a session file, and no raw-format manifest {manifest_path.name} "
                            "beside it") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{manifest_path}: unreadable manifest ({e})") from None
    if not isinstance(m, dict) or m.get("kind") != "raw":
        raise ManifestError(f"{manifest_path}: not a kvsession raw manifest")
    try:
        c = engine.config
        for key, want in (("n_layers", c.n_layers), ("n_kv_heads", c.n_kv_heads), ("head_dim", c.head_dim)):
            if m[key] != want:
                raise SessionMismatch(key, m[key], want)
        _check_fields({**m, "kind": "session"}, engine, kv_dtype, where)
        if m["partial"]:
            raise SessionMismatch("partial", "a partial raw file", "a full session")
        tokens = m["tokens"]
        if len(tokens) != m["n_tokens"] or any(not isinstance(t, int) or not 0 <= t < c.vocab_size for t in tokens):
            raise ManifestError(f"{manifest_path}: tokens do not match n_tokens or the vocabulary")
        logits = np.frombuffer(base64.b64decode(m["logits_f32_base64"]), dtype="<f4")
        if logits.size != (c.vocab_size if m["has_logits"] else 0):
            raise ManifestError(f"{manifest_path}: {logits.size} logits, expected {c.vocab_size}")
        session = Session._empty_like(m, engine, max_tokens, ring_margin, where)
        itemsize = np.dtype(numpy_dtype(KV_DTYPES[m["kv_dtype"]])).itemsize
        row_bytes = c.n_kv_heads * c.head_dim * itemsize
        size = path.stat().st_size
        if size != m["blob_bytes"]:
            raise TruncatedSession(f"{where}: blob has {size} bytes, the manifest says {m['blob_bytes']}")
        staged = []
        with open(path, "rb") as f:
            expect = 0
            for d in m["layers"]:
                (ko, kn), (vo, vn) = d["k"], d["v"]
                if ko != expect or kn != d["rows"] * row_bytes or vo != ko + kn or vn != kn:
                    raise ManifestError(f"{manifest_path}: layer {d['index']} byte ranges {d['k']} {d['v']} do not "
                                        f"match {d['rows']} rows of {row_bytes} bytes at offset {expect}")
                expect = vo + vn
                layer = session.cache[d["index"]]
                k, v = layer.host_rows(d["rows"])
                f.seek(ko)
                if f.readinto(fileformat.as_bytes(k)) != kn or f.readinto(fileformat.as_bytes(v)) != vn:
                    raise TruncatedSession(f"{where}: layer {d['index']} is cut short")
                if "xxh3" in d and fileformat.checksum([k, v]) != int(d["xxh3"], 16):
                    raise CorruptSession(f"{where}: layer {d['index']}: checksum mismatch")
                staged.append((d, k, v))
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{manifest_path}: manifest field missing or malformed ({e!r})") from None
    for d, k, v in staged:
        session.cache[d["index"]].write_rows(d["start"], k, v)
    session._finish_load(list(tokens), torch.from_numpy(logits.copy()) if logits.size else None, m)
    return session


# --- named sessions ----------------------------------------------------------------

SESSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SUFFIX = ".kvs"


def sessions_dir(override: str | os.PathLike | None = None) -> Path:
    """Where named sessions live: the override, $KVSESSION_SESSIONS_DIR, else the user's data folder."""
    if override:
        return Path(override)
    if os.environ.get("KVSESSION_SESSIONS_DIR"):
        return Path(os.environ["KVSESSION_SESSIONS_DIR"])
    data = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(data) / "kvsession" / "sessions"


def check_session_name(name: str) -> str:
    """A session name: letters, digits, '.', '_', '-', at most 64, not starting with a dot or dash.

    Names never contain a path separator, so a name cannot escape its folder.
    """
    if not SESSION_NAME.fullmatch(name):
        raise InvalidSessionName(
            f"session name {name!r}: use letters, digits, '.', '_' and '-' (at most 64, starting with a letter "
            "or digit)"
        )
    return name


def session_path(name_or_path: str, folder: str | os.PathLike | None = None) -> Path:
    """NAME -> folder/NAME.kvs; anything with a path separator or ending in .kvs is a path."""
    if os.sep in name_or_path or "/" in name_or_path or name_or_path.endswith(SUFFIX):
        return Path(name_or_path)
    return sessions_dir(folder) / (check_session_name(name_or_path) + SUFFIX)


class InvalidSessionName(KvsessionError, ValueError):
    pass
