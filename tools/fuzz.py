"""Coverage-guided fuzzing of the readers that take bytes from outside: every input is refused with the typed
error or read correctly, and none crashes, hangs or allocates past a bound.

    .venv/bin/pip install atheris
    nice -n 19 .venv/bin/python tools/fuzz.py TARGET [--corpus DIR] -- -runs=10000000 -rss_limit_mb=2048 -timeout=10
    .venv/bin/python tools/fuzz.py TARGET --replay FILE...      # one input (a crash atheris saved), its traceback

Targets, each on a tiny random-weight model with sliding and full layers (tests/tiny.py):

    session   a session file, through Session.load
    raw       a raw import: a u32 length, the manifest JSON, then the blob (Session.load of the blob)
    manifest  a store manifest in place of a checkpoint's, through a lookup and a restore
    chunk     a store chunk in place of a checkpoint's middle chunk, through a lookup and a restore
    valkey    what a shared tier holds (its keys, their bytes, a tail hash), through a lookup that reads
              it on a local miss (tiering.py: ValkeyTier's own parsing, the folder's checks), and a restore

"Read correctly" is checked, not assumed: a load or restore that works must give back exactly the token
ids, the logits and every KV row (byte for byte) of the session the seed was saved from; a restore of a
prefix, that prefix. Checksums make a mutated section fail its checks, so the mutator (mutate(), also
atheris' custom mutator) rewrites half its inputs at the level of the format: a header's JSON field
changed and the header's checksum made right again, a section cut or grown with its table and checksums
kept consistent, a raw manifest's field changed. A header that stays valid may say other things of the same
bytes (a title, a sampler); only the rows, tokens and logits are compared.

The suite runs every target over a few thousand seeded mutations (tests/test_fuzz.py: deterministic,
not timed); this tool is for long runs out of CI. A crash atheris finds is saved as crash-* in the
working folder: replay it, fix it, add it to the suite's cases.
"""
from __future__ import annotations

import argparse
import base64
import json
import logging
import math
import os
import random
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny import TinySpec, write_tiny  # noqa: E402

from kvsession.errors import SessionFileError  # noqa: E402
from kvsession.files import framing  # noqa: E402

SPEC = TinySpec(arch="gemma3", n_layers=4, n_heads=4, n_kv_heads=1, head_dim=32, sliding_window=8, rope_base=1e6,
                seed=11)
TOKENS = list(range(3, 3 + 44))  # two whole chunks of 16, a tail of 12: chunks, a manifest, rings of 8
CHUNK_TOKENS = 16
TARGETS = ("session", "raw", "manifest", "chunk", "valkey")


