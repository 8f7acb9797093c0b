"""What the store keeps: which checkpoints to write, how long they are, which to evict.

ds4-server's policy, with its flag names, and the fixes its users asked for:

- min_tokens (--kv-cache-min-tokens, 512): shorter sessions are not worth a
  checkpoint.
- cold_max_tokens (--kv-cache-cold-max-tokens, 30000): a cold prompt is
  saved ("cold", trimmed to whole chunks: the part another request can
  share) only when it has at most this many tokens; 0 turns cold saves off.
  Longer prompts are covered by continued checkpoints during their prefill.
- continued_interval_tokens (--kv-cache-continued-interval-tokens, 10000):
  a growing session is checkpointed at absolute frontiers this far apart,
  rounded up to whole chunks (10,240 with chunks of 256): during prefill and
  generation, wherever the first checkpoint landed, so a crash in a long
  prefill loses at most one interval. 0 turns them off.
- chunk_tokens (--kv-cache-chunk-tokens, 256): tokens per chunk.

Eviction. A byte budget that holds when put() returns. Each checkpoint's
value is its decayed hits + 1; the lowest goes first, ties (the checkpoints
never hit) to the least recently used (see value()). Protected: the
checkpoint just written (without that, a full store picks that brand-new
zero-hit checkpoint as the cheapest deletion) and the hit a request is
about to restore (ds4 issue #448: the evict-save of the outgoing session
deleted the checkpoint of the incoming one). A checkpoint that does not fit
beside what is protected is cut to the whole chunks that fit, or not kept.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..kv.rows import ROW_FORMATS
from .layout import Chunk, Entry, Hit


@dataclass(frozen=True)
class StoreOptions:
    chunk_tokens: int = 256  # tokens per chunk
    min_tokens: int = 512  # shorter sessions are neither saved nor worth a lookup
    cold_max_tokens: int = 30000  # cold saves for prompts of at most this many tokens; 0: none
    continued_interval_tokens: int = 10000  # continued checkpoints this far apart (whole chunks); 0: none
    align_cold: bool = True  # a cold save keeps only whole chunks: the reusable part of a prompt
    budget_bytes: int = 4 << 30  # never exceeded when put() returns
    half_life_hours: float = 6.0  # hits lose half their weight in this time
    fsync: bool = False  # fsync every file (and the folder) before it counts as written
    row_format: str = "exact"  # "exact" (the cache's dtype) or "q8" (8-bit blocks, about half the bytes)
    # the shared tier (valkey.py): redis://HOST:PORT, valkey://HOST:PORT, valkey+cluster://HOST:PORT,HOST:PORT;
    # None: this folder only
    shared_url: str | None = None
    shared_ttl_seconds: int = 7 * 24 * 3600  # every key expires this long after its last write; 0: never
    shared_timeout_seconds: float = 0.5  # a slower answer counts as the tier being down
    shared_retry_seconds: float = 10.0  # a tier that failed is tried again after this long

    def __post_init__(self) -> None:
        if (self.chunk_tokens < 1 or self.min_tokens < 0 or self.budget_bytes < 0 or self.half_life_hours <= 0
                or self.cold_max_tokens < 0 or self.continued_interval_tokens < 0
                or self.row_format not in ROW_FORMATS or self.shared_ttl_seconds < 0
                or self.shared_timeout_seconds <= 0 or self.shared_retry_seconds < 0):
            raise ValueError(f"bad store options: {self}")
        if self.cold_max_tokens and self.cold_max_tokens < self.min_tokens:
            raise ValueError(f"cold_max_tokens {self.cold_max_tokens} must be 0 or >= min_tokens {self.min_tokens}")


# a hybrid's snapshot (its recurrent states and logits) costs at most this share of the KV bytes of the span
# between two of them
SNAPSHOT_SHARE = 1 / 8


def snapshot_step(o: StoreOptions, snapshot_bytes: int, kv_bytes_per_token: int) -> int:
    """How far apart (whole chunks) a hybrid's prefill is checkpointed whole, its recurrent states with it, so
    that a prompt sharing only part of a stored one restores from the last such frontier before they part: as
    often as every chunk, and no more often than SNAPSHOT_SHARE of the span's KV bytes pays for (an LFM2
    snapshot is tens of kB, every chunk; a Qwen3-Next one tens of MB, far fewer)."""
    chunk_bytes = max(1, kv_bytes_per_token * o.chunk_tokens)
    return o.chunk_tokens * max(1, math.ceil(snapshot_bytes / (SNAPSHOT_SHARE * chunk_bytes)))


def continued_step(o: StoreOptions) -> int:
    """The distance between continued frontiers: the interval rounded up to whole chunks (0: none)."""
    if not o.continued_interval_tokens:
        return 0
    return -(-o.continued_interval_tokens // o.chunk_tokens) * o.chunk_tokens


def continued_frontier(o: StoreOptions, n_tokens: int, last_saved: int) -> int:
    """The frontier a session of n_tokens owes a continued checkpoint for, or 0: the highest multiple of
    the step in (last_saved, n_tokens], when it is at least min_tokens."""
    step = continued_step(o)
    if not step:
        return 0
    frontier = n_tokens // step * step
    return frontier if frontier > last_saved and frontier >= max(1, o.min_tokens) else 0


def cold_length(o: StoreOptions, n_tokens: int) -> int:
    """How many tokens of a cold prompt of n_tokens a "cold" save keeps: its whole chunks (when
    align_cold), 0 when the prompt is outside [min_tokens, cold_max_tokens] or cold saves are off."""
    if not o.cold_max_tokens or n_tokens > o.cold_max_tokens:
        return 0
    if o.align_cold and n_tokens >= o.chunk_tokens:
        n_tokens = n_tokens // o.chunk_tokens * o.chunk_tokens
    return n_tokens if n_tokens >= max(1, o.min_tokens) else 0


def decayed_hits(o: StoreOptions, entry: Entry, now: float | None = None) -> float:
    now = time.time() if now is None else now
    age_h = max(0.0, now - entry.hits_at) / 3600.0
    return entry.hits * 0.5 ** (age_h / o.half_life_hours)


def exclusive_bytes(entry: Entry, chunks: dict[str, Chunk]) -> int:
    """What deleting this checkpoint frees: its manifest and the chunks no other checkpoint names."""
    return entry.nbytes + sum(chunks[c].nbytes for c in entry.chunks if c in chunks and chunks[c].users == {entry.key})


def value(o: StoreOptions, entry: Entry, now: float | None = None) -> float:
    """Eviction score: hits (decayed) plus one. Lowest goes first, ties (every checkpoint never hit) to the least
    recently used.

    Not weighed by the bytes a checkpoint alone costs: a conversation's checkpoints share their chunks, so its
    latest one owned only a chunk or two and looked cheap, while a new conversation's first checkpoint owned all of
    its chunks and looked the costliest -- it went first, while conversations long over stayed (an hour of agent
    traffic lost the live conversations' checkpoints this way and found them cold after restarts)."""
    return 1.0 + decayed_hits(o, entry, now)


@dataclass(frozen=True)
class Protected:
    """What an eviction must leave: these checkpoints, and these chunks with at least one of their users.

    Built from a hit about to be restored: its checkpoint and every chunk it names."""

    entries: frozenset[str] = frozenset()
    chunks: frozenset[str] = frozenset()

    @classmethod
    def of(cls, hit: Hit | None) -> "Protected":
        """What an eviction must leave for a hit: its checkpoint, or one that names its deepest chunk."""
        if hit is None:
            return cls()
        return cls(frozenset({hit.entry.key} if hit.entry is not None else ()), frozenset(hit.chunks))

    def with_chunks(self, chunks: set[str]) -> "Protected":
        return Protected(self.entries, self.chunks | frozenset(chunks)) if chunks else self

    def evictable(self, entry: Entry, chunks: dict[str, Chunk]) -> bool:
        if entry.key in self.entries:
            return False
        # deleting the last user of a protected chunk would delete the chunk
        return not any(c in self.chunks and chunks[c].users == {entry.key} for c in entry.chunks if c in chunks)


def victim(o: StoreOptions, entries: dict[str, Entry], chunks: dict[str, Chunk], keep: Protected,
           now: float) -> Entry | None:
    """The checkpoint to evict next, or None when every one left is protected."""
    candidates = [e for e in entries.values() if keep.evictable(e, chunks)]
    return min(candidates, key=lambda e: (value(o, e, now), e.last_used)) if candidates else None
