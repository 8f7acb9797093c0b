"""The shared tier: the store's chunks and manifests in Valkey, for a fleet of servers.

One machine's disk holds one machine's conversations. With a shared tier a
conversation checkpointed by one server restores on any other: the local
folder stays the first tier (every restore reads local files), Valkey the
second.

    kvsession:ROOT:c:KEY    a chunk file, byte for byte as on disk
    kvsession:ROOT:m:KEY    a manifest file
    kvsession:ROOT:t:BASE   a hash: tail token ids (int32, little-endian) -> manifest key;
                            BASE is the chain key the manifests hang from (layout.py)

ROOT namespaces everything by model fingerprint, KV dtype, chunk size and
row format, so servers of other models or formats never meet.

Write-through. After the local store commits a checkpoint, a background
thread refreshes the TTL of every chunk the manifest names (EXPIRE),
uploads the ones Valkey lacks, then the manifest and its tail entry: one
round trip to ask, one to write. A Valkey restarted empty is filled again
by the next checkpoints.

Read on a local miss. longest_prefix asks Valkey, in one pipelined round
trip, which of the query's chain keys it holds and which manifests hang
from them; when that is longer than the local hit, the missing files are
fetched, written into the folder like any file (temporary name, rename)
and read back through the same checks: a damaged one is a miss, removed
here and in Valkey.

Budget: each key expires `ttl_seconds` after its last write-through (0:
never), and Valkey's own eviction (maxmemory with allkeys-lru) may drop
any key at any time -- a reader treats a missing key as a miss.

Failures: a connection refused, a timeout (short: `timeout_seconds`), any
error -- the tier's breaker (breaker.py) opens, logged once, and the tier is
skipped until `retry_seconds` have passed; requests are served from the
local tier or cold, never failed.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .. import fileformat
from ..breaker import Breaker
from .layout import Hit

if TYPE_CHECKING:
    from .layout import Entry
    from .local import Store
    from .policy import StoreOptions

log = logging.getLogger("kvsession.store")

NAMESPACE = "kvsession"


def redis_url(url: str) -> str:
    """valkey:// and valkeys:// as the redis client spells them."""
    for ours, theirs in (("valkey://", "redis://"), ("valkeys://", "rediss://")):
        if url.startswith(ours):
            return theirs + url[len(ours):]
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"shared tier URL {url!r}: redis://HOST:PORT or valkey://HOST:PORT")
    return url