class Harness:
    """What the targets share, made once per process: the model, the good session, a scratch folder (tmpfs
    where there is one), each target's seed, and the store's good files."""

    def __init__(self, scratch: Path | None = None):
        from kvsession.engine import Engine
        from kvsession.sampling import GREEDY
        from kvsession.store import Store, StoreOptions

        shm = Path("/dev/shm")
        self.scratch = Path(tempfile.mkdtemp(prefix="kvsession-fuzz-", dir=scratch or (shm if shm.is_dir() else None)))
        self.engine = Engine.load(write_tiny(self.scratch / "tiny.gguf", SPEC), device="cpu", precision="f32")
        self.good = self.engine.session(sampler=GREEDY)
        self.good.prefill(TOKENS)
        self.options = StoreOptions(chunk_tokens=CHUNK_TOKENS, min_tokens=CHUNK_TOKENS)
        self.good.save(self.scratch / "good.kvs")
        self.good.save(self.scratch / "good.raw", format="raw")
        store = Store(self.scratch / "kv-good", self.options)
        self.entry = store.put(self.good, "continued")
        store.close()
        self.files = {p.relative_to(self.scratch / "kv-good"): p.read_bytes()
                      for p in (self.scratch / "kv-good").rglob("*") if p.is_file() and p.name != ".lock"}
        self.work = self.scratch / "a" / "b" / "c" / "work"  # deep: a name that climbs out lands in scratch
        raw_manifest = (self.scratch / "good.raw.json").read_bytes()
        self.seeds = {
            "session": (self.scratch / "good.kvs").read_bytes(),
            "raw": struct.pack("<I", len(raw_manifest)) + raw_manifest + (self.scratch / "good.raw").read_bytes(),
            "manifest": self.files[self.manifest_file()],
            "chunk": self.files[self.chunk_file()],
            "valkey": self._valkey_seed(),
        }
        self.outside = self._outside() | {"fuzzed.kvs", "fuzzed.raw", "fuzzed.raw.json"}

    def manifest_file(self) -> Path:
        return Path("manifests") / f"{self.entry.key}.kvm"

    def chunk_file(self) -> Path:
        return Path("chunks") / f"{self.entry.chunks[1]}.kvc"

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)

    # --- the oracle ---

    def _outside(self) -> set[str]:
        """The files (and links) under the scratch folder outside the store's work folder, which is not walked."""
        out = set()
        for root, dirs, files in os.walk(self.scratch):
            if root == str(self.work.parent) and self.work.name in dirs:
                dirs.remove(self.work.name)
            out.update(os.path.relpath(os.path.join(root, n), self.scratch)
                       for n in files + [d for d in dirs if os.path.islink(os.path.join(root, d))])
        return out

    def check_nothing_outside(self) -> None:
        assert self._outside() <= self.outside, f"written outside its folder: {self._outside() - self.outside}"

    def same_as_good(self, s, n: int, logits: bool, other: frozenset = frozenset()) -> None:
        """A session read back must hold the good session's first n tokens, their rows (the live ones of a
        ring), and its logits when it has any. other: the sections ("tokens", "logits", "layer.I") whose
        checksums are right over other bytes than the good file's: a file that says something else, with every
        check passing, is read as what it says, so those parts are not compared."""
        assert "tokens" in other or s.tokens == TOKENS[:n], (s.tokens, n)
        for i, (mine, theirs) in enumerate(zip(s.cache, self.good.cache)):
            if f"layer.{i}" in other:
                continue
            start = max(0, n - mine.window) if mine.ring else 0
            got, want = mine.read_rows(start, n - start), theirs.read_rows(start, n - start)
            assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(got, want)), f"layer {i}"
        if logits and "logits" not in other:
            assert s.logits is not None and bool((s.logits == self.good.logits).all())
        self.check_nothing_outside()

    # --- the targets ---

    def session(self, data: bytes) -> None:
        from kvsession.session import Session

        path = self.scratch / "fuzzed.kvs"
        path.write_bytes(data)
        try:
            s = Session.load(path, self.engine)
        except SessionFileError:
            return
        self.same_as_good(s, len(s.tokens), s.logits is not None, self.other_sections(data, "session"))

    def other_sections(self, data: bytes, seed: str) -> frozenset:
        """The sections of a framing file that passed every check whose checksums differ from the seed's own."""
        good = {x.name: x.xxh3 for x in framing.parse_header(self.seeds[seed], len(self.seeds[seed])).sections}
        return frozenset(x.name for x in framing.parse_header(data, len(data)).sections if good.get(x.name) != x.xxh3)

    def raw(self, data: bytes) -> None:
        from kvsession.session import Session

        n = struct.unpack("<I", data[:4])[0] if len(data) >= 4 else 0
        path = self.scratch / "fuzzed.raw"
        (self.scratch / "fuzzed.raw.json").write_bytes(data[4 : 4 + n])
        path.write_bytes(data[4 + n :])
        try:
            s = Session.load(path, self.engine)
        except SessionFileError:
            return
        blob = data[4 + n :]
        if blob[:8] == framing.MAGIC:  # read as the session file it is
            self.same_as_good(s, len(s.tokens), s.logits is not None, self.other_sections(blob, "session"))
            return
        # a raw manifest's tokens, logits and text carry no checksum (nor, optionally, its layers: other tools
        # write them): what it says is what must be read
        m = json.loads(data[4 : 4 + n])
        assert s.tokens == m["tokens"]
        logits = base64.b64decode(m["logits_f32_base64"])
        assert (s.logits.numpy().tobytes() if s.logits is not None else b"") == logits
        for d in m["layers"]:
            k, v = s.cache[d["index"]].read_rows(d["start"], d["rows"])
            (ko, kn), (vo, vn) = d["k"], d["v"]
            assert k.tobytes() == blob[ko : ko + kn] and v.tobytes() == blob[vo : vo + vn], f"layer {d['index']}"
        self.check_nothing_outside()

    def store_with(self, replaced: dict[Path, bytes], shared=None):
        from kvsession.store import Store

        shutil.rmtree(self.work, ignore_errors=True)
        for rel, data in {**self.files, **replaced}.items():
            (self.work / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.work / rel).write_bytes(data)
        return Store(self.work, self.options, shared=shared)

    def _lookup_and_restore(self, store) -> None:
        from kvsession.sampling import GREEDY

        try:
            hit = store.longest_prefix(TOKENS, self.engine)
            s = self.engine.session(sampler=GREEDY)
            if hit is not None and store.restore(hit, s):
                self.same_as_good(s, hit.n_tokens, hit.has_logits)
        finally:
            store.close()
        self.check_nothing_outside()

    def manifest(self, data: bytes) -> None:
        self._lookup_and_restore(self.store_with({self.manifest_file(): data}))

    def chunk(self, data: bytes) -> None:
        self._lookup_and_restore(self.store_with({self.chunk_file(): data}))

    def _valkey_seed(self) -> bytes:
        """What a shared tier holds after the good checkpoint's write-through, serialized (see FuzzedValkey)."""
        from kvsession.store.tiering import Tiering

        held: dict[bytes, bytes | dict[bytes, bytes]] = {}
        tier = FuzzedValkey(held)
        store = self.store_with({}, shared=tier)
        Tiering(store.local, tier)._write_through(store.local.entries[self.entry.key])
        store.close()
        return encode_keys(held)

    def valkey(self, data: bytes) -> None:
        try:
            held = decode_keys(data)
        except ValueError:
            return  # not a serialization: nothing a Valkey could hold
        self._lookup_and_restore(self.shared_store(held))

    def shared_store(self, held: dict):
        """A store on an empty folder (a lookup reads the shared tier) whose shared tier holds `held`."""
        from kvsession.store import Store

        shutil.rmtree(self.work, ignore_errors=True)
        return Store(self.work, self.options, shared=FuzzedValkey(held))


