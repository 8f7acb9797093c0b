"""The store in a local folder: files, lock, index, and the calls the server makes.

    DIR/.lock                 flock: one writer at a time, across processes
    DIR/store.json            the folder's layout: format version and chunk size
    DIR/chunks/KEY.kvc        rows of chunk_tokens positions (layout.py)
    DIR/manifests/KEY.kvm     one checkpoint (tokens, logits, text, tail, windows)
    DIR/stats/KEY.json        hits and last use, small and rewritten on a hit

Every file is written to a temporary name and renamed, checksummed per
section, verified on every read, its header type-checked field by field. A
corrupt or vanished entry is logged, removed and reported as a miss, never
raised.

Why two kinds of failure: an entry can be damaged (a flipped byte, a chunk
deleted by hand) while the folder is fine -- then that entry goes; or the
folder itself can be unusable (deleted, read-only, full, a file where a
folder should be) -- then every entry would look damaged, and removing them
would lose what a remount or a chmod brings back. So a failed read asks the
folder first (`_folder_problem`), and a folder problem is StoreUnavailable,
which removes nothing. The store recovers by itself: the first call after a
failure reopens the folder (see Store).

Why an index in memory: a lookup must not list a folder. The index is built
at open and kept fresh by one stat of the manifests folder per lookup (a
rename in it changes its mtime), so a second process's checkpoints show up
without a rescan of anything that did not change.

Threads. Checkpoints are written by the store's writer thread
(checkpoint.py) while the worker looks up and restores. Two locks, always
taken in this order: the folder's flock (every change to the files), then
`_mutex` (every read or change of the index, held briefly; never while
waiting for the flock). A restore holds `_mutex` while it reads, so this
process's evictions cannot take its files away mid-read.

Checkpoint files and how much of a checkpoint fits are checkpoint.py's
(CheckpointFiles); staging a restore is restore.py's (Restoring).
"""
from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import logging
import os
import stat
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from .. import fileformat
from ..errors import KvsessionError, SessionFileError, SessionNotFound, UnreadableSession
from ..session import common_prefix
from . import checkpoint, policy
from .layout import (
    CHUNK_SUFFIX,
    LAYOUT_FIELDS,
    MANIFEST_SUFFIX,
    REASONS,
    SMALL_FILE,
    STATS_FIELDS,
    STATS_SUFFIX,
    Chunk,
    Entry,
    Hit,
    chain,
    chain_root,
    check_manifest,
)
from .policy import Protected, StoreOptions
from .restore import Restoring

if TYPE_CHECKING:
    from ..engine import Engine
    from ..session import Session
    from .valkey import ValkeyTier

log = logging.getLogger("kvsession.store")


class StoreError(KvsessionError):
    pass


class StoreUnavailable(StoreError):
    """The store's folder cannot be used: missing (and not to be made again), read-only, full, a file
    where a folder should be, an unusable lock file. Nothing stored was removed; the message is one line
    naming the folder and what is wrong. See Store for which calls to retry."""


class _Damaged(Exception):
    """A manifest or chunk that failed its checks while being read."""

    def __init__(self, kind: str, key: str, error: Exception):
        super().__init__(f"{kind} {key}: {error}")
        self.kind, self.key, self.error = kind, key, error


def _available(method):
    """A public call of Store: it reopens the folder first when the last call found it unusable, and
    turns a failure of the folder itself (any OSError that is not one entry's damage) into StoreUnavailable."""

    @functools.wraps(method)
    def call(self: "Store", *args, **kwargs):
        try:
            if self._broken:
                self._open()
            return method(self, *args, **kwargs)
        except OSError as e:
            self._broken = True
            raise self._unavailable(e) from e
        except StoreUnavailable:
            self._broken = True
            raise

    return call


