"""Hostile and careless input: crafted, sparse and non-regular files, unusable store folders.

Every file here is real: sparse files are made with seek and truncate, FIFOs
with os.mkfifo, headers rewritten with a correct checksum. A read-only folder
is chmod 555 for a normal user; root ignores modes, so as root it is a
read-only bind mount (EROFS, which root cannot write either), and a full disk
is a 64 KiB tmpfs. A probe that needs a mount is skipped, with the reason,
where mounting is not allowed.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsession.cli.main import main
from kvsession.errors import (
    CorruptSession,
    KvsessionError,
    NotASessionFile,
    SessionMismatch,
    SessionNotFound,
    SessionSaveError,
)
from kvsession.files import framing
from kvsession.files.named import (
    InvalidSessionName,
    SavedSession,
    delete_saved,
    list_saved,
)
from kvsession.sampling import GREEDY
from kvsession.session import Session
from kvsession.store import Store, StoreError, StoreOptions, StoreUnavailable

SMALL = StoreOptions(chunk_tokens=16, min_tokens=16)
PREFIX = list(range(3, 3 + 40))
GIB4 = 4 << 30


# --- making files ------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_file(tiny_engine, tmp_path_factory) -> Path:
    """A sound session file with a chat's messages in its meta, as `kvsession run --session` writes it."""
    s = tiny_engine.session(sampler=GREEDY)
    s.prefill(tiny_engine.tokenizer.encode("a file to rewrite in every hostile way"))
    s.meta = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
              "title": "hi", "turns": [len(s)]}
    path = tmp_path_factory.mktemp("good") / "good.kvs"
    s.save(path)
    return path


def header_doc(path: Path) -> dict:
    data = path.read_bytes()
    (length,) = struct.unpack_from("<I", data, 12)
    return json.loads(data[16 : 16 + length])


def rebuild(src: Path, out: Path, edit=None, lengths: dict | None = None, text=None) -> Path:
    """Copy a session file with its header changed and its checksum recomputed.

    edit(doc) changes the header's JSON; lengths {section: n} declare other
    section sizes (the bytes that are not there are left as a hole: a sparse
    file); text(json_text) edits the header as text, for what json.dumps
    cannot write.
    """
    data = src.read_bytes()
    with open(src, "rb") as f:
        old = framing.read_header(f, str(src))
    doc = header_doc(src)
    offset, moves = 0, []
    for s in doc["sections"]:
        moves.append((old.data_start + s["offset"], min(s["length"], (lengths or {}).get(s["name"], s["length"])), offset))
        s["offset"], s["length"] = offset, (lengths or {}).get(s["name"], s["length"])
        offset += s["length"] + (-s["length"] % 64)
    if edit:
        edit(doc)
    body = json.dumps(doc)
    body = (text(body) if text else body).encode()
    pre = framing.PREAMBLE.pack(framing.MAGIC, 1, 0, len(body)) + body
    pre += framing.CHECKSUM.pack(framing.checksum([pre]))
    pre += bytes(-len(pre) % 64)
    with open(out, "wb") as f:
        f.write(pre)
        for src_at, n, dst in moves:
            f.seek(len(pre) + dst)
            f.write(data[src_at : src_at + n])
        f.truncate(len(pre) + offset)
    return out


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvsession: error: "), err
    assert "Traceback" not in err
    return lines[0]


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail instead of hanging: a call blocked in open() on a FIFO is interrupted and raises."""
    def timeout(signum, frame):
        raise TimeoutError(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _mount(*args: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"mount {' '.join(args)} is not allowed here ({r.stderr.strip()}); "
                    "as root chmod cannot make a folder read-only")


@contextlib.contextmanager
def read_only(folder: Path):
    """The folder and everything in it become read-only, for root too (see the module's note)."""
    if os.geteuid() != 0:
        dirs = [folder, *(p for p in folder.rglob("*") if p.is_dir())]
        for d in dirs:
            d.chmod(0o555)
        try:
            yield
        finally:
            for d in dirs:
                d.chmod(0o755)
        return
    _mount("--bind", str(folder), str(folder))
    try:
        _mount("-o", "remount,ro,bind", str(folder))
        yield
    finally:
        _unmount(folder)


@contextlib.contextmanager
def tiny_filesystem(folder: Path, size: str = "64k"):
    if os.geteuid() != 0:
        pytest.skip("a full disk is a small tmpfs, and mounting one needs root")
    folder.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder))
    try:
        yield folder
    finally:
        _unmount(folder)


