"""What a checkpoint becomes on disk: how much of a snapshot fits, its chunk files, its manifest.

Sizes are planned before a byte is written, exactly (framing.file_size):
a checkpoint that does not fit beside what eviction must leave is cut to
whole chunks, not written and then thrown away. The snapshot is
checkpoint.py's, the folder (its index, its paths) local.py's; the store
(store.py) commits: it plans and writes here under the folder's lock, then
indexes the entry and evicts.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from ..errors import SessionFileError, SessionNotFound
from ..files import framing
from ..kv.cache import KV_DTYPES
from ..kv.rows import encode_rows, encoded_row_bytes
from .checkpoint import Snapshot
from .layout import Entry, check_chunk, manifest_key
from .policy import Protected
from .tier import CHUNK, MANIFEST

if TYPE_CHECKING:
    from .local import FolderTier


class CheckpointFiles:
    """A snapshot's files in a folder: plan() how many of its tokens fit, then write() them."""

    def __init__(self, folder: "FolderTier"):
        self.folder = folder

    @property
    def options(self):
        return self.folder.options  # read at each call: opening the folder may adopt its chunk size

    def plan(self, snap: Snapshot, keep: Protected, created: float) -> int:
        """How many tokens of the snapshot to write: all of them when they fit the budget beside what is
        protected, else the most whole chunks that do (layers without rings only), else 0.

        Every other checkpoint can be evicted, so what stays is the protected manifests and chunks; the
        rest of the budget is the checkpoint's own: its manifest and the chunks it names that are not
        among the protected ones. Sizes are exact (framing.file_size)."""
        o, c = self.options, self.options.chunk_tokens
        entries, chunks = self.folder.entries, self.folder.chunks  # the caller holds the folder's mutex
        kept_chunks = set(keep.chunks) | {k for e in keep.entries if e in entries for k in entries[e].chunks}
        fixed = (sum(entries[e].nbytes for e in keep.entries if e in entries)
                 + sum(chunks[k].nbytes for k in kept_chunks if k in chunks))
        # the chunks this snapshot can name: on disk, or in the snapshot; a gap ends it
        usable = next((j for j, k in enumerate(snap.keys) if k not in chunks and k not in snap.chunk_rows),
                      len(snap.keys))
        sizes = [0 if k in kept_chunks else chunks[k].nbytes if k in chunks else self._chunk_size(snap, k)
                 for k in snap.keys[:usable]]

        def fits(n: int) -> bool:
            return fixed + sum(sizes[: n // c]) + self._manifest_size(snap, n, created) <= o.budget_bytes

        n = snap.n_tokens
        if usable == len(snap.keys) and fits(n):
            return n
        if any(kind == "sliding" for _, kind, _ in snap.layer_kinds) or snap.state.recurrent:
            return 0  # a shorter checkpoint needs the rings' windows (or a hybrid's states) at its end: not here
        lo, hi = 0, min(usable, (n - 1) // c)  # whole chunks: the largest m with fits(m * c), by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid * c) else (lo, mid - 1)
        return lo * c if lo * c >= max(1, o.min_tokens) and fits(lo * c) else 0

    def _chunk_fields(self, snap: Snapshot, key: str, j: int, ring: bool, layers: list[int]) -> dict:
        c = self.options.chunk_tokens
        return {"kind": "chunk", "key": key, "root": snap.root, "index": j, "start": j * c, "n_tokens": c,
                "kv_dtype": snap.state.kv_dtype, "row_shape": snap.state.row_shape, "ring": ring, "layers": layers,
                "row_format": self.options.row_format}

    def _row_bytes(self, snap: Snapshot) -> int:
        return encoded_row_bytes(snap.state.row_shape, KV_DTYPES[snap.state.kv_dtype], self.options.row_format)

    def _chunk_size(self, snap: Snapshot, key: str) -> int:
        j, ring, rows = snap.chunk_rows[key]
        c, rb = self.options.chunk_tokens, self._row_bytes(snap)
        fields = self._chunk_fields(snap, key, j, ring, sorted(rows))
        return framing.file_size(fields, [("tokens", 4 * c)] + [(f"rows.{i}", 2 * c * rb) for i in sorted(rows)])

    def _manifest(self, snap: Snapshot, n: int, created: float = 0.0) -> tuple[dict, dict, str]:
        """The manifest of the first n tokens: header fields (chunk sizes filled in later), the rows each
        layer keeps {layer: (start, rows)}, the text."""
        c = self.options.chunk_tokens
        keys = snap.keys[: n // c]
        tail_start = len(keys) * c
        layers, spans = [], {}
        for i, kind, window in snap.layer_kinds:
            start = max(0, n - window) if kind == "sliding" else tail_start
            layers.append({"index": i, "kind": kind, "window": window, "start": start, "rows": n - start})
            spans[i] = (start, n - start)
        fields = {
            "kind": "manifest", "key": manifest_key(keys[-1] if keys else snap.root, snap.tokens[tail_start:n]),
            "root": snap.root, "reason": snap.reason, "created": created, "model_file": snap.state.model_file,
            "fingerprint": snap.state.fingerprint, "kv_dtype": snap.state.kv_dtype, "row_shape": snap.state.row_shape,
            "chunk_tokens": c, "n_tokens": n, "chunks": keys, "chunk_bytes": [0] * len(keys),
            "chunk_ring": [False] * len(keys), "has_logits": n == snap.n_tokens and snap.state.logits.size > 0,
            "layers": layers, "sampler": snap.state.sampler, "meta": snap.state.meta, "row_format": self.options.row_format,
            **({"recurrent": [r.describe() for r in snap.state.recurrent]} if snap.state.recurrent else {}),
        }
        return fields, spans, snap.text(n)

    def _manifest_size(self, snap: Snapshot, n: int, created: float) -> int:
        fields, spans, text = self._manifest(snap, n, created)
        for j, k in enumerate(fields["chunks"]):  # the sizes' digits count too, and true is shorter than false
            known = self.folder.chunks.get(k)
            fields["chunk_bytes"][j] = known.nbytes if known else self._chunk_size(snap, k)
            fields["chunk_ring"][j] = known.ring if known else snap.chunk_rows[k][1]
        rb = self._row_bytes(snap)
        logits = snap.state.logits.nbytes if fields["has_logits"] else 0
        return framing.file_size(fields, [("tokens", 4 * n), ("logits", logits), ("text", len(text.encode()))]
                                    + [(f"rows.{i}", 2 * rows * rb) for i, (_, rows) in spans.items()]
                                    + [(f"state.{r.index}", r.nbytes) for r in snap.state.recurrent])

    def write(self, snap: Snapshot, n: int, created: float) -> Entry:
        """Write the first n tokens' missing chunks and manifest; returns the entry."""
        o = self.options
        dtype = KV_DTYPES[snap.state.kv_dtype]
        fields, spans, text = self._manifest(snap, n, created)
        keys = fields["chunks"]
        for j, key in enumerate(keys):
            known = self.folder.chunks.get(key)
            nbytes, ring = (known.nbytes, known.ring) if known is not None else self._write_chunk(snap, key)
            fields["chunk_bytes"][j], fields["chunk_ring"][j] = nbytes, ring
        key = fields["key"]
        with self.folder.mutex:
            if key in self.folder.entries:  # the same checkpoint again: nothing new to write
                return self.folder.entries[key]
        sections = [("tokens", [np.asarray(snap.tokens[:n], dtype="<i4")]),
                    ("logits", [snap.state.logits if fields["has_logits"] else np.zeros(0, dtype="<f4")]),
                    ("text", [text.encode("utf-8")])]
        for i, (start, rows) in spans.items():
            t_start, k, v = snap.tail[i]  # the snapshot's rows start at or before this layer's start
            a = start - t_start
            sections.append((f"rows.{i}", encode_rows(k[a : a + rows], v[a : a + rows], dtype, o.row_format)))
        sections += [(f"state.{r.index}", [r.arrays[name] for name in sorted(r.arrays)]) for r in snap.state.recurrent]
        nbytes = framing.write_file(self.folder.path(MANIFEST, key), fields, sections, durable=o.fsync)
        entry = Entry(key=key, root=snap.root, n_tokens=n, chunks=keys, chunk_bytes=fields["chunk_bytes"],
                      chunk_ring=fields["chunk_ring"], tokens=np.asarray(snap.tokens[:n], dtype="<i4"), text=text,
                      reason=snap.reason, created=created, nbytes=nbytes, has_logits=fields["has_logits"],
                      model_file=snap.state.model_file, row_format=o.row_format)
        entry.last_used = entry.created
        return entry

    def _write_chunk(self, snap: Snapshot, key: str) -> tuple[int, bool]:
        """Write a chunk (or find it written by another process): its size and ring flag."""
        j, ring, rows = snap.chunk_rows[key]
        path = self.folder.path(CHUNK, key)
        try:
            with framing.open_regular(path) as f:
                h = framing.read_header(f, str(path))
                check_chunk(h, key, j, self.options.chunk_tokens, snap.state.kv_dtype, snap.state.row_shape,
                            [(i, kind == "sliding") for i, kind, _ in snap.layer_kinds], str(path))
                return os.fstat(f.fileno()).st_size, h.fields["ring"]
        except SessionNotFound:
            pass
        except SessionFileError:
            path.unlink(missing_ok=True)  # damaged: write it again
        c = self.options.chunk_tokens
        dtype = KV_DTYPES[snap.state.kv_dtype]
        sections = [("tokens", [np.asarray(snap.tokens[j * c : (j + 1) * c], dtype="<i4")])]
        sections += [(f"rows.{i}", encode_rows(*rows[i], dtype, self.options.row_format)) for i in sorted(rows)]
        fields = self._chunk_fields(snap, key, j, ring, sorted(rows))
        return framing.write_file(path, fields, sections, durable=self.options.fsync), ring

