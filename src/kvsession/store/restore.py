"""Restoring a hit: every row read and checked before the session changes, most of them in place.

Bringing back 2,000 tokens of SmolLM2 moves ~45 MB. Read into host arrays,
checksummed and copied into the cache, it cost several passes over the
bytes. Here the rows of full layers past the session's end are read
straight into the cache (kv.free_rows: rows nobody reads yet; on a GPU
through transfer.Uploads' pinned slots, never a host copy of the whole
cache), checksummed while they are hot, and made live only once every check held
(Session.restore_rows -> kv.adopt_rows). Rows the
session still holds, and the sliding layers' windows, are staged in host
arrays. A failure anywhere leaves the session as it was.

The folder's files are read through its `reading` (a damaged entry is
local.Damaged, a folder at fault StoreUnavailable); the store decides what
a damaged entry costs and makes the session's rows live.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import CorruptSession, KvsessionError
from ..files import framing
from ..files.session_file import compare_fingerprint, read_state
from ..kv.rows import decode_q8_into
from ..kv.state import SessionState
from ..kv.transfer import Uploads
from .layout import Entry, Hit, check_chunk, check_manifest
from .tier import CHUNK, MANIFEST

if TYPE_CHECKING:
    from .local import FolderTier


class Restorer:
    """A hit's rows, read from the folder and checked, staged for a session."""

    def __init__(self, folder: "FolderTier"):
        self.folder = folder

    def stage(self, hit: Hit, e: Entry | None, target: SessionState, keep: int):
        """Read and verify every row the restore needs (under the folder's mutex) for the session whose state
        is `target`, which holds room for them (Session.reserve) and keeps its first `keep` tokens.

        Returns (rows, filled, logits, states): rows {layer: [(start, k, v), ...]} staged in host arrays,
        filled {layer: [(start, count), ...]} read in place past the session's end (see the module's
        docstring), the logits, a hybrid's recurrent states {layer: arrays} (whole checkpoints only hold them:
        a recurrent layer's state exists at a checkpoint's end, never at a chunk boundary before it)."""
        c, row_format = self.folder.options.chunk_tokens, self.folder.options.row_format
        n = hit.n_tokens
        cache = {layer.index: layer.cache for layer in target.layers}  # the attention layers'
        rows: dict[int, list] = {i: [] for i in cache}
        filled: dict[int, list] = {i: [] for i in cache}
        states: dict[int, dict] = {}
        ring_starts = {}
        logits = None
        whole = e is not None and e.n_tokens == n  # else a prefix of it: its tail up to n, no windows, no logits
        if target.recurrent and not whole:  # longest_prefix never offers this for a hybrid
            raise KvsessionError(f"a hybrid's restore at {n} tokens needs its states: a whole checkpoint")

        def load(f, h, name: str, i: int, start: int, count: int, use: int, skip: int, where: str) -> None:
            """Section `name`: `count` rows of layer i from position `start`, of which rows [skip, use) are
            restored; read in place when they all lie past the session's end, else into host arrays."""
            layer = cache[i]

            def read(k: np.ndarray, v: np.ndarray) -> None:
                if h.fields.get("row_format", "exact") == "q8":
                    decode_q8_into(framing.read_section(f, h, name, where=where), k, v, target.dtype)
                else:
                    framing.read_section(f, h, name, into=[k, v], where=where)

            if skip == 0 and layer.can_fill_free(start, count):
                up.fill_free(layer, start, count, read)
                filled[i].append((start, use))
            else:
                k, v = layer.host_rows(count)
                read(k, v)
                rows[i].append((start + skip, k[skip:use], v[skip:use]))

        up = Uploads(target.device, target.row_shape, target.dtype)  # in place: staged on a GPU
        with up:  # every copy done when it ends
            if e is not None:
                path = self.folder.path(MANIFEST, e.key)
                with self.folder.reading(MANIFEST, e.key), framing.open_regular(path) as f:
                    h = framing.read_header(f, str(path))
                    check_manifest(h, e.key, c, str(path))
                    self._check_compatible(h, target, str(path))
                    for d in h.fields["layers"]:
                        i = d["index"]
                        if cache[i].ring and whole:
                            ring_starts[i] = d["start"]
                            load(f, h, f"rows.{i}", i, d["start"], d["rows"], d["rows"], 0, str(path))
                        elif not cache[i].ring and n > d["start"]:
                            load(f, h, f"rows.{i}", i, d["start"], d["rows"], n - d["start"], 0, str(path))
                    if whole and e.has_logits:
                        buf = framing.read_section(f, h, "logits", where=str(path))
                        logits = torch.from_numpy(np.frombuffer(buf, dtype="<f4").copy())
                    if whole:
                        states = {r["index"]: read_state(f, h, r, str(path)) for r in h.fields.get("recurrent", [])}
            # chunks: full layers from the first chunk the session does not hold; rings from their window
            windows = {i: layer.window for i, layer in cache.items() if layer.ring}
            row_shape = target.row_shape
            for j, key in enumerate(hit.chunks):
                start = j * c
                need_full = start + c > keep
                need_ring = {i for i, w in windows.items() if i not in ring_starts and start + c > max(0, n - w)}
                if not need_full and not need_ring:
                    continue
                path = self.folder.path(CHUNK, key)
                with self.folder.reading(CHUNK, key), framing.open_regular(path) as f:
                    h = framing.read_header(f, str(path))
                    check_chunk(h, key, j, c, target.kv_dtype, row_shape, [(i, x.ring) for i, x in cache.items()],
                                str(path))
                    if h.fields.get("row_format", "exact") != row_format:
                        raise CorruptSession(f"{path}: rows in {h.fields.get('row_format', 'exact')}, "
                                             f"the store holds {row_format}")
                    for i in h.fields["layers"]:
                        if i not in cache:
                            raise CorruptSession(f"{path}: layer {i} holds no K/V rows in this model")
                        layer = cache[i]
                        if (layer.ring and i not in need_ring) or (not layer.ring and not need_full):
                            continue
                        skip = max(0, n - layer.window - start) if layer.ring else 0  # a ring takes its window only
                        load(f, h, f"rows.{i}", i, start, c, c, skip, str(path))
        if not whole and windows:
            for i, w in windows.items():  # a chunk-boundary hit: the rings' window must come from chunks
                first = max(0, n - w)
                if not any(s <= first for s, _, _ in rows[i]) and n > 0:  # longest_prefix never offers this
                    raise KvsessionError(f"chunks hold no window for sliding layer {i}")
        return rows, filled, logits, states

    @staticmethod
    def _check_compatible(h: framing.Header, target: SessionState, where: str) -> None:
        """A checked manifest against the session it is restored into: model, dtype, layers, logits."""
        fields = h.fields
        compare_fingerprint(fields["fingerprint"], target.fingerprint)
        if fields["kv_dtype"] != target.kv_dtype or fields["row_shape"] != target.row_shape:
            raise CorruptSession(f"{where}: kv dtype {fields['kv_dtype']} rows {fields['row_shape']}, "
                                 f"session {target.kv_dtype} rows {target.row_shape}")
        attention = {layer.index: layer for layer in target.layers}
        for d in fields["layers"]:
            i = d["index"]
            if i not in attention or (d["kind"], d["window"]) != (attention[i].kind, attention[i].window):
                raise CorruptSession(f"{where}: layer {i} ({d['kind']}/{d['window']}) is not one of the model's")
        want = {r.index: r.describe() for r in target.recurrent}
        got = {r["index"]: r for r in fields.get("recurrent", [])}
        if got != want:
            raise CorruptSession(f"{where}: recurrent states {sorted(got)} are not the model's {sorted(want)}")
        h.check_lengths({"logits": 4 * target.vocab_size if fields["has_logits"] else 0}, where)
