"""The session file (.kvs): what its header must hold, and a session's rows written to one and read back.

framing.py frames the bytes (preamble, header, sections, checksums);
this module says what a session file holds: a header with the model
fingerprint, the KV dtype, the row format, each layer's kind, window and
live rows, the sampler state and `meta`; then the sections tokens, logits,
text (the rendered prefix) and one per layer (its K rows, then its V rows,
in logical order). Which file a session loads, and what a load means for
its timeline, is the session's business (session.py).

A file is hostile input until checked: `check_session_header` type-checks
every header field and the section sizes they imply, with no model at hand
(inspect and the listing of named sessions use it too); `check_against_model`
then compares it with the model, all before any allocation. `open_checked`
does both and hands out a SessionFile whose reads verify each section's
checksum before its bytes are used.

The store's manifests and chunks reuse these field specs (store/layout.py).
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable, Iterator

import numpy as np
import torch

from ..config import RECURRENT_KINDS
from ..errors import (
    CorruptSession,
    SessionMismatch,
    UnreadableSession,
    UnsupportedVersion,
)
from ..kv.cache import KV_DTYPES, LayerCache
from ..kv.recurrent import state_shapes
from ..kv.rows import ROW_FORMATS, decode_q8_into, encode_rows, encoded_row_bytes
from ..kv.state import SessionState
from ..kv.transfer import Downloads, Uploads
from ..sampling import Sampler
from . import framing
from .fields import (
    AnyJSON,
    Bool,
    Either,
    Int,
    ListOf,
    Null,
    Num,
    Obj,
    OneOf,
    Str,
    check_json,
    short,
)

if TYPE_CHECKING:
    from ..engine import Engine


# --- what a header must hold ----------------------------------------------------------

MAX_TIME = 253402214400  # 9999-12-31 00:00 UTC: a day short of datetime's end, for every time zone
LAYER_FIELDS = Obj({"index": Int(), "kind": OneOf("full", "sliding"), "window": Int(), "start": Int(), "rows": Int()})
FINGERPRINT_FIELDS = Obj({"kv_shape": Obj({"arch": Str(), "n_layers": Int(1), "n_kv_heads": Int(1),
                                           "head_dim": Int(1), "layers": ListOf(Obj({"kind": Str()}))}),
                          "weights": Str()})
SAMPLER_FIELDS = Obj({
    # closed: the params become SamplerParams(**params), which takes no other field
    "params": Obj({"temperature": Num(), "top_k": Int(), "top_p": Num(), "min_p": Num(),
                   "seed": Either(Null(), Int())}, closed=True),
    "rng": Obj({"bit_generator": OneOf("PCG64"),
                "state": Obj({"state": Int(0, 2 ** 128 - 1), "inc": Int(0, 2 ** 128 - 1)}),
                "has_uint32": Int(0, 1), "uinteger": Int(0, 2 ** 32 - 1)}),
})
# meta is free-form JSON, but what the chat and `run --session` read from it has a shape
MESSAGE_FIELDS = Obj({"role": Str(), "content": Either(Str(), ListOf(AnyJSON()), Null())}, extra=AnyJSON())
META_FIELDS = Obj({}, {"messages": ListOf(MESSAGE_FIELDS), "title": Str(), "turns": ListOf(Int())},
                  extra=AnyJSON())
# a hybrid's recurrent layer (kv/recurrent.py): its kind and each state array's shape, float32 in section state.N
RECURRENT_FIELDS = Obj({"index": Int(), "kind": OneOf(*RECURRENT_KINDS),
                        "arrays": Obj({"conv": ListOf(Int(1), length=2)}, {"ssm": ListOf(Int(1), length=3)},
                                      closed=True)})
SESSION_FIELDS = Obj({
    "created": Num(0, MAX_TIME, "a Unix time"),
    "model": Obj({"file": Str(), "fingerprint": FINGERPRINT_FIELDS}),
    "kv_dtype": OneOf(*KV_DTYPES), "row_shape": ListOf(Int(1), length=2), "n_tokens": Int(), "vocab_size": Int(1),
    "has_logits": Bool(), "partial": Bool(), "layers": ListOf(LAYER_FIELDS), "sampler": SAMPLER_FIELDS,
    "meta": META_FIELDS,
}, {"row_format": OneOf(*ROW_FORMATS),  # from format 1.1; absent: exact
    "recurrent": ListOf(RECURRENT_FIELDS)})  # a hybrid's recurrent layers; absent: none


def describe(state: SessionState, row_format: str = "exact") -> dict:
    """The header fields of a state's file: everything a loader checks before it reads a row."""
    return {
        "kind": "session",
        "created": time.time(),
        "model": {"file": state.model_file, "fingerprint": state.fingerprint},
        "kv_dtype": state.kv_dtype,
        "row_format": row_format,
        "row_shape": list(state.row_shape),
        "n_tokens": state.n_tokens,
        "vocab_size": state.vocab_size,
        "has_logits": state.has_logits,
        "partial": state.partial,
        "layers": [layer.describe() for layer in state.layers],
        "sampler": state.sampler,
        "meta": state.meta,
        **({"recurrent": [r.describe() for r in state.recurrent]} if state.recurrent else {}),
    }


