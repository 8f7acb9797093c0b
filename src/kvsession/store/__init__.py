"""The disk KV cache: content-addressed chunks, manifests, a byte budget, and a shared tier.

ds4-server keeps one whole file per checkpoint and rescans its folder on
every lookup; a shared system prompt is then stored once per conversation.
This store cuts KV rows into chunks named by a hash chained over the tokens
(layout.py), so sessions sharing a prefix store it once and a session that
grew writes only its new chunks; a manifest per checkpoint holds the rest.

    layout.py      keys, and what chunks and manifests hold
    policy.py      what to checkpoint (ds4's knobs) and what to evict
    checkpoint.py  snapshots of a session, the files they become, the thread that writes them
    local.py       the folder: lock, index, put, lookups, housekeeping (Store)
    restore.py     a hit read back and checked, most rows straight into the cache
    valkey.py      the shared tier: a fleet of servers on one Valkey
    live.py        the sessions a server keeps in memory, under a byte budget, routed by prefix or key
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
from .local import Store, StoreError, StoreUnavailable
from .policy import StoreOptions

__all__ = [
    "CHUNK_SUFFIX", "MANIFEST_SUFFIX", "REASONS", "STATS_SUFFIX", "Entry", "Hit", "Snapshot", "Store", "StoreError",
    "StoreOptions", "StoreUnavailable", "chain", "chain_root", "default_store_dir", "manifest_key",
]