class Store(checkpoint.CheckpointFiles, Restoring):
    """A disk KV cache in a folder, optionally backed by a shared tier (Valkey).

    Failures. StoreUnavailable means the folder itself cannot be used; it is
    raised by the constructor and by every public method (lookups, restore,
    put, ls, get, delete, gc, clear, verify, find_damage), and nothing stored
    is removed by it. Every one of them is safe to call again later: the
    first call after a failure reopens the folder -- creates it when it is
    missing, with its subfolders when none of chunks/ and manifests/ is
    there (stats/ always), re-reads the index -- and raises again, saying
    why, until the folder is usable. A failed put leaves no partial
    checkpoint; a failed restore leaves the session as it was; a retried
    delete of a checkpoint that is gone is StoreError("no checkpoint").
    One of chunks/ and manifests/ missing without the other is never made
    again empty: that would make every checkpoint look damaged, or every
    chunk an orphan, and lose them once the folder came back. A Store that
    cannot be constructed is retried by constructing it again. The shared
    tier never raises: while it fails, the store works from its folder alone.
    """

    def __init__(self, folder: str | os.PathLike, options: StoreOptions = StoreOptions(), *,
                 shared: "ValkeyTier | None" = None):
        self.dir = Path(folder)
        self.options = options
        self.chunk_dir = self.dir / "chunks"
        self.manifest_dir = self.dir / "manifests"
        self.stats_dir = self.dir / "stats"  # apart, so a hit does not touch the manifests folder's mtime
        self.entries: dict[str, Entry] = {}
        self.chunks: dict[str, Chunk] = {}
        # base chain key -> tail tokens -> manifest key: a lookup probes the tail lengths present
        self.by_base: dict[str, dict[tuple[int, ...], str]] = {}
        self._seen_mtime = 0
        self._mutex = threading.RLock()
        self._writer = checkpoint.Writer(lambda snap: self._commit(snap))
        self._broken = True  # the folder must be opened before use
        if shared is None and options.shared_url:
            from .valkey import ValkeyTier

            shared = ValkeyTier.from_options(options)
        self.shared = shared
        try:
            self._open()
        except OSError as e:
            raise self._unavailable(e) from e
        self._writer.start()

    # --- the folder, locking, index ------------------------------------------------------

    def _open(self) -> None:
        """Make the folder usable and the index exact: at construction, and on the first call after a failure."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with self._locked(), self._mutex:
            if os.path.lexists(self.chunk_dir) == os.path.lexists(self.manifest_dir):  # see the class docstring
                self.chunk_dir.mkdir(exist_ok=True)
                self.manifest_dir.mkdir(exist_ok=True)
            self.stats_dir.mkdir(exist_ok=True)
            self._check_usable()
            self._adopt_layout()
            self._clean_temporaries()
            self._sync(force=True)
            self._remove_orphan_chunks()
        self._broken = False

    def _layout_problem(self) -> str | None:
        """What is wrong with the folder's structure, in words: a part missing, or not what it should be."""
        for d in (self.dir, self.chunk_dir, self.manifest_dir, self.stats_dir):
            try:
                mode = os.stat(d).st_mode
            except FileNotFoundError:
                return f"{d} is missing"
            except OSError as e:
                return f"{d}: {e.strerror}"
            if not stat.S_ISDIR(mode):
                return f"{d} is {fileformat.file_kind(mode)}, not a folder"
        lock = self.dir / ".lock"
        try:
            mode = os.lstat(lock).st_mode
        except FileNotFoundError:
            return None
        except OSError as e:
            return f"{lock}: {e.strerror}"
        return None if stat.S_ISREG(mode) else f"{lock} is {fileformat.file_kind(mode)}, not a lock file"

    def _folder_problem(self) -> str | None:
        """The layout's problem, or a part this process cannot write in (a read-only mount, a chmod)."""
        problem = self._layout_problem()
        if problem is None:
            for d in (self.dir, self.chunk_dir, self.manifest_dir, self.stats_dir):
                if not os.access(d, os.R_OK | os.W_OK | os.X_OK):
                    return f"{d} is read-only (or not writable by this user)"
        return problem

    def _check_usable(self) -> None:
        problem = self._folder_problem()
        if problem:
            raise StoreUnavailable(f"store {self.dir} is unavailable: {problem}")

    def _unavailable(self, e: OSError) -> StoreUnavailable:
        problem = self._layout_problem() or (f"{e.strerror}: {e.filename}" if e.filename else str(e.strerror or e))
        return StoreUnavailable(f"store {self.dir} is unavailable: {problem}")

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock, also when a killed process's fd goes away

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """The lock, and a folder fit to write in: a failure is found before anything is changed."""
        with self._locked():
            self._check_usable()
            yield

    @contextmanager
    def _reading(self, kind: str, key: str) -> Iterator[None]:
        """Turn a failure to read one entry into _Damaged -- unless the folder is at fault: StoreUnavailable."""
        try:
            yield
        except (SessionNotFound, UnreadableSession, OSError) as e:
            problem = self._folder_problem()
            if problem:
                raise StoreUnavailable(f"store {self.dir} is unavailable: {problem}") from e
            raise _Damaged(kind, key, e) from e
        except (SessionFileError, ValueError) as e:  # ValueError: text that is not UTF-8
            raise _Damaged(kind, key, e) from e

    def _adopt_layout(self) -> None:
        """A folder keeps the chunk size it was made with: other sizes would name other chunks."""
        path = self.dir / "store.json"
        try:
            layout = json.loads(fileformat.read_small(path, SMALL_FILE))
            fileformat.check_json(layout, LAYOUT_FIELDS, str(path), what="field")
            chunk = layout["chunk_tokens"]
        except SessionNotFound:
            fileformat.atomic_write(path, lambda f: f.write(json.dumps(
                {"format": "kvsession-store", "version": 1, "chunk_tokens": self.options.chunk_tokens}).encode()),
                durable=self.options.fsync)
            return
        except (SessionFileError, ValueError, RecursionError) as e:
            raise StoreUnavailable(f"{path}: unreadable store layout ({e}); is {self.dir} a kvsession cache "
                                   "folder?") from None
        if chunk != self.options.chunk_tokens:
            log.info("store %s: using its chunk size %d (asked for %d)", self.dir, chunk, self.options.chunk_tokens)
            self.options = dataclasses.replace(self.options, chunk_tokens=chunk)

    def _clean_temporaries(self) -> None:
        """Remove files a killed writer left half-written. Call with the lock held: no writer is active."""
        for d in (self.dir, self.chunk_dir, self.manifest_dir, self.stats_dir):
            for e in os.scandir(d):
                if e.name.startswith(".") and e.name.endswith(".tmp") and not e.is_dir(follow_symlinks=False):
                    log.info("store: removing a temporary file left by a killed writer: %s", e.path)
                    Path(e.path).unlink(missing_ok=True)

    def _sync(self, force: bool = False) -> None:
        """Bring the index up to date with the manifests folder, reading only what changed (under _mutex).

        The folder's mtime counts as seen only once its listing was read whole: a listing that failed
        is tried again by the next call.
        """
        mtime = self.manifest_dir.stat().st_mtime_ns
        if not force and mtime == self._seen_mtime:
            return
        present = {e.name[: -len(MANIFEST_SUFFIX)] for e in os.scandir(self.manifest_dir)
                   if e.name.endswith(MANIFEST_SUFFIX) and not e.name.startswith(".") and e.is_file()}
        for key in set(self.entries) - present:
            self._forget(key)
        for key in present - set(self.entries):
            entry = self._read_entry(key)
            if entry is not None:
                self._remember(entry)
        self._seen_mtime = mtime

    def _read_entry(self, key: str) -> Entry | None:
        path = self._manifest_path(key)
        try:
            with self._reading("manifest", key), fileformat.open_regular(path) as f:
                h = fileformat.read_header(f, str(path))
                check_manifest(h, key, self.options.chunk_tokens, str(path))
                tokens = np.frombuffer(fileformat.read_section(f, h, "tokens", where=str(path)), dtype="<i4").copy()
                text = bytes(fileformat.read_section(f, h, "text", where=str(path))).decode("utf-8")
                nbytes = os.fstat(f.fileno()).st_size
        except _Damaged as damaged:
            if not isinstance(damaged.error, SessionNotFound):  # else another process removed it since the listing
                log.warning("store: removing damaged manifest %s: %s", path, damaged.error)
                self._unlink_manifest(key)
            return None
        d = h.fields
        entry = Entry(key=key, root=d["root"], n_tokens=d["n_tokens"], chunks=d["chunks"], chunk_bytes=d["chunk_bytes"],
                      chunk_ring=d["chunk_ring"], tokens=tokens, text=text, reason=d["reason"], created=d["created"],
                      nbytes=nbytes, has_logits=d["has_logits"], model_file=d["model_file"],
                      row_format=d.get("row_format", "exact"))
        entry.last_used = entry.created
        self._read_stats(entry)
        return entry

    def _read_stats(self, entry: Entry) -> None:
        path = self._stats_path(entry.key)
        try:
            s = json.loads(fileformat.read_small(path, SMALL_FILE))
            fileformat.check_json(s, STATS_FIELDS, str(path), what="field")
        except (SessionFileError, ValueError, RecursionError):
            return  # no hits yet, or a damaged stats file: start from zero
        entry.hits, entry.hits_at, entry.last_used = s["hits"], s["hits_at"], s["last_used"]

    def _remember(self, entry: Entry) -> None:
        self.entries[entry.key] = entry
        self.by_base.setdefault(entry.base, {})[self._tail(entry)] = entry.key
        for key, nbytes, ring in zip(entry.chunks, entry.chunk_bytes, entry.chunk_ring):
            self.chunks.setdefault(key, Chunk(nbytes, ring)).users.add(entry.key)

    def _forget(self, key: str) -> None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        tails = self.by_base.get(entry.base)
        if tails is not None:
            tails.pop(self._tail(entry), None)
            if not tails:
                del self.by_base[entry.base]
        for c in entry.chunks:
            chunk = self.chunks.get(c)
            if chunk is not None:
                chunk.users.discard(key)
                if not chunk.users:
                    del self.chunks[c]

    def _tail(self, entry: Entry) -> tuple[int, ...]:
        return tuple(entry.tokens[len(entry.chunks) * self.options.chunk_tokens :].tolist())

    def _remove_orphan_chunks(self) -> None:
        for e in os.scandir(self.chunk_dir):
            if (e.name.endswith(CHUNK_SUFFIX) and e.name[: -len(CHUNK_SUFFIX)] not in self.chunks
                    and not e.is_dir(follow_symlinks=False)):
                Path(e.path).unlink(missing_ok=True)

    def _chunk_path(self, key: str) -> Path:
        return self.chunk_dir / (key + CHUNK_SUFFIX)

    def _manifest_path(self, key: str) -> Path:
        return self.manifest_dir / (key + MANIFEST_SUFFIX)

    def _stats_path(self, key: str) -> Path:
        return self.stats_dir / (key + STATS_SUFFIX)

    def _unlink_manifest(self, key: str) -> None:
        self._manifest_path(key).unlink(missing_ok=True)
        self._stats_path(key).unlink(missing_ok=True)

    def _mark_synced(self) -> None:
        """After our own writes under the lock the index is exact: the next lookup need not relist."""
        self._seen_mtime = self.manifest_dir.stat().st_mtime_ns

    def root(self, engine: "Engine", kv_dtype: str = "f16") -> str:
        """The chain root this store's checkpoints of `engine` with `kv_dtype` rows hang from."""
        return chain_root(engine.fingerprint.digest, kv_dtype, self.options.chunk_tokens, self.options.row_format)

    # --- sizes, value and policy ---------------------------------------------------------

    def total_bytes(self) -> int:
        with self._mutex:
            return sum(e.nbytes for e in self.entries.values()) + sum(c.nbytes for c in self.chunks.values())

    def exclusive_bytes(self, entry: Entry) -> int:
        """What deleting this checkpoint frees: its manifest and the chunks no other checkpoint names."""
        return policy.exclusive_bytes(entry, self.chunks)

    def decayed_hits(self, entry: Entry, now: float | None = None) -> float:
        return policy.decayed_hits(self.options, entry, now)

    def value(self, entry: Entry, now: float | None = None) -> float:
        """Eviction score: hits (decayed) plus one, times tokens per byte it alone costs. Lowest goes first."""
        return policy.value(self.options, entry, self.chunks, now)

    def continued_frontier(self, n_tokens: int, last_saved: int) -> int:
        """The chunk-aligned frontier a growing session of n_tokens owes a "continued" checkpoint for
        (pass it as n_tokens to checkpoint_async), or 0. See policy.py."""
        return policy.continued_frontier(self.options, n_tokens, last_saved)

    def should_checkpoint(self, n_tokens: int, last_saved: int) -> bool:
        """A growing session has passed a continued frontier since its last checkpoint."""
        return self.continued_frontier(n_tokens, last_saved) > 0

    # --- checkpoints -----------------------------------------------------------------------

    @_available
    def put(self, session: "Session", reason: str, *, protect: Hit | None = None,
            n_tokens: int | None = None) -> Entry | None:
        """Checkpoint a session now, on this thread: its missing chunks, a manifest, then eviction.

        Returns the entry, or None when nothing was kept (below min_tokens, a cold prompt outside the
        cold policy, too big for the budget). protect: a hit about to be restored -- eviction leaves its
        checkpoint and chunks, and a checkpoint that does not fit beside them is cut to the whole chunks
        that do (or not kept). n_tokens: checkpoint only the first n_tokens (a continued frontier).
        """
        snap = self._snapshot(session, reason, protect, n_tokens, copy=False, skip_pending=False)
        return None if snap is None else self._commit(snap)

    def checkpoint_async(self, session: "Session", reason: str, *, protect: Hit | None = None,
                         n_tokens: int | None = None) -> Future:
        """put(), written by the store's writer thread: a Future of the Entry (or None).

        On this thread it copies only what the store does not hold yet (see checkpoint.py), so the session
        may change as soon as this returns. Failures -- StoreUnavailable among them -- are the future's."""
        future: Future = Future()
        try:
            snap = self._snapshot_checked(session, reason, protect, n_tokens)
            if snap is not None:
                return self._writer.submit(snap)
        except Exception as e:  # StoreUnavailable, a closed store, a bad argument
            future.set_exception(e)
            return future
        future.set_result(None)
        return future

    @_available
    def _snapshot_checked(self, session, reason, protect, n_tokens):
        return self._snapshot(session, reason, protect, n_tokens, copy=True, skip_pending=True)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every checkpoint submitted so far (and the shared tier's write-through); False on a timeout."""
        done = self._writer.flush(timeout)
        if self.shared is not None:
            done = self.shared.flush(timeout) and done
        return done

    def close(self, timeout: float | None = None) -> bool:
        """Write what is pending, then stop the writer threads. The store can still be read afterwards."""
        done = self._writer.close(timeout)
        if self.shared is not None:
            done = self.shared.close(timeout) and done
        return done

    def _snapshot(self, session: "Session", reason: str, protect: Hit | None, n_tokens: int | None, *,
                  copy: bool, skip_pending: bool) -> checkpoint.Snapshot | None:
        """How many tokens this checkpoint keeps (the policy), and a snapshot of them; None: nothing to keep."""
        if reason not in REASONS:
            raise ValueError(f"save reason {reason!r}: one of {', '.join(REASONS)}")
        o = self.options
        n = len(session) if n_tokens is None else n_tokens
        if not 0 <= n <= len(session):
            raise ValueError(f"n_tokens {n_tokens}: the session holds {len(session)} tokens")
        if reason == "cold":
            n = policy.cold_length(o, n)
            if n and not self._windows_live(session, n):  # a trimmed save needs the rings' rows at that point
                n = len(session)
        elif n < len(session) and not self._windows_live(session, n):
            n = len(session)
        if n < o.min_tokens or n == 0:
            return None
        session.check_meta(f"store {self.dir}", error=StoreError)  # a manifest must be readable again
        root = self.root(session.engine, session.kv_dtype)
        keys = chain(root, session.tokens[:n], o.chunk_tokens)
        with self._mutex:
            skip = set(self.chunks)
        if skip_pending:
            skip |= self._writer.pending_keys()
        return checkpoint.take(session, reason=reason, root=root, n=n, chunk=o.chunk_tokens, keys=keys, skip=skip,
                               copy=copy, protect=protect)

    def _windows_live(self, session: "Session", n: int) -> bool:
        return all(layer.start <= max(0, n - layer.window) for layer in session.cache if layer.ring)

    @_available
    def _commit(self, snap: checkpoint.Snapshot) -> Entry | None:
        """Write a snapshot under the folder's lock: what fits of it, its missing chunks, its manifest."""
        with self._writing():
            with self._mutex:
                self._sync()
                keep = self._protection(snap.protect)
                created = time.time()
                n = self._plan(snap, keep, created)
            if not n:
                log.warning("store: a checkpoint of %d tokens does not fit the budget of %d bytes beside what "
                            "is protected; not kept", snap.n_tokens, self.options.budget_bytes)
                return None
            try:
                entry = self._write(snap, n, created)
            except OSError:
                with suppress(OSError), self._mutex:  # what is left now is removed at the next open
                    self._remove_orphan_chunks()
                raise
            with self._mutex:
                self._remember(entry)
                self._enforce_budget(keep, new=entry.key)
                self._mark_synced()
                kept = self.entries.get(entry.key)
        if kept is not None and self.shared is not None:
            self.shared.push(self, kept)
        return kept

    def _protection(self, hit: Hit | None) -> Protected:
        """What an eviction must leave for a hit: its checkpoint, or one that names its deepest chunk."""
        if hit is None:
            return Protected()
        entries = set()
        if hit.entry is not None:
            entries.add(hit.entry.key)
        return Protected(frozenset(entries), frozenset(hit.chunks))

    def _enforce_budget(self, keep: Protected, new: str | None = None) -> None:
        """Evict down to the budget (under the lock and _mutex), never what `keep` protects nor `new`,
        unless `new` itself does not fit: then it goes."""
        now = time.time()
        keep_new = Protected(keep.entries | ({new} if new else set()), keep.chunks)
        while self.total_bytes() > self.options.budget_bytes:
            loose = next((k for k, ch in self.chunks.items() if not ch.users and k not in keep.chunks), None)
            if loose is not None:  # a chunk fetched for a chunk-boundary hit, named by no checkpoint
                self._chunk_path(loose).unlink(missing_ok=True)
                del self.chunks[loose]
                continue
            victim = policy.victim(self.options, self.entries, self.chunks, keep_new, now)
            if victim is None:
                victim = self.entries.get(new) if new else None
                if victim is None:
                    break
                log.warning("store: a checkpoint of %d bytes exceeds the budget of %d; not kept",
                            self.exclusive_bytes(victim), self.options.budget_bytes)
            self._delete(victim.key)
            if victim.key == new:
                break

    def _delete(self, key: str) -> None:
        entry = self.entries.get(key)
        if entry is None:
            return
        self._unlink_manifest(key)
        self._forget(key)
        for c in entry.chunks:
            if c not in self.chunks:  # no kept checkpoint names it any more
                self._chunk_path(c).unlink(missing_ok=True)
        self._mark_synced()

    # --- lookups -------------------------------------------------------------------------

    @_available
    def longest_prefix(self, tokens: Sequence[int], engine: "Engine", kv_dtype: str = "f16") -> Hit | None:
        """The longest stored prefix of `tokens`: a whole checkpoint, or any chunk boundary of one.

        With a shared tier, a longer prefix held there is brought into the folder first (verified like
        any file, then kept locally) and returned with source "shared"."""
        root = self.root(engine, kv_dtype)
        keys = chain(root, tokens, self.options.chunk_tokens)
        window = max((s.window for s in engine.config.layers if s.kind == "sliding"), default=0)
        with self._mutex:
            self._sync()
            best = self._local_prefix(tokens, root, keys, window)
        if self.shared is not None:
            from .valkey import shared_prefix

            remote = shared_prefix(self, tokens, root, keys, window, best)
            if remote is not None:
                best = remote
        return best

    def _local_prefix(self, tokens: Sequence[int], root: str, keys: list[str], window: int) -> Hit | None:
        c = self.options.chunk_tokens
        best_chunks, matched = 0, []
        for j, key in enumerate(keys):
            if key not in self.chunks:
                break
            matched.append(key)
            # a boundary is restorable when its chunks hold the sliding layers' window before it
            first = max(0, (j + 1) * c - window) // c if window else j + 1
            if all(self.chunks[k].ring for k in matched[first:]):
                best_chunks = j + 1
        best: Hit | None = None
        for j in range(len(matched), -1, -1):  # the deepest base first: its checkpoints are the longest
            tails = self.by_base.get(matched[j - 1] if j else root)
            if not tails:
                continue
            rest = tuple(tokens[j * c : (j + 1) * c])
            lengths = sorted({len(t) for t in tails if len(t) <= len(rest)}, reverse=True)
            key = next((tails[rest[:n]] for n in lengths if rest[:n] in tails), None)
            if key is not None:
                e = self.entries[key]
                best = Hit(e.n_tokens, list(tokens[: e.n_tokens]), list(e.chunks), e)
                break
        if not window:  # a checkpoint that goes on past the query (a retried request) still holds its prefix
            tails = self.by_base.get(matched[-1] if matched else root, {})
            rest = tokens[len(matched) * c : (len(matched) + 1) * c]
            for tail, key in tails.items():
                n = len(matched) * c + common_prefix(tail, rest)
                if n > (best.n_tokens if best else 0) and n > len(matched) * c:
                    best = Hit(n, list(tokens[:n]), list(matched), self.entries[key])
        if best_chunks and (best is None or best_chunks * c > best.n_tokens):
            best = Hit(best_chunks * c, list(tokens[: best_chunks * c]), matched[:best_chunks])
        return best

    @_available
    def longest_text_prefix(self, text: str, engine: "Engine", kv_dtype: str = "f16") -> tuple[Hit, str] | None:
        """ds4's lookup by rendered bytes: the checkpoint whose text is the longest prefix of `text`
        (in this folder: the shared tier is looked up by tokens only).

        Returns the hit (its exact stored tokens) and the rest of the text, which
        is all the caller needs to tokenize.
        """
        root = self.root(engine, kv_dtype)
        with self._mutex:
            self._sync()
            best = None
            for e in self.entries.values():
                if e.root == root and text.startswith(e.text) and (best is None or len(e.text) > len(best.text)):
                    best = e
        if best is None:
            return None
        return Hit(best.n_tokens, best.tokens.tolist(), list(best.chunks), best), text[len(best.text):]

    # --- restore -------------------------------------------------------------------------

    @_available
    def restore(self, hit: Hit, session: "Session") -> bool:
        """Load a hit into a session, reusing the rows the session already holds for its prefix.

        Every byte is read and checked before the session changes (rows past its end may be filled
        in place first: no reader sees them). On a corrupt or vanished entry the entry is removed, the
        session is left as it was, and False is returned: a miss.
        """
        keep = min(common_prefix(session.tokens, hit.tokens), hit.n_tokens)
        e = hit.entry
        try:
            with self._mutex:
                rows, filled, logits = self._stage(hit, e, session, keep)
        except _Damaged as damaged:
            log.warning("store: miss on a damaged %s (%s); removing it", damaged.kind, damaged.error)
            with self._writing(), self._mutex:
                self._sync()
                if damaged.kind == "manifest":
                    self._delete(damaged.key)
                else:  # only the checkpoints that name this chunk lose it; shared good chunks stay
                    self._drop_chunk(damaged.key)
            if self.shared is not None and not isinstance(damaged.error, SessionNotFound):
                self.shared.forget(self.root(session.engine, session.kv_dtype), damaged.kind, damaged.key)
            return False
        session.restore_rows(hit.tokens, rows, logits, keep=keep, filled=filled)
        if e is not None:
            self._record_hit(e)
        return True

    def _drop_chunk(self, key: str) -> None:
        """A damaged chunk takes every checkpoint that names it along."""
        chunk = self.chunks.get(key)
        for user in list(chunk.users if chunk else ()):
            self._delete(user)
        self.chunks.pop(key, None)
        self._chunk_path(key).unlink(missing_ok=True)

    def _record_hit(self, e: Entry) -> None:
        """Count a hit now; its statistics file is written by the writer thread (a rename costs a restore
        milliseconds)."""
        now = time.time()
        e.hits = self.decayed_hits(e, now) + 1.0
        e.hits_at = e.last_used = now
        stats = json.dumps({"hits": e.hits, "hits_at": e.hits_at, "last_used": e.last_used}).encode()
        self._writer.later(lambda: self._write_stats(e.key, stats))

    def _write_stats(self, key: str, stats: bytes) -> None:
        with self._mutex:  # an eviction (under _mutex) removes the stats file with its manifest
            if key not in self.entries:
                return
            try:
                fileformat.atomic_write(self._stats_path(key), lambda f: f.write(stats), durable=False)
            except OSError as err:  # statistics are a hint; a full disk must not fail a restore
                log.info("store: cannot record a hit: %s", err)

    # --- housekeeping ----------------------------------------------------------------------

    @_available
    def ls(self) -> list[Entry]:
        with self._mutex:
            self._sync()
            return sorted(self.entries.values(), key=lambda e: e.last_used, reverse=True)

    @_available
    def get(self, key_prefix: str) -> Entry:
        with self._mutex:
            self._sync()
            found = [e for k, e in self.entries.items() if k.startswith(key_prefix)]
        if len(found) != 1:
            raise StoreError(f"{len(found)} checkpoints match {key_prefix!r}" + (": give more of the key"
                                                                                if found else ""))
        return found[0]

    @_available
    def delete(self, key: str) -> None:
        with self._writing(), self._mutex:
            self._sync()
            if key not in self.entries:
                raise StoreError(f"no checkpoint {key!r} in {self.dir}")
            self._delete(key)

    @_available
    def gc(self) -> dict:
        """Remove temporaries, orphan chunks and damaged entries; enforce the budget. Returns counts."""
        with self._writing(), self._mutex:
            before = (len(self.entries), self.total_bytes())
            self._clean_temporaries()
            self._sync(force=True)
            for key in list(self.entries):
                if not self.verify(self.entries[key]):
                    self._delete(key)
            self._remove_orphan_chunks()
            self._enforce_budget(Protected())
            return {"removed": before[0] - len(self.entries), "freed_bytes": before[1] - self.total_bytes()}

    def verify(self, e: Entry) -> bool:
        """Every checksum of a checkpoint and its chunks; a damaged one is logged."""
        damage = self.find_damage(e)
        if damage is not None:
            log.warning("store: damaged checkpoint %s: %s", e.key, damage)
        return damage is None

    @_available
    def find_damage(self, e: Entry) -> str | None:
        """The first check a checkpoint or one of its chunks fails, in words, or None when all hold.

        Streams every section (memory stays a block). A folder that cannot be read is StoreUnavailable,
        not damage.
        """
        files = [("manifest", e.key, self._manifest_path(e.key))] + [("chunk", c, self._chunk_path(c)) for c in e.chunks]
        for kind, key, path in files:
            try:
                with self._reading(kind, key), fileformat.open_regular(path) as f:
                    h = fileformat.read_header(f, str(path))
                    for s in h.sections:
                        fileformat.verify_section(f, h, s.name, where=str(path))
            except _Damaged as damaged:
                return str(damaged.error)
        return None

    @_available
    def clear(self) -> int:
        with self._writing(), self._mutex:
            self._sync(force=True)
            n = len(self.entries)
            for key in list(self.entries):
                self._delete(key)
            self.chunks.clear()
            self._remove_orphan_chunks()
            return n
