"""The shared tier: the store's chunks and manifests in Valkey, for a fleet of servers.

One machine's disk holds one machine's conversations. With a shared tier a
conversation checkpointed by one server restores on any other: the local
folder stays the first tier (every restore reads local files), Valkey the
second. This module is the connector, one tier (tier.py); what goes
through it and when -- write-through after a checkpoint, a read on a local
miss -- is tiering.py's.

    kvsession:ROOT:c:KEY    a chunk file, byte for byte as on disk
    kvsession:ROOT:m:KEY    a manifest file
    kvsession:ROOT:t:BASE   a hash: tail token ids (int32, little-endian) -> manifest key;
                            BASE is the chain key the manifests hang from (layout.py)

ROOT namespaces everything by model fingerprint, KV dtype, chunk size and
row format, so servers of other models or formats never meet.

Every call is one pipelined round trip, whatever the batch: a lookup asks
in one which of the query's chain keys Valkey holds and which manifests
hang from them (listing); a write-through asks in one which chunks it
lacks while renewing the others' lifetimes (touch), and sends in one the
missing files and the manifest's tail (put).

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
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..breaker import Breaker
from .tier import CHUNK, MANIFEST, FileKey, Listing, Tail

if TYPE_CHECKING:
    from .policy import StoreOptions

log = logging.getLogger("kvsession.store")

NAMESPACE = "kvsession"
LETTERS = {CHUNK: "c", MANIFEST: "m"}  # a file kind as its keys spell it


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

    @classmethod
    def from_options(cls, o: "StoreOptions") -> "ValkeyTier":
        return cls(o.shared_url, ttl_seconds=o.shared_ttl_seconds, timeout_seconds=o.shared_timeout_seconds,
                   retry_seconds=o.shared_retry_seconds)

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

    def key(self, f: FileKey) -> str:
        return f"{self.namespace}:{f.root}:{LETTERS[f.kind]}:{f.key}"

    def _tails_key(self, root: str, base: str) -> str:
        return f"{self.namespace}:{root}:t:{base}"

    # --- the tier (tier.py) ---

    def contains(self, keys: Sequence[FileKey]) -> list[bool] | None:
        result = self._run(lambda p: [p.exists(self.key(k)) for k in keys])
        return None if result is None else [bool(n) for n in result]

    def get(self, keys: Sequence[FileKey]) -> list[bytes | None] | None:
        return self._run(lambda p: [p.get(self.key(k)) for k in keys])

    def put(self, files: Sequence[tuple[FileKey, bytes]], tails: Sequence[Tail] = ()) -> None:
        ttl = self.ttl

        def commands(p):
            for f, data in files:
                p.set(self.key(f), data, ex=ttl)
            for t in tails:
                hanging = self._tails_key(t.root, t.base)
                p.hset(hanging, np.asarray(t.tokens, dtype="<i4").tobytes(), t.manifest)
                if ttl:
                    p.expire(hanging, ttl)

        self._run(commands)

    def remove(self, keys: Sequence[FileKey]) -> None:
        """Chunks and manifests that failed their checks somewhere; a manifest's tail entry goes when it
        expires (a lookup that finds its manifest gone counts a miss)."""
        self._run(lambda p: [p.delete(self.key(k)) for k in keys])

    def listing(self, root: str, chunks: Sequence[str], bases: Sequence[str]) -> Listing | None:
        def commands(p):
            for k in chunks:
                p.exists(self.key(FileKey(root, CHUNK, k)))
            for b in bases:
                p.hgetall(self._tails_key(root, b))

        result = self._run(commands)
        if result is None:
            return None
        listing = Listing({k for k, n in zip(chunks, result) if n})
        for base, fields in zip(bases, result[len(chunks):]):
            if fields:
                listing.tails[base] = {tuple(np.frombuffer(t, dtype="<i4").tolist()): m.decode()
                                       for t, m in fields.items() if len(t) % 4 == 0}
        return listing

    def touch(self, keys: Sequence[FileKey]) -> list[bool] | None:
        ttl = self.ttl
        result = self._run(lambda p: [p.expire(self.key(k), ttl) if ttl else p.exists(self.key(k)) for k in keys])
        return None if result is None else [bool(n) for n in result]

    def close(self) -> None:
        self.client.close()
