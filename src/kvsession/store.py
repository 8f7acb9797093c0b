"""The disk KV cache: content-addressed chunks, manifests, a byte budget.

ds4-server keeps one whole file per checkpoint and rescans its folder on
every lookup; a shared system prompt is then stored once per conversation.
This store cuts KV rows into chunks of `chunk_tokens` tokens, each named by
a hash chained over the model fingerprint, the KV dtype, the chunk size and
every token id up to the chunk's end. Two sessions that share a prefix name
its chunks alike and store them once; a session that grew by k tokens
writes only its new chunks. A manifest per checkpoint names its chunks and
holds what chunks cannot: the rows after the last whole chunk (the tail),
the sliding layers' window, the logits, the sampler state, the text.

    DIR/.lock                 flock: one writer at a time, across processes
    DIR/store.json            the folder's layout: format version and chunk size
    DIR/chunks/KEY.kvc        rows of chunk_tokens positions, every full layer
                              (and the sliding layers when all were live)
    DIR/manifests/KEY.kvm     one checkpoint (tokens, logits, text, tail, windows)
    DIR/stats/KEY.json        hits and last use, small and rewritten on a hit

Both file kinds are fileformat.py files: written to a temporary name and
renamed, checksummed per section, verified on every read, their headers
type-checked field by field. A corrupt or vanished entry is logged, removed
and reported as a miss, never raised.

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

Why a protected entry: without it a full store could pick the checkpoint
it has just written, zero hits and all, as the cheapest to evict.
"""
from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import logging
import os
import stat
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import torch
import xxhash

from . import fileformat
from .errors import CorruptSession, KvsessionError, SessionFileError, SessionNotFound, UnreadableSession
from .fileformat import Bool, Hex, Int, ListOf, Num, Obj, OneOf, Str
from .kv import KV_DTYPES
from .session import (
    FINGERPRINT_FIELDS,
    LAYER_FIELDS,
    MAX_TIME,
    META_FIELDS,
    SAMPLER_FIELDS,
    common_prefix,
    compare_fingerprint,
    row_bytes,
)

if TYPE_CHECKING:
    from .engine import Engine
    from .session import Session

log = logging.getLogger(__name__)

REASONS = ("cold", "continued", "evict", "shutdown")
CHUNK_SUFFIX, MANIFEST_SUFFIX, STATS_SUFFIX = ".kvc", ".kvm", ".json"


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


MANIFEST_FIELDS = Obj({
    "kind": OneOf("manifest"), "key": Hex(32), "root": Hex(32), "reason": OneOf(*REASONS),
    "created": Num(0, MAX_TIME, "a Unix time"), "model_file": Str(), "fingerprint": FINGERPRINT_FIELDS,
    "kv_dtype": OneOf(*KV_DTYPES), "row_shape": ListOf(Int(1), length=2), "chunk_tokens": Int(1), "n_tokens": Int(),
    "chunks": ListOf(Hex(32)), "chunk_bytes": ListOf(Int()), "chunk_ring": ListOf(Bool()), "has_logits": Bool(),
    "layers": ListOf(LAYER_FIELDS), "sampler": SAMPLER_FIELDS, "meta": META_FIELDS,
})
CHUNK_FIELDS = Obj({
    "kind": OneOf("chunk"), "key": Hex(32), "root": Hex(32), "index": Int(), "start": Int(), "n_tokens": Int(1),
    "kv_dtype": OneOf(*KV_DTYPES), "row_shape": ListOf(Int(1), length=2), "ring": Bool(), "layers": ListOf(Int()),
})
STATS_FIELDS = Obj({"hits": Num(0), "hits_at": Num(0, MAX_TIME), "last_used": Num(0, MAX_TIME)})
LAYOUT_FIELDS = Obj({"chunk_tokens": Int(1)})
SMALL_FILE = 4096  # store.json and a stats file are a line of JSON



@dataclass(frozen=True)
class StoreOptions:
    """What the store keeps (ds4-server's policy, with the fixes its users asked for)."""

    chunk_tokens: int = 256  # tokens per chunk
    min_tokens: int = 512  # shorter sessions are not worth a checkpoint
    align_cold: bool = True  # a cold save keeps only whole chunks: the reusable part of a prompt
    continued_every: int = 8192  # a growing session is checkpointed again after this many tokens
    budget_bytes: int = 4 << 30  # never exceeded when put() returns
    half_life_hours: float = 6.0  # hits lose half their weight in this time
    fsync: bool = False  # fsync every file (and the folder) before it counts as written

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1 or self.min_tokens < 0 or self.budget_bytes < 0 or self.half_life_hours <= 0:
            raise ValueError(f"bad store options: {self}")