def encode_keys(held: dict) -> bytes:
    """A Valkey's keys as bytes: per key, u32 length and name, a kind byte (0 a string, 1 a hash), then u32
    length and value, or u32 count and that many (field, value) pairs."""
    out = []
    for name, value in held.items():
        out.append(struct.pack("<I", len(name)) + name)
        if isinstance(value, dict):
            out.append(b"\1" + struct.pack("<I", len(value)))
            out += [struct.pack("<I", len(f)) + f + struct.pack("<I", len(v)) + v for f, v in value.items()]
        else:
            out.append(b"\0" + struct.pack("<I", len(value)) + value)
    return b"".join(out)


def decode_keys(data: bytes) -> dict:
    """encode_keys' inverse; ValueError when the bytes are none of its."""
    held, at = {}, 0

    def take(n: int) -> bytes:
        nonlocal at
        if at + n > len(data):
            raise ValueError("cut short")
        at += n
        return data[at - n : at]

    def blob() -> bytes:
        return take(struct.unpack("<I", take(4))[0])

    while at < len(data):
        name = blob()
        if take(1) == b"\1":
            held[name] = {blob(): blob() for _ in range(min(struct.unpack("<I", take(4))[0], 1 << 16))}
        else:
            held[name] = blob()
    return held


def _fuzzed_valkey_class():
    from kvsession.store.valkey import ValkeyTier

    class Fuzzed(ValkeyTier):
        """The shared tier's own code (ValkeyTier: its keys, its parsing of what Valkey answers) over a dict
        standing for the server: the fuzzer decides what the server holds and so what it answers."""

        def __init__(self, held: dict):
            super().__init__("redis://127.0.0.1:1", timeout_seconds=0.01, retry_seconds=0)
            self.held, self.mode = held, "server"

        def _run(self, *phases):
            out = []
            for name, key, *args in (c for phase in phases for c in phase):
                k = key.encode() if isinstance(key, str) else key
                value = self.held.get(k)
                if name == "exists" or name == "expire":
                    out.append(int(value is not None))
                elif name == "get":
                    out.append(value if isinstance(value, bytes) else None)
                elif name == "hgetall":
                    out.append(value if isinstance(value, dict) else {})
                elif name == "set":
                    self.held[k] = args[0]
                    out.append(True)
                elif name == "hset":
                    self.held.setdefault(k, {})[args[0]] = args[1].encode()
                    out.append(1)
                elif name == "delete":
                    out.append(int(self.held.pop(k, None) is not None))
                else:
                    raise AssertionError(f"a command the tier never sends: {name}")
            return out

    return Fuzzed


