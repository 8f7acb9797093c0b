"""The one interface of the store's tiers: files by key, and what a lookup and a budget need of them.

LMCache's storage backends are the model: one small interface (contains,
get, put, remove by chunk key), a local-disk backend and remote connectors
beside it, and the tiering written once above them. Here a tier holds the
two kinds of files layout.py defines, byte for byte, each named by its key
within its chain's root:

    chunk      rows of chunk_tokens positions
    manifest   one checkpoint; it hangs from a chain key (its last whole
               chunk's, or the root) by its tail token ids

The tiers: the local folder (local.py, the first: every restore reads its
files) and a shared Valkey (valkey.py, the second, for a fleet). The store
(store.py) and its tiering (tiering.py) use them through this interface
only; neither tier knows the other.

Batches, not single keys: a remote tier answers a whole batch in one round
trip. A tier that cannot answer now (a remote one that is down) returns None
from its queries and drops its writes; a folder that cannot be used raises
StoreUnavailable instead (local.py says why).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

CHUNK, MANIFEST = "chunk", "manifest"


@dataclass(frozen=True)
class FileKey:
    """One stored file: a chunk or a manifest of the chain `root`, by its key."""

    root: str  # the chain's root: model fingerprint, KV dtype, chunk size, row format (layout.py)
    kind: str  # CHUNK or MANIFEST
    key: str


@dataclass(frozen=True)
class Tail:
    """Where a manifest hangs: from chain key `base` of the chain `root`, by its tail token ids."""

    root: str
    base: str
    tokens: tuple[int, ...]
    manifest: str  # the manifest's key


@dataclass
class Listing:
    """What a tier holds for a lookup: which of the asked chunks, and the manifests hanging from each asked
    base ({base: {tail token ids: manifest key}}; a base with none is left out)."""

    chunks: set[str]
    tails: dict[str, dict[tuple[int, ...], str]] = field(default_factory=dict)


class Tier(Protocol):
    """A place that holds chunks and manifests (see the module's docstring)."""

    def contains(self, keys: Sequence[FileKey]) -> list[bool] | None:
        """Whether each file is held."""

    def get(self, keys: Sequence[FileKey]) -> list[bytes | None] | None:
        """Each file's bytes as stored, None for one not held."""

    def put(self, files: Sequence[tuple[FileKey, bytes]], tails: Sequence[Tail] = ()) -> None:
        """Store files (one held already may be written again: a key names its bytes); `tails` hang the
        manifests among them (the folder, which reads its manifests through their checks, takes that from
        the manifests themselves, and keeps no file that fails them)."""

    def remove(self, keys: Sequence[FileKey]) -> None:
        """Files that must go (they failed their checks somewhere). The folder, which knows its
        checkpoints, takes along the chunks only a removed manifest names and the checkpoints that name a
        removed chunk; Valkey leaves a removed manifest's tail entry to expire."""

    def listing(self, root: str, chunks: Sequence[str], bases: Sequence[str]) -> Listing | None:
        """Which of `chunks` are held, and the manifests hanging from each of `bases`: what a lookup needs,
        in one call."""

    def touch(self, keys: Sequence[FileKey]) -> list[bool] | None:
        """Whether each file is held, renewing its lifetime where the tier's budget is one (a key's TTL)."""


class RemoteTier(Tier, Protocol):
    """A tier on another machine, shared by a fleet: it may be down, and then only costs misses."""

    url: str

    def usable(self) -> bool:
        """False while the tier is known to be down (its calls would only wait)."""

    def state(self) -> dict:
        """What a health check shows of it (local knowledge only: it asks the tier nothing)."""

    def close(self) -> None:
        """Let go of the connection."""