def _unmount(folder: Path) -> None:
    """umount, again after a moment while the kernel still counts a file just closed ("target is busy": seen
    once in a whole suite's run); lazily at last, so that a test's teardown does not outlive its mount."""
    for attempt in range(10):
        gc.collect()
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode == 0:
            return
        time.sleep(0.2)
    subprocess.run(["umount", "-l", str(folder)], check=True)


def session_of(engine, tokens):
    s = engine.session(sampler=GREEDY)
    s.prefill(tokens)
    return s


# --- 1. sparse and oversized files -------------------------------------------------

MEASURE = """
import resource, sys
from kvsession.cli.main import main
from kvsession.engine import Engine
from kvsession.errors import KvsessionError
from kvsession.session import Session
from kvsession.store import Store, StoreOptions

engine = Engine.load(sys.argv[1], device="cpu", precision="f32")
start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for case in sys.argv[2:]:
    how, path = case.split("=", 1)
    try:
        if how == "inspect":
            main(["inspect", path])
        elif how == "load":
            Session.load(path, engine)
        elif how == "layers":
            s = engine.session()
            s.prefill([1, 2, 3])
            s.load_layers(path)
        elif how == "store":
            store = Store(path, StoreOptions(chunk_tokens=16, min_tokens=16))
            print("entries", len(store.ls()), file=sys.stderr)
        print(how, "no error", file=sys.stderr)
    except KvsessionError as e:
        print(f"{how}: {type(e).__name__}: {e}", file=sys.stderr)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) // 1024
    print(f"grown {how} {grown}", file=sys.stderr)
"""


