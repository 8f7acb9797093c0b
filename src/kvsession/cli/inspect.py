"""`kvsession inspect`: a session file's header, layers, sizes and text, every checksum verified; no model needed.

A session file's header is checked whole (session_file.check_session_header)
before anything is printed, and its sections are streamed a block at a
time: memory stays small whatever sizes a (hostile) header declares. A
regular file that does not start with the session magic and has a
NAME.json beside it is read as a raw blob and its manifest (files/raw_file.py).
"""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

from ..errors import SessionFileError, UnreadableSession
from ..files import framing
from ..files.raw_file import open_blob, read_manifest
from ..files.session_file import check_session_header


def run(args) -> int:
    path = Path(args.file)
    with framing.open_regular(path) as f:
        try:
            head = f.read(len(framing.MAGIC))
            if head and not framing.MAGIC.startswith(head) and os.path.lexists(f"{path}.json"):
                return _inspect_raw(path, args.preview)
            f.seek(0)
            header = framing.read_header(f, str(path))
            check_session_header(header, str(path))
            text, bad = _Ends(4 * args.preview + 4), []
            for sec in header.sections:
                try:
                    framing.verify_section(f, header, sec.name, where=str(path),
                                              sink=text if sec.name == "text" else None)
                except SessionFileError as e:
                    bad.append((sec.name, str(e)))
            size = os.fstat(f.fileno()).st_size
        except OSError as e:
            raise UnreadableSession(f"{path}: {e.strerror}") from None
    h = header.fields
    fp = h["model"]["fingerprint"]
    print(f"file        {path} ({size:,} bytes, format {framing.VERSION[0]})")
    print(f"model       {h['model']['file']}  arch {fp['kv_shape']['arch']}  weights {fp['weights'][:16]}")
    print(f"created     {datetime.datetime.fromtimestamp(h['created']).isoformat(timespec='seconds')}")
    print(f"tokens      {h['n_tokens']}   kv dtype {h['kv_dtype']}   row shape {h['row_shape']}   "
          f"logits {'yes' if h['has_logits'] else 'no'}   partial {'yes' if h['partial'] else 'no'}")
    print(f"sampler     {json.dumps(h['sampler']['params'])}")
    if h["meta"]:
        print(f"meta        {', '.join(sorted(h['meta']))}")
    sizes = {sec.name: sec.length for sec in header.sections}
    _print_layers([{**d, "bytes": sizes[f"layer.{d['index']}"]} for d in h["layers"]])
    print("sections    " + ", ".join(f"{sec.name} {sec.length:,} B" for sec in header.sections
                                      if not sec.name.startswith("layer.")))
    if text.total and "text" not in dict(bad):
        print(f"text        {text.preview(args.preview)!r}")
    if bad:
        for name, err in bad:
            print(f"BAD         {err}")
        raise SessionFileError(f"{path}: {len(bad)} of {len(header.sections)} sections failed their checksum")
    print(f"checksums   all {len(header.sections) + 1} ok (header and every section)")
    return 0


class _Ends:
    """The first and the last n bytes of a stream (all of it when it is short): a preview of a section
    that costs 2n bytes of memory whatever the section's length."""

    def __init__(self, n: int):
        self.n, self.head, self.tail, self.total = n, bytearray(), bytearray(), 0

    def __call__(self, block: memoryview) -> None:
        self.head += block[: self.n - len(self.head)]
        self.tail = (self.tail + block)[-self.n:]
        self.total += len(block)

    def preview(self, chars: int) -> str:
        """The text, or its first and last chars/2 characters when it has more than `chars`."""
        head = bytes(self.head).decode("utf-8", errors="replace")
        if self.total <= self.n and len(head) <= chars:
            return head
        tail = bytes(self.tail if self.total > self.n else self.head).decode("utf-8", errors="replace")
        return head[: chars // 2] + " [...] " + tail[-(chars // 2):]


def _print_layers(layers: list[dict]) -> None:
    """One line per run of consecutive layers that differ only in index (kind, window, start, rows, bytes)."""
    for first, last, d in _runs(layers):
        which = f"layer {first}" if first == last else f"layers {first}-{last}"
        print(f"{which:<12}{d['kind']}" + (f" (window {d['window']})" if d["window"] else "")
              + f", rows [{d['start']}, {d['start'] + d['rows']}), {d['bytes']:,} bytes" + (" each" if last > first else ""))


def _runs(layers: list[dict]):
    """(first index, last index, description) for runs of consecutive layers that differ only in index."""
    out = []
    for d in layers:
        key = {k: v for k, v in d.items() if k != "index"}
        if out and out[-1][1] == d["index"] - 1 and {k: v for k, v in out[-1][2].items() if k != "index"} == key:
            out[-1] = (out[-1][0], d["index"], out[-1][2])
        else:
            out.append((d["index"], d["index"], d))
    return out


def _inspect_raw(path: Path, preview: int) -> int:
    m = read_manifest(path)
    print(f"file        {path} ({m['blob_bytes']:,} bytes, raw format; manifest {path.name}.json)")
    print(f"model       {m['model']['file']}")
    print(f"tokens      {m['n_tokens']}   kv dtype {m['kv_dtype']}   layers {m['n_layers']}   "
          f"kv heads {m['n_kv_heads']}   head dim {m['head_dim']}")
    bad = []
    with open_blob(path, m) as f:
        for d in m["layers"]:  # K then V, back to back (read_manifest checked the ranges)
            digest = framing.checksum_range(f, d["k"][0], d["k"][1] + d["v"][1], f"{path}: layer {d['index']}")
            if "xxh3" in d and digest != int(d["xxh3"], 16):
                bad.append(d["index"])
    _print_layers([{"index": d["index"], "kind": d["kind"], "window": d["window"], "start": d["start"],
                    "rows": d["rows"], "bytes": d["k"][1] + d["v"][1]} for d in m["layers"]])
    text = m["text"]
    if text:
        print(f"text        {(text if len(text) <= preview else text[: preview // 2] + ' [...] ' + text[-preview // 2:])!r}")
    if bad:
        raise SessionFileError(f"{path}: layers {bad} failed their checksum")
    print(f"checksums   all {len(m['layers'])} layers ok")
    return 0