def check_session_header(header: framing.Header, where: str) -> None:
    """Everything a session file's header must be, whatever the model: each field's type, then the
    section sizes those fields imply. Raises CorruptSession naming the field or section.
    """
    fields = header.fields
    check_row_format(fields, where)
    check_structure(fields, SESSION_FIELDS, "session", where)
    n = fields["n_tokens"]
    header.section("text")
    header.check_lengths({"tokens": 4 * n, "logits": 4 * fields["vocab_size"] if fields["has_logits"] else 0,
                          **{f"layer.{d['index']}": 2 * d["rows"] * row_bytes(fields) for d in fields["layers"]},
                          **{f"state.{r['index']}": state_bytes(r) for r in fields.get("recurrent", [])}},
                         where)


def state_bytes(r: dict) -> int:
    """Bytes of a recurrent layer's state section (a checked RECURRENT_FIELDS entry): its float32 arrays."""
    return sum(4 * int(np.prod(shape)) for shape in r["arrays"].values())


def row_bytes(fields: dict) -> int:
    """Bytes of one token's K (or V) row in a file whose checked header gives row_shape, kv_dtype and
    (from format 1.1) row_format."""
    return encoded_row_bytes(fields["row_shape"], KV_DTYPES[fields["kv_dtype"]], fields.get("row_format", "exact"))


def check_row_format(fields: dict, where: str) -> None:
    """A row format this kvsession does not know is refused as a later version's file, not misread."""
    fmt = fields.get("row_format", "exact")
    if not isinstance(fmt, str) or fmt not in ROW_FORMATS:
        raise UnsupportedVersion(f"{where}: row format {short(fmt)}; this kvsession reads "
                                 f"{', '.join(ROW_FORMATS)}")


def check_structure(fields: dict, spec: Obj, kind: str, where: str, error=CorruptSession) -> None:
    """The checks a session header and a raw manifest share: kind, types, and how the fields hang together."""
    if fields.get("kind") != kind:
        raise error(f"{where}: header kind {short(fields.get('kind'))}, expected {kind!r}")
    check_json(fields, spec, where, error=error)
    n = fields["n_tokens"]
    check_json(fields["meta"].get("turns", []), ListOf(Int(0, n)), where, field="meta.turns", error=error)
    seen = set()
    for d in fields["layers"]:
        if d["index"] in seen:
            raise error(f"{where}: layer index {d['index']} appears twice")
        seen.add(d["index"])
        if d["start"] + d["rows"] != n:
            raise error(f"{where}: layer {d['index']} holds rows [{d['start']}, {d['start'] + d['rows']}) "
                        f"of {n} tokens")
    seen = set()
    for r in fields.get("recurrent", []):
        if r["index"] in seen:
            raise error(f"{where}: recurrent layer index {r['index']} appears twice")
        seen.add(r["index"])
    try:
        Sampler.from_state(fields["sampler"])
    except ValueError as e:  # SamplerParams refuses a value its type allows (top_p 3)
        raise error(f"{where}: header field sampler.params: {e}") from None


