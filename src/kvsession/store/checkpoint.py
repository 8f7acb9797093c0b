"""Checkpoints as snapshots, and the one thread that writes them.

A checkpoint written on the compute thread stalls prefill and decoding for
as long as the disk takes: tens of milliseconds per thousand tokens. So a
checkpoint is split in two. On the calling thread, `take` copies what the
store does not hold yet -- the rows of the whole chunks not on disk (nor on
their way there), the tail rows after the last whole chunk, each sliding
layer's window, the logits, the token ids, the sampler state, the metadata
-- into a Snapshot that no longer changes when the session does. The
Writer thread turns snapshots into files (Store._commit): chunk files,
then the manifest, then eviction down to the budget.

One writer, a bounded queue. A snapshot queued behind the running one is
superseded by a newer snapshot of the same timeline (its tokens a prefix of
the newer one's): the newer one takes over the rows it skipped because the
older was to write them, and both futures get its result. A snapshot of
another timeline waits for room (two queued at most), so memory stays
bounded by a few snapshots, never a backlog.

A failure (a full disk, a chunk an earlier failed snapshot was to write) is
the future's exception, logged; the store stays as it was (every file is
renamed into place whole, the manifest last).
"""
from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from .. import fileformat
from ..errors import SessionFileError, SessionNotFound
from ..kv import KV_DTYPES, encode_rows, encoded_row_bytes
from .layout import Entry, check_chunk, manifest_key
from .policy import Protected

if TYPE_CHECKING:
    from ..session import Session
    from .layout import Hit

log = logging.getLogger("kvsession.store")


@dataclass
class Snapshot:
    """One checkpoint's content, independent of the session it came from.

    Rows are host arrays [n, H, D] in the cache's dtype, logical order."""

    reason: str
    root: str
    tokens: list[int]  # [n_tokens]
    keys: list[str]  # chain keys of its whole chunks
    chunk_rows: dict[str, tuple[int, bool, dict]]  # key -> (j, ring, {layer: (k, v)}): the chunks to write
    tail: dict[int, tuple[int, np.ndarray, np.ndarray]]  # layer -> (start, k, v): the manifest's rows
    layer_kinds: list[tuple[str, int]]  # per layer: kind, window
    logits: np.ndarray  # f32 [vocab] or [0]
    sampler: dict
    meta: dict
    kv_dtype: str
    row_shape: list[int]
    model_file: str
    fingerprint: dict
    decode: Callable[[list[int]], str]  # the tokenizer's decode, for the manifest's text
    protect: "Hit | None" = None
    futures: list[Future] = field(default_factory=list)

    _texts: dict = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def text(self, n: int) -> str:
        """The rendered text of the first n tokens (decoded once: planning and writing both need it)."""
        if n not in self._texts:
            self._texts[n] = self.decode(self.tokens[:n])
        return self._texts[n]

    def continues(self, older: "Snapshot") -> bool:
        """This snapshot covers `older`: same chain, older's tokens a prefix of these, nothing else to protect."""
        n = older.n_tokens
        return (older.root == self.root and n <= self.n_tokens and self.tokens[:n] == older.tokens
                and older.protect is None)


