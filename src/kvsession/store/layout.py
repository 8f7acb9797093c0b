"""The store's content-addressed layout: keys, and what a chunk and a manifest hold.

KV rows are cut into chunks of `chunk_tokens` tokens, each named by a hash
chained over the chain's root and every token id up to the chunk's end:

    root    = xxh3_128("kvsession.store.v1|FINGERPRINT|KV_DTYPE|CHUNK_TOKENS[|ROW_FORMAT]")
    key_j   = xxh3_128(key_{j-1} || token ids of chunk j)      (key_{-1} = root)
    manifest = xxh3_128(key of its last whole chunk (or root) || tail token ids || "|manifest")

Two sessions that share a prefix name its chunks alike, on one machine or on
a fleet sharing a Valkey tier: a key says which model, KV dtype, chunk size,
row format and tokens its rows belong to, and nothing else. (An exact-row
root keeps the first version's spelling, so folders written before row
formats existed still hit.)

Both file kinds are framing.py files (checksummed per section):

    chunk     sections: tokens, rows.<layer> for every full layer (and the
              sliding layers when all their rows of the chunk were live)
    manifest  sections: tokens, logits, text, rows.<layer> (a full layer's
              tail after the last whole chunk; a sliding layer's window),
              state.<layer> (a hybrid's recurrent layers' state at its end)

A row section holds the layer's K rows then its V rows, each as
kv.encode_rows writes them: exact (the cache's dtype) or q8.

This module is pure: names, field specs, and the checks a header must pass
before a byte of its payload is used. The folder is local.py's; the policy
policy.py's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import xxhash

from ..config import ATTENTION_KINDS, RECURRENT_KINDS
from ..errors import CorruptSession
from ..files import framing
from ..files.fields import Bool, Hex, Int, ListOf, Num, Obj, OneOf, Str, check_json
from ..files.session_file import (
    FINGERPRINT_FIELDS,
    LAYER_FIELDS,
    MAX_TIME,
    META_FIELDS,
    RECURRENT_FIELDS,
    SAMPLER_FIELDS,
    row_bytes,
    state_bytes,
)
from ..kv.cache import KV_DTYPES
from ..kv.rows import ROW_FORMATS

REASONS = ("cold", "continued", "evict", "shutdown")
CHUNK_SUFFIX, MANIFEST_SUFFIX, STATS_SUFFIX = ".kvc", ".kvm", ".json"

MANIFEST_FIELDS = Obj({
    "kind": OneOf("manifest"), "key": Hex(32), "root": Hex(32), "reason": OneOf(*REASONS),
    "created": Num(0, MAX_TIME, "a Unix time"), "model_file": Str(), "fingerprint": FINGERPRINT_FIELDS,
    "kv_dtype": OneOf(*KV_DTYPES), "row_shape": ListOf(Int(1), length=2), "chunk_tokens": Int(1), "n_tokens": Int(),
    "chunks": ListOf(Hex(32)), "chunk_bytes": ListOf(Int()), "chunk_ring": ListOf(Bool()), "has_logits": Bool(),
    "layers": ListOf(LAYER_FIELDS), "sampler": SAMPLER_FIELDS, "meta": META_FIELDS,
}, {"row_format": OneOf(*ROW_FORMATS), "recurrent": ListOf(RECURRENT_FIELDS)})  # recurrent: a hybrid's states
CHUNK_FIELDS = Obj({
    "kind": OneOf("chunk"), "key": Hex(32), "root": Hex(32), "index": Int(), "start": Int(), "n_tokens": Int(1),
    "kv_dtype": OneOf(*KV_DTYPES), "row_shape": ListOf(Int(1), length=2), "ring": Bool(), "layers": ListOf(Int()),
}, {"row_format": OneOf(*ROW_FORMATS)})
STATS_FIELDS = Obj({"hits": Num(0), "hits_at": Num(0, MAX_TIME), "last_used": Num(0, MAX_TIME)})
LAYOUT_FIELDS = Obj({"chunk_tokens": Int(1)})
SMALL_FILE = 4096  # store.json and a stats file are a line of JSON


def default_store_dir() -> Path:
    """$KVSESSION_KV_DIR, else ~/.cache/kvsession/kv."""
    if os.environ.get("KVSESSION_KV_DIR"):
        return Path(os.environ["KVSESSION_KV_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "kvsession" / "kv"


def chain_root(fingerprint: str, kv_dtype: str, chunk_tokens: int, row_format: str = "exact") -> str:
    suffix = "" if row_format == "exact" else f"|{row_format}"
    return xxhash.xxh3_128_hexdigest(f"kvsession.store.v1|{fingerprint}|{kv_dtype}|{chunk_tokens}{suffix}".encode())


def chain(root: str, tokens: Sequence[int], chunk_tokens: int) -> list[str]:
    """Keys of the whole chunks of `tokens`: key_j hashes key_{j-1} and chunk j's token ids."""
    ids = np.asarray(tokens, dtype="<i4")
    keys, key = [], root
    for j in range(len(ids) // chunk_tokens):
        key = xxhash.xxh3_128_hexdigest(bytes.fromhex(key) + ids[j * chunk_tokens : (j + 1) * chunk_tokens].tobytes())
        keys.append(key)
    return keys


def is_key(name: object) -> bool:
    """Whether a name is a key as chain() and manifest_key() spell them: 32 lowercase hex digits. What another
    tier names a file by is checked with it before it becomes a path (a name like "../x" would leave the folder)."""
    return isinstance(name, str) and len(name) == 32 and LOWER_HEX.issuperset(name)


LOWER_HEX = frozenset("0123456789abcdef")


def manifest_key(base: str, tail: Sequence[int]) -> str:
    return xxhash.xxh3_128_hexdigest(bytes.fromhex(base) + np.asarray(tail, dtype="<i4").tobytes() + b"|manifest")


@dataclass
class Entry:
    """One checkpoint (manifest), as the index keeps it."""

    key: str
    root: str  # the chain's root: fingerprint, KV dtype, chunk size, row format
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
    row_format: str = "exact"
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
    source: str = "local"  # "local", or "shared": brought from the shared tier by this lookup

    @property
    def has_logits(self) -> bool:
        return self.entry is not None and self.entry.has_logits and self.entry.n_tokens == self.n_tokens


@dataclass
class Chunk:
    """A chunk as the index keeps it."""

    nbytes: int
    ring: bool  # holds the sliding layers' rows too
    users: set[str] = field(default_factory=set)  # manifests naming it (none: fetched for a chunk-boundary hit)


def check_manifest(h: framing.Header, key: str, chunk_tokens: int, where: str) -> None:
    """Every field of a manifest and the sizes they imply, before anything is read or allocated."""
    d = h.fields
    check_json(d, MANIFEST_FIELDS, where)
    c, n, chunks = d["chunk_tokens"], d["n_tokens"], d["chunks"]
    if d["key"] != key or c != chunk_tokens:
        raise CorruptSession(f"{where}: not the manifest of {key} with chunks of {chunk_tokens}")
    if not len(chunks) == len(d["chunk_bytes"]) == len(d["chunk_ring"]) or not 0 <= n - len(chunks) * c < c:
        raise CorruptSession(f"{where}: {n} tokens do not match {len(chunks)} chunks of {c} and a tail")
    seen = set()
    for x in d["layers"]:
        # what a checkpoint keeps: a full layer's tail after the chunks, a sliding layer's window
        want = n - len(chunks) * c if x["kind"] == "full" else min(n, x["window"])
        if x["index"] in seen or x["start"] + x["rows"] != n or x["rows"] != want:
            raise CorruptSession(f"{where}: layer {x['index']} holds rows [{x['start']}, {x['start'] + x['rows']})"
                                 f" of {n} tokens, expected the last {want}")
        seen.add(x["index"])
    # a layer left out would be restored as nothing (found by tools/fuzz.py): every attention layer's rows, and
    # a hybrid's every recurrent state
    kinds = d["fingerprint"]["kv_shape"]["layers"]
    attending = {i for i, x in enumerate(kinds) if x["kind"] in ATTENTION_KINDS}
    if seen != attending:
        raise CorruptSession(f"{where}: layers {sorted(seen)}, the model's attention layers are {sorted(attending)}")
    states = [r["index"] for r in d.get("recurrent", [])]
    recurrent = {i for i, x in enumerate(kinds) if x["kind"] in RECURRENT_KINDS or x.get("beside")}
    if sorted(states) != sorted(recurrent) or len(set(states)) != len(states):
        raise CorruptSession(f"{where}: recurrent states {states}, the model's recurrent layers are {sorted(recurrent)}")
    h.section("text")
    h.check_lengths({"tokens": 4 * n, **{f"rows.{x['index']}": 2 * x["rows"] * row_bytes(d) for x in d["layers"]},
                     **{f"state.{r['index']}": state_bytes(r) for r in d.get("recurrent", [])}}, where)


def check_chunk(h: framing.Header, key: str, j: int, chunk_tokens: int, kv_dtype: str, row_shape: list,
                layers: Sequence[tuple[int, bool]], where: str) -> None:
    """Chunk j of a chain, checked before any of its rows is read: fields, sizes, and the session's shape.

    layers: the model's attention layers, each (index, whether it is a sliding one, a ring): a chunk holds
    every full layer, and the sliding ones too when its ring flag says so."""
    d = h.fields
    check_json(d, CHUNK_FIELDS, where)
    c = chunk_tokens
    if d["key"] != key or d["start"] != j * c or d["n_tokens"] != c:
        raise CorruptSession(f"{where}: not chunk {j} of this chain")
    if d["kv_dtype"] != kv_dtype or d["row_shape"] != row_shape:
        raise CorruptSession(f"{where}: kv dtype {d['kv_dtype']} rows {d['row_shape']}, "
                             f"session {kv_dtype} rows {row_shape}")
    want = sorted(i for i, ring in layers if d["ring"] or not ring)
    if sorted(d["layers"]) != want or len(set(d["layers"])) != len(d["layers"]):  # one left out: restored as nothing
        raise CorruptSession(f"{where}: layers {d['layers']}, the model's {'' if d['ring'] else 'full '}ones are {want}")
    h.check_lengths({"tokens": 4 * c, **{f"rows.{i}": 2 * c * row_bytes(d) for i in d["layers"]}}, where)
