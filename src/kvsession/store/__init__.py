"""The disk KV cache: content-addressed chunks, manifests, a byte budget, and a shared tier.

ds4-server keeps one whole file per checkpoint and rescans its folder on
every lookup; a shared system prompt is then stored once per conversation.
This store cuts KV rows into chunks named by a hash chained over the tokens
(layout.py), so sessions sharing a prefix store it once and a session that
grew writes only its new chunks; a manifest per checkpoint holds the rest.

As LMCache's storage backends do, the places that hold files are tiers
behind one interface, and the tiering is written once above them:

    layout.py            keys, and what chunks and manifests hold
    policy.py            what to checkpoint (ds4's knobs) and what to evict
    tier.py              the tiers' one interface: contains / get / put / remove by key, listing, touch
    local.py             the folder tier: lock, index, files, budget
    valkey.py            the shared tier: a fleet of servers on one Valkey
    tiering.py           the two together: write-through, reads on a local miss
    checkpoint.py        snapshots of a session, and the thread that writes them
    checkpoint_files.py  what a snapshot becomes on disk: how much fits, chunk files, manifest
    restore.py           a hit read back and checked, most rows straight into the cache
    verify.py            the whole folder checked, every checksum and reference; what fails removed
    store.py             the calls the server makes (Store), over the parts above
    breaker.py           the circuit breaker: a failing tier costs one log line, not every request

A local valkey-server for the tests and the benchmark is kvsession.testing.valkey; the live
sessions a server keeps in memory are the server's (server/sessions.py).
"""
from .checkpoint import Snapshot
from .layout import (
    CHUNK_SUFFIX,
    MANIFEST_SUFFIX,
    REASONS,
    STATS_SUFFIX,
    Entry,
    Hit,
    chain,
    chain_root,
    default_store_dir,
    manifest_key,
)
from .local import StoreError, StoreUnavailable
from .policy import StoreOptions
from .store import Store

__all__ = [
    "CHUNK_SUFFIX", "MANIFEST_SUFFIX", "REASONS", "STATS_SUFFIX", "Entry", "Hit", "Snapshot", "Store", "StoreError",
    "StoreOptions", "StoreUnavailable", "chain", "chain_root", "default_store_dir", "manifest_key",
]