class ValkeyTier:
    """A Valkey (or Redis) server as the store's second tier. Never raises into the store's callers."""

    MAX_PUSHES = 8  # checkpoints waiting for write-through; more are dropped (the tier is behind)

    def __init__(self, url: str, *, ttl_seconds: int = 7 * 24 * 3600, timeout_seconds: float = 0.5,
                 retry_seconds: float = 10.0, namespace: str = NAMESPACE):
        import redis

        self.url = url
        self.ttl = ttl_seconds or None
        self.namespace = namespace
        self._errors = (redis.RedisError, OSError)
        self.client = redis.Redis.from_url(redis_url(url), socket_timeout=timeout_seconds,
                                           socket_connect_timeout=timeout_seconds, retry_on_timeout=False)
        self.health = Breaker(f"the shared KV tier {url}", "serving from the local tier", retry_seconds, log,
                              describe=lambda e: f"{type(e).__name__}: {e}")
        self._cv = threading.Condition()
        self._pushes: deque = deque()
        self._pushing = False
        self._thread: threading.Thread | None = None
        self._closed = False

    @classmethod
    def from_options(cls, o: "StoreOptions") -> "ValkeyTier":
        return cls(o.shared_url, ttl_seconds=o.shared_ttl_seconds, timeout_seconds=o.shared_timeout_seconds,
                   retry_seconds=o.shared_retry_seconds)

    # --- health ---

    @property
    def reason(self) -> str | None:
        """Why the tier is skipped now, None while it works."""
        return self.health.reason

    def usable(self) -> bool:
        return self.health.usable()

    def _run(self, commands) -> list | None:
        """Run commands(pipeline) in one round trip; None while the tier is down or when it fails."""
        if not self.health.usable():
            return None
        try:
            pipe = self.client.pipeline(transaction=False)
            commands(pipe)
            result = pipe.execute()
        except self._errors as e:
            self.health.failed(e)
            return None
        self.health.ok()
        return result

    def key(self, root: str, kind: str, key: str) -> str:
        return f"{self.namespace}:{root}:{kind}:{key}"

    # --- reads ---

    def probe(self, root: str, chunk_keys: Sequence[str], bases: Sequence[str]):
        """Which of chunk_keys Valkey holds, and the manifests hanging from each base:
        (set of keys, {base: {tail tokens: manifest key}}), or None."""

        def commands(p):
            for k in chunk_keys:
                p.exists(self.key(root, "c", k))
            for b in bases:
                p.hgetall(self.key(root, "t", b))

        result = self._run(commands)
        if result is None:
            return None
        present = {k for k, n in zip(chunk_keys, result) if n}
        tails = {}
        for base, fields in zip(bases, result[len(chunk_keys):]):
            if fields:
                tails[base] = {tuple(np.frombuffer(t, dtype="<i4").tolist()): m.decode() for t, m in fields.items()
                               if len(t) % 4 == 0}
        return present, tails

    def fetch(self, root: str, items: Sequence[tuple[str, str]]) -> list[bytes | None] | None:
        """The files (kind "c" or "m", key) as stored, None for each one Valkey no longer holds."""
        return self._run(lambda p: [p.get(self.key(root, kind, key)) for kind, key in items])

    def forget(self, root: str, kind: str, key: str) -> None:
        """A file that failed its checks here: gone from Valkey too."""
        kind = {"chunk": "c", "manifest": "m"}.get(kind, kind)
        self._run(lambda p: p.delete(self.key(root, kind, key)))

    # --- write-through ---

    def push(self, store: "Store", entry: "Entry") -> None:
        """Write a checkpoint through to Valkey, off the caller's thread (see the module's docstring)."""
        with self._cv:
            if self._closed:
                return
            if len(self._pushes) >= self.MAX_PUSHES:
                log.info("shared KV tier %s: write-through behind, dropping checkpoint %s", self.url, entry.key)
                return
            self._pushes.append((store, entry))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._push_loop, name="kvsession-valkey", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _push_loop(self) -> None:
        while True:
            with self._cv:
                while not self._pushes:
                    if self._closed:
                        return
                    self._cv.wait()
                store, entry = self._pushes.popleft()
                self._pushing = True
            try:
                self._write_through(store, entry)
            except Exception:  # the tier is a cache: a bug here must not stop the next write-through
                log.exception("shared KV tier %s: write-through of %s failed", self.url, entry.key)
            finally:
                with self._cv:
                    self._pushing = False
                    self._cv.notify_all()

    def _write_through(self, store: "Store", entry: "Entry") -> None:
        root, ttl = entry.root, self.ttl
        keys = [self.key(root, "c", k) for k in entry.chunks]
        have = self._run(lambda p: [p.expire(k, ttl) if ttl else p.exists(k) for k in keys])
        if have is None:
            return
        files = [(k, store._chunk_path(c)) for k, c, there in zip(keys, entry.chunks, have) if not there]
        files.append((self.key(root, "m", entry.key), store._manifest_path(entry.key)))
        blobs = []
        for k, path in files:
            try:
                blobs.append((k, _read_file(path)))
            except OSError:  # evicted here since: Valkey must not hold a manifest without its chunks
                return
        tails = self.key(root, "t", entry.base)
        field = np.asarray(store._tail(entry), dtype="<i4").tobytes()

        def commands(p):
            for k, data in blobs:
                p.set(k, data, ex=ttl)
            p.hset(tails, field, entry.key)
            if ttl:
                p.expire(tails, ttl)

        self._run(commands)

    def flush(self, timeout: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not self._pushes and not self._pushing, timeout)

    def close(self, timeout: float | None = None) -> bool:
        done = self.flush(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self.client.close()
        return done


def _read_file(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def shared_prefix(store: "Store", tokens: Sequence[int], root: str, keys: list[str], window: int,
                  local: Hit | None) -> Hit | None:
    """A prefix of `tokens` longer than the local hit that the shared tier holds, brought into the
    folder; None when it holds nothing longer (or is down, or what it sent fails its checks)."""
    tier, o = store.shared, store.options
    c = o.chunk_tokens
    if tier is None or not tier.usable() or len(tokens) < max(1, o.min_tokens):
        return None
    with store._mutex:
        here = {k for k in keys if k in store.chunks}
    probe = tier.probe(root, [k for k in keys if k not in here], [root, *keys])
    if probe is None:
        return None
    present, tails = probe
    matched = []
    for k in keys:
        if k not in here and k not in present:
            break
        matched.append(k)
    manifest = None  # (tokens, chunks, key): the deepest manifest whose tail starts the rest of the query
    for j in range(len(matched), -1, -1):
        hanging = tails.get(matched[j - 1] if j else root)
        rest = tuple(tokens[j * c : (j + 1) * c])
        for tail in sorted(hanging or (), key=len, reverse=True):
            if rest[: len(tail)] == tail:
                manifest = (j * c + len(tail), matched[:j], hanging[tail])
                break
        if manifest:
            break
    by_chunks = len(matched) * c if not window else 0  # a ring model's boundary needs chunks' ring flags
    n = max(manifest[0] if manifest else 0, by_chunks)
    if n <= (local.n_tokens if local else 0) or n < max(1, o.min_tokens):
        return None
    use_manifest = manifest is not None and manifest[0] >= by_chunks
    chunks = manifest[1] if use_manifest else matched
    items = [("c", k) for k in chunks if k not in here] + ([("m", manifest[2])] if use_manifest else [])
    blobs = tier.fetch(root, items)
    if blobs is None or any(b is None for b in blobs):
        return None  # expired or evicted between the two round trips
    t0 = time.perf_counter()
    with store._writing():
        for (kind, key), data in zip(items, blobs):
            path = store._manifest_path(key) if kind == "m" else store._chunk_path(key)
            if not path.exists():
                fileformat.atomic_write(path, lambda f, data=data: f.write(data), durable=o.fsync)
        with store._mutex:
            store._sync()
            if use_manifest:
                entry = store.entries.get(manifest[2])
                if entry is None:  # failed its checks: _sync removed it
                    tier.forget(root, "m", manifest[2])
                    return None
                hit = Hit(entry.n_tokens, list(tokens[: entry.n_tokens]), list(entry.chunks), entry, source="shared")
            else:
                from .layout import Chunk

                for (_, key), data in zip(items, blobs):
                    store.chunks.setdefault(key, Chunk(len(data), True))  # named by no manifest here (yet)
                hit = Hit(n, list(tokens[:n]), list(matched), source="shared")
            store._enforce_budget(store._protection(hit))
            store._mark_synced()
    log.info("shared KV tier: %d tokens brought in (%d files, %.1f MB) in %.1f ms", hit.n_tokens, len(items),
             sum(len(b) for b in blobs) / 1e6, (time.perf_counter() - t0) * 1e3)
    return hit