@dataclass
class Entry:
    """One checkpoint (manifest), as the index keeps it."""

    key: str
    root: str  # the chain's root: fingerprint, KV dtype, chunk size
    n_tokens: int
    chunks: list[str]  # keys of its whole chunks, in order
    chunk_bytes: list[int]
    chunk_ring: list[bool]  # whether each chunk also holds the sliding layers' rows
    tokens: np.ndarray  # int32 [n_tokens]
    text: str
    reason: str
    created: float
    nbytes: int  # the manifest file's size
    has_logits: bool
    model_file: str
    hits: float = 0.0  # decayed hit count at `hits_at`
    hits_at: float = 0.0
    last_used: float = 0.0

    @property
    def base(self) -> str:
        """The chain key its tail hangs from: the last whole chunk's, or the root."""
        return self.chunks[-1] if self.chunks else self.root


@dataclass
class Hit:
    """A stored prefix of a query: `n_tokens` tokens, from a whole manifest or from chunks."""

    n_tokens: int
    tokens: list[int]
    chunks: list[str]
    entry: Entry | None = None  # a whole checkpoint (tail, windows, logits); None: chunk boundary only

    @property
    def has_logits(self) -> bool:
        return self.entry is not None and self.entry.has_logits and self.entry.n_tokens == self.n_tokens


@dataclass
class _Chunk:
    nbytes: int
    ring: bool  # holds the sliding layers' rows too
    users: set[str] = field(default_factory=set)  # manifests naming it


