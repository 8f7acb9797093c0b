"""The bytes on disk: framing, checksums, and crash-safe writes.

A kvsession file (a session file, a store's chunk or manifest) is

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
is the business of each kind of file (files/session_file.py, store/layout.py);
what to keep is the store's.

Every write goes to a temporary file in the target's folder, is flushed,
fsynced when the caller asks for durability (and the folder too, so the
rename survives a power cut), then renamed over the target: a reader sees
the old file or the new one, never half of either. The temporary file is
flock()ed while it is written, so that one a killed writer left is told
from one being written (by any process) and removed
(remove_dead_temporaries: the sessions' and stored responses' folders;
the store cleans its own under its folder's lock).

Reading is written for hostile files. Only regular files are opened (a
FIFO blocks its reader forever). A header's checksum proves its bytes are
the ones written, not that kvsession wrote them, so its JSON is
type-checked field by field before use (files/fields.py). Every size a header
declares is checked against the bytes really on disk -- inside the file's
length, over no hole -- before anything is allocated for it, and sections
that are only verified are streamed a block at a time.
"""
from __future__ import annotations

import fcntl
import json
import os
import stat
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Sequence

import xxhash

from ..errors import (
    CorruptSession,
    NotASessionFile,
    SessionNotFound,
    SessionSaveError,
    TruncatedSession,
    UnreadableSession,
    UnsupportedVersion,
)
from .fields import HEX_DIGITS, Hex, Int, Obj, Str, check_json

MAGIC = b"\x89KVS\r\n\x1a\n"
# 1.1: rows may be stored in another row format than the cache's dtype (a
# header field "row_format", see kv.ROW_FORMATS); a file without it is 1.0's
# exact rows. A 1.0 reader refuses a q8 file by its section sizes.
VERSION = (1, 1)
PREAMBLE = struct.Struct("<8sHHI")  # magic, major, minor, header length
CHECKSUM = struct.Struct("<Q")
ALIGN = 64
# A header is JSON metadata (a long chat's messages are a few MB); parsing JSON
# costs several times its size in memory, so the bound is also a memory bound.
MAX_HEADER = 16 << 20
BLOCK = 1 << 20  # bytes read at a time from a section that is verified, not kept


# --- opening and replacing files -------------------------------------------------------

FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
              (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"),
              (stat.S_ISREG, "a file"))


def file_kind(mode: int) -> str:
    """What a stat mode is, in words: "a FIFO", "a folder", "a file", ..."""
    return next((name for test, name in FILE_KINDS if test(mode)), "an unknown kind of file")


def _refuse_irregular(mode: int, where: str) -> None:
    if not stat.S_ISREG(mode):
        raise NotASessionFile(f"{where}: not a regular file ({file_kind(mode)})")


def open_regular(path: str | os.PathLike, where: str | None = None) -> BinaryIO:
    """Open a regular file for reading; anything else raises before it can block or mislead.

    Opening a FIFO for reading waits for a writer, forever, and a device can
    be endless: stat() names what the path is first, O_NONBLOCK keeps the
    open from waiting should the path change in between, and fstat() checks
    what was really opened.
    """
    where = where or str(path)
    try:
        _refuse_irregular(os.stat(path).st_mode, where)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        detail = "a symbolic link to a missing file" if os.path.islink(path) else "no such file"
        raise SessionNotFound(f"{where}: {detail}") from None
    except OSError as e:
        raise UnreadableSession(f"{where}: {e.strerror}") from None
    try:
        _refuse_irregular(os.fstat(fd).st_mode, where)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def private_folder(folder: str | os.PathLike) -> None:
    """Make a folder (and its missing parents) that only its owner may enter: mode 0700, whatever the umask
    would give. The cache's and the sessions' folders hold conversations (their token ids, text and KV rows);
    their files are 0600 already (mkstemp), and a folder others can list would still show their names and
    sizes. A folder already there keeps the mode its owner gave it; missing parents get the usual one."""
    Path(folder).mkdir(mode=0o700, parents=True, exist_ok=True)


def private_opener(path: str, flags: int) -> int:
    """open()'s opener for a file that only its owner may read (0600), like the files atomic_write makes."""
    return os.open(path, flags, 0o600)


