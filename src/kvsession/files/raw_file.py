"""The seed's raw layout, for interoperability: layer blobs back to back, and a JSON manifest beside them.

`save(..., format="raw")` writes PATH, every saved layer's K rows then its V
rows in logical order with no header, and PATH.json, which carries what the
raw bytes do not: the session file's header fields (session_file.describe),
each layer's byte ranges and xxh3-64, the tokens, the logits (base64 f32)
and the text. The manifest is written last, so a blob without one is
refused, never misread.

A raw file is as hostile as any: the manifest is type-checked whole, its
byte ranges against the rows its fields imply, and the blob against the
manifest (its exact size, no hole) before a row is read; every layer's
checksum is verified before a row reaches a cache.
"""
from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import torch

from ..errors import (
    CorruptSession,
    ManifestError,
    MissingManifest,
    SessionFileError,
    SessionMismatch,
    SessionNotFound,
    TruncatedSession,
    UnreadableSession,
)
from ..kv.state import SessionState
from . import framing
from .fields import Hex, Int, ListOf, Obj, Str, short
from .session_file import (
    LAYER_FIELDS,
    SESSION_FIELDS,
    check_against_model,
    check_structure,
    row_bytes,
)

if TYPE_CHECKING:
    from ..engine import Engine

MAX_MANIFEST = 64 << 20  # a raw manifest carries the tokens, the text and the logits as JSON
RAW_LAYER_FIELDS = Obj({**LAYER_FIELDS.required, "k": ListOf(Int(), length=2), "v": ListOf(Int(), length=2)},
                       {"xxh3": Hex(16)})
RAW_FIELDS = Obj({**SESSION_FIELDS.required, "layers": ListOf(RAW_LAYER_FIELDS), "blob_bytes": Int(),
                  "n_layers": Int(1), "n_kv_heads": Int(1), "head_dim": Int(1), "tokens": ListOf(Int()),
                  "logits_f32_base64": Str(), "text": Str()})


def is_raw(path: Path) -> bool:
    """A regular file that does not start with the session magic is treated as a raw blob."""
    try:
        with framing.open_regular(path) as f:
            head = f.read(len(framing.MAGIC))
    except (SessionFileError, OSError):  # the session-file path opens it again and says what is wrong
        return False
    return len(head) > 0 and not framing.MAGIC.startswith(head)


def manifest_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def write(state: SessionState, path: Path, fields: dict, *, durable: bool) -> int:
    """The blob of the layers `fields` describes (session_file.describe of `state`, exact rows) and its
    manifest `path.json`; returns the blob's size."""
    rows = {layer.index: layer.read() for layer in state.layers}
    layers, offset = [], 0
    for d in fields["layers"]:
        k, v = rows[d["index"]]
        layers.append({**d, "k": [offset, k.nbytes], "v": [offset + k.nbytes, v.nbytes],
                       "xxh3": f"{framing.checksum([k, v]):016x}"})
        offset += k.nbytes + v.nbytes
    manifest = {
        **fields, "kind": "raw", "version": 1, "layers": layers, "blob_bytes": offset,
        "n_layers": state.n_layers, "n_kv_heads": fields["row_shape"][0], "head_dim": fields["row_shape"][1],
        "tokens": state.tokens,
        "logits_f32_base64": base64.b64encode(state.logits.tobytes()).decode(),
        "text": state.text(),
    }

    def write_blob(f) -> None:
        for d in fields["layers"]:
            for a in rows[d["index"]]:
                f.write(framing.as_bytes(np.ascontiguousarray(a)))

    framing.atomic_write(path, write_blob, durable=durable)
    # the manifest goes last: a blob without one is refused, never misread
    framing.atomic_write(manifest_path(path), lambda f: f.write(json.dumps(manifest).encode()), durable=durable)
    return offset