def check_against_model(fields: dict, engine: "Engine", kv_dtype: str | None, where: str) -> None:
    """Refuse a file made for another model, dtype or shape, naming the first field that differs.

    The fields have passed check_structure: each has its type.
    """
    compare_fingerprint(fields["model"]["fingerprint"], engine.fingerprint.to_dict())
    if kv_dtype is not None and fields["kv_dtype"] != kv_dtype:
        raise SessionMismatch("kv_dtype", fields["kv_dtype"], kv_dtype)
    c = engine.config
    if fields["row_shape"] != [c.n_kv_heads, c.head_dim]:
        raise SessionMismatch("row_shape", fields["row_shape"], [c.n_kv_heads, c.head_dim])
    if fields["vocab_size"] != c.vocab_size:
        raise SessionMismatch("vocab_size", fields["vocab_size"], c.vocab_size)
    n = fields["n_tokens"]
    for d in fields["layers"]:
        i = d["index"]
        if i >= c.n_layers:
            raise CorruptSession(f"{where}: layer index {i}, the model has {c.n_layers} layers")
        spec = c.layers[i]
        if d["kind"] != spec.kind or d["window"] != spec.window:
            raise SessionMismatch(f"layer {i} kind", f"{d['kind']}/{d['window']}", f"{spec.kind}/{spec.window}")
        want_rows = n if spec.kind == "full" else min(n, spec.window)
        if d["rows"] != want_rows:
            raise CorruptSession(f"{where}: layer {i} holds rows [{d['start']}, {n}) of {n} tokens, "
                                 f"expected the last {want_rows}")
    for r in fields.get("recurrent", []):
        i = r["index"]
        if i >= c.n_layers or not c.layers[i].recurrent:
            raise SessionMismatch(f"layer {i} state", r["kind"], "a layer without a recurrent state")
        if r["kind"] != c.layers[i].recurrent:
            raise SessionMismatch(f"layer {i} state", r["kind"], c.layers[i].recurrent)
        want = {name: list(shape) for name, shape in state_shapes(c.ssm).items()}
        if r["arrays"] != want:
            raise SessionMismatch(f"layer {i} state arrays", r["arrays"], want)
    if not fields["partial"]:
        attention = sum(spec.attention for spec in c.layers)
        recurrent = sum(bool(spec.recurrent) for spec in c.layers)
        if len(fields["layers"]) != attention or len(fields.get("recurrent", [])) != recurrent:
            raise CorruptSession(f"{where}: {len(fields['layers'])} attention layers and "
                                 f"{len(fields.get('recurrent', []))} recurrent states in a full session of a model "
                                 f"with {attention} and {recurrent}")


def compare_fingerprint(file_fp: dict, model_fp: dict) -> None:
    fa, ma = file_fp["kv_shape"], model_fp["kv_shape"]
    for key in ("arch", "n_layers", "n_kv_heads", "head_dim"):
        if fa.get(key) != ma.get(key):
            raise SessionMismatch(key, fa.get(key), ma.get(key))
    for i, (a, b) in enumerate(zip(fa["layers"], ma["layers"])):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                raise SessionMismatch(f"layer {i} {key}", a.get(key), b.get(key))
    if file_fp["weights"] != model_fp["weights"]:
        raise SessionMismatch("weights", file_fp["weights"][:16], model_fp["weights"][:16],
                              "the file was saved with other weights")


# --- writing ----------------------------------------------------------------------------


def write(state: SessionState, path: Path, fields: dict, *, row_format: str, transfer: str, durable: bool,
          progress: Callable[[int, int], None] | None) -> int:
    """The session file of `fields` (describe); each layer's rows leave the device while the layer before is
    written (transfer.py). Returns the file's size."""
    dtype = KV_DTYPES[state.kv_dtype]
    row = encoded_row_bytes(state.row_shape, dtype, row_format)
    with Downloads([layer.runs() for layer in state.layers], state.device, transfer) as down:
        sections = [("tokens", [np.asarray(state.tokens, dtype="<i4")]),
                    ("logits", [state.logits]),
                    ("text", [state.text().encode("utf-8")])]
        sections += [(f"layer.{layer.index}", framing.Lazy(2 * row * layer.rows,
                                                           lambda j=j: encode_rows(*down.take(j), dtype, row_format)))
                     for j, layer in enumerate(state.layers)]
        sections += [(f"state.{r.index}", [r.arrays[name] for name in sorted(r.arrays)]) for r in state.recurrent]
        return framing.write_file(path, fields, sections, durable=durable, progress=progress)


# --- reading ----------------------------------------------------------------------------