def FuzzedValkey(held: dict):  # noqa: N802 (a class, made on first use: the store is imported lazily)
    return _fuzzed_valkey_class()(held)


# --- the mutator ---------------------------------------------------------------------------------------------


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One mutation: at the level of the format (a framing header's field, its checksum made right; a raw
    manifest's field) half the time, else bytes (flips, cuts, insertions, copies)."""
    if rng.random() < 0.5:
        out = _mutate_framed(data, rng) or _mutate_raw(data, rng)
        if out is not None:
            return out
    return _mutate_bytes(data, rng)


INTERESTING = (0, 1, -1, 2, 15, 16, 17, 63, 64, 255, 256, 4096, 1 << 31, -(1 << 31), 1 << 62, 10 ** 20)


def _mutate_value(v, rng: random.Random, depth: int = 0):
    """A JSON value changed a little, or replaced by another kind."""
    roll = rng.random()
    if roll < 0.1:
        return rng.choice([None, True, False, "", "x" * rng.randint(1, 70), [], {}, 0.5, "ff" * 16])
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return rng.choice([v + rng.choice((-1, 1)), v * 2, -v, rng.choice(INTERESTING), v // 2])
    if isinstance(v, float):
        return rng.choice([v * 2, -v, 0.0, 1e308, float(int(v)) if math.isfinite(v) else v])
    if isinstance(v, str):
        return rng.choice([v[:-1], v + v[-1:], v.upper(), "0" * len(v), v[::-1]])
    if isinstance(v, list) and v:
        i = rng.randrange(len(v))
        op = rng.random()
        if op < 0.5 and depth < 6:
            return v[:i] + [_mutate_value(v[i], rng, depth + 1)] + v[i + 1 :]
        return rng.choice([v[:i] + v[i + 1 :], v + [v[i]], v[::-1], v * 2])
    if isinstance(v, dict) and v:
        k = rng.choice(list(v))
        if rng.random() < 0.8 and depth < 6:
            return {**v, k: _mutate_value(v[k], rng, depth + 1)}
        return {x: y for x, y in v.items() if x != k}
    return v


def _mutate_framed(data: bytes, rng: random.Random) -> bytes | None:
    """A framing file with one header field changed (or a section grown or cut, the table kept consistent),
    rewritten with a right header checksum; None when data is no framing file."""
    try:
        h = framing.parse_header(data, len(data))
    except SessionFileError:
        return None
    table = [{"name": s.name, "offset": s.offset, "length": s.length, "xxh3": f"{s.xxh3:016x}"} for s in h.sections]
    sections = [data[h.data_start + s.offset : h.data_start + s.offset + s.length] for s in h.sections]
    fields = dict(h.fields)
    if rng.random() < 0.25 and sections:  # a section grown or cut, its checksum right: what its fields imply
        i = rng.randrange(len(sections))
        cut = rng.randint(0, len(sections[i]))
        authentic = framing.checksum([sections[i]]) == h.sections[i].xxh3
        sections[i] = sections[i][:cut] if rng.random() < 0.5 else sections[i] + sections[i][:cut]
        if authentic:  # a checksum made right over bytes an earlier mutation changed would bless them
            table[i]["xxh3"] = f"{framing.checksum([sections[i]]):016x}"  # that one's only
        offset = 0
        for entry, body in zip(table, sections):
            entry.update(offset=offset, length=len(body))
            offset += len(body) + (-len(body) % framing.ALIGN)
    elif fields:
        key = rng.choice(list(fields))
        fields[key] = _mutate_value(fields[key], rng)
    header = json.dumps({**fields, "sections": table}, separators=(",", ":")).encode()
    pre = framing.PREAMBLE.pack(framing.MAGIC, framing.VERSION[0], framing.VERSION[1], len(header)) + header
    pre += framing.CHECKSUM.pack(framing.checksum([pre]))
    pre += bytes(-len(pre) % framing.ALIGN)
    return pre + b"".join(body + bytes(-len(body) % framing.ALIGN) for body in sections)


def _mutate_raw(data: bytes, rng: random.Random) -> bytes | None:
    """A raw target's input (u32 length, manifest JSON, blob) with one manifest field changed."""
    if len(data) < 4:
        return None
    n = struct.unpack("<I", data[:4])[0]
    try:
        m = json.loads(data[4 : 4 + n])
    except ValueError:
        return None
    if not isinstance(m, dict) or not m:
        return None
    key = rng.choice(list(m))
    m[key] = _mutate_value(m[key], rng)
    text = json.dumps(m).encode()
    return struct.pack("<I", len(text)) + text + data[4 + n :]


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        if not b or op < 0.1:
            b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif op < 0.45:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op < 0.6:
            i = rng.randrange(len(b))
            b[i : i + 4] = struct.pack("<q", rng.choice(INTERESTING[:-1]))[: min(4, len(b) - i)]
        elif op < 0.75:
            del b[rng.randrange(len(b)) :]
        elif op < 0.9:
            i, j = sorted(rng.randrange(len(b) + 1) for _ in range(2))
            k = rng.randrange(len(b) + 1)
            b[k:k] = b[i:j]
        else:
            i = rng.randrange(len(b))
            del b[i : i + rng.randint(1, 64)]
    return bytes(b)


def run_target(harness: Harness, target: str) -> Callable[[bytes], None]:
    if target not in TARGETS:
        raise SystemExit(f"target {target!r}: one of {', '.join(TARGETS)}")
    return getattr(harness, target)


def instrument(atheris) -> None:
    """Coverage for kvsession's own Python code, the readers, what guides the fuzzer (instrument_all takes
    minutes over torch's 30,000 functions, and its coverage is noise here)."""
    import gc
    import types

    for obj in gc.get_objects():
        if isinstance(obj, types.FunctionType) and (getattr(obj, "__module__", None) or "").startswith("kvsession"):
            atheris.instrument_func(obj)


def main(argv: list[str]) -> int:
    own, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target", choices=TARGETS)
    p.add_argument("--corpus", type=Path, help="atheris' corpus folder (made, with the seed, when missing)")
    p.add_argument("--replay", type=Path, nargs="+", help="run these inputs once each, and stop")
    args = p.parse_args(own)
    logging.getLogger("kvsession").setLevel(logging.CRITICAL)  # a miss on damage logs a line: millions here
    import torch

    torch.set_num_threads(1)  # one fuzzing process per core
    harness = Harness()
    try:
        target = run_target(harness, args.target)
        if args.replay:
            for path in args.replay:
                target(path.read_bytes())
                print(f"{path}: refused with its typed error or read correctly")
            return 0
        import atheris

        corpus = args.corpus or Path(f"fuzz-corpus-{args.target}")
        corpus.mkdir(parents=True, exist_ok=True)
        (corpus / "seed").write_bytes(harness.seeds[args.target])

        def custom(data: bytes, max_size: int, seed: int) -> bytes:
            rng = random.Random(seed)
            out = mutate(data, rng) if rng.random() < 0.5 else atheris.Mutate(data, max_size)
            return out[:max_size]

        instrument(atheris)
        max_len = 2 * len(harness.seeds[args.target]) + 4096
        atheris.Setup([sys.argv[0], f"-max_len={max_len}", *rest, str(corpus)], target, custom_mutator=custom)
        atheris.Fuzz()
    finally:
        harness.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