def read_manifest(path: Path) -> dict:
    """The manifest beside a raw blob, every field checked and the byte ranges it gives the layers too.

    Needs no model (inspect reads raw files with it). Raises ManifestError (MissingManifest when there is none).
    """
    mpath = manifest_path(path)
    where = str(mpath)
    try:
        m = json.loads(framing.read_small(mpath, MAX_MANIFEST))
    except SessionNotFound:
        raise MissingManifest(f"{path}: not a session file, and no raw-format manifest {mpath.name} "
                              "beside it") from None
    except SessionFileError as e:
        raise ManifestError(str(e)) from None
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{where}: unreadable manifest ({e!r})") from None
    if not isinstance(m, dict):
        raise ManifestError(f"{where}: not a kvsession raw manifest")
    check_structure(m, RAW_FIELDS, "raw", where, error=ManifestError)
    if m.get("row_format", "exact") != "exact":
        raise ManifestError(f"{where}: row format {short(m['row_format'])}: raw files hold exact rows")
    if len(m["tokens"]) != m["n_tokens"]:
        raise ManifestError(f"{where}: {len(m['tokens'])} tokens, n_tokens says {m['n_tokens']}")
    row = row_bytes(m)
    expect = 0
    for d in m["layers"]:
        (ko, kn), (vo, vn) = d["k"], d["v"]
        if ko != expect or kn != d["rows"] * row or vo != ko + kn or vn != kn:
            raise ManifestError(f"{where}: layer {d['index']} byte ranges {d['k']} {d['v']} do not match "
                                f"{d['rows']} rows of {row} bytes at offset {expect}")
        expect = vo + vn
    if expect != m["blob_bytes"]:
        raise ManifestError(f"{where}: the layers take {expect} bytes, blob_bytes says {m['blob_bytes']}")
    return m


def open_blob(path: Path, m: dict) -> BinaryIO:
    """The blob a checked manifest describes, open, once it holds exactly blob_bytes really written bytes."""
    f = framing.open_regular(path)
    try:
        size = os.fstat(f.fileno()).st_size
        if size != m["blob_bytes"]:
            raise TruncatedSession(f"{path}: blob has {size} bytes, the manifest says {m['blob_bytes']}")
        hole = framing.first_hole(f, 0, size)
        if hole is not None:
            raise CorruptSession(f"{path}: a hole at byte {hole}: a sparse file, not one kvsession wrote")
        return f
    except BaseException:
        f.close()
        raise


@dataclass(frozen=True)
class RawFile:
    """A raw blob whose manifest passed every check, the model's included (read): its fields, tokens and
    logits at hand, its rows read by fill."""

    path: Path
    fields: dict  # the manifest
    tokens: list[int]
    logits: torch.Tensor | None  # [vocab] f32

    def fill(self, target: SessionState) -> None:
        """Every layer's rows into the layers of `target` (the state of a session nobody reads yet), once each
        layer's checksum has been verified."""
        where = str(self.path)
        cache = {layer.index: layer.cache for layer in target.layers}
        staged = []
        with open_blob(self.path, self.fields) as f:
            try:
                for d in self.fields["layers"]:
                    k, v = cache[d["index"]].host_rows(d["rows"])
                    f.seek(d["k"][0])
                    if f.readinto(framing.as_bytes(k)) != k.nbytes or f.readinto(framing.as_bytes(v)) != v.nbytes:
                        raise TruncatedSession(f"{where}: layer {d['index']} is cut short")
                    if "xxh3" in d and framing.checksum([k, v]) != int(d["xxh3"], 16):
                        raise CorruptSession(f"{where}: layer {d['index']}: checksum mismatch")
                    staged.append((d, k, v))
            except OSError as e:
                raise UnreadableSession(f"{where}: {e.strerror}") from None
        for d, k, v in staged:
            cache[d["index"]].write_rows(d["start"], k, v)


def read(path: Path, engine: "Engine", kv_dtype: str | None) -> RawFile:
    """The raw file at `path` checked against the model: manifest, tokens and logits (the rows: RawFile.fill)."""
    m = read_manifest(path)
    c = engine.config
    for key, want in (("n_layers", c.n_layers), ("n_kv_heads", c.n_kv_heads), ("head_dim", c.head_dim)):
        if m[key] != want:
            raise SessionMismatch(key, m[key], want)
    check_against_model(m, engine, kv_dtype, str(path))
    if m["partial"]:
        raise SessionMismatch("partial", "a partial raw file", "a full session")
    if any(not 0 <= t < c.vocab_size for t in m["tokens"]):
        raise ManifestError(f"{manifest_path(path)}: a token id outside the vocabulary of {c.vocab_size}")
    try:
        logits = np.frombuffer(base64.b64decode(m["logits_f32_base64"], validate=True), dtype="<f4")
    except ValueError as e:
        raise ManifestError(f"{manifest_path(path)}: logits_f32_base64: {e}") from None
    if logits.size != (c.vocab_size if m["has_logits"] else 0):
        raise ManifestError(f"{manifest_path(path)}: {logits.size} logits, expected {c.vocab_size}")
    return RawFile(path, m, list(m["tokens"]), torch.from_numpy(logits.copy()) if logits.size else None)
