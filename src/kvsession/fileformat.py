"""The bytes on disk: framing, checksums, and crash-safe writes.

A session file is

    preamble  16 bytes   magic b"\\x89KVS\\r\\n\\x1a\\n", u16 major, u16 minor, u32 header length
    header    N bytes    UTF-8 JSON: what the payload is, and the section table
    checksum  8 bytes    xxh3-64 of preamble + header, little-endian
    padding              zeros up to a multiple of 64
    sections             back to back, each padded to a multiple of 64

and each entry of the header's section table gives a section's name, its
offset from the start of the sections, its length and its xxh3-64. The
magic's high byte, CR LF and ^Z catch a file mangled by a text-mode
transfer (PNG's trick); the header length lets later versions add fields;
the per-section checksums say which part of a file went bad.

This module knows framing only. What the sections hold, and in which order,
is the session's business (session.py); what to keep is the store's.

Every write goes to a temporary file in the target's folder, is flushed,
fsynced when the caller asks for durability (and the folder too, so the
rename survives a power cut), then renamed over the target: a reader sees
the old file or the new one, never half of either.
"""
from __future__ import annotations

import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Sequence

import xxhash

from .errors import CorruptSession, NotASessionFile, TruncatedSession, UnsupportedVersion

MAGIC = b"\x89KVS\r\n\x1a\n"
VERSION = (1, 0)
PREAMBLE = struct.Struct("<8sHHI")  # magic, major, minor, header length
CHECKSUM = struct.Struct("<Q")
ALIGN = 64
MAX_HEADER = 64 << 20  # a header is JSON metadata; anything larger is damage


def as_bytes(b) -> memoryview:
    """A flat byte view of any buffer (numpy array, bytes, bytearray), empty ones included."""
    m = memoryview(b)
    return m.cast("B") if m.nbytes else memoryview(b"")


def checksum(buffers: Iterable) -> int:
    h = xxhash.xxh3_64()
    for b in buffers:
        h.update(as_bytes(b))
    return h.intdigest()


def _pad(n: int) -> int:
    return -n % ALIGN


@dataclass(frozen=True)
class Section:
    name: str
    offset: int  # from the start of the sections
    length: int
    xxh3: int


@dataclass(frozen=True)
class Header:
    fields: dict  # the payload's own description (everything but the section table)
    sections: tuple[Section, ...]
    data_start: int  # absolute offset of the first section

    def section(self, name: str) -> Section:
        for s in self.sections:
            if s.name == name:
                return s
        raise CorruptSession(f"section {name!r} is missing (the file has {[s.name for s in self.sections]})")

    @property
    def end(self) -> int:
        last = max((s.offset + s.length for s in self.sections), default=0)
        return self.data_start + last