def measure(model: Path, *cases: str) -> tuple[dict[str, int], str]:
    """Run the readers in a fresh process; returns the peak memory growth (MB) after each, and stderr."""
    r = subprocess.run([sys.executable, "-c", MEASURE, str(model), *cases], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    grown = {line.split()[1]: int(line.split()[2]) for line in r.stderr.splitlines() if line.startswith("grown ")}
    return grown, r.stderr


@pytest.mark.parametrize("section", ["tokens", "text", "layer.1"])
def test_a_sparse_file_declaring_4_gib_costs_no_memory(tiny_engine, tiny_path, good_file, tmp_path, section):
    sparse = rebuild(good_file, tmp_path / "sparse.kvs", lengths={section: GIB4})
    st_ = sparse.stat()
    assert st_.st_size > GIB4 and st_.st_blocks * 512 < 1 << 20  # 4 GiB long, a few KB on disk
    grown, err = measure(tiny_path, f"inspect={sparse}", f"load={sparse}")
    assert grown["inspect"] < 100 and grown["load"] < 100, err
    assert f"load: CorruptSession: {sparse}: section {section!r}" in err, err
    assert f"kvsession: error: {sparse}: section {section!r}" in err, err
    assert "hole" in err


def test_a_sparse_partial_file_raw_manifest_and_store_entry(tiny_engine, tiny_path, tmp_path):
    s = session_of(tiny_engine, [1, 2, 3])
    s.save(tmp_path / "part.kvs", layers=[1])
    rebuild(tmp_path / "part.kvs", tmp_path / "part-sparse.kvs", lengths={"layer.1": GIB4})
    s.save(tmp_path / "raw.bin", format="raw")
    os.truncate(tmp_path / "raw.bin.json", GIB4)  # a manifest of 4 GiB, almost all hole
    store = Store(tmp_path / "kv", SMALL)
    e = store.put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")
    manifest = tmp_path / "kv" / "manifests" / f"{e.key}.kvm"
    rebuild(manifest, manifest, lengths={"text": GIB4})
    grown, err = measure(tiny_path, f"layers={tmp_path / 'part-sparse.kvs'}", f"load={tmp_path / 'raw.bin'}",
                         f"store={tmp_path / 'kv'}")
    assert max(grown.values()) < 100, err
    assert "layers: CorruptSession" in err and "hole" in err
    assert "load: ManifestError" in err and "raw.bin.json" in err and "bytes" in err
    assert "entries 0" in err  # the crafted manifest is a damaged entry: removed, logged, nothing raised


def test_sizes_the_header_implies_are_checked_before_any_read(tiny_engine, good_file, tmp_path):
    """Dense files (no hole) whose sections disagree with what the header or the model says."""
    n = header_doc(good_file)["n_tokens"]
    cases = {
        "tokens": ({"tokens": 4 * n + 4}, None, f"section 'tokens' holds {4 * n + 4} bytes, the header implies {4 * n}"),
        "logits": ({"logits": 4}, None, "section 'logits' holds 4 bytes, the header implies 1152"),
        "layer": ({"layer.0": 128}, None, "section 'layer.0' holds 128 bytes, the header implies"),
    }
    for name, (lengths, edit, message) in cases.items():
        p = rebuild(good_file, tmp_path / f"{name}.kvs", edit, lengths)
        p.write_bytes(p.read_bytes())  # every declared byte written: no hole, only the sizes are wrong
        with pytest.raises(CorruptSession, match=message.replace("(", r"\(")):
            Session.load(p, tiny_engine)


def test_a_file_longer_than_the_context_is_refused_before_allocation(tiny_engine, good_file, tmp_path):
    ctx = tiny_engine.config.context_length

    def grow(doc):
        doc["n_tokens"] = 10 * ctx
        for d in doc["layers"]:
            d["rows"] = 10 * ctx

    row = 2 * 16 * 2 * 2  # K and V rows of 2 heads x 16 dims in f16
    p = rebuild(good_file, tmp_path / "long.kvs", grow,
                {"tokens": 40 * ctx, "layer.0": 10 * ctx * row, "layer.1": 10 * ctx * row})
    p.write_bytes(p.read_bytes())  # dense: every byte written, so only the context can refuse it
    with pytest.raises(SessionMismatch, match=f"n_tokens: file {10 * ctx}, model a context of {ctx}"):
        Session.load(p, tiny_engine)


# --- 2. header schema ----------------------------------------------------------------


def _set(path: str, value):
    """An edit that sets one field, given as a dotted path with list indices (meta.messages.0.role)."""
    def edit(doc):
        *parents, last = path.split(".")
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        node[int(last) if isinstance(node, list) else last] = value
    return edit


BAD_HEADERS = [
    ("meta", [1, 2], "header field meta: expected an object"),
    ("meta", "notes", "header field meta: expected an object"),
    ("meta.messages", 5, "header field meta.messages: expected a list"),
    ("meta.messages.0", "hi", "header field meta.messages[0]: expected an object"),
    ("meta.messages.0.role", 7, "header field meta.messages[0].role: expected a string"),
    ("meta.messages.1.content", 3.5, "header field meta.messages[1].content"),
    ("meta.title", ["x"], "header field meta.title: expected a string"),
    ("meta.turns", ["a"], "header field meta.turns[0]: expected a whole number"),
    ("meta.turns", [10 ** 6], "header field meta.turns[0]"),
    ("created", 1e300, "header field created: expected a Unix time"),
    ("created", "yesterday", "header field created"),
    ("created", float("nan"), "header field created"),
    ("n_tokens", 3.0, "header field n_tokens: expected a whole number"),
    ("n_tokens", "3", "header field n_tokens: expected a whole number"),
    ("n_tokens", -1, "header field n_tokens"),
    ("n_tokens", True, "header field n_tokens"),
    ("layers.0.rows", 3.0, "header field layers[0].rows: expected a whole number"),
    ("layers.0.index", 1, "layer index 1 appears twice"),
    ("layers.0", "x", "header field layers[0]: expected an object"),
    ("layers", {}, "header field layers: expected a list"),
    ("row_shape", "2x16", "header field row_shape"),
    ("row_shape", [2.0, 16], "header field row_shape[0]"),
    ("kv_dtype", 5, "header field kv_dtype"),
    ("kv_dtype", "f8", "header field kv_dtype"),
    ("vocab_size", 1e300, "header field vocab_size"),
    ("has_logits", "yes", "header field has_logits: expected true or false"),
    ("partial", 0, "header field partial: expected true or false"),
    ("sampler", [], "header field sampler: expected an object"),
    ("sampler.params.temperature", "hot", "header field sampler.params.temperature"),
    ("sampler.params.temperature", float("inf"), "header field sampler.params.temperature"),
    ("sampler.params.top_p", 3, "sampler.params: top_p must be"),
    ("sampler.params.seed", 1.5, "header field sampler.params.seed"),
    ("sampler.params.extra", 1, "header field sampler.params: unexpected field 'extra'"),
    ("sampler.rng", 3, "header field sampler.rng: expected an object"),
    ("sampler.rng.state.state", -5, "header field sampler.rng.state.state"),
    ("sampler.rng.bit_generator", "MT19937", "header field sampler.rng.bit_generator"),
    ("model", "x", "header field model: expected an object"),
    ("model.fingerprint", [], "header field model.fingerprint: expected an object"),
    ("model.fingerprint.kv_shape.layers", 5, "header field model.fingerprint.kv_shape.layers"),
    ("model.fingerprint.weights", 5, "header field model.fingerprint.weights"),
    ("kind", 5, "header kind 5, expected 'session'"),
    ("sections.0.length", 12.0, "section table entry 0: length: expected a whole number"),
    ("sections.1.name", 5, "section table entry 1: name: expected a string"),
    ("sections.1.name", "tokens", "section 'tokens' appears twice"),
    ("sections.2.xxh3", "zz", "section table entry 2: xxh3: expected 16 hex digits"),
]
BAD_TEXT = [  # what json.dumps cannot write
    ("huge number", lambda t: t.replace('"n_tokens": ', '"n_tokens": ' + "9" * 5000 + ", \"x\": "), "header is not JSON"),
    ("deep nesting", lambda t: t.replace('"meta": {', '"meta": {"deep": ' + "[" * 100_000 + "]" * 100_000 + ", "),
     "header is not JSON"),
    ("nesting under the limit", lambda t: t.replace('"meta": {', '"meta": {"deep": ' + "[" * 200 + "]" * 200 + ", "),
     "header field meta.deep: expected JSON nested at most"),
]


def _check_refused(path: Path, tiny_path: Path, message: str, capsys) -> None:
    before = path.read_bytes()
    assert main(["inspect", str(path)]) == 1
    out, err = capsys.readouterr()
    assert message in one_line_error(err) and out == "", (message, err)
    assert main(["run", "-p", "x", "--session", str(path), "--model", str(tiny_path), "--precision", "f32",
                 "-n", "1"]) == 1
    out, err = capsys.readouterr()
    assert message in one_line_error(err), (message, err)
    assert path.read_bytes() == before  # a refused session is never overwritten


@pytest.mark.parametrize("field, value, message", BAD_HEADERS, ids=[f"{f}={v!r}"[:40] for f, v, _ in BAD_HEADERS])
def test_a_crafted_header_is_one_line_of_error(tiny_path, good_file, tmp_path, capsys, field, value, message):
    p = rebuild(good_file, tmp_path / "crafted.kvs", _set(field, value))
    _check_refused(p, tiny_path, message, capsys)


@pytest.mark.parametrize("name, edit, message", BAD_TEXT, ids=[n for n, _, _ in BAD_TEXT])
def test_a_crafted_header_text_is_one_line_of_error(tiny_path, good_file, tmp_path, capsys, name, edit, message):
    p = rebuild(good_file, tmp_path / "crafted.kvs", text=edit)
    _check_refused(p, tiny_path, message, capsys)


def _paths(node, prefix=""):
    """Every dotted path of a JSON document."""
    yield prefix.rstrip(".")
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield from _paths(v, f"{prefix}{k}.")


JSON = st.recursive(st.none() | st.booleans() | st.integers(min_value=-2 ** 70, max_value=2 ** 70)
                    | st.floats(allow_nan=True) | st.text(max_size=6),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                    max_leaves=8)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_any_value_in_any_header_field(tiny_engine, good_file, tmp_path, capsys, data):
    """Whatever value lands in whichever field, load and inspect succeed or raise a KvsessionError."""
    paths = [p for p in _paths(header_doc(good_file)) if p and not p.startswith("sections")]
    field = data.draw(st.sampled_from(paths))
    p = rebuild(good_file, tmp_path / "fuzz.kvs", _set(field, data.draw(JSON)))
    try:
        Session.load(p, tiny_engine).save(tmp_path / "again.kvs")
    except KvsessionError:
        pass
    assert main(["inspect", str(p)]) in (0, 1)
    _, err = capsys.readouterr()
    assert "Traceback" not in err


def test_a_header_larger_than_the_limit_is_not_written(tiny_engine, tmp_path):
    s = session_of(tiny_engine, [1, 2])
    s.meta = {"notes": "x" * (framing.MAX_HEADER + 1)}
    with pytest.raises(SessionSaveError, match="header"):
        s.save(tmp_path / "big.kvs")
    assert list(tmp_path.iterdir()) == []


def test_a_meta_no_reader_accepts_is_never_written(tiny_engine, tmp_path):
    s = session_of(tiny_engine, PREFIX)
    deep = 0
    for _ in range(40):
        deep = [deep]
    for meta, message in (({"deep": deep}, "meta.deep"),
                          ({"messages": "hi"}, "meta.messages: expected a list")):
        s.meta = meta
        with pytest.raises(SessionSaveError, match=message):
            s.save(tmp_path / "x.kvs")
        with pytest.raises(StoreError, match=message):
            Store(tmp_path / "kv", SMALL).put(s, "continued")
    assert not (tmp_path / "x.kvs").exists() and not list((tmp_path / "kv" / "manifests").iterdir())


# --- 3. non-regular files ---------------------------------------------------------------


def test_a_fifo_is_refused_without_hanging(tiny_engine, tiny_path, tmp_path, capsys):
    fifo = tmp_path / "x.kvs"
    os.mkfifo(fifo)
    with deadline(5):
        with pytest.raises(NotASessionFile, match=r"not a regular file \(a FIFO\)"):
            Session.load(fifo, tiny_engine)
        s = session_of(tiny_engine, [1, 2])
        with pytest.raises(NotASessionFile, match="FIFO"):
            s.load_layers(fifo)
        assert main(["inspect", str(fifo)]) == 1
        assert "not a regular file (a FIFO)" in one_line_error(capsys.readouterr().err)
        assert main(["run", "-p", "x", "-s", "x", "--sessions-dir", str(tmp_path), "--model", str(tiny_path),
                     "-n", "1"]) == 1
        assert "not a regular file (a FIFO)" in one_line_error(capsys.readouterr().err)
    assert fifo.is_fifo()


def _sessions_folder(tiny_engine, folder: Path) -> Path:
    folder.mkdir()
    s = session_of(tiny_engine, [1, 2, 3])
    s.meta = {"title": "the good one"}
    s.save(folder / "good.kvs")
    os.mkfifo(folder / "fifo.kvs")
    (folder / "dangling.kvs").symlink_to(folder / "gone.kvs")
    (folder / "dir.kvs").mkdir()
    (folder / "junk.kvs").write_bytes(b"not a session")
    (folder / "bad name.kvs").write_bytes(b"")
    (folder / ".chat_history").write_text("history\n")
    (folder / "notes.txt").write_text("not a session\n")
    return folder


def test_list_saved_lists_regular_files_and_warns_about_the_rest(tiny_engine, tmp_path):
    folder = _sessions_folder(tiny_engine, tmp_path / "s")
    with deadline(5):
        sessions, warnings = list_saved(folder)
    assert sorted(x.name for x in sessions) == ["good", "junk"]
    good = next(x for x in sessions if x.name == "good")
    assert good == SavedSession("good", folder / "good.kvs", 3, "the good one", good.size, good.mtime, None)
    assert good.size == (folder / "good.kvs").stat().st_size
    junk = next(x for x in sessions if x.name == "junk")
    assert junk.n_tokens is None and "not a kvsession file" in junk.problem
    text = "\n".join(warnings)
    assert "fifo.kvs: not a regular file (a FIFO)" in text
    assert "dangling.kvs: a symbolic link to a missing file" in text
    assert "dir.kvs: not a regular file (a folder)" in text
    assert "bad name.kvs: not a session name" in text
    assert len(warnings) == 4 and all("\n" not in w for w in warnings)
    assert list_saved(tmp_path / "none") == ([], [])


def test_save_onto_a_folder_or_fifo_is_refused_and_leaves_it_alone(tiny_engine, tmp_path):
    (tmp_path / "dir.kvs").mkdir()
    (tmp_path / "dir.kvs" / "inside").write_text("keep me")
    os.mkfifo(tmp_path / "fifo.kvs")
    s = session_of(tiny_engine, [1, 2])
    with pytest.raises(SessionSaveError, match=r"dir.kvs: not a regular file \(a folder\)"):
        s.save(tmp_path / "dir.kvs")
    with pytest.raises(SessionSaveError, match=r"fifo.kvs: not a regular file \(a FIFO\)"):
        s.save(tmp_path / "fifo.kvs")
    assert (tmp_path / "dir.kvs" / "inside").read_text() == "keep me" and (tmp_path / "fifo.kvs").is_fifo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.kvs", "fifo.kvs"]  # no temporary left
    with pytest.raises(SessionSaveError, match="no-such-folder"):
        s.save(tmp_path / "no-such-folder" / "x.kvs")


def test_delete_saved_refuses_what_is_not_a_session_file(tiny_engine, tmp_path):
    folder = _sessions_folder(tiny_engine, tmp_path / "s")
    with pytest.raises(SessionNotFound, match="no session 'nope'"):
        delete_saved(folder, "nope")
    with pytest.raises(InvalidSessionName):
        delete_saved(folder, "../s/good")
    with pytest.raises(NotASessionFile, match=r"not a regular file \(a folder\)"):
        delete_saved(folder, "dir")
    with pytest.raises(NotASessionFile, match="FIFO"):
        delete_saved(folder, "fifo")
    assert (folder / "dir.kvs").is_dir() and (folder / "fifo.kvs").is_fifo()
    delete_saved(folder, "good")
    assert not (folder / "good.kvs").exists()


def test_a_fifo_or_folder_in_the_store_is_a_miss_not_a_hang(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    a = store.put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")
    b = store.put(session_of(tiny_engine, PREFIX + [6] * 20), "continued")
    chunk = tmp_path / "chunks" / f"{a.chunks[2]}.kvc"  # a's own chunk (the first two are shared with b)
    chunk.unlink()
    os.mkfifo(chunk)
    os.mkfifo(tmp_path / "stats" / f"{b.key}.json")
    (tmp_path / "manifests" / ("f" * 32 + ".kvm")).mkdir()
    with deadline(5):
        hit = store.longest_prefix(a.tokens.tolist(), tiny_engine)
        assert store.restore(hit, tiny_engine.session()) is False  # a logged miss, that removes a only
        reopened = Store(tmp_path, SMALL)  # reads b's statistics: a FIFO, so none
    assert [e.key for e in reopened.ls()] == [b.key] and reopened.entries[b.key].hits == 0
    assert (tmp_path / "manifests" / ("f" * 32 + ".kvm")).is_dir()  # not a manifest, and not ours to remove


# --- 4. the store degrades instead of failing ---------------------------------------------


def _one_line(e: StoreUnavailable, folder: Path) -> str:
    text = str(e)
    assert "\n" not in text and str(folder) in text
    return text


def test_a_read_only_store_folder(tiny_engine, tmp_path):
    folder = tmp_path / "kv"
    store = Store(folder, SMALL)
    kept = store.put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    with read_only(folder):
        with pytest.raises(StoreUnavailable) as e:
            Store(folder, SMALL)
        _one_line(e.value, folder)
        # a restore only reads: it goes on (its hit statistics are not written)
        assert store.restore(store.longest_prefix(kept.tokens.tolist(), tiny_engine), tiny_engine.session())
        with pytest.raises(StoreUnavailable, match="read-only|Read-only|Permission"):
            store.put(session_of(tiny_engine, PREFIX + [6] * 20), "continued")
        # from the first failure on, every call tries to reopen the folder, and says why it cannot
        for call in (store.ls, lambda: store.longest_prefix(PREFIX, tiny_engine), lambda: store.delete(kept.key),
                     store.gc, store.clear):
            with pytest.raises(StoreUnavailable, match="read-only|Read-only|Permission"):
                call()
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before  # nothing lost
    assert [x.key for x in store.ls()] == [kept.key]  # recovered by itself
    assert store.put(session_of(tiny_engine, PREFIX + [6] * 20), "continued") is not None


def test_a_deleted_store_folder_is_made_again(tiny_engine, tmp_path):
    folder = tmp_path / "kv"
    store = Store(folder, SMALL)
    store.put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")
    shutil.rmtree(folder)
    with pytest.raises(StoreUnavailable, match="is missing"):
        store.longest_prefix(PREFIX + [5] * 20, tiny_engine)
    assert store.longest_prefix(PREFIX + [5] * 20, tiny_engine) is None  # the next call made it again
    assert store.put(session_of(tiny_engine, PREFIX + [6] * 20), "continued") is not None
    assert len(Store(folder, SMALL).ls()) == 1


def test_a_deleted_store_folder_that_cannot_be_made_again(tiny_engine, tmp_path):
    parent = tmp_path / "parent"
    folder = parent / "kv"
    store = Store(folder, SMALL)
    shutil.rmtree(folder)
    with read_only(parent):
        for call in (lambda: store.longest_prefix(PREFIX, tiny_engine), lambda: store.ls(),
                     lambda: store.put(session_of(tiny_engine, PREFIX + [6] * 20), "continued")):
            with pytest.raises(StoreUnavailable, match="missing"):
                call()
    assert store.put(session_of(tiny_engine, PREFIX + [6] * 20), "continued") is not None  # recovered


@pytest.mark.parametrize("where", ["folder", "chunks", "manifests", "stats"])
def test_a_file_where_a_store_folder_should_be(tiny_engine, tmp_path, capsys, where):
    folder = tmp_path / "kv"
    store = Store(folder, SMALL)
    kept = store.put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")
    hit = store.longest_prefix(kept.tokens.tolist(), tiny_engine)
    moved = folder if where == "folder" else folder / where
    moved.rename(tmp_path / "aside")
    moved.write_text("a file, not a folder")
    calls = {"init": lambda: Store(folder, SMALL), "lookup": lambda: store.longest_prefix(PREFIX, tiny_engine),
             "text": lambda: store.longest_text_prefix("x", tiny_engine), "ls": store.ls,
             "get": lambda: store.get(kept.key), "restore": lambda: store.restore(hit, tiny_engine.session()),
             "put": lambda: store.put(session_of(tiny_engine, PREFIX + [6] * 20), "continued"),
             "delete": lambda: store.delete(kept.key), "gc": store.gc, "clear": store.clear}
    failed = []
    for name, call in calls.items():
        try:
            call()
        except StoreUnavailable as e:
            assert "a file, not a folder" in _one_line(e, folder) or "missing" in str(e), (name, str(e))
            failed.append(name)
    # the folder's own operations all fail; a lookup answered from the index alone may still succeed
    assert {"init", "put", "delete", "gc", "clear"} <= set(failed), failed
    if where in ("folder", "chunks"):
        assert "restore" in failed
    assert main(["cache", "ls", "--dir", str(folder)]) == 1
    assert "kvsession: error: " in one_line_error(capsys.readouterr().err)
    assert moved.read_text() == "a file, not a folder"  # never removed
    moved.unlink()
    (tmp_path / "aside").rename(moved)
    assert [e.key for e in store.ls()] == [kept.key]  # recovered: nothing was deleted meanwhile
    assert store.restore(store.longest_prefix(kept.tokens.tolist(), tiny_engine), tiny_engine.session())


def test_an_unusable_lock_file(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    (tmp_path / ".lock").unlink()
    (tmp_path / ".lock").mkdir()
    with pytest.raises(StoreUnavailable, match=r"\.lock"):
        store.put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")
    with pytest.raises(StoreUnavailable, match=r"\.lock"):
        Store(tmp_path, SMALL)


def test_a_full_disk(tiny_engine, tmp_path):
    with tiny_filesystem(tmp_path / "kv") as folder:
        store = Store(folder, StoreOptions(chunk_tokens=16, min_tokens=16))
        kept = store.put(session_of(tiny_engine, PREFIX[:20]), "continued")
        with pytest.raises(StoreUnavailable, match="No space left on device"):
            store.put(session_of(tiny_engine, PREFIX * 12), "continued")  # 480 tokens: 30 chunks
        assert [e.key for e in store.ls()] == [kept.key]
        assert not [p for p in folder.rglob("*") if p.name.endswith(".tmp")]
        assert store.restore(store.longest_prefix(kept.tokens.tolist(), tiny_engine), tiny_engine.session())


def test_an_unreadable_chunk_folder_deletes_nothing(tiny_engine, tmp_path):
    """A chunks folder gone missing fails the calls; it must neither remove the checkpoints that need it
    nor be made again empty (which would make them look damaged)."""
    store = Store(tmp_path, SMALL)
    kept = store.put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")
    hit = store.longest_prefix(kept.tokens.tolist(), tiny_engine)
    (tmp_path / "chunks").rename(tmp_path / "aside")
    with pytest.raises(StoreUnavailable, match="chunks is missing"):
        store.restore(hit, tiny_engine.session())
    with pytest.raises(StoreUnavailable, match="chunks is missing"):
        store.verify(kept)
    assert (tmp_path / "manifests" / f"{kept.key}.kvm").exists() and not (tmp_path / "chunks").exists()
    (tmp_path / "aside").rename(tmp_path / "chunks")
    assert store.restore(store.longest_prefix(kept.tokens.tolist(), tiny_engine), tiny_engine.session())


def test_cache_commands_on_unusable_folders(tiny_engine, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "chunks").write_text("x")
    for folder in (tmp_path / "file", tmp_path / "c"):
        for action in ("ls", "gc", "show", "clear"):
            assert main(["cache", action, "k", "--dir", str(folder), "--yes"]) == 1
            assert str(folder) in one_line_error(capsys.readouterr().err)


def test_cache_show_of_a_damaged_checkpoint_exits_1(tiny_engine, tmp_path, capsys):
    store = Store(tmp_path, SMALL)
    e = store.put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")
    path = tmp_path / "chunks" / f"{e.chunks[1]}.kvc"
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF
    path.write_bytes(data)
    assert main(["cache", "show", e.key[:8], "--dir", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "DAMAGED" in out and "checksum mismatch" in one_line_error(err)
