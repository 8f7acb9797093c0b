"""The local folder tier: the store's files in a folder, its lock, its index and its budget.

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
folder first (`problem`), and a folder problem is StoreUnavailable, which
removes nothing. The store above recovers by itself: its first call after a
failure reopens the folder (store.py).

Why an index in memory: a lookup must not list a folder. The index is built
at open and kept fresh by one stat of the manifests folder per lookup (a
rename in it changes its mtime), so a second process's checkpoints show up
without a rescan of anything that did not change.

Threads. Checkpoints are written by the store's writer thread while the
worker looks up and restores. Two locks, always taken in this order: the
folder's (`writing`: the flock, for every change to the files; re-entered by
the thread that holds it), then `mutex` (every read or change of the index,
held briefly; never while waiting for the folder's lock). A restore holds
`mutex` while it reads, so this process's evictions cannot take its files
away mid-read. A method that changes files takes both itself; a caller that
needs several under one hold takes them around the calls.

The folder is a tier (tier.py) over its index: contains, get, put, remove,
listing, touch. It keeps its own budget (evict_to_budget, by policy.py's
choice); what to look up, restore and checkpoint is the store's.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import stat
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from ..errors import (
    KvsessionError,
    SessionFileError,
    SessionNotFound,
    UnreadableSession,
)
from ..files import framing
from ..files.fields import check_json
from . import policy
from .layout import (
    CHUNK_FIELDS,
    CHUNK_SUFFIX,
    LAYOUT_FIELDS,
    MANIFEST_SUFFIX,
    SMALL_FILE,
    STATS_FIELDS,
    STATS_SUFFIX,
    Chunk,
    Entry,
    check_manifest,
    is_key,
)
from .policy import Protected, StoreOptions
from .tier import CHUNK, MANIFEST, FileKey, Listing, Tail

log = logging.getLogger("kvsession.store")


class StoreError(KvsessionError):
    pass


class StoreUnavailable(StoreError):
    """The store's folder cannot be used: missing (and not to be made again), read-only, full, a file
    where a folder should be, an unusable lock file. Nothing stored was removed; the message is one line
    naming the folder and what is wrong. See Store for which calls to retry."""


@dataclass(frozen=True)
class Removal:
    """A file the folder removed because it could not be served: what it was, and why."""

    path: Path
    kind: str  # "damaged" (its own checks fail), "dangling" (names a chunk that is not there or not sound),
    # "temporary" (a killed writer's), "orphan" (named by no checkpoint)
    why: str

    def __str__(self) -> str:
        return f"{self.kind} {self.path.parent.name}/{self.path.name}: {self.why}"


class Damaged(Exception):
    """A manifest or chunk that failed its checks while being read."""

    def __init__(self, kind: str, key: str, error: Exception):
        super().__init__(f"{kind} {key}: {error}")
        self.kind, self.key, self.error = kind, key, error


class FolderTier:
    """The store's first tier: chunks and manifests in a folder, indexed in memory (see the module's docstring).

    A folder holds the files of every chain root side by side: their keys, chained over the root, never meet.
    `options` are the store's, with the chunk size the folder was made with.
    """

    def __init__(self, folder: str | os.PathLike, options: StoreOptions):
        self.dir = Path(folder)
        self.options = options
        self.chunk_dir = self.dir / "chunks"
        self.manifest_dir = self.dir / "manifests"
        self.stats_dir = self.dir / "stats"  # apart, so a hit does not touch the manifests folder's mtime
        self.entries: dict[str, Entry] = {}
        self.chunks: dict[str, Chunk] = {}
        # base chain key -> tail tokens -> manifest key: a lookup probes the tail lengths present
        self.by_base: dict[str, dict[tuple[int, ...], str]] = {}
        self.mutex = threading.RLock()
        self._seen_mtime = 0
        self._holder = threading.RLock()  # this process's threads take the flock one at a time
        self._held = 0  # how deep the thread in _holder is in writing()
        self.evictions = 0  # checkpoints this process evicted for the budget (/metrics)
        self.removed_at_open: list[Removal] = []  # what the last open() removed (`cache verify` reports it)
        # chunks that checkpoints queued in this process will name without writing them (the Store's writer):
        # an eviction leaves them, or those checkpoints would be left with a gap and not kept
        self.pinned: Callable[[], set[str]] = set

    # --- the folder and its lock -------------------------------------------------------

    def open(self) -> None:
        """Make the folder usable and the index exact: at construction, and on the first call after a failure."""
        framing.private_folder(self.dir)
        with self._holding(check=False), self.mutex:  # the folder is checked once its parts are made
            if os.path.lexists(self.chunk_dir) == os.path.lexists(self.manifest_dir):  # see Store (store.py)
                framing.private_folder(self.chunk_dir)
                framing.private_folder(self.manifest_dir)
            framing.private_folder(self.stats_dir)
            self._check_usable()
            self._adopt_layout()
            removed = self.clean_temporaries()
            removed += self.sync(force=True)
            self.removed_at_open = removed + self.remove_orphan_chunks()

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
                return f"{d} is {framing.file_kind(mode)}, not a folder"
        lock = self.dir / ".lock"
        try:
            mode = os.lstat(lock).st_mode
        except FileNotFoundError:
            return None
        except OSError as e:
            return f"{lock}: {e.strerror}"
        return None if stat.S_ISREG(mode) else f"{lock} is {framing.file_kind(mode)}, not a lock file"

    def problem(self) -> str | None:
        """The layout's problem, or a part this process cannot write in (a read-only mount, a chmod)."""
        problem = self._layout_problem()
        if problem is None:
            for d in (self.dir, self.chunk_dir, self.manifest_dir, self.stats_dir):
                if not os.access(d, os.R_OK | os.W_OK | os.X_OK):
                    return f"{d} is read-only (or not writable by this user)"
        return problem

    def _check_usable(self) -> None:
        problem = self.problem()
        if problem:
            raise StoreUnavailable(f"store {self.dir} is unavailable: {problem}")

    def unavailable(self, e: OSError) -> StoreUnavailable:
        """A failed system call as what it says about the folder."""
        problem = self._layout_problem() or (f"{e.strerror}: {e.filename}" if e.filename else str(e.strerror or e))
        return StoreUnavailable(f"store {self.dir} is unavailable: {problem}")

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock, also when a killed process's fd goes away

    def writing(self):
        """The folder's lock, and a folder fit to write in: a failure is found before anything is changed."""
        return self._holding(check=True)

    @contextmanager
    def _holding(self, *, check: bool) -> Iterator[None]:
        """The flock, re-entered by the thread that holds it: a second flock of this process's own, on
        another descriptor, would wait for the first forever."""
        with self._holder:
            if self._held:
                self._held += 1
                try:
                    yield
                finally:
                    self._held -= 1
                return
            with self._locked():
                if check:
                    self._check_usable()
                self._held = 1
                try:
                    yield
                finally:
                    self._held = 0

    @contextmanager
    def reading(self, kind: str, key: str) -> Iterator[None]:
        """Turn a failure to read one entry into Damaged -- unless the folder is at fault: StoreUnavailable."""
        try:
            yield
        except (SessionNotFound, UnreadableSession, OSError) as e:
            problem = self.problem()
            if problem:
                raise StoreUnavailable(f"store {self.dir} is unavailable: {problem}") from e
            raise Damaged(kind, key, e) from e
        except (SessionFileError, ValueError) as e:  # ValueError: text that is not UTF-8
            raise Damaged(kind, key, e) from e

    def _adopt_layout(self) -> None:
        """A folder keeps the chunk size it was made with: other sizes would name other chunks."""
        path = self.dir / "store.json"
        try:
            layout = json.loads(framing.read_small(path, SMALL_FILE))
            check_json(layout, LAYOUT_FIELDS, str(path), what="field")
            chunk = layout["chunk_tokens"]
        except SessionNotFound:
            framing.atomic_write(path, lambda f: f.write(json.dumps(
                {"format": "kvsession-store", "version": 1, "chunk_tokens": self.options.chunk_tokens}).encode()),
                durable=self.options.fsync)
            return
        except (SessionFileError, ValueError, RecursionError) as e:
            raise StoreUnavailable(f"{path}: unreadable store layout ({e}); is {self.dir} a kvsession cache "
                                   "folder?") from None
        if chunk != self.options.chunk_tokens:
            log.info("store %s: using its chunk size %d (asked for %d)", self.dir, chunk, self.options.chunk_tokens)
            self.options = dataclasses.replace(self.options, chunk_tokens=chunk)

    def clean_temporaries(self) -> list[Removal]:
        """Remove files a killed writer left half-written (under the lock: no writer is active)."""
        removed = []
        with self.writing():
            for d in (self.dir, self.chunk_dir, self.manifest_dir, self.stats_dir):
                for e in os.scandir(d):
                    if e.name.startswith(".") and e.name.endswith(".tmp") and not e.is_dir(follow_symlinks=False):
                        log.info("store: removing a temporary file left by a killed writer: %s", e.path)
                        Path(e.path).unlink(missing_ok=True)
                        removed.append(Removal(Path(e.path), "temporary", "left by a writer that was killed"))
        return removed

    # --- the index ---------------------------------------------------------------------

    def sync(self, force: bool = False) -> list[Removal]:
        """Bring the index up to date with the manifests folder, reading only what changed; returns the
        damaged manifests it found and removed.

        The folder's mtime counts as seen only once its listing was read whole: a listing that failed
        is tried again by the next call.
        """
        removed: list[Removal] = []
        with self.mutex:
            mtime = self.manifest_dir.stat().st_mtime_ns
            if not force and mtime == self._seen_mtime:
                return removed
            present = {e.name[: -len(MANIFEST_SUFFIX)] for e in os.scandir(self.manifest_dir)
                       if e.name.endswith(MANIFEST_SUFFIX) and not e.name.startswith(".") and e.is_file()}
            for key in set(self.entries) - present:
                self._forget(key)
            for key in present - set(self.entries):
                entry = self._read_entry(key, removed)
                if entry is not None:
                    self.remember(entry)
            self._seen_mtime = mtime
        return removed

    def mark_synced(self) -> None:
        """After our own writes under the lock the index is exact: the next lookup need not relist."""
        self._seen_mtime = self.manifest_dir.stat().st_mtime_ns

    def _read_entry(self, key: str, removed: list[Removal]) -> Entry | None:
        """The manifest's entry; None when it is gone, or damaged: then it is removed (and counted in `removed`)."""
        path = self.path(MANIFEST, key)
        try:
            with self.reading(MANIFEST, key), framing.open_regular(path) as f:
                h = framing.read_header(f, str(path))
                check_manifest(h, key, self.options.chunk_tokens, str(path))
                tokens = np.frombuffer(framing.read_section(f, h, "tokens", where=str(path)), dtype="<i4").copy()
                text = bytes(framing.read_section(f, h, "text", where=str(path))).decode("utf-8")
                nbytes = os.fstat(f.fileno()).st_size
        except Damaged as damaged:
            if not isinstance(damaged.error, SessionNotFound):  # else another process removed it since the listing
                log.warning("store: removing damaged manifest %s: %s", path, damaged.error)
                self._unlink_manifest(key)
                removed.append(Removal(path, "damaged", str(damaged.error)))
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
            s = json.loads(framing.read_small(path, SMALL_FILE))
            check_json(s, STATS_FIELDS, str(path), what="field")
        except (SessionFileError, ValueError, RecursionError):
            return  # no hits yet, or a damaged stats file: start from zero
        entry.hits, entry.hits_at, entry.last_used = s["hits"], s["hits_at"], s["last_used"]

    def remember(self, entry: Entry) -> None:
        """A checkpoint into the index: its tail under its base, its chunks' users."""
        with self.mutex:
            self.entries[entry.key] = entry
            self.by_base.setdefault(entry.base, {})[self.tail(entry)] = entry.key
            for key, nbytes, ring in zip(entry.chunks, entry.chunk_bytes, entry.chunk_ring):
                self.chunks.setdefault(key, Chunk(nbytes, ring)).users.add(entry.key)

    def _forget(self, key: str) -> None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        tails = self.by_base.get(entry.base)
        if tails is not None:
            tails.pop(self.tail(entry), None)
            if not tails:
                del self.by_base[entry.base]
        for c in entry.chunks:
            chunk = self.chunks.get(c)
            if chunk is not None:
                chunk.users.discard(key)
                if not chunk.users:
                    del self.chunks[c]

    def tail(self, entry: Entry) -> tuple[int, ...]:
        """The token ids a checkpoint holds after its last whole chunk: what it hangs from its base by."""
        return tuple(entry.tokens[len(entry.chunks) * self.options.chunk_tokens :].tolist())

    def remove_orphan_chunks(self) -> list[Removal]:
        """Remove the chunk files the index does not know: what a failed write left."""
        removed = []
        with self.writing(), self.mutex:
            for e in os.scandir(self.chunk_dir):
                if (e.name.endswith(CHUNK_SUFFIX) and e.name[: -len(CHUNK_SUFFIX)] not in self.chunks
                        and not e.is_dir(follow_symlinks=False)):
                    Path(e.path).unlink(missing_ok=True)
                    removed.append(Removal(Path(e.path), "orphan", "no checkpoint names it"))
        return removed

    # --- files -------------------------------------------------------------------------

    def path(self, kind: str, key: str) -> Path:
        if kind == CHUNK:
            return self.chunk_dir / (key + CHUNK_SUFFIX)
        return self.manifest_dir / (key + MANIFEST_SUFFIX)

    def _stats_path(self, key: str) -> Path:
        return self.stats_dir / (key + STATS_SUFFIX)

    def _unlink_manifest(self, key: str) -> None:
        self.path(MANIFEST, key).unlink(missing_ok=True)
        self._stats_path(key).unlink(missing_ok=True)

    def write_stats(self, key: str, stats: bytes) -> None:
        """A checkpoint's hit statistics, while it is kept (a hint: failing to write them is logged, no more)."""
        with self.mutex:  # an eviction (under mutex) removes the stats file with its manifest
            if key not in self.entries:
                return
            try:
                framing.atomic_write(self._stats_path(key), lambda f: f.write(stats), durable=False)
            except OSError as err:  # statistics are a hint; a full disk must not fail a restore
                log.info("store: cannot record a hit: %s", err)

    def verify(self, e: Entry) -> bool:
        """Every checksum of a checkpoint and its chunks; a damaged one is logged."""
        damage = self.find_damage(e)
        if damage is not None:
            log.warning("store: damaged checkpoint %s: %s", e.key, damage)
        return damage is None

    def find_damage(self, e: Entry) -> str | None:
        """The first check a checkpoint or one of its chunks fails, in words, or None when all hold.

        Streams every section (memory stays a block). A folder that cannot be read is StoreUnavailable,
        not damage.
        """
        for kind, key in [(MANIFEST, e.key)] + [(CHUNK, c) for c in e.chunks]:
            path = self.path(kind, key)
            try:
                with self.reading(kind, key), framing.open_regular(path) as f:
                    h = framing.read_header(f, str(path))
                    for s in h.sections:
                        framing.verify_section(f, h, s.name, where=str(path))
            except Damaged as damaged:
                return str(damaged.error)
        return None

    # --- the tier (tier.py) ------------------------------------------------------------

    def contains(self, keys: Sequence[FileKey]) -> list[bool]:
        """By the index (sync() brings it up to date with other processes' writes)."""
        with self.mutex:
            return [k.key in (self.chunks if k.kind == CHUNK else self.entries) for k in keys]

    def get(self, keys: Sequence[FileKey]) -> list[bytes | None]:
        """Each file's bytes; None for one not here (evicted since it was looked up, or unreadable)."""
        out: list[bytes | None] = []
        for k in keys:
            try:
                with framing.open_regular(self.path(k.kind, k.key)) as f:
                    out.append(f.read())
            except (SessionFileError, OSError):
                out.append(None)
        return out

    def put(self, files: Sequence[tuple[FileKey, bytes]], tails: Sequence[Tail] = ()) -> None:
        """Write the files this folder lacks (temporary name, rename), then index them: a manifest is read
        through every check (a damaged one is removed again: not held), a chunk no manifest names is kept
        loose -- counted in the budget, the first to go -- once its header holds (the ring flag is its).
        The tails are the manifests' own."""
        with self.writing(), self.mutex:
            loose = {}
            for k, data in files:
                if not is_key(k.key):  # named by another tier: never a path out of the folder
                    log.warning("store: not keeping a %s named %r: not a key", k.kind, k.key[:80])
                    continue
                path = self.path(k.kind, k.key)
                if k.kind == CHUNK:
                    ring = self._chunk_ring(k.key, data, str(path))
                    if ring is None:
                        continue
                    loose[k.key] = Chunk(len(data), ring)
                if not path.exists():
                    framing.atomic_write(path, lambda f, data=data: f.write(data), durable=self.options.fsync)
            self.sync()
            for key, chunk in loose.items():
                self.chunks.setdefault(key, chunk)

    @staticmethod
    def _chunk_ring(key: str, data: bytes, where: str) -> bool | None:
        """A chunk's ring flag, from a header that holds; None (logged) when it does not."""
        try:
            h = framing.parse_header(data, len(data), where)
            check_json(h.fields, CHUNK_FIELDS, where)
        except SessionFileError as e:
            log.warning("store: not keeping a damaged chunk: %s", e)
            return None
        if h.fields["key"] != key:
            log.warning("store: not keeping %s: it holds chunk %s", where, h.fields["key"])
            return None
        return h.fields["ring"]

    def remove(self, keys: Sequence[FileKey]) -> None:
        """A manifest goes with the chunks no other checkpoint names; a chunk takes every checkpoint that
        names it along (shared good chunks stay)."""
        with self.writing(), self.mutex:
            self.sync()
            for k in keys:
                if k.kind == MANIFEST:
                    self.delete(k.key)
                else:
                    self._drop_chunk(k.key)

    def listing(self, root: str, chunks: Sequence[str], bases: Sequence[str]) -> Listing:
        with self.mutex:
            return Listing({k for k in chunks if k in self.chunks},
                           {b: dict(self.by_base[b]) for b in bases if b in self.by_base})

    def touch(self, keys: Sequence[FileKey]) -> list[bool]:
        """contains(): a folder's files have no lifetime, its budget evicts by value."""
        return self.contains(keys)

    # --- the budget --------------------------------------------------------------------

    def total_bytes(self) -> int:
        with self.mutex:
            return sum(e.nbytes for e in self.entries.values()) + sum(c.nbytes for c in self.chunks.values())

    def evict_to_budget(self, keep: Protected, new: str | None = None) -> None:
        """Evict down to the budget, never what `keep` protects nor `new`, unless `new` itself does not fit:
        then it goes."""
        with self.writing(), self.mutex:
            now = time.time()
            keep = keep.with_chunks(self.pinned())
            keep_new = Protected(keep.entries | ({new} if new else set()), keep.chunks)
            while self.total_bytes() > self.options.budget_bytes:
                loose = next((k for k, ch in self.chunks.items() if not ch.users and k not in keep.chunks), None)
                if loose is not None:  # a chunk fetched for a chunk-boundary hit, named by no checkpoint
                    self.path(CHUNK, loose).unlink(missing_ok=True)
                    del self.chunks[loose]
                    continue
                victim = policy.victim(self.options, self.entries, self.chunks, keep_new, now)
                if victim is None:
                    victim = self.entries.get(new) if new else None
                    if victim is None:
                        break
                    log.warning("store: a checkpoint of %d bytes exceeds the budget of %d; not kept",
                                policy.exclusive_bytes(victim, self.chunks), self.options.budget_bytes)
                self.delete(victim.key)
                self.evictions += 1
                if victim.key == new:
                    break

    def delete(self, key: str) -> list[Path]:
        """Remove a checkpoint, with the chunks no other one names; returns those chunks' paths."""
        with self.writing(), self.mutex:
            entry = self.entries.get(key)
            if entry is None:
                return []
            self._unlink_manifest(key)
            self._forget(key)
            gone = [self.path(CHUNK, c) for c in entry.chunks if c not in self.chunks]  # no kept checkpoint names it
            for path in gone:
                path.unlink(missing_ok=True)
            self.mark_synced()
            return gone

    def _drop_chunk(self, key: str) -> None:
        """A damaged chunk takes every checkpoint that names it along."""
        with self.writing(), self.mutex:
            chunk = self.chunks.get(key)
            for user in list(chunk.users if chunk else ()):
                self.delete(user)
            self.chunks.pop(key, None)
            self.path(CHUNK, key).unlink(missing_ok=True)

    # --- housekeeping ------------------------------------------------------------------

    def gc(self) -> dict:
        """Remove temporaries, orphan chunks and damaged entries; enforce the budget. Returns counts."""
        with self.writing(), self.mutex:
            before = (len(self.entries), self.total_bytes())
            self.clean_temporaries()
            self.sync(force=True)
            for key in list(self.entries):
                if not self.verify(self.entries[key]):
                    self.delete(key)
            self.remove_orphan_chunks()
            self.evict_to_budget(Protected())
            return {"removed": before[0] - len(self.entries), "freed_bytes": before[1] - self.total_bytes()}

    def clear(self) -> int:
        """Remove every checkpoint and chunk; returns how many checkpoints there were."""
        with self.writing(), self.mutex:
            self.sync(force=True)
            n = len(self.entries)
            for key in list(self.entries):
                self.delete(key)
            self.chunks.clear()
            self.remove_orphan_chunks()
            return n