class SessionFile:
    """A session file open for reading, its header past every check, the model's included (open_checked).

    Each read verifies its section's checksum; nothing here touches a live
    session: rows go into a new session's cache (fill) or into host arrays
    (read_layers) that the caller writes once every one is checked.
    """

    def __init__(self, f: BinaryIO, header: framing.Header, engine: "Engine", where: str):
        self.f, self.header, self.engine, self.where = f, header, engine, where
        self.fields = header.fields

    def tokens(self) -> list[int]:
        ids = np.frombuffer(framing.read_section(self.f, self.header, "tokens", where=self.where), dtype="<i4")
        vocab = self.engine.config.vocab_size
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise CorruptSession(f"{self.where}: token id outside the vocabulary of {vocab}")
        return ids.tolist()

    def logits(self) -> torch.Tensor | None:
        """[vocab] f32, or None when the file has none."""
        buf = framing.read_section(self.f, self.header, "logits", where=self.where)
        return torch.from_numpy(np.frombuffer(buf, dtype="<f4").copy()) if buf.nbytes else None

    def states(self, into: dict[int, dict[str, np.ndarray]] | None = None) -> dict[int, dict[str, np.ndarray]]:
        """Each recurrent layer's state arrays (float32, checksum verified), by layer; read into `into`'s arrays
        where it has the layer's (the states of a session nobody reads yet, on the CPU)."""
        into = into or {}
        return {r["index"]: read_state(self.f, self.header, r, self.where, into.get(r["index"]))
                for r in self.fields.get("recurrent", [])}

    def fill(self, target: SessionState, transfer: str, progress: Callable[[int, int], None] | None) -> None:
        """The text section verified (never kept), then every layer's rows into the layers of `target` (the
        state of a session nobody reads yet) through `transfer`; progress(done, total): layers read, after each."""
        framing.verify_section(self.f, self.header, "text", where=self.where)
        layers = self.fields["layers"]
        caches = {layer.index: layer.cache for layer in target.layers}
        with Uploads(target.device, target.row_shape, target.dtype, transfer) as up:
            for d in layers:
                layer = caches[d["index"]]
                _check_layer_fits(d, layer)
                up.fill(layer, d["start"], d["rows"], self._rows(d))
                if progress:
                    progress(d["index"] + 1, len(layers))

    def read_layers(self, target: SessionState) -> list[tuple[dict, np.ndarray, np.ndarray]]:
        """(layer description, K rows, V rows [rows, H, D]) host arrays for each layer, every checksum verified,
        shaped for the layers of `target`; nothing is written to them."""
        caches = {layer.index: layer.cache for layer in target.layers}
        staged = []
        for d in self.fields["layers"]:
            layer = caches[d["index"]]
            _check_layer_fits(d, layer)
            k, v = layer.host_rows(d["rows"])
            self._rows(d)(k, v)
            staged.append((d, k, v))
        return staged

    def _rows(self, d: dict) -> Callable[[np.ndarray, np.ndarray], None]:
        """fill(k, v): a layer section's rows, checksum verified, into host rows [n, H, D] of the file's KV dtype,
        decoded from 8-bit blocks when the file holds those."""
        section = f"layer.{d['index']}"
        if self.fields.get("row_format", "exact") == "exact":
            return lambda k, v: framing.read_section(self.f, self.header, section, into=[k, v], where=self.where)

        def fill(k: np.ndarray, v: np.ndarray) -> None:
            decode_q8_into(framing.read_section(self.f, self.header, section, where=self.where), k, v,
                           KV_DTYPES[self.fields["kv_dtype"]])

        return fill


def read_state(f: BinaryIO, header: framing.Header, r: dict, where: str,
               into: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """A recurrent layer's state section (`state.N` of a session file or a manifest; r: its checked header entry)
    as float32 arrays by name, its checksum verified; the bytes land in the arrays as they are read (a
    Qwen3.5-0.8B's states are 20 MB): `into`'s, where it holds arrays of the section's names and shapes, else
    new ones."""
    shapes = {name: tuple(r["arrays"][name]) for name in sorted(r["arrays"])}
    if into is not None and {n: a.shape for n, a in into.items()} == shapes and \
            all(a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable for a in into.values()):
        arrays = {name: into[name] for name in shapes}
    else:
        arrays = {name: np.empty(shape, dtype="<f4") for name, shape in shapes.items()}
    framing.read_section(f, header, f"state.{r['index']}", into=list(arrays.values()), where=where)
    return arrays


def _check_layer_fits(d: dict, layer: LayerCache) -> None:
    if layer.ring and d["rows"] > layer.capacity:
        raise SessionMismatch(f"layer {d['index']} rows", d["rows"], f"a ring of {layer.capacity}")


@contextmanager
def open_checked(path: str | os.PathLike, engine: "Engine", kv_dtype: str | None) -> Iterator[SessionFile]:
    """A session file open for reading, its header past every check, the model's included.

    An I/O error while the caller reads it becomes UnreadableSession.
    """
    where = str(path)
    with framing.open_regular(path, where) as f:
        try:
            header = framing.read_header(f, where)
            check_session_header(header, where)
            check_against_model(header.fields, engine, kv_dtype, where)
            yield SessionFile(f, header, engine, where)
        except OSError as e:
            raise UnreadableSession(f"{where}: {e.strerror}") from None