def take(session: "Session", *, reason: str, root: str, n: int, chunk: int, keys: list[str], skip: set[str],
         copy: bool, protect: "Hit | None") -> Snapshot:
    """Snapshot the first n tokens of a session: the rows of chunks not in `skip`, the manifest's parts.

    copy: take private copies of rows that are views of a CPU cache (for a write on another thread);
    rows read from another device are copies already."""
    cache = session.cache

    def own(a: np.ndarray) -> np.ndarray:
        return np.array(a, copy=True) if copy and cache[0].k.device.type == "cpu" else a

    def rows(layer, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        k, v = layer.read_rows(start, count)
        return own(k), own(v)

    chunk_rows = {}
    for j, key in enumerate(keys):
        if key in skip or key in chunk_rows:
            continue
        start = j * chunk
        ring = all(layer.start <= start for layer in cache if layer.ring)
        chunk_rows[key] = (j, ring, {i: rows(layer, start, chunk) for i, layer in enumerate(cache)
                                     if ring or not layer.ring})
    tail_start = len(keys) * chunk
    tail = {}
    for i, layer in enumerate(cache):
        start = max(0, n - layer.window) if layer.ring else tail_start
        tail[i] = (start, *rows(layer, start, n - start))
    e = session.engine
    has_logits = n == len(session) and session.logits is not None
    return Snapshot(
        reason=reason, root=root, tokens=list(session.tokens[:n]), keys=keys, chunk_rows=chunk_rows, tail=tail,
        layer_kinds=[(layer.kind, layer.window) for layer in cache],
        logits=session.logits_array().copy() if has_logits else np.zeros(0, dtype="<f4"),
        sampler=session.sampler.state(), meta=json.loads(json.dumps(session.meta)), kv_dtype=session.kv_dtype,
        row_shape=list(cache[0].row_shape), model_file=e.path.name, fingerprint=e.fingerprint.to_dict(),
        decode=e.tokenizer.decode, protect=protect)


class Writer:
    """The thread that commits snapshots, one at a time, in order (see the module's docstring)."""

    MAX_QUEUED = 2

    def __init__(self, commit: Callable[[Snapshot], "Entry | None"], name: str = "kvsession-store-writer"):
        self._commit = commit
        self._name = name
        self._cv = threading.Condition()
        self._queue: list[Snapshot] = []
        self._running: Snapshot | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def pending_keys(self) -> set[str]:
        """Chunks that queued or running snapshots will write: a new snapshot need not copy them."""
        with self._cv:
            jobs = self._queue + ([self._running] if self._running else [])
            return {k for s in jobs if isinstance(s, Snapshot) for k in s.chunk_rows}

    def later(self, task: Callable[[], None]) -> None:
        """Run a small task on the writer thread, in order with the checkpoints (a hit's statistics file:
        a restore must not wait for a rename)."""
        with self._cv:
            if self._closed:
                return
            self._queue.append(task)
            self._start()
            self._cv.notify_all()

    def start(self) -> None:
        """Start the thread now (else the first checkpoint or hit does: a thread's start costs the caller
        ~3 ms of waiting for the interpreter lock, which a restore should not pay)."""
        with self._cv:
            self._start()

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def submit(self, snap: Snapshot) -> Future:
        future: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the store is closed")
            snap.futures.append(future)
            while True:
                older = next((s for s in self._queue if isinstance(s, Snapshot) and snap.continues(s)), None)
                if older is not None:  # superseded: its rows and its futures move to the newer snapshot
                    for key, rows in older.chunk_rows.items():
                        snap.chunk_rows.setdefault(key, rows)
                    snap.futures[:0] = older.futures
                    self._queue[self._queue.index(older)] = snap
                    break
                if sum(isinstance(s, Snapshot) for s in self._queue) < self.MAX_QUEUED:
                    self._queue.append(snap)
                    break
                self._cv.wait()
            self._start()
            self._cv.notify_all()
        return future

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    if self._closed:
                        return
                    self._cv.wait()
                snap = self._running = self._queue.pop(0)
                self._cv.notify_all()
            if not isinstance(snap, Snapshot):
                try:
                    snap()
                except Exception:
                    log.exception("store: a background task failed")
                with self._cv:
                    self._running = None
                    self._cv.notify_all()
                continue
            try:
                result = self._commit(snap)
            except BaseException as e:  # a failed write is its futures' business; the thread goes on
                log.warning("store: checkpoint (%s, %d tokens) failed: %s", snap.reason, snap.n_tokens, e)
                outcome = (None, e)
            else:
                outcome = (result, None)
            for f in snap.futures:
                if outcome[1] is None:
                    f.set_result(outcome[0])
                else:
                    f.set_exception(outcome[1])
            with self._cv:
                self._running = None
                self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every snapshot submitted so far is written (or failed); False on a timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and self._running is None, timeout)

    def close(self, timeout: float | None = None) -> bool:
        done = self.flush(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        return done


class CheckpointFiles:
    """What a snapshot becomes on disk (a part of Store): how much of it fits, its chunk files, its manifest.

    Sizes are planned before a byte is written, exactly (fileformat.file_size): a checkpoint that does not
    fit beside what eviction must leave is cut to whole chunks, not written and then thrown away."""

    def _plan(self, snap: Snapshot, keep: Protected, created: float) -> int:
        """How many tokens of the snapshot to write: all of them when they fit the budget beside what is
        protected, else the most whole chunks that do (layers without rings only), else 0.

        Every other checkpoint can be evicted, so what stays is the protected manifests and chunks; the
        rest of the budget is the checkpoint's own: its manifest and the chunks it names that are not
        among the protected ones. Sizes are exact (fileformat.file_size)."""
        o, c = self.options, self.options.chunk_tokens
        kept_chunks = set(keep.chunks) | {k for e in keep.entries if e in self.entries for k in self.entries[e].chunks}
        fixed = (sum(self.entries[e].nbytes for e in keep.entries if e in self.entries)
                 + sum(self.chunks[k].nbytes for k in kept_chunks if k in self.chunks))
        # the chunks this snapshot can name: on disk, or in the snapshot; a gap ends it
        usable = next((j for j, k in enumerate(snap.keys) if k not in self.chunks and k not in snap.chunk_rows),
                      len(snap.keys))
        sizes = [0 if k in kept_chunks else self.chunks[k].nbytes if k in self.chunks else self._chunk_size(snap, k)
                 for k in snap.keys[:usable]]

        def fits(n: int) -> bool:
            return fixed + sum(sizes[: n // c]) + self._manifest_size(snap, n, created) <= o.budget_bytes

        n = snap.n_tokens
        if usable == len(snap.keys) and fits(n):
            return n
        if any(kind == "sliding" for kind, _ in snap.layer_kinds):
            return 0  # a shorter checkpoint needs the rings' windows at its end, which the snapshot lacks
        lo, hi = 0, min(usable, (n - 1) // c)  # whole chunks: the largest m with fits(m * c), by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid * c) else (lo, mid - 1)
        return lo * c if lo * c >= max(1, o.min_tokens) and fits(lo * c) else 0

    def _chunk_fields(self, snap: Snapshot, key: str, j: int, ring: bool, layers: list[int]) -> dict:
        c = self.options.chunk_tokens
        return {"kind": "chunk", "key": key, "root": snap.root, "index": j, "start": j * c, "n_tokens": c,
                "kv_dtype": snap.kv_dtype, "row_shape": snap.row_shape, "ring": ring, "layers": layers,
                "row_format": self.options.row_format}

    def _row_bytes(self, snap: Snapshot) -> int:
        return encoded_row_bytes(snap.row_shape, KV_DTYPES[snap.kv_dtype], self.options.row_format)

    def _chunk_size(self, snap: Snapshot, key: str) -> int:
        j, ring, rows = snap.chunk_rows[key]
        c, rb = self.options.chunk_tokens, self._row_bytes(snap)
        fields = self._chunk_fields(snap, key, j, ring, sorted(rows))
        return fileformat.file_size(fields, [("tokens", 4 * c)] + [(f"rows.{i}", 2 * c * rb) for i in sorted(rows)])

    def _manifest(self, snap: Snapshot, n: int, created: float = 0.0) -> tuple[dict, dict, str]:
        """The manifest of the first n tokens: header fields (chunk sizes filled in later), the rows each
        layer keeps {layer: (start, rows)}, the text."""
        c = self.options.chunk_tokens
        keys = snap.keys[: n // c]
        tail_start = len(keys) * c
        layers, spans = [], {}
        for i, (kind, window) in enumerate(snap.layer_kinds):
            start = max(0, n - window) if kind == "sliding" else tail_start
            layers.append({"index": i, "kind": kind, "window": window, "start": start, "rows": n - start})
            spans[i] = (start, n - start)
        fields = {
            "kind": "manifest", "key": manifest_key(keys[-1] if keys else snap.root, snap.tokens[tail_start:n]),
            "root": snap.root, "reason": snap.reason, "created": created, "model_file": snap.model_file,
            "fingerprint": snap.fingerprint, "kv_dtype": snap.kv_dtype, "row_shape": snap.row_shape,
            "chunk_tokens": c, "n_tokens": n, "chunks": keys, "chunk_bytes": [0] * len(keys),
            "chunk_ring": [False] * len(keys), "has_logits": n == snap.n_tokens and snap.logits.size > 0,
            "layers": layers, "sampler": snap.sampler, "meta": snap.meta, "row_format": self.options.row_format,
        }
        return fields, spans, snap.text(n)

    def _manifest_size(self, snap: Snapshot, n: int, created: float) -> int:
        fields, spans, text = self._manifest(snap, n, created)
        for j, k in enumerate(fields["chunks"]):  # the sizes' digits count too, and true is shorter than false
            known = self.chunks.get(k)
            fields["chunk_bytes"][j] = known.nbytes if known else self._chunk_size(snap, k)
            fields["chunk_ring"][j] = known.ring if known else snap.chunk_rows[k][1]
        rb = self._row_bytes(snap)
        logits = snap.logits.nbytes if fields["has_logits"] else 0
        return fileformat.file_size(fields, [("tokens", 4 * n), ("logits", logits), ("text", len(text.encode()))]
                                    + [(f"rows.{i}", 2 * rows * rb) for i, (_, rows) in spans.items()])

    def _write(self, snap: Snapshot, n: int, created: float) -> Entry:
        """Write the first n tokens' missing chunks and manifest; returns the entry."""
        o = self.options
        dtype = KV_DTYPES[snap.kv_dtype]
        fields, spans, text = self._manifest(snap, n, created)
        keys = fields["chunks"]
        for j, key in enumerate(keys):
            known = self.chunks.get(key)
            nbytes, ring = (known.nbytes, known.ring) if known is not None else self._write_chunk(snap, key)
            fields["chunk_bytes"][j], fields["chunk_ring"][j] = nbytes, ring
        key = fields["key"]
        with self._mutex:
            if key in self.entries:  # the same checkpoint again: nothing new to write
                return self.entries[key]
        sections = [("tokens", [np.asarray(snap.tokens[:n], dtype="<i4")]),
                    ("logits", [snap.logits if fields["has_logits"] else np.zeros(0, dtype="<f4")]),
                    ("text", [text.encode("utf-8")])]
        for i, (start, rows) in spans.items():
            t_start, k, v = snap.tail[i]  # the snapshot's rows start at or before this layer's start
            a = start - t_start
            sections.append((f"rows.{i}", encode_rows(k[a : a + rows], v[a : a + rows], dtype, o.row_format)))
        nbytes = fileformat.write_file(self._manifest_path(key), fields, sections, durable=o.fsync)
        entry = Entry(key=key, root=snap.root, n_tokens=n, chunks=keys, chunk_bytes=fields["chunk_bytes"],
                      chunk_ring=fields["chunk_ring"], tokens=np.asarray(snap.tokens[:n], dtype="<i4"), text=text,
                      reason=snap.reason, created=created, nbytes=nbytes, has_logits=fields["has_logits"],
                      model_file=snap.model_file, row_format=o.row_format)
        entry.last_used = entry.created
        return entry

    def _write_chunk(self, snap: Snapshot, key: str) -> tuple[int, bool]:
        """Write a chunk (or find it written by another process): its size and ring flag."""
        j, ring, rows = snap.chunk_rows[key]
        path = self._chunk_path(key)
        try:
            with fileformat.open_regular(path) as f:
                h = fileformat.read_header(f, str(path))
                check_chunk(h, key, j, self.options.chunk_tokens, snap.kv_dtype, snap.row_shape,
                            len(snap.layer_kinds), str(path))
                return os.fstat(f.fileno()).st_size, h.fields["ring"]
        except SessionNotFound:
            pass
        except SessionFileError:
            path.unlink(missing_ok=True)  # damaged: write it again
        c = self.options.chunk_tokens
        dtype = KV_DTYPES[snap.kv_dtype]
        sections = [("tokens", [np.asarray(snap.tokens[j * c : (j + 1) * c], dtype="<i4")])]
        sections += [(f"rows.{i}", encode_rows(*rows[i], dtype, self.options.row_format)) for i in sorted(rows)]
        fields = self._chunk_fields(snap, key, j, ring, sorted(rows))
        return fileformat.write_file(path, fields, sections, durable=self.options.fsync), ring