def check_target(path: str | os.PathLike) -> None:
    """Saving renames a new file over `path`: refuse when that would replace a folder, a FIFO, a device."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # nothing there (or a dangling link): the write itself says what is wrong, if anything
        return
    if not stat.S_ISREG(mode):
        raise SessionSaveError(f"{path}: not a regular file ({file_kind(mode)}); left as it is")


def read_small(path: str | os.PathLike, limit: int, where: str | None = None) -> bytes:
    """The whole of a small regular file (a JSON sidecar), refused unread when it is longer than `limit`."""
    where = where or str(path)
    with open_regular(path, where) as f:
        try:
            size = os.fstat(f.fileno()).st_size
            data = f.read(limit + 1) if size <= limit else b""
        except OSError as e:
            raise UnreadableSession(f"{where}: {e.strerror}") from None
    if size > limit or len(data) > limit:
        raise CorruptSession(f"{where}: {max(size, len(data)):,} bytes, more than the {limit:,} such a file holds")
    return data


def first_hole(f: BinaryIO, start: int, end: int) -> int | None:
    """The first byte in [start, end) that lies in a hole of a sparse file, or None.

    A hole is a range the file system never stored; it reads back as zeros.
    kvsession writes every byte of its files, so a hole means the file was
    made by other means: `truncate -s 4G` on a 2 MB file declares gigabytes
    that cost nothing on disk and would cost as much memory to read. Where
    the file system cannot tell, SEEK_HOLE answers "at the end" and nothing
    is refused. (ZFS with compression stores a block of zeros as a hole;
    a payload is hardly ever a whole block of zeros, and such a file is
    refused, never misread.)
    """
    if end <= start:
        return None
    fd = f.fileno()
    here = os.lseek(fd, 0, os.SEEK_CUR)  # the buffered reader above trusts the descriptor's position
    try:
        hole = os.lseek(fd, start, os.SEEK_HOLE)
    except OSError:  # no SEEK_HOLE on this file system, or start is past the end
        return None
    finally:
        os.lseek(fd, here, os.SEEK_SET)
    return hole if hole < end else None


# --- framing, checksums, reading and writing -----------------------------------------

SECTION = Obj({"name": Str(), "offset": Int(), "length": Int(), "xxh3": Hex(16)})


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

    def check_lengths(self, implied: dict[str, int], where: str) -> None:
        """Each named section holds exactly the bytes the payload's fields imply (before any is read)."""
        for name, size in implied.items():
            if self.section(name).length != size:
                raise CorruptSession(f"{where}: section {name!r} holds {self.section(name).length} bytes, "
                                     f"the header implies {size}")

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
    except (ValueError, RecursionError) as e:  # ValueError: bad UTF-8, bad JSON, a number of 5,000 digits
        raise CorruptSession(f"{where}: header is not JSON ({e!r})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("sections"), list):
        raise CorruptSession(f"{where}: header has no section table")
    sections = []
    expect = 0
    for i, s in enumerate(doc.pop("sections")):
        if not _plain_section(s):  # the slow path names what is wrong
            check_json(s, SECTION, where, what=f"section table entry {i}:")
        sec = Section(s["name"], s["offset"], s["length"], int(s["xxh3"], 16))
        if sec.offset != expect:
            raise CorruptSession(f"{where}: section {sec.name!r} at {sec.offset}, expected {expect}")
        if any(other.name == sec.name for other in sections):
            raise CorruptSession(f"{where}: section {sec.name!r} appears twice")
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


def _plain_section(s) -> bool:
    """What SECTION checks, for the well-formed entry every file has (a chunk's header holds dozens)."""
    return (type(s) is dict and type(s.get("name")) is str and type(s.get("offset")) is int
            and type(s.get("length")) is int and s["offset"] >= 0 and s["length"] >= 0
            and type(s.get("xxh3")) is str and len(s["xxh3"]) == 16 and HEX_DIGITS.issuperset(s["xxh3"]))


def read_header(f: BinaryIO, where: str) -> Header:
    """The header of an open file, checked: framing, checksum, and sections that are really on disk.

    Once it returns, every section lies inside the file and over no hole, so
    reading one costs at most the bytes the file really holds.
    """
    try:
        size = os.fstat(f.fileno()).st_size
        pre = f.read(PREAMBLE.size)
        if len(pre) < PREAMBLE.size or pre[:8] != MAGIC:
            return parse_header(pre, size, where)
        header_len = PREAMBLE.unpack(pre)[3]
        rest = f.read(min(header_len, MAX_HEADER + 1) + CHECKSUM.size)
        header = parse_header(pre + rest, size, where)
        pad = f.read(header.data_start - len(pre) - len(rest))
        hole = first_hole(f, header.data_start, header.end)
    except OSError as e:
        raise UnreadableSession(f"{where}: {e.strerror}") from None
    if pad.strip(b"\0"):
        raise CorruptSession(f"{where}: the padding after the header is not zero (the file is damaged)")
    if hole is not None:
        sec = next(s for s in header.sections if header.data_start + s.offset + s.length + _pad(s.length) > hole)
        raise CorruptSession(f"{where}: section {sec.name!r} ({sec.length:,} bytes) has a hole at byte {hole:,}: "
                             "a sparse file, not one kvsession wrote")
    return header


def read_section(f: BinaryIO, header: Header, name: str, into: Sequence | None = None,
                 where: str = "file") -> memoryview | None:
    """A section's bytes, checked against its checksum.

    With `into` (writable buffers whose sizes add up to the section's length)
    the bytes land there, in order, without an intermediate copy, and None is
    returned. Without, a buffer of the section's length is allocated: read_header
    has checked that the file really holds that many bytes; callers check the
    length the payload implies first.
    """
    sec = header.section(name)
    f.seek(header.data_start + sec.offset)
    bufs = [as_bytes(b) for b in into] if into is not None else [memoryview(bytearray(sec.length))]
    if sum(b.nbytes for b in bufs) != sec.length:
        raise CorruptSession(
            f"{where}: section {name!r} holds {sec.length} bytes, {sum(b.nbytes for b in bufs)} expected"
        )
    h = xxhash.xxh3_64()
    for b in bufs:
        for at in range(0, b.nbytes, BLOCK):  # hashed a block at a time as it lands, while it is in the cache
            block = b[at : at + BLOCK]
            if f.readinto(block) != block.nbytes:
                raise TruncatedSession(f"{where}: section {name!r} is cut short")
            h.update(block)
    _check_end(f, sec, h.intdigest(), where)
    return None if into is not None else bufs[0]


def verify_section(f: BinaryIO, header: Header, name: str, *, where: str = "file",
                   sink: Callable[[memoryview], None] | None = None) -> None:
    """Check a section's checksum a block at a time: memory stays one block, whatever the section's size.

    sink(block) sees every block in order; the block's buffer is reused, so a sink keeps a copy.
    """
    sec = header.section(name)
    digest = checksum_range(f, header.data_start + sec.offset, sec.length, f"{where}: section {name!r}", sink)
    _check_end(f, sec, digest, where)


def checksum_range(f: BinaryIO, offset: int, length: int, what: str,
                   sink: Callable[[memoryview], None] | None = None) -> int:
    """The xxh3-64 of bytes [offset, offset + length) of a file, read a block at a time (see verify_section)."""
    f.seek(offset)
    h = xxhash.xxh3_64()
    buf = memoryview(bytearray(min(BLOCK, length)))
    left = length
    while left:
        got = f.readinto(buf[: min(left, BLOCK)])
        if not got:
            raise TruncatedSession(f"{what} is cut short")
        h.update(buf[:got])
        if sink:
            sink(buf[:got])
        left -= got
    return h.intdigest()


def _check_end(f: BinaryIO, sec: Section, digest: int, where: str) -> None:
    """The checksum of a section just read, and the zero padding after it."""
    if digest != sec.xxh3 or f.read(_pad(sec.length)).strip(b"\0"):
        raise CorruptSession(f"{where}: section {sec.name!r}: checksum mismatch (the file is damaged)")


def _preamble(fields: dict, table: list[dict], path) -> bytes:
    """Preamble, header, its checksum and the padding: everything before the first section."""
    header = json.dumps({**fields, "sections": table}, separators=(",", ":")).encode()
    if len(header) > MAX_HEADER:  # a file no reader would accept is never written
        raise SessionSaveError(f"{path}: its header would take {len(header):,} bytes, more than the "
                               f"{MAX_HEADER:,} a reader accepts (is the metadata that large?)")
    pre = PREAMBLE.pack(MAGIC, VERSION[0], VERSION[1], len(header)) + header
    pre += CHECKSUM.pack(checksum([pre]))
    return pre + bytes(_pad(len(pre)))


def file_size(fields: dict, lengths: Sequence[tuple[str, int]]) -> int:
    """The size write_file gives a file of these fields and (section name, length) pairs, computed
    without its bytes: a checksum always takes 16 hex digits. (The store plans what fits its budget.)"""
    table, offset = [], 0
    for name, length in lengths:
        table.append({"name": name, "offset": offset, "length": length, "xxh3": "0" * 16})
        offset += length + _pad(length)
    return len(_preamble(fields, table, "file")) + offset


@dataclass(frozen=True)
class Lazy:
    """A section whose bytes exist only when its turn to be written comes: produce() returns its buffers
    (a save copies a layer off the device then, while the layer before it goes to disk)."""
    length: int
    produce: Callable[[], Sequence]


def write_file(path: str | os.PathLike, fields: dict, sections: Sequence[tuple[str, Sequence | Lazy]], *,
               durable: bool = True, progress: Callable[[int, int], None] | None = None) -> int:
    """Write header fields and (name, buffers or Lazy) sections crash-safely; returns the file's size.

    One pass over the bytes: each buffer is hashed and written while it is
    hot, after a header whose checksums are placeholders of the same length,
    which is written again, complete, once every section is on disk (a reader
    only ever sees the renamed, finished file). progress(done, total) is
    called after each section with bytes written so far.
    """
    lengths = [(name, b.length if isinstance(b, Lazy) else sum(as_bytes(x).nbytes for x in b)) for name, b in sections]
    table, offset = [], 0
    for name, length in lengths:
        table.append({"name": name, "offset": offset, "length": length, "xxh3": "0" * 16})
        offset += length + _pad(length)
    pre = _preamble(fields, table, path)

    def write(f: BinaryIO) -> None:
        f.write(pre)
        done = len(pre)
        for entry, (name, b) in zip(table, sections):
            h = xxhash.xxh3_64()
            n = 0
            for x in b.produce() if isinstance(b, Lazy) else b:
                x = as_bytes(x)
                h.update(x)
                n += f.write(x)
            if n != entry["length"]:
                raise SessionSaveError(f"{path}: section {name!r} produced {n} bytes, {entry['length']} announced")
            entry["xxh3"] = f"{h.intdigest():016x}"
            f.write(bytes(_pad(n)))
            done += n + _pad(n)
            if progress:
                progress(done, len(pre) + offset)
        final = _preamble(fields, table, path)  # checksums are 16 hex digits, placeholders too: the same length
        f.seek(0)
        f.write(final)

    atomic_write(path, write, durable=durable)
    return len(pre) + offset


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None], *, durable: bool) -> None:
    """Run write(f) on a temporary file beside `path`, then rename it into place.

    On any failure the temporary file is removed and `path` is left as it was.
    """
    path = Path(path)
    fd, tmp = _locked_temporary(path)
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


def _locked_temporary(path: Path) -> tuple[int, str]:
    """A temporary file beside `path`, flock()ed while it is written: a writer killed before its rename
    leaves the file unlocked, which is how remove_dead_temporaries tells it from one still writing."""
    while True:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without flock: no cleaning of what a killed writer leaves there
            return fd, tmp
        if os.fstat(fd).st_nlink:  # not taken for a dead writer's between its creation and the lock
            return fd, tmp
        os.close(fd)


def remove_dead_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporary files of atomic_write in `folder` whose writer was killed (no lock held on them),
    and say which; a writer still at work, in any process, keeps its file."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for e in entries:
        if not (e.name.startswith(".") and e.name.endswith(".tmp")) or not e.is_file(follow_symlinks=False):
            continue
        try:
            fd = os.open(e.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its writer is alive
            if os.path.samestat(os.fstat(fd), os.stat(e.path, follow_symlinks=False)):
                os.unlink(e.path)
                removed.append(Path(e.path))
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
