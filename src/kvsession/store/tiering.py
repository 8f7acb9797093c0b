"""The two tiers together: the local folder first, a shared tier behind it, for a fleet of servers.

Both are tiers (tier.py); this is what goes from one to the other, and when,
written once above them through their interface alone.

Write-through. After the local store commits a checkpoint, a background
thread renews the lifetime of every chunk the manifest names in the shared
tier (touch), reads from the folder the ones the tier lacks and the
manifest, and puts them there with the manifest's tail: one round trip to
ask, one to write. A shared tier restarted empty is filled again by the
next checkpoints. A checkpoint evicted here meanwhile is not written
through: the shared tier must not hold a manifest without its chunks.

Read on a local miss. A lookup asks the shared tier, in one round trip,
which of the query's chain keys it holds and which manifests hang from
them (listing); when that is longer than the local hit, the missing files
are fetched and put into the folder like any file (temporary name,
rename), read back through the same checks: one that fails them is a
miss, and goes from the shared tier too. The folder's budget then makes
room, the hit protected.

The shared tier never raises (it is down: its calls answer None), so
neither does anything here: a request is served from the folder or cold.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Sequence

from .layout import Entry, Hit
from .policy import Protected
from .tier import CHUNK, MANIFEST, FileKey, RemoteTier, Tail

if TYPE_CHECKING:
    from .local import FolderTier

log = logging.getLogger("kvsession.store")


class Tiering:
    """The folder and a shared tier: write-through off the caller's thread, and reads on a local miss."""

    MAX_PUSHES = 8  # checkpoints waiting for write-through; more are dropped (the shared tier is behind)

    def __init__(self, local: "FolderTier", shared: RemoteTier):
        self.local = local
        self.shared = shared
        self._cv = threading.Condition()
        self._pushes: deque[Entry] = deque()
        self._pushing = False
        self._thread: threading.Thread | None = None
        self._closed = False

    # --- write-through ---

    def push(self, entry: Entry) -> None:
        """Write a checkpoint through to the shared tier, off the caller's thread (see the module's docstring)."""
        with self._cv:
            if self._closed:
                return
            if len(self._pushes) >= self.MAX_PUSHES:
                log.info("shared KV tier %s: write-through behind, dropping checkpoint %s", self.shared.url,
                         entry.key)
                return
            self._pushes.append(entry)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._push_loop, name="kvsession-write-through", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _push_loop(self) -> None:
        while True:
            with self._cv:
                while not self._pushes:
                    if self._closed:
                        return
                    self._cv.wait()
                entry = self._pushes.popleft()
                self._pushing = True
            try:
                self._write_through(entry)
            except Exception:  # the tier is a cache: a bug here must not stop the next write-through
                log.exception("shared KV tier %s: write-through of %s failed", self.shared.url, entry.key)
            finally:
                with self._cv:
                    self._pushing = False
                    self._cv.notify_all()

    def _write_through(self, entry: Entry) -> None:
        chunks = [FileKey(entry.root, CHUNK, c) for c in entry.chunks]
        have = self.shared.touch(chunks)
        if have is None:
            return
        wanted = [k for k, there in zip(chunks, have) if not there] + [FileKey(entry.root, MANIFEST, entry.key)]
        blobs = self.local.get(wanted)
        if any(b is None for b in blobs):  # evicted here since
            return
        tail = Tail(entry.root, entry.base, self.local.tail(entry), entry.key)
        self.shared.put(list(zip(wanted, blobs)), [tail])

    def flush(self, timeout: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not self._pushes and not self._pushing, timeout)

    def close(self, timeout: float | None = None) -> bool:
        done = self.flush(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self.shared.close()
        return done

    # --- read on a local miss ---

    def longest_prefix(self, tokens: Sequence[int], root: str, keys: list[str], window: int,
                       local: Hit | None) -> Hit | None:
        """A prefix of `tokens` longer than the local hit that the shared tier holds, brought into the
        folder; None when it holds nothing longer (or is down, or what it sent fails its checks).

        keys: the query's chain keys; window: the model's widest sliding window (0: none)."""
        o = self.local.options
        c = o.chunk_tokens
        if not self.shared.usable() or len(tokens) < max(1, o.min_tokens):
            return None
        held = self.local.contains([FileKey(root, CHUNK, k) for k in keys])
        here = {k for k, h in zip(keys, held) if h}
        listing = self.shared.listing(root, [k for k in keys if k not in here], [root, *keys])
        if listing is None:
            return None
        matched = []
        for k in keys:
            if k not in here and k not in listing.chunks:
                break
            matched.append(k)
        manifest = None  # (tokens, chunks, key): the deepest manifest whose tail starts the rest of the query
        for j in range(len(matched), -1, -1):
            hanging = listing.tails.get(matched[j - 1] if j else root)
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
        items = [FileKey(root, CHUNK, k) for k in chunks if k not in here]
        if use_manifest:
            items.append(FileKey(root, MANIFEST, manifest[2]))
        blobs = self.shared.get(items)
        if blobs is None or any(b is None for b in blobs):
            return None  # expired or evicted between the two round trips
        t0 = time.perf_counter()
        with self.local.writing(), self.local.mutex:  # nothing of ours is evicted before the hit is protected
            self.local.put(list(zip(items, blobs)))
            refused = [k for k, kept in zip(items, self.local.contains(items)) if not kept]
            if refused:  # failed their checks here: gone from the shared tier too
                self.shared.remove(refused)
                return None
            if use_manifest:
                entry = self.local.entries[manifest[2]]
                hit = Hit(entry.n_tokens, list(tokens[: entry.n_tokens]), list(entry.chunks), entry, source="shared")
            else:
                hit = Hit(n, list(tokens[:n]), list(matched), source="shared")
            self.local.evict_to_budget(Protected.of(hit))
        log.info("shared KV tier: %d tokens brought in (%d files, %.1f MB) in %.1f ms", hit.n_tokens, len(items),
                 sum(len(b) for b in blobs) / 1e6, (time.perf_counter() - t0) * 1e3)
        return hit
