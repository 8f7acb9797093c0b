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

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..kv.state import SessionState
from .layout import Entry

if TYPE_CHECKING:
    from .layout import Hit

log = logging.getLogger("kvsession.store")


@dataclass
class Snapshot:
    """One checkpoint's content, independent of the session it came from: its state's metadata (tokens,
    logits, sampler, meta, the model's identity; copied when the state was made) and private copies of the
    rows to write. Rows are host arrays [n, H, D] in the cache's dtype, logical order; the state's layers are
    never read after `take`."""

    reason: str
    root: str
    state: SessionState  # the session at n_tokens
    keys: list[str]  # chain keys of its whole chunks
    chunk_rows: dict[str, tuple[int, bool, dict]]  # key -> (j, ring, {layer: (k, v)}): the chunks to write
    tail: dict[int, tuple[int, np.ndarray, np.ndarray]]  # layer -> (start, k, v): the manifest's rows
    layer_kinds: list[tuple[int, str, int]]  # per attention layer: index, kind, window
    protect: "Hit | None" = None
    futures: list[Future] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.state.tokens

    @property
    def n_tokens(self) -> int:
        return self.state.n_tokens

    def text(self, n: int) -> str:
        """The rendered text of the first n tokens (decoded once: planning and writing both need it)."""
        return self.state.text(n)

    def continues(self, older: "Snapshot") -> bool:
        """This snapshot covers `older`: same chain, older's tokens a prefix of these, nothing else to protect, and
        no recurrent states (a hybrid's checkpoint is restorable at its own end only: a longer one does not hold
        the states at a shorter one's frontier)."""
        n = older.n_tokens
        return (older.root == self.root and n <= self.n_tokens and self.tokens[:n] == older.tokens
                and older.protect is None and not older.state.recurrent)


def take(state: SessionState, *, reason: str, root: str, chunk: int, keys: list[str], skip: set[str], copy: bool,
         protect: "Hit | None") -> Snapshot:
    """Snapshot a session's state: the rows of chunks not in `skip`, the manifest's parts.

    copy: take private copies of rows that are views of a CPU cache (for a write on another thread);
    rows read from another device are copies already."""
    n = state.n_tokens
    chunk_rows = {}
    for j, key in enumerate(keys):
        if key in skip or key in chunk_rows:
            continue
        start = j * chunk
        ring = all(layer.cache.start <= start for layer in state.layers if layer.ring)
        chunk_rows[key] = (j, ring, {layer.index: layer.read(start, chunk, copy=copy) for layer in state.layers
                                     if ring or not layer.ring})
    tail_start = len(keys) * chunk
    tail = {}
    for layer in state.layers:
        start = layer.start if layer.ring else tail_start
        tail[layer.index] = (start, *layer.read(start, n - start, copy=copy))
    return Snapshot(reason=reason, root=root, state=state, keys=keys, chunk_rows=chunk_rows, tail=tail,
                    layer_kinds=[(layer.index, layer.kind, layer.window) for layer in state.layers], protect=protect)


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

    def relied_keys(self) -> set[str]:
        """Chunks that queued snapshots name but do not carry (on disk when they were taken, or left to a
        snapshot before them): they must still be there when those snapshots are written."""
        with self._cv:
            return {k for s in self._queue if isinstance(s, Snapshot) for k in s.keys if k not in s.chunk_rows}

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