def parse_header(blob: bytes, file_size: int, where: str = "file") -> Header:
    """Validate a file's first bytes (at least preamble + header + checksum) and return its Header.

    Raises only SessionFileError subclasses, whatever the bytes.
    """
    if file_size == 0:
        raise NotASessionFile(f"{where}: empty file")
    if len(blob) < PREAMBLE.size:
        if MAGIC.startswith(blob[: len(MAGIC)]):
            raise TruncatedSession(f"{where}: preamble: expected {PREAMBLE.size} bytes, found {len(blob)}")
        raise NotASessionFile(f"{where}: not a kvsession file (starts with {blob[:8]!r})")
    magic, major, minor, header_len = PREAMBLE.unpack_from(blob)
    if magic != MAGIC:
        raise NotASessionFile(f"{where}: not a kvsession file (starts with {magic!r}, expected {MAGIC!r})")
    if major != VERSION[0]:
        raise UnsupportedVersion(f"{where}: format version {major}.{minor}; this kvsession reads {VERSION[0]}.x")
    if header_len > MAX_HEADER:
        raise CorruptSession(f"{where}: header length {header_len} exceeds {MAX_HEADER}")
    end = PREAMBLE.size + header_len
    if len(blob) < end + CHECKSUM.size:
        raise TruncatedSession(
            f"{where}: header: expected {end + CHECKSUM.size} bytes, found {len(blob)}"
        )
    (stored,) = CHECKSUM.unpack_from(blob, end)
    if checksum([blob[:end]]) != stored:
        raise CorruptSession(f"{where}: header checksum mismatch")
    try:
        doc = json.loads(blob[PREAMBLE.size : end].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CorruptSession(f"{where}: header is not JSON ({e!r})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("sections"), list):
        raise CorruptSession(f"{where}: header has no section table")
    sections = []
    expect = 0
    for i, s in enumerate(doc.pop("sections")):
        try:
            sec = Section(str(s["name"]), int(s["offset"]), int(s["length"]), int(s["xxh3"], 16))
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptSession(f"{where}: section table entry {i} is malformed ({e!r})") from None
        if sec.offset != expect or sec.length < 0:
            raise CorruptSession(f"{where}: section {sec.name!r} at {sec.offset}, expected {expect}")
        expect = sec.offset + sec.length + _pad(sec.length)
        sections.append(sec)
    data_start = end + CHECKSUM.size + _pad(end + CHECKSUM.size)
    header = Header(doc, tuple(sections), data_start)
    if header.end > file_size:
        cut = next((s for s in sections if data_start + s.offset + s.length > file_size), None)
        if cut is None:
            raise TruncatedSession(f"{where}: truncated after the header: sections start at byte {data_start}, "
                                   f"the file has {file_size}")
        raise TruncatedSession(
            f"{where}: truncated in section {cut.name!r}: it ends at byte {data_start + cut.offset + cut.length}, "
            f"the file has {file_size}"
        )
    return header


def read_header(f: BinaryIO, where: str) -> Header:
    size = os.fstat(f.fileno()).st_size
    pre = f.read(PREAMBLE.size)
    if len(pre) == PREAMBLE.size and pre[:8] == MAGIC:
        header_len = PREAMBLE.unpack(pre)[3]
        rest = f.read(min(header_len, MAX_HEADER + 1) + CHECKSUM.size)
        header = parse_header(pre + rest, size, where)
        pad = f.read(header.data_start - len(pre) - len(rest))
        if pad.strip(b"\0"):
            raise CorruptSession(f"{where}: the padding after the header is not zero (the file is damaged)")
        return header
    return parse_header(pre, size, where)


def read_section(f: BinaryIO, header: Header, name: str, into: Sequence | None = None,
                 where: str = "file") -> memoryview | None:
    """A section's bytes, checked against its checksum.

    With `into` (writable buffers whose sizes add up to the section's length)
    the bytes land there, in order, without an intermediate copy, and None is
    returned.
    """
    sec = header.section(name)
    f.seek(header.data_start + sec.offset)
    bufs = [as_bytes(b) for b in into] if into is not None else [memoryview(bytearray(sec.length))]
    if sum(b.nbytes for b in bufs) != sec.length:
        raise CorruptSession(
            f"{where}: section {name!r} holds {sec.length} bytes, {sum(b.nbytes for b in bufs)} expected"
        )
    for b in bufs:
        got = f.readinto(b) if b.nbytes else 0
        if got != b.nbytes:
            raise TruncatedSession(f"{where}: section {name!r} is cut short")
    if checksum(bufs) != sec.xxh3 or f.read(_pad(sec.length)).strip(b"\0"):
        raise CorruptSession(f"{where}: section {name!r}: checksum mismatch (the file is damaged)")
    return None if into is not None else bufs[0]


def write_file(path: str | os.PathLike, fields: dict, sections: Sequence[tuple[str, Sequence]], *,
               durable: bool = True, progress: Callable[[int, int], None] | None = None) -> int:
    """Write header fields and (name, buffers) sections crash-safely; returns the file's size.

    progress(done, total) is called after each section with bytes written so far.
    """
    table, offset = [], 0
    for name, buffers in sections:
        length = sum(as_bytes(b).nbytes for b in buffers)
        table.append({"name": name, "offset": offset, "length": length, "xxh3": f"{checksum(buffers):016x}"})
        offset += length + _pad(length)
    header = json.dumps({**fields, "sections": table}, separators=(",", ":")).encode()
    pre = PREAMBLE.pack(MAGIC, VERSION[0], VERSION[1], len(header)) + header
    pre += CHECKSUM.pack(checksum([pre]))
    pre += bytes(_pad(len(pre)))

    def write(f: BinaryIO) -> None:
        f.write(pre)
        done = len(pre)
        for _, buffers in sections:
            n = 0
            for b in buffers:
                n += f.write(as_bytes(b))
            f.write(bytes(_pad(n)))
            done += n + _pad(n)
            if progress:
                progress(done, len(pre) + offset)

    atomic_write(path, write, durable=durable)
    return len(pre) + offset


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None], *, durable: bool) -> None:
    """Run write(f) on a temporary file beside `path`, then rename it into place.

    On any failure the temporary file is removed and `path` is left as it was.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
