"""Session files: resume equivalence, partial and raw formats, and every kind of bad file."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import TinySpec

from kvsession.engine import Engine
from kvsession.errors import (
    CorruptSession,
    InvalidArgument,
    ManifestError,
    NotASessionFile,
    SessionFileError,
    SessionMismatch,
    SessionSaveError,
    TruncatedSession,
    UnsupportedVersion,
)
from kvsession.files import framing
from kvsession.generate import generate_tokens
from kvsession.sampling import GREEDY, SamplerParams
from kvsession.session import Session

HELPER = Path(__file__).parent / "helpers" / "resume.py"
SEEDED = SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)


def run_child(model, precision, paths, n) -> list[dict]:
    """Load each session file in one fresh process and generate n tokens from it."""
    out = subprocess.run([sys.executable, str(HELPER), str(model), precision, str(n), *map(str, paths)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["runs"]


def split_run(engine, prompt, sampler, path, *, total=64, head=20, **session_kw):
    """The tokens of an uninterrupted run of `total`, and of a run stopped after `head` and saved to path."""
    whole = engine.session(sampler=sampler, **session_kw)
    whole.prefill(prompt)
    expected = list(generate_tokens(whole, total, ignore_eos=True))
    first = engine.session(sampler=sampler, **session_kw)
    first.prefill(prompt)
    started = list(generate_tokens(first, head, ignore_eos=True))
    first.save(path)
    return expected, started


def _resume_equivalence(engine, model_path, precision, prompt, sampler, tmp_path):
    path = tmp_path / "s.kvs"
    expected, head = split_run(engine, prompt, sampler, path)
    [child] = run_child(model_path, precision, [path], 44)  # a fresh process
    assert child["forwards_during_load"] == 0
    assert head + child["tokens"] == expected


@pytest.mark.parametrize("sampler", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_resume_in_a_fresh_process_tiny(tiny_engine, tiny_path, sampler, tmp_path):
    prompt = tiny_engine.tokenizer.encode("the sea is on the string of words")
    _resume_equivalence(tiny_engine, tiny_path, "f32", prompt, sampler, tmp_path)


# one of each architecture, in blocks (the decode stack), its own RoPE, norms and multipliers in the rows saved
ARCHITECTURES = {
    "qwen2": TinySpec(arch="qwen2", weight_type="Q4_0", seed=21),
    "qwen3": TinySpec(arch="qwen3", weight_type="Q4_0", n_heads=4, head_dim=32, seed=22),
    "gemma3": TinySpec(arch="gemma3", weight_type="Q8_0", n_layers=4, sliding_window=8, seed=23),
    "llama3": TinySpec(weight_type="Q4_1", rope_freqs=True, rope_base=5e5, seed=24),
    "smollm3": TinySpec(arch="smollm3", weight_type="Q4_0", n_layers=4, seed=25),
    "granite": TinySpec(arch="granite", weight_type="Q4_0", seed=26),
    "qwen3moe": TinySpec(arch="qwen3moe", weight_type="Q4_0", n_heads=4, head_dim=32, seed=27),
    "olmo2": TinySpec(arch="olmo2", weight_type="Q4_0", tied=False, seed=28),
    "olmo3": TinySpec(arch="olmo2", weight_type="Q4_0", n_layers=4, sliding_window=8, yarn=8.0, tied=False, seed=35),
    "gemma2": TinySpec(arch="gemma2", weight_type="Q8_0", n_layers=4, sliding_window=8, seed=29),
    "phi3": TinySpec(arch="phi3", weight_type="Q4_0", rope_dim=8, seed=30),
    "phi3-longrope": TinySpec(arch="phi3", weight_type="Q4_0", rope_dim=12, longrope=True, seed=37),
    "gpt-oss": TinySpec(arch="gpt-oss", weight_type="Q8_0", expert_type="MXFP4", n_layers=4, n_heads=4, head_dim=32,
                        sliding_window=8, experts_used=4, rope_base=150000.0, yarn=32.0, tied=False, seed=32),
}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_resume_in_a_fresh_process_every_architecture(tiny_factory, arch, tmp_path):
    path = tiny_factory(ARCHITECTURES[arch])
    engine = Engine.load(path, device="cpu", precision="bf16")
    assert engine.config.arch == {"llama3": "llama", "olmo3": "olmo2", "phi3-longrope": "phi3"}.get(arch, arch)
    prompt = engine.tokenizer.encode("the sea is on the string of words, or is it the world")
    _resume_equivalence(engine, path, "bf16", prompt, GREEDY, tmp_path)


@pytest.mark.parametrize("sampler", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_resume_in_a_fresh_process_smollm2(smollm2, smollm2_path, sampler, tmp_path):
    prompt = smollm2.tokenizer.encode("Once upon a time, in a small village by the sea,")
    _resume_equivalence(smollm2, smollm2_path, "bf16", prompt, sampler, tmp_path)


def test_load_runs_no_forward_and_logits_are_bit_identical(smollm2, tmp_path):
    s = smollm2.session(sampler=SEEDED)
    s.prefill(smollm2.chat_tokens([{"role": "user", "content": "Hello"}]))
    list(generate_tokens(s, 5))
    s.meta["title"] = "hello"
    s.save(tmp_path / "a.kvs")
    before = smollm2.model.n_forward
    t = Session.load(tmp_path / "a.kvs", smollm2)
    assert smollm2.model.n_forward == before
    assert torch.equal(t.logits, s.logits)
    assert t.tokens == s.tokens and t.meta == {"title": "hello"} and t.kv_dtype == s.kv_dtype
    for a, b in zip(s.cache, t.cache):
        assert torch.equal(a.k[: a.end], b.k[: b.end]) and torch.equal(a.v[: a.end], b.v[: b.end])


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "bf16"])
def test_every_kv_dtype_round_trips(tiny_engine, tmp_path, kv_dtype):
    s = tiny_engine.session(kv_dtype=kv_dtype, sampler=GREEDY)
    s.prefill(tiny_engine.tokenizer.encode("hello there"))
    s.save(tmp_path / "x.kvs")
    t = Session.load(tmp_path / "x.kvs", tiny_engine)
    assert t.kv_dtype == kv_dtype
    assert list(generate_tokens(s, 10)) == list(generate_tokens(t, 10))


def test_empty_session_round_trips(tiny_engine, tmp_path):
    s = tiny_engine.session()
    s.save(tmp_path / "e.kvs")
    t = Session.load(tmp_path / "e.kvs", tiny_engine)
    assert t.tokens == [] and t.logits is None


def test_raw_format_round_trips_and_checks_sizes(tiny_engine, tmp_path):
    s = tiny_engine.session(sampler=SEEDED)
    s.prefill(tiny_engine.tokenizer.encode("raw blobs for interoperability"))
    p = tmp_path / "s.raw"
    s.save(p, format="raw")
    manifest = json.loads((tmp_path / "s.raw.json").read_text())
    assert manifest["n_layers"] == 2 and manifest["tokens"] == s.tokens
    layer_bytes = manifest["layers"][0]["k"][1]
    assert layer_bytes == len(s) * 2 * 16 * 2  # rows x kv heads x head dim x f16
    assert p.stat().st_size == sum(d["k"][1] + d["v"][1] for d in manifest["layers"])
    t = Session.load(p, tiny_engine)
    assert torch.equal(t.logits, s.logits)
    assert list(generate_tokens(s, 8)) == list(generate_tokens(t, 8))
    # a manifest that lies about sizes is caught before any row is used
    manifest["layers"][1]["rows"] += 1
    (tmp_path / "s.raw.json").write_text(json.dumps(manifest))
    with pytest.raises(SessionFileError):
        Session.load(p, tiny_engine)


def test_raw_blob_without_manifest(tiny_engine, tmp_path):
    s = tiny_engine.session()
    s.prefill([1, 2, 3])
    s.save(tmp_path / "b.raw", format="raw")
    os.unlink(tmp_path / "b.raw.json")
    with pytest.raises(ManifestError, match="b.raw.json"):
        Session.load(tmp_path / "b.raw", tiny_engine)


def test_partial_save_loads_only_into_the_same_timeline(tiny_engine, tmp_path):
    ids = tiny_engine.tokenizer.encode("one timeline")
    s = tiny_engine.session()
    s.prefill(ids)
    s.save(tmp_path / "p.kvs", layers=[1])
    with pytest.raises(SessionMismatch, match="partial"):
        Session.load(tmp_path / "p.kvs", tiny_engine)
    t = tiny_engine.session()
    t.prefill(ids)
    t.cache[1].k.zero_()
    assert t.load_layers(tmp_path / "p.kvs") == [1]
    assert torch.equal(t.cache[1].k[: len(ids)], s.cache[1].k[: len(ids)])
    other = tiny_engine.session()
    other.prefill(tiny_engine.tokenizer.encode("another timeline"))
    before = other.cache[1].k[: len(other)].clone()
    with pytest.raises(SessionMismatch, match="token"):
        other.load_layers(tmp_path / "p.kvs")
    assert torch.equal(other.cache[1].k[: len(other)], before)
    s.save(tmp_path / "full.kvs")
    with pytest.raises(SessionMismatch, match="partial"):
        t.load_layers(tmp_path / "full.kvs")


# --- bad files -------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_file(tiny_engine, tmp_path_factory) -> Path:
    s = tiny_engine.session(sampler=SEEDED)
    s.prefill(tiny_engine.tokenizer.encode("a file to damage in every way"))
    path = tmp_path_factory.mktemp("good") / "good.kvs"
    s.save(path)
    return path


def _sections(path: Path):
    with open(path, "rb") as f:
        h = framing.read_header(f, "x")
    return h


def test_truncated_at_every_boundary_and_inside_every_section(tiny_engine, good_file, tmp_path):
    data = good_file.read_bytes()
    h = _sections(good_file)
    cuts = {1, 7, 8, 15, 16, 17, h.data_start - 9, h.data_start - 1}
    for s in h.sections:
        a = h.data_start + s.offset
        cuts |= {a, a + 1, a + s.length // 2, a + s.length - 1}
    live = tiny_engine.session()
    live.prefill([5, 6, 7])
    snapshot = (list(live.tokens), live.logits.clone(), live.cache[0].k[:3].clone())
    for cut in sorted(c for c in cuts if 0 < c < len(data)):
        p = tmp_path / f"cut{cut}.kvs"
        p.write_bytes(data[:cut])
        with pytest.raises((TruncatedSession, NotASessionFile)) as e:
            Session.load(p, tiny_engine)
        assert "truncated" in str(e.value) or "expected" in str(e.value) or "cut short" in str(e.value), str(e.value)
    assert live.tokens == snapshot[0] and torch.equal(live.logits, snapshot[1])
    assert torch.equal(live.cache[0].k[:3], snapshot[2])


def test_one_flipped_byte_in_each_section(tiny_engine, good_file, tmp_path):
    data = bytearray(good_file.read_bytes())
    h = _sections(good_file)
    for s in h.sections:
        # a byte inside the section, and one in the padding after it
        for offset in (s.offset + s.length // 2, s.offset + s.length + 1):
            if offset >= s.offset + s.length + (-s.length % 64):
                continue
            bad = bytearray(data)
            bad[h.data_start + offset] ^= 0x01
            p = tmp_path / f"flip-{s.name}-{offset}.kvs"
            p.write_bytes(bad)
            with pytest.raises(CorruptSession, match=f"section '{s.name}'"):
                Session.load(p, tiny_engine)
    header_end = framing.PREAMBLE.size + struct.unpack_from("<I", data, 12)[0]
    assert header_end + 8 < h.data_start  # there is padding to flip
    for where, error in ((0, NotASessionFile), (8, UnsupportedVersion), (12, SessionFileError), (40, CorruptSession),
                         (header_end + 2, CorruptSession), (h.data_start - 1, CorruptSession)):
        bad = bytearray(data)
        bad[where] ^= 0x01
        p = tmp_path / f"flip{where}.kvs"
        p.write_bytes(bad)
        with pytest.raises(error):
            Session.load(p, tiny_engine)


@pytest.mark.parametrize("spec, message", [
    (TinySpec(seed=77), "weights.*other weights"),  # the same shapes, other weights
    (TinySpec(n_heads=2, n_kv_heads=2), "head_dim: file 16, model 32"),
    (TinySpec(n_layers=3), "n_layers: file 2, model 3"),
], ids=["weights", "head_dim", "layers"])
def test_file_from_another_model(tiny_factory, good_file, spec, message):
    other = Engine.load(tiny_factory(spec), device="cpu", precision="f32")
    with pytest.raises(SessionMismatch, match=message):
        Session.load(good_file, other)


def test_file_with_another_dtype(tiny_engine, good_file):
    with pytest.raises(SessionMismatch, match="kv_dtype: file f16, model f32"):
        Session.load(good_file, tiny_engine, kv_dtype="f32")


def test_empty_file_folder_missing_and_foreign(tiny_engine, tmp_path, tiny_path):
    (tmp_path / "empty.kvs").write_bytes(b"")
    with pytest.raises(NotASessionFile, match="empty"):
        Session.load(tmp_path / "empty.kvs", tiny_engine)
    with pytest.raises(NotASessionFile, match="folder"):
        Session.load(tmp_path, tiny_engine)
    with pytest.raises(NotASessionFile, match="no such file"):
        Session.load(tmp_path / "nope.kvs", tiny_engine)
    with pytest.raises(ManifestError, match="not a session file"):
        Session.load(tiny_path, tiny_engine)  # a GGUF is no session


def test_failed_save_keeps_the_old_file(tiny_engine, good_file, tmp_path, monkeypatch):
    target = tmp_path / "keep.kvs"
    target.write_bytes(good_file.read_bytes())
    s = tiny_engine.session()
    s.prefill([1, 2])

    def boom(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(SessionSaveError, match="keep.kvs: cannot save: No space left on device"):
        s.save(target)
    assert target.read_bytes() == good_file.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["keep.kvs"]  # no temporary file left


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_fuzz_header_parser_with_raw_bytes(blob):
    try:
        framing.parse_header(blob, max(len(blob), 1))
    except SessionFileError:
        pass


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.one_of(
    st.binary(max_size=300),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                 lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                 max_leaves=20).map(lambda d: json.dumps({"sections": d} if isinstance(d, list) else d).encode()),
), st.integers(min_value=0, max_value=10**9))
def test_fuzz_header_parser_with_valid_checksums(body, file_size):
    """Headers whose checksum holds, so the JSON and section-table checks are reached."""
    pre = struct.pack("<8sHHI", framing.MAGIC, 1, 0, len(body)) + body
    blob = pre + struct.pack("<Q", framing.checksum([pre]))
    try:
        framing.parse_header(blob, file_size)
    except SessionFileError:
        pass


@pytest.mark.parametrize("bad", [-1, 0, 1.5, True, "512"])
def test_a_bad_max_tokens_is_a_typed_error(tiny_engine, good_file, bad):
    with pytest.raises(InvalidArgument, match=f"max_tokens must be a whole number >= 1 .*got {bad!r}"):
        tiny_engine.session(max_tokens=bad)
    with pytest.raises(InvalidArgument, match="max_tokens"):
        Session.load(good_file, tiny_engine, max_tokens=bad)


def test_what_a_killed_writer_left_is_removed_and_a_live_writer_keeps_its_file(tiny_engine, tmp_path):
    """A killed writer's temporary file holds no lock (the kernel drops it with the process); a writer at work
    holds one, in this process or another, and keeps its file: its save completes."""
    from kvsession.files.named import make_folder

    folder = tmp_path / "sessions"
    folder.mkdir()
    dead = folder / ".ada.kvs.k1ll3d.tmp"
    dead.write_bytes(b"half a session")
    writing, go_on = threading.Event(), threading.Event()

    def slow(f):
        f.write(b"the new one")
        writing.set()
        go_on.wait(60)

    writer = threading.Thread(target=framing.atomic_write, args=(folder / "bob.kvs", slow), kwargs={"durable": False})
    writer.start()
    assert writing.wait(60)
    make_folder(folder)  # what a named save does before it writes
    left = sorted(p.name for p in folder.iterdir())
    assert len(left) == 1 and left[0].startswith(".bob.kvs.")  # the dead one gone, the live one kept
    go_on.set()
    writer.join(60)
    assert sorted(p.name for p in folder.iterdir()) == ["bob.kvs"] and (folder / "bob.kvs").read_bytes() == \
        b"the new one"
    s = tiny_engine.session()
    s.prefill([1, 2, 3])
    (folder / ".ada.kvs.k1ll3d.tmp").write_bytes(b"again")
    s.save(folder / "ada.kvs")
    assert framing.remove_dead_temporaries(folder) == [folder / ".ada.kvs.k1ll3d.tmp"]
    assert sorted(p.name for p in folder.iterdir()) == ["ada.kvs", "bob.kvs"]