def default_store_dir() -> Path:
    """$KVSESSION_KV_DIR, else ~/.cache/kvsession/kv."""
    if os.environ.get("KVSESSION_KV_DIR"):
        return Path(os.environ["KVSESSION_KV_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "kvsession" / "kv"


def chain_root(fingerprint: str, kv_dtype: str, chunk_tokens: int) -> str:
    return xxhash.xxh3_128_hexdigest(f"kvsession.store.v1|{fingerprint}|{kv_dtype}|{chunk_tokens}".encode())


def chain(root: str, tokens: Sequence[int], chunk_tokens: int) -> list[str]:
    """Keys of the whole chunks of `tokens`: key_j hashes key_{j-1} and chunk j's token ids."""
    ids = np.asarray(tokens, dtype="<i4")
    keys, key = [], root
    for j in range(len(ids) // chunk_tokens):
        key = xxhash.xxh3_128_hexdigest(bytes.fromhex(key) + ids[j * chunk_tokens : (j + 1) * chunk_tokens].tobytes())
        keys.append(key)
    return keys


def manifest_key(base: str, tail: Sequence[int]) -> str:
    return xxhash.xxh3_128_hexdigest(bytes.fromhex(base) + np.asarray(tail, dtype="<i4").tobytes() + b"|manifest")


class Store:
    """A disk KV cache in a folder.

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
    cannot be constructed is retried by constructing it again.
    """

    def __init__(self, folder: str | os.PathLike, options: StoreOptions = StoreOptions()):
        self.dir = Path(folder)
        self.options = options
        self.chunk_dir = self.dir / "chunks"
        self.manifest_dir = self.dir / "manifests"
        self.stats_dir = self.dir / "stats"  # apart, so a hit does not touch the manifests folder's mtime
        self.entries: dict[str, Entry] = {}
        self.chunks: dict[str, _Chunk] = {}
        # base chain key -> tail tokens -> manifest key: a lookup probes the tail lengths present
        self.by_base: dict[str, dict[tuple[int, ...], str]] = {}
        self._seen_mtime = 0
        self._broken = True  # the folder must be opened before use
        try:
            self._open()
        except OSError as e:
            raise self._unavailable(e) from e

    # --- the folder, locking, index ------------------------------------------------------

    def _open(self) -> None:
        """Make the folder usable and the index exact: at construction, and on the first call after a failure."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with self._locked():
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
        """Bring the index up to date with the manifests folder, reading only what changed.

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
                self._check_manifest(h, key, str(path))
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
                      nbytes=nbytes, has_logits=d["has_logits"], model_file=d["model_file"])
        entry.last_used = entry.created
        self._read_stats(entry)
        return entry

    def _check_manifest(self, h: fileformat.Header, key: str, where: str) -> None:
        """Every field of a manifest and the sizes they imply, before anything is read or allocated."""
        d = h.fields
        fileformat.check_json(d, MANIFEST_FIELDS, where)
        c, n, chunks = d["chunk_tokens"], d["n_tokens"], d["chunks"]
        if d["key"] != key or c != self.options.chunk_tokens:
            raise CorruptSession(f"{where}: not the manifest of {key} with chunks of {self.options.chunk_tokens}")
        if not len(chunks) == len(d["chunk_bytes"]) == len(d["chunk_ring"]) or not 0 <= n - len(chunks) * c < c:
            raise CorruptSession(f"{where}: {n} tokens do not match {len(chunks)} chunks of {c} and a tail")
        seen = set()
        for x in d["layers"]:
            # what _write keeps: a full layer's tail after the chunks, a sliding layer's window
            want = n - len(chunks) * c if x["kind"] == "full" else min(n, x["window"])
            if x["index"] in seen or x["start"] + x["rows"] != n or x["rows"] != want:
                raise CorruptSession(f"{where}: layer {x['index']} holds rows [{x['start']}, {x['start'] + x['rows']})"
                                     f" of {n} tokens, expected the last {want}")
            seen.add(x["index"])
        h.section("text")
        h.check_lengths({"tokens": 4 * n, **{f"rows.{x['index']}": 2 * x["rows"] * row_bytes(d) for x in d["layers"]}},
                        where)

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
            self.chunks.setdefault(key, _Chunk(nbytes, ring)).users.add(entry.key)

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

    # --- sizes and value -----------------------------------------------------------

    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values()) + sum(c.nbytes for c in self.chunks.values())

    def exclusive_bytes(self, entry: Entry) -> int:
        """What deleting this checkpoint frees: its manifest and the chunks no other checkpoint names."""
        return entry.nbytes + sum(self.chunks[c].nbytes for c in entry.chunks
                                  if c in self.chunks and self.chunks[c].users == {entry.key})

    def decayed_hits(self, entry: Entry, now: float | None = None) -> float:
        now = time.time() if now is None else now
        age_h = max(0.0, now - entry.hits_at) / 3600.0
        return entry.hits * 0.5 ** (age_h / self.options.half_life_hours)

    def value(self, entry: Entry, now: float | None = None) -> float:
        """Eviction score: hits (decayed) plus one, times tokens per byte it alone costs. Lowest goes first."""
        return (1.0 + self.decayed_hits(entry, now)) * entry.n_tokens / max(1, self.exclusive_bytes(entry))

    # --- put ---------------------------------------------------------------------------

    @_available
    def put(self, session: "Session", reason: str) -> Entry | None:
        """Checkpoint a session: write its missing chunks and a manifest, then evict down to the budget.

        Returns the entry, or None when the session is below min_tokens or the
        checkpoint alone would exceed the budget. A cold save keeps only whole
        chunks (the part of a prompt another request can share).
        """
        if reason not in REASONS:
            raise ValueError(f"save reason {reason!r}: one of {', '.join(REASONS)}")
        o = self.options
        n = len(session)
        if reason == "cold" and o.align_cold and n >= o.chunk_tokens:
            aligned = n // o.chunk_tokens * o.chunk_tokens
            if self._windows_live(session, aligned):  # a trimmed save needs the rings' rows at that point
                n = aligned
        if n < o.min_tokens or n == 0:
            return None
        session.check_meta(f"store {self.dir}", error=StoreError)  # a manifest must be readable again
        with self._writing():
            self._sync()
            try:
                entry = self._write(session, n, reason)
            except OSError:
                with suppress(OSError):  # what is left now is removed at the next open
                    self._remove_orphan_chunks()
                raise
            self._remember(entry)
            self._enforce_budget(protect=entry.key)
            self._mark_synced()
            return self.entries.get(entry.key)

    def _mark_synced(self) -> None:
        """After our own writes under the lock the index is exact: the next lookup need not relist."""
        self._seen_mtime = self.manifest_dir.stat().st_mtime_ns

    def _windows_live(self, session: "Session", n: int) -> bool:
        return all(layer.start <= max(0, n - layer.window) for layer in session.cache if layer.ring)

    def _write(self, session: "Session", n: int, reason: str) -> Entry:
        o = self.options
        e = session.engine
        root = chain_root(e.fingerprint.digest, session.kv_dtype, o.chunk_tokens)
        tokens = session.tokens[:n]
        keys = chain(root, tokens, o.chunk_tokens)
        chunk_bytes, chunk_ring = [], []
        for j, key in enumerate(keys):
            known = self.chunks.get(key)
            nbytes, ring = (known.nbytes, known.ring) if known else self._write_chunk(session, root, key, j)
            chunk_bytes.append(nbytes)
            chunk_ring.append(ring)
        tail_start = len(keys) * o.chunk_tokens
        key = manifest_key(keys[-1] if keys else root, tokens[tail_start:])
        if key in self.entries:  # the same checkpoint again: nothing new to write
            return self.entries[key]
        layers, sections = [], []
        for i, layer in enumerate(session.cache):
            start = max(0, n - layer.window) if layer.ring else tail_start
            k, v = layer.read_rows(start, n - start)
            layers.append({"index": i, "kind": layer.kind, "window": layer.window, "start": start, "rows": n - start})
            sections.append((f"rows.{i}", [k, v]))
        has_logits = n == len(session) and session.logits is not None
        logits = session.logits_array() if has_logits else np.zeros(0, dtype="<f4")
        fields = {
            "kind": "manifest", "key": key, "root": root, "reason": reason, "created": time.time(),
            "model_file": e.path.name, "fingerprint": e.fingerprint.to_dict(), "kv_dtype": session.kv_dtype,
            "row_shape": list(session.cache[0].row_shape), "chunk_tokens": o.chunk_tokens, "n_tokens": n,
            "chunks": keys, "chunk_bytes": chunk_bytes, "chunk_ring": chunk_ring, "has_logits": has_logits,
            "layers": layers,
            "sampler": session.sampler.state(), "meta": session.meta,
        }
        text = e.tokenizer.decode(tokens)
        all_sections = [("tokens", [np.asarray(tokens, dtype="<i4")]), ("logits", [logits]),
                        ("text", [text.encode("utf-8")]), *sections]
        path = self._manifest_path(key)
        nbytes = fileformat.write_file(path, fields, all_sections, durable=o.fsync)
        entry = Entry(key=key, root=root, n_tokens=n, chunks=keys, chunk_bytes=chunk_bytes, chunk_ring=chunk_ring,
                      tokens=np.asarray(tokens, dtype="<i4"), text=text, reason=reason, created=fields["created"],
                      nbytes=nbytes, has_logits=has_logits, model_file=e.path.name)
        entry.last_used = entry.created
        return entry

    def _write_chunk(self, session: "Session", root: str, key: str, j: int) -> tuple[int, bool]:
        """Write chunk j (or find it written by another process); returns its size and ring flag."""
        path = self._chunk_path(key)
        try:
            with fileformat.open_regular(path) as f:
                h = fileformat.read_header(f, str(path))
                self._check_chunk(h, key, j, session, str(path))
                return os.fstat(f.fileno()).st_size, h.fields["ring"]
        except SessionNotFound:
            pass
        except SessionFileError:
            path.unlink(missing_ok=True)  # damaged: write it again
        c = self.options.chunk_tokens
        start = j * c
        ring = all(layer.start <= start for layer in session.cache if layer.ring)
        sections, layers = [("tokens", [np.asarray(session.tokens[start : start + c], dtype="<i4")])], []
        for i, layer in enumerate(session.cache):
            if layer.ring and not ring:
                continue
            k, v = layer.read_rows(start, c)
            sections.append((f"rows.{i}", [k, v]))
            layers.append(i)
        fields = {"kind": "chunk", "key": key, "root": root, "index": j, "start": start, "n_tokens": c,
                  "kv_dtype": session.kv_dtype, "row_shape": list(session.cache[0].row_shape), "ring": ring,
                  "layers": layers}
        return fileformat.write_file(path, fields, sections, durable=self.options.fsync), ring

    def _enforce_budget(self, protect: str) -> None:
        now = time.time()
        while self.total_bytes() > self.options.budget_bytes:
            candidates = [e for e in self.entries.values() if e.key != protect]
            if not candidates:
                victim = self.entries.get(protect)
                if victim is None:
                    break
                log.warning("store: a checkpoint of %d bytes exceeds the budget of %d; not kept",
                            self.exclusive_bytes(victim), self.options.budget_bytes)
            else:
                victim = min(candidates, key=lambda e: (self.value(e, now), e.last_used))
            self._delete(victim.key)

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
        """The longest stored prefix of `tokens`: a whole checkpoint, or any chunk boundary of one."""
        self._sync()
        root = chain_root(engine.fingerprint.digest, kv_dtype, self.options.chunk_tokens)
        keys = chain(root, tokens, self.options.chunk_tokens)
        window = max((s.window for s in engine.config.layers if s.kind == "sliding"), default=0)
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
        """ds4's lookup by rendered bytes: the checkpoint whose text is the longest prefix of `text`.

        Returns the hit (its exact stored tokens) and the rest of the text, which
        is all the caller needs to tokenize.
        """
        self._sync()
        root = chain_root(engine.fingerprint.digest, kv_dtype, self.options.chunk_tokens)
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

        Every byte is read and checked before the session changes. On a
        corrupt or vanished entry the entry is removed, the session is left as
        it was, and False is returned: a miss.
        """
        keep = min(common_prefix(session.tokens, hit.tokens), hit.n_tokens)
        e = hit.entry
        try:
            staged = self._stage(hit, e, session, keep)
        except _Damaged as damaged:
            log.warning("store: miss on a damaged %s (%s); removing it", damaged.kind, damaged.error)
            with self._writing():
                self._sync()
                if damaged.kind == "manifest":
                    self._delete(damaged.key)
                else:  # only the checkpoints that name this chunk lose it; shared good chunks stay
                    self._drop_chunk(damaged.key)
            return False
        rows, logits = staged
        session.restore_rows(hit.tokens, rows, logits, keep=keep)
        if e is not None:
            self._record_hit(e)
        return True

    def _stage(self, hit: Hit, e: Entry | None, session: "Session", keep: int):
        """Read (and verify) every row the restore needs: {layer: [(start, k, v), ...]}, logits."""
        c = self.options.chunk_tokens
        n = hit.n_tokens
        rows: dict[int, list] = {i: [] for i in range(len(session.cache))}
        ring_starts = {}
        logits = None
        whole = e is not None and e.n_tokens == n  # else a prefix of it: its tail up to n, no windows, no logits
        if e is not None:
            path = self._manifest_path(e.key)
            with self._reading("manifest", e.key), fileformat.open_regular(path) as f:
                h = fileformat.read_header(f, str(path))
                self._check_manifest(h, e.key, str(path))
                self._check_compatible(h, session, str(path))
                for d in h.fields["layers"]:
                    layer = session.cache[d["index"]]
                    k, v = layer.host_rows(d["rows"])
                    fileformat.read_section(f, h, f"rows.{d['index']}", into=[k, v], where=str(path))
                    if layer.ring and whole:
                        ring_starts[d["index"]] = d["start"]
                        rows[d["index"]].append((d["start"], k, v))
                    elif not layer.ring and n > d["start"]:
                        rows[d["index"]].append((d["start"], k[: n - d["start"]], v[: n - d["start"]]))
                if whole and e.has_logits:
                    buf = fileformat.read_section(f, h, "logits", where=str(path))
                    logits = torch.from_numpy(np.frombuffer(buf, dtype="<f4").copy())
        # chunks: full layers from the first chunk the session does not hold; rings from their window
        windows = {i: layer.window for i, layer in enumerate(session.cache) if layer.ring}
        for j, key in enumerate(hit.chunks):
            start = j * c
            need_full = start + c > keep
            need_ring = {i for i, w in windows.items() if i not in ring_starts and start + c > max(0, n - w)}
            if not need_full and not need_ring:
                continue
            path = self._chunk_path(key)
            with self._reading("chunk", key), fileformat.open_regular(path) as f:
                h = fileformat.read_header(f, str(path))
                self._check_chunk(h, key, j, session, str(path))
                for i in h.fields["layers"]:
                    layer = session.cache[i]
                    if (layer.ring and i not in need_ring) or (not layer.ring and not need_full):
                        continue
                    k, v = layer.host_rows(c)
                    fileformat.read_section(f, h, f"rows.{i}", into=[k, v], where=str(path))
                    skip = max(0, n - layer.window - start) if layer.ring else 0  # a ring takes its window only
                    rows[i].append((start + skip, k[skip:], v[skip:]))
        if not whole and windows:
            for i, w in windows.items():  # a chunk-boundary hit: the rings' window must come from chunks
                first = max(0, n - w)
                if not any(s <= first for s, _, _ in rows[i]) and n > 0:  # longest_prefix never offers this
                    raise StoreError(f"chunks hold no window for sliding layer {i}")
        return rows, logits

    def _check_compatible(self, h: fileformat.Header, session: "Session", where: str) -> None:
        """A checked manifest against the session it is restored into: model, dtype, layers, logits."""
        fields = h.fields
        compare_fingerprint(fields["fingerprint"], session.engine.fingerprint.to_dict())
        if fields["kv_dtype"] != session.kv_dtype or fields["row_shape"] != list(session.cache[0].row_shape):
            raise CorruptSession(f"{where}: kv dtype {fields['kv_dtype']} rows {fields['row_shape']}, "
                                 f"session {session.kv_dtype} rows {list(session.cache[0].row_shape)}")
        for d in fields["layers"]:
            i = d["index"]
            if i >= len(session.cache) or (d["kind"], d["window"]) != (session.cache[i].kind, session.cache[i].window):
                raise CorruptSession(f"{where}: layer {i} ({d['kind']}/{d['window']}) is not one of the model's")
        vocab = session.engine.config.vocab_size
        h.check_lengths({"logits": 4 * vocab if fields["has_logits"] else 0}, where)

    def _check_chunk(self, h: fileformat.Header, key: str, j: int, session: "Session", where: str) -> None:
        """Chunk j of a chain, checked before any of its rows is read: fields, sizes, and the session's shape."""
        d = h.fields
        fileformat.check_json(d, CHUNK_FIELDS, where)
        c = self.options.chunk_tokens
        if d["key"] != key or d["start"] != j * c or d["n_tokens"] != c:
            raise CorruptSession(f"{where}: not chunk {j} of this chain")
        if d["kv_dtype"] != session.kv_dtype or d["row_shape"] != list(session.cache[0].row_shape):
            raise CorruptSession(f"{where}: kv dtype {d['kv_dtype']} rows {d['row_shape']}, "
                                 f"session {session.kv_dtype} rows {list(session.cache[0].row_shape)}")
        if len(set(d["layers"])) != len(d["layers"]) or any(i >= len(session.cache) for i in d["layers"]):
            raise CorruptSession(f"{where}: layers {d['layers']} are not the model's")
        h.check_lengths({"tokens": 4 * c, **{f"rows.{i}": 2 * c * row_bytes(d) for i in d["layers"]}}, where)

    def _drop_chunk(self, key: str) -> None:
        """A damaged chunk takes every checkpoint that names it along."""
        for user in list(self.chunks.get(key, _Chunk(0, False)).users):
            self._delete(user)
        self._chunk_path(key).unlink(missing_ok=True)

    def _record_hit(self, e: Entry) -> None:
        now = time.time()
        e.hits = self.decayed_hits(e, now) + 1.0
        e.hits_at = e.last_used = now
        try:
            fileformat.atomic_write(self._stats_path(e.key), lambda f: f.write(json.dumps(
                {"hits": e.hits, "hits_at": e.hits_at, "last_used": e.last_used}).encode()), durable=False)
        except OSError as err:  # statistics are a hint; a full disk must not fail a restore
            log.info("store: cannot record a hit: %s", err)

    # --- housekeeping ----------------------------------------------------------------------

    @_available
    def ls(self) -> list[Entry]:
        self._sync()
        return sorted(self.entries.values(), key=lambda e: e.last_used, reverse=True)

    @_available
    def get(self, key_prefix: str) -> Entry:
        self._sync()
        found = [e for k, e in self.entries.items() if k.startswith(key_prefix)]
        if len(found) != 1:
            raise StoreError(f"{len(found)} checkpoints match {key_prefix!r}" + (": give more of the key"
                                                                                if found else ""))
        return found[0]

    @_available
    def delete(self, key: str) -> None:
        with self._writing():
            self._sync()
            if key not in self.entries:
                raise StoreError(f"no checkpoint {key!r} in {self.dir}")
            self._delete(key)

    @_available
    def gc(self) -> dict:
        """Remove temporaries, orphan chunks and damaged entries; enforce the budget. Returns counts."""
        with self._writing():
            before = (len(self.entries), self.total_bytes())
            self._clean_temporaries()
            self._sync(force=True)
            for key in list(self.entries):
                if not self.verify(self.entries[key]):
                    self._delete(key)
            self._remove_orphan_chunks()
            self._enforce_budget(protect="")
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
        with self._writing():
            self._sync(force=True)
            n = len(self.entries)
            for key in list(self.entries):
                self._delete(key)
            self._remove_orphan_chunks()
            return n

    def should_checkpoint(self, n_tokens: int, last_saved: int) -> bool:
        """A growing session earns a "continued" checkpoint every continued_every tokens."""
        return n_tokens >= self.options.min_tokens and n_tokens - last_saved >= self.options.continued_every
