"""The disk KV cache: sharing, incremental puts, lookups, restores, budget, and every way to break it."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import TinySpec

from kvsession.engine import Engine
from kvsession.files import framing
from kvsession.generate import generate_tokens
from kvsession.sampling import GREEDY
from kvsession.store import Store, StoreOptions, StoreUnavailable

WORKER = Path(__file__).parent / "helpers" / "store_worker.py"
SMALL = StoreOptions(chunk_tokens=16, min_tokens=16)
PREFIX = list(range(3, 3 + 40))


def session_of(engine, tokens, **kw):
    s = engine.session(sampler=GREEDY, **kw)
    s.prefill(tokens)
    return s


def files(folder: Path, sub: str) -> set[str]:
    return {p.name for p in (folder / sub).iterdir()}


def test_shared_prefixes_are_stored_once(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    a = store.put(session_of(tiny_engine, PREFIX + [7] * 20), "cold")
    b = store.put(session_of(tiny_engine, PREFIX + [9] * 20), "continued")
    assert a.chunks[:2] == b.chunks[:2]  # the 40-token prefix: two whole chunks of 16, shared
    assert a.chunks[2] != b.chunks[2]
    assert len(files(tmp_path, "chunks")) == len(set(a.chunks) | set(b.chunks)) == 4


def test_cold_saves_are_trimmed_to_whole_chunks(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    e = store.put(session_of(tiny_engine, PREFIX + [7] * 10), "cold")  # 50 tokens
    assert e.n_tokens == 48 and e.has_logits is False and e.reason == "cold"
    e = store.put(session_of(tiny_engine, PREFIX + [7] * 10), "continued")
    assert e.n_tokens == 50 and e.has_logits


def test_min_tokens_and_reasons(tiny_engine, tmp_path):
    store = Store(tmp_path, StoreOptions(chunk_tokens=16, min_tokens=30))
    assert store.put(session_of(tiny_engine, PREFIX[:20]), "continued") is None
    with pytest.raises(ValueError, match="reason"):
        store.put(session_of(tiny_engine, PREFIX), "whim")


def test_incremental_put_writes_only_new_chunks_and_the_tail(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    s = session_of(tiny_engine, PREFIX + list(range(50, 90)))  # 80 tokens: 5 chunks
    store.put(s, "continued")
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "chunks").iterdir()}
    s.prefill(list(range(100, 120)))  # 100 tokens: one more whole chunk, a tail of 4
    e = store.put(s, "continued")
    after = {p: p.stat().st_mtime_ns for p in (tmp_path / "chunks").iterdir()}
    assert all(after[p] == t for p, t in before.items())  # nothing rewritten
    assert len(after) == len(before) + 1 and len(e.chunks) == 6 and e.n_tokens == 100


def test_restore_equals_the_live_session(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    ids = PREFIX + list(range(60, 95))
    live = session_of(tiny_engine, ids)
    store.put(live, "continued")
    hit = store.longest_prefix(ids + [1, 2, 3], tiny_engine)
    assert hit.n_tokens == len(ids) and hit.has_logits
    s = tiny_engine.session(sampler=GREEDY)
    before = tiny_engine.model.n_forward
    assert store.restore(hit, s)
    assert tiny_engine.model.n_forward == before and s.tokens == ids
    assert torch.equal(s.logits, live.logits)
    assert list(generate_tokens(s, 12, ignore_eos=True)) == list(generate_tokens(live, 12, ignore_eos=True))


def test_chunk_boundary_hit_then_prefill(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    store.put(session_of(tiny_engine, PREFIX + list(range(60, 100))), "continued")
    query = PREFIX + list(range(60, 70)) + [200, 201, 202]  # diverges inside the third chunk
    hit = store.longest_prefix(query, tiny_engine)
    assert hit.n_tokens == 48 and hit.entry is None and not hit.has_logits
    s = tiny_engine.session(sampler=GREEDY)
    assert store.restore(hit, s)
    s.prefill(query[48:])
    fresh = session_of(tiny_engine, query)
    torch.testing.assert_close(s.logits, fresh.logits, rtol=1e-5, atol=1e-5)


def test_restore_reuses_what_the_session_holds(tiny_engine, tmp_path, monkeypatch):
    store = Store(tmp_path, SMALL)
    ids = PREFIX + list(range(60, 100))
    store.put(session_of(tiny_engine, ids), "continued")
    s = session_of(tiny_engine, PREFIX + list(range(60, 70)) + [250, 251])  # shares 50 tokens, then differs
    read = []
    real = framing.read_section
    monkeypatch.setattr(framing, "read_section",
                        lambda f, h, name, **kw: read.append((h.fields["kind"], name)) or real(f, h, name, **kw))
    assert store.restore(store.longest_prefix(ids, tiny_engine), s)
    assert s.tokens == ids
    chunk_reads = [name for kind, name in read if kind == "chunk"]
    assert len(chunk_reads) == 2 * 2  # chunks 3 and 4 only (positions 48..79), two layers each
    ref = session_of(tiny_engine, ids)
    assert list(generate_tokens(s, 8, ignore_eos=True)) == list(generate_tokens(ref, 8, ignore_eos=True))


def test_text_prefix_lookup(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    msgs = [{"role": "user", "content": "hello there, the sea is on the string of words " * 2}]
    ids = tiny_engine.chat_tokens(msgs)
    s = session_of(tiny_engine, ids)
    store.put(s, "continued")
    longer = tiny_engine.template.render(msgs + [{"role": "assistant", "content": "ok"},
                                                 {"role": "user", "content": "again"}])
    hit, rest = store.longest_text_prefix(longer, tiny_engine)
    assert hit.tokens == ids and longer == s.text + rest
    assert store.longest_text_prefix("something else entirely", tiny_engine) is None


def test_other_model_or_dtype_never_hits(tiny_engine, tiny_factory, tmp_path):
    store = Store(tmp_path, SMALL)
    store.put(session_of(tiny_engine, PREFIX + [5] * 10), "continued")
    other = Engine.load(tiny_factory(TinySpec(seed=123)), device="cpu", precision="f32")
    assert store.longest_prefix(PREFIX + [5] * 10, other) is None
    assert store.longest_prefix(PREFIX + [5] * 10, tiny_engine, kv_dtype="f32") is None


def test_ring_layers_restore_exactly(tiny_factory, tmp_path):
    engine = Engine.load(tiny_factory(TinySpec(arch="gemma3", n_layers=4, n_heads=4, n_kv_heads=1, head_dim=32,
                                               sliding_window=8, rope_base=1e6, seed=11)),
                         device="cpu", precision="f32")
    store = Store(tmp_path, SMALL)
    ids = PREFIX + list(range(60, 85))  # 65 tokens: the rings (window 8, margin 4) have wrapped many times
    live = session_of(engine, ids, ring_margin=4)
    store.put(live, "continued")
    s = engine.session(sampler=GREEDY)
    assert store.restore(store.longest_prefix(ids, engine), s)
    assert list(generate_tokens(s, 15, ignore_eos=True)) == list(generate_tokens(live, 15, ignore_eos=True))
    # the wrapped rings held no whole chunk: no chunk boundary is restorable for this model
    assert store.longest_prefix(ids[:64] + [9, 9], engine) is None
    # with rings that held every row when it was written, chunk 3 (positions 48..63) carries the window
    other = PREFIX + list(range(100, 125))
    store.put(session_of(engine, other), "continued")
    query = other[:64] + [9, 9]
    hit = store.longest_prefix(query, engine)
    assert hit.n_tokens == 64 and hit.entry is None
    t = engine.session(sampler=GREEDY)
    assert store.restore(hit, t)
    t.prefill(query[64:])
    fresh = session_of(engine, query)
    assert list(generate_tokens(t, 10, ignore_eos=True)) == list(generate_tokens(fresh, 10, ignore_eos=True))


def test_budget_is_never_exceeded_and_shared_chunks_stay(tiny_engine, tmp_path):
    one = Store(tmp_path / "probe", SMALL).put(session_of(tiny_engine, PREFIX + [5] * 30), "continued")
    budget = int(3.5 * (one.nbytes + sum(one.chunk_bytes)))
    store = Store(tmp_path / "s", StoreOptions(chunk_tokens=16, min_tokens=16, budget_bytes=budget))
    rng = np.random.default_rng(0)
    for i in range(12):
        e = store.put(session_of(tiny_engine, PREFIX + rng.integers(3, 250, 30).tolist()), "continued")
        assert store.total_bytes() <= budget
        assert e is not None and e.key in store.entries  # the entry just written is protected
        on_disk = sum(p.stat().st_size for sub in ("chunks", "manifests") for p in (tmp_path / "s" / sub).iterdir())
        assert on_disk <= budget + 4096  # plus the small stats files
        for kept in store.entries.values():
            assert all((tmp_path / "s" / "chunks" / (c + ".kvc")).exists() for c in kept.chunks)


def test_too_big_for_the_budget_is_not_kept(tiny_engine, tmp_path):
    store = Store(tmp_path, StoreOptions(chunk_tokens=16, min_tokens=16, budget_bytes=1000))
    assert store.put(session_of(tiny_engine, PREFIX), "continued") is None
    assert store.total_bytes() == 0 and not files(tmp_path, "chunks")


def test_eviction_prefers_hits_then_recency(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    sessions = [session_of(tiny_engine, PREFIX + [10 + i] * 30) for i in range(3)]
    entries = [store.put(s, "continued") for s in sessions]
    hit = store.longest_prefix(sessions[0].tokens, tiny_engine)  # entry 0 gets a hit
    assert store.restore(hit, tiny_engine.session())
    entries[1].last_used -= 100  # entry 1 is the least recently used
    ranked = sorted(store.entries.values(), key=lambda e: (store.value(e), e.last_used))
    assert ranked[0].key == entries[1].key and ranked[-1].key == entries[0].key
    assert store.value(entries[0]) > store.value(entries[2])
    store.local.options = StoreOptions(chunk_tokens=16, min_tokens=16, budget_bytes=store.total_bytes() - 1)
    from kvsession.store.policy import Protected

    store.local.evict_to_budget(Protected())
    assert entries[1].key not in store.entries and entries[0].key in store.entries


def test_a_new_conversation_outlives_the_turns_of_an_old_one(tiny_engine, tmp_path):
    """An old conversation's checkpoints (a turn each, sharing their chunks) go before a newer conversation's first
    checkpoint, though that one alone owns all of its chunks."""
    old = [PREFIX + list(range(100, 100 + n)) for n in (20, 40, 60)]  # three turns of one conversation
    new, newer = [PREFIX + [7 + i] * 60 for i in range(2)]
    sizes = {}
    for name, checkpoints in (("new", [new]), ("newer", [newer])):
        scratch = Store(tmp_path / name, SMALL)
        for tokens in checkpoints:
            scratch.put(session_of(tiny_engine, tokens), "continued")
        sizes[name] = scratch.local.total_bytes()
    store = Store(tmp_path / "kv", StoreOptions(chunk_tokens=16, min_tokens=16,
                                                budget_bytes=sizes["new"] + sizes["newer"] + 4096))
    turns = [store.put(session_of(tiny_engine, tokens), "continued") for tokens in old]
    for e in turns:
        e.last_used -= 100  # an hour ago, say
    kept = store.put(session_of(tiny_engine, new), "continued")
    last = store.put(session_of(tiny_engine, newer), "continued")  # over the budget: something must go
    assert {e.key for e in store.ls()} == {kept.key, last.key}
    assert store.total_bytes() <= store.options.budget_bytes


def test_hits_decay_with_a_half_life(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    e = store.put(session_of(tiny_engine, PREFIX), "continued")
    e.hits, e.hits_at = 4.0, time.time() - 6 * 3600
    assert store.decayed_hits(e) == pytest.approx(2.0, rel=1e-3)


def test_index_survives_a_restart(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    keys = {store.put(session_of(tiny_engine, PREFIX + [i] * 20), "continued").key for i in range(4)}
    again = Store(tmp_path, SMALL)
    assert {e.key for e in again.ls()} == keys
    hit = again.longest_prefix(PREFIX + [2] * 20, tiny_engine)
    assert hit.n_tokens == 60 and again.restore(hit, tiny_engine.session())


def test_lookups_do_not_rescan_the_folder(tiny_engine, tmp_path, monkeypatch):
    store = Store(tmp_path, SMALL)
    store.put(session_of(tiny_engine, PREFIX), "continued")
    monkeypatch.setattr(Path, "iterdir", lambda self: pytest.fail("folder listed on a lookup"))
    for _ in range(3):
        assert store.longest_prefix(PREFIX, tiny_engine) is not None


def test_corrupt_chunk_is_a_logged_miss_and_is_removed(tiny_engine, tmp_path, caplog):
    store = Store(tmp_path, SMALL)
    e = store.put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")
    path = tmp_path / "chunks" / (e.chunks[1] + ".kvc")
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF
    path.write_bytes(data)
    s = session_of(tiny_engine, [3, 4, 5])
    before = (list(s.tokens), s.logits.clone())
    assert store.restore(store.longest_prefix(PREFIX + [5] * 20, tiny_engine), s) is False
    assert s.tokens == before[0] and torch.equal(s.logits, before[1])  # the session is untouched
    assert "damaged" in caplog.text
    assert e.key not in store.entries and not path.exists()
    assert store.longest_prefix(PREFIX + [5] * 20, tiny_engine) is None


def test_corrupt_or_truncated_manifest_is_removed_at_open(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    e1 = store.put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")
    e2 = store.put(session_of(tiny_engine, PREFIX + [6] * 20), "continued")
    p1 = tmp_path / "manifests" / (e1.key + ".kvm")
    p1.write_bytes(p1.read_bytes()[:200])
    p2 = tmp_path / "manifests" / (e2.key + ".kvm")
    data = bytearray(p2.read_bytes())
    data[100] ^= 0x10
    p2.write_bytes(data)
    again = Store(tmp_path, SMALL)
    assert again.ls() == [] and not files(tmp_path, "chunks")  # their chunks were orphans, now gone


def test_temporaries_left_by_a_killed_writer_are_removed_at_open(tiny_engine, tmp_path):
    Store(tmp_path, SMALL).put(session_of(tiny_engine, PREFIX), "continued")
    (tmp_path / "chunks" / ".abc.kvc.x1y2.tmp").write_bytes(b"half a chunk")
    (tmp_path / "manifests" / ".def.kvm.z3.tmp").write_bytes(b"half a manifest")
    store = Store(tmp_path, SMALL)
    assert not [n for sub in ("chunks", "manifests") for n in files(tmp_path, sub) if n.endswith(".tmp")]
    assert len(store.ls()) == 1


def test_a_failed_write_leaves_the_store_consistent(tiny_engine, tmp_path, monkeypatch):
    store = Store(tmp_path, SMALL)
    kept = store.put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")
    real = framing.write_file
    calls = []

    def failing(path, *a, **kw):
        calls.append(path)
        if len(calls) == 2:  # the second file of this put: one new chunk is already written
            raise OSError(28, "No space left on device")
        return real(path, *a, **kw)

    monkeypatch.setattr(framing, "write_file", failing)
    with pytest.raises(StoreUnavailable, match="No space left"):
        store.put(session_of(tiny_engine, PREFIX + list(range(100, 140))), "continued")
    monkeypatch.undo()
    assert [e.key for e in store.ls()] == [kept.key]
    assert files(tmp_path, "chunks") == {c + ".kvc" for c in kept.chunks}  # no orphan left behind
    assert not [n for n in files(tmp_path, "manifests") if n.endswith(".tmp")]
    assert Store(tmp_path, SMALL).restore(store.longest_prefix(PREFIX + [5] * 20, tiny_engine),
                                          tiny_engine.session())


def test_delete_gc_clear(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    a = store.put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")
    b = store.put(session_of(tiny_engine, PREFIX + [6] * 20), "continued")
    store.delete(a.key)
    assert [e.key for e in store.ls()] == [b.key]
    assert files(tmp_path, "chunks") == {c + ".kvc" for c in b.chunks}  # shared chunks stay
    (tmp_path / "chunks" / "0123.kvc").write_bytes(b"orphan")
    assert store.gc()["removed"] == 0 and "0123.kvc" not in files(tmp_path, "chunks")
    assert store.clear() == 1 and store.ls() == [] and not files(tmp_path, "chunks")


def _worker(model, folder, seed, count, budget=1 << 30):
    return subprocess.Popen([sys.executable, str(WORKER), str(model), str(folder), str(seed), str(count),
                             str(budget)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _check_store(engine, folder) -> int:
    store = Store(folder, SMALL)
    names = [n for sub in ("chunks", "manifests") for n in files(folder, sub)]
    assert not [n for n in names if n.endswith(".tmp")], names
    for e in store.ls():
        assert store.verify(e)
        s = engine.session()
        assert store.restore(store.longest_prefix(e.tokens.tolist(), engine), s), e.key
        assert s.tokens == e.tokens.tolist()
    return len(store.entries)


def test_two_processes_at_once_lose_nothing(tiny_engine, tiny_path, tmp_path):
    procs = [_worker(tiny_path, tmp_path, seed, 12) for seed in (1, 2)]
    reader = Store(tmp_path, SMALL)
    seen = 0
    while any(p.poll() is None for p in procs):  # read while they write: never half an entry
        for e in reader.ls():
            hit = reader.longest_prefix(e.tokens.tolist(), tiny_engine)
            if hit is not None:
                reader.restore(hit, tiny_engine.session())
                seen += 1
        time.sleep(0.05)
    for p in procs:
        out, err = p.communicate()
        assert p.returncode == 0, err
        assert out.strip().endswith("put 12")
    assert _check_store(tiny_engine, tmp_path) == 24  # distinct suffixes: every put kept
    assert seen > 0


def test_crash_safety_under_sigkill(tiny_engine, tiny_path, tmp_path):
    """20 times: a writer is killed at a random moment; the store opens whole each time (tools/crash_test.py kills a
    server inside each kind of write, a hundred times and more)."""
    rnd = random.Random(7)
    budget = 300_000  # small enough that eviction runs too
    for i in range(20):
        p = _worker(tiny_path, tmp_path, i, 0, budget)
        assert p.stdout.readline().strip() == "ready"
        for _ in range(rnd.randint(0, 3)):
            p.stdout.readline()
        time.sleep(rnd.uniform(0, 0.05))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        p.stdout.close()
        p.stderr.close()
        _check_store(tiny_engine, tmp_path)
    assert len(Store(tmp_path, SMALL).ls()) > 0


def test_a_folder_keeps_its_chunk_size(tiny_engine, tmp_path):
    Store(tmp_path, SMALL).put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")
    again = Store(tmp_path, StoreOptions(chunk_tokens=256, min_tokens=16))
    assert again.options.chunk_tokens == 16
    assert again.longest_prefix(PREFIX + [5] * 20, tiny_engine).n_tokens == 60
    (tmp_path / "store.json").write_text("{broken")
    from kvsession.store import StoreError

    with pytest.raises(StoreError, match="unreadable store layout"):
        Store(tmp_path, SMALL)


def test_cache_cli(tiny_engine, tmp_path):
    from test_cli import kvsession

    store = Store(tmp_path, SMALL)
    e = store.put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")
    r = kvsession("cache", "ls", "--dir", tmp_path)
    assert r.returncode == 0 and e.key[:12] in r.stdout and "continued" in r.stdout and "1 checkpoints" in r.stdout
    r = kvsession("cache", "show", e.key[:6], "--dir", tmp_path)
    assert r.returncode == 0 and "all checksums ok" in r.stdout and "tail 12" in r.stdout
    r = kvsession("cache", "stats", "--dir", tmp_path)
    assert r.returncode == 0 and "1 checkpoints of 60 tokens in all, 3 distinct chunks of 16 tokens" in r.stdout
    r = kvsession("cache", "stats", "--shared-url", "mongodb://h:1")
    assert r.returncode == 1 and "shared tier URL 'mongodb://h:1'" in r.stderr and "Traceback" not in r.stderr
    r = kvsession("cache", "clear", "--yes", "--dir", tmp_path, "--shared-url", "redis://h:1")
    assert r.returncode == 1 and "--shared-url is for cache stats" in r.stderr and len(Store(tmp_path, SMALL).ls()) == 1
    r = kvsession("cache", "show", "zzz", "--dir", tmp_path)
    assert r.returncode == 1 and "0 checkpoints match" in r.stderr
    r = kvsession("cache", "clear", "--dir", tmp_path)
    assert r.returncode == 1 and "--yes" in r.stderr and len(Store(tmp_path, SMALL).ls()) == 1
    r = kvsession("cache", "clear", "--yes", "--dir", tmp_path)
    assert r.returncode == 0 and Store(tmp_path, SMALL).ls() == []
    r = kvsession("cache", "gc", "--dir", tmp_path / "nope")
    assert r.returncode == 1 and "no such cache folder" in r.stderr


def test_a_query_shorter_than_a_checkpoint_reuses_its_prefix(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    ids = PREFIX + list(range(60, 90))  # 70 tokens: 4 whole chunks and a tail of 6
    store.put(session_of(tiny_engine, ids), "continued")
    for query in (ids[:67] + [250, 251], ids[:67]):  # diverges inside the tail; a retry of a shorter prompt
        hit = store.longest_prefix(query, tiny_engine)
        assert hit.n_tokens == 67 and hit.entry is not None and not hit.has_logits
        s = tiny_engine.session(sampler=GREEDY)
        assert store.restore(hit, s) and s.tokens == ids[:67] and s.logits is None
    live = session_of(tiny_engine, ids)  # the stored rows, cut back where the query parts from them
    live.truncate(67)
    live.prefill([250, 251])
    s = tiny_engine.session(sampler=GREEDY)
    store.restore(store.longest_prefix(ids[:67] + [250, 251], tiny_engine), s)
    s.prefill([250, 251])
    assert torch.equal(s.logits, live.logits)  # the restored rows are the stored rows, bit for bit
    fresh = session_of(tiny_engine, ids[:67] + [250, 251])  # one pass: the same sums in another order
    torch.testing.assert_close(s.logits, fresh.logits, rtol=1e-4, atol=1e-4)


def test_a_damaged_chunk_costs_only_the_checkpoints_that_name_it(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    a = store.put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")  # chunks: shared, shared, its own
    b = store.put(session_of(tiny_engine, PREFIX + [6] * 20), "continued")
    path = tmp_path / "chunks" / (a.chunks[2] + ".kvc")
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF
    path.write_bytes(data)
    assert store.restore(store.longest_prefix(a.tokens.tolist(), tiny_engine), tiny_engine.session()) is False
    assert a.key not in store.entries and b.key in store.entries
    assert all((tmp_path / "chunks" / (c + ".kvc")).exists() for c in b.chunks)
    s = tiny_engine.session()
    assert store.restore(store.longest_prefix(b.tokens.tolist(), tiny_engine), s) and s.tokens == b.tokens.tolist()


def test_a_damaged_manifest_keeps_its_shared_chunks(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    a = store.put(session_of(tiny_engine, PREFIX + [5] * 20), "continued")
    b = store.put(session_of(tiny_engine, PREFIX + [6] * 20), "continued")
    path = tmp_path / "manifests" / (a.key + ".kvm")
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF
    path.write_bytes(data)
    assert store.restore(store.longest_prefix(a.tokens.tolist(), tiny_engine), tiny_engine.session()) is False
    assert a.key not in store.entries and b.key in store.entries
    assert all((tmp_path / "chunks" / (c + ".kvc")).exists() for c in b.chunks)


# --- issue 14: a returning conversation keeps its checkpoint; the policy's knobs ---------------------

A_IDS = PREFIX + list(range(60, 100))  # conversation A: 80 tokens, 5 chunks of 16
B_IDS = list(range(150, 230))  # B: 80 unrelated tokens


def store_holding_a(engine, tmp_path, budget_of):
    """A store (chunks of 16) holding A's checkpoint, its budget budget_of(the bytes that checkpoint takes):
    (store, budget, A's session)."""
    probe = Store(tmp_path / "probe", SMALL).put(session_of(engine, A_IDS), "continued")
    budget = budget_of(probe.nbytes + sum(probe.chunk_bytes))
    store = Store(tmp_path / "kv", StoreOptions(chunk_tokens=16, min_tokens=16, budget_bytes=budget))
    a = session_of(engine, A_IDS)
    store.put(a, "continued")
    return store, budget, a


def test_the_hit_is_protected_while_the_outgoing_session_is_saved(tiny_engine, tmp_path):
    """ds4 #448: conversation A, then an unrelated B, then A continued, with a budget that holds one of them.
    The worker looks A up first, saves B with A's hit protected, then restores A: A keeps its checkpoint."""
    a_ids, b_ids = A_IDS, B_IDS
    store, budget, a = store_holding_a(tiny_engine, tmp_path, lambda n: int(1.5 * n))
    b = session_of(tiny_engine, b_ids)  # the live session is B now
    query = a_ids + [7, 8, 9]
    hit = store.longest_prefix(query, tiny_engine)  # 1. look up first
    assert hit.n_tokens == len(a_ids)
    saved = store.put(b, "evict", protect=hit)  # 2. save the outgoing session, the hit protected
    assert store.total_bytes() <= budget
    assert saved is not None and 16 <= saved.n_tokens < len(b_ids) and saved.n_tokens % 16 == 0  # what fits of B
    assert not saved.has_logits
    s = tiny_engine.session(sampler=GREEDY)
    assert store.restore(hit, s) and s.tokens == a_ids  # 3. restore: A's checkpoint is whole
    assert torch.equal(s.logits, a.logits)
    # B's whole chunks come back too, as a chunk boundary
    assert store.longest_prefix(b_ids, tiny_engine).n_tokens == saved.n_tokens


def test_without_protection_the_returning_conversation_would_lose_its_checkpoint(tiny_engine, tmp_path):
    a_ids, b_ids = A_IDS, B_IDS
    store, budget, _ = store_holding_a(tiny_engine, tmp_path, lambda n: int(1.5 * n))
    hit = store.longest_prefix(a_ids, tiny_engine)
    assert store.put(session_of(tiny_engine, b_ids), "evict").n_tokens == len(b_ids)  # the old order: B whole ...
    assert store.restore(hit, tiny_engine.session()) is False  # ... and A's hit is gone: a cold prefill


def test_a_protected_hit_that_leaves_no_room_saves_nothing(tiny_engine, tmp_path):
    a_ids, b_ids = A_IDS, B_IDS
    # room for A, and less than a chunk and a manifest of B
    store, budget, _ = store_holding_a(tiny_engine, tmp_path, lambda n: n + 2000)
    hit = store.longest_prefix(a_ids, tiny_engine)
    assert store.put(session_of(tiny_engine, b_ids), "evict", protect=hit) is None
    assert store.total_bytes() <= budget and not (set(files(tmp_path / "kv", "chunks")) - {c + ".kvc" for c in hit.chunks})
    assert store.restore(hit, tiny_engine.session())


def test_a_chunk_boundary_hit_keeps_its_chunks(tiny_engine, tmp_path):
    a_ids, b_ids = A_IDS, B_IDS
    store, budget, _ = store_holding_a(tiny_engine, tmp_path, lambda n: int(1.5 * n))
    hit = store.longest_prefix(a_ids[:50] + [1, 2], tiny_engine)  # diverges in chunk 3: a boundary at 48
    assert hit.entry is None and hit.n_tokens == 48
    store.put(session_of(tiny_engine, b_ids), "evict", protect=hit)
    assert store.restore(hit, tiny_engine.session())


def test_cold_saves_follow_ds4s_cold_max_tokens(tiny_engine, tmp_path):
    store = Store(tmp_path, StoreOptions(chunk_tokens=16, min_tokens=16, cold_max_tokens=60))
    assert store.put(session_of(tiny_engine, PREFIX + [7] * 10), "cold").n_tokens == 48  # 50 <= 60: trimmed
    assert store.put(session_of(tiny_engine, PREFIX + [8] * 30), "cold") is None  # 70 > 60: not a cold save
    assert store.put(session_of(tiny_engine, PREFIX + [8] * 30), "continued").n_tokens == 70
    off = Store(tmp_path / "off", StoreOptions(chunk_tokens=16, min_tokens=16, cold_max_tokens=0))
    assert off.put(session_of(tiny_engine, PREFIX), "cold") is None
    with pytest.raises(ValueError, match="cold_max_tokens"):
        StoreOptions(min_tokens=512, cold_max_tokens=100)


def test_continued_checkpoints_fall_on_absolute_chunk_aligned_frontiers(tiny_engine, tmp_path):
    store = Store(tmp_path, StoreOptions(chunk_tokens=16, min_tokens=16, continued_interval_tokens=40))
    # 40 tokens round up to 48: frontiers 48, 96, 144, ... wherever the last checkpoint landed
    assert [store.continued_frontier(n, 0) for n in (47, 48, 95, 100)] == [0, 48, 48, 96]
    assert store.continued_frontier(100, 96) == 0 and store.continued_frontier(150, 96) == 144
    assert store.should_checkpoint(50, 0) and not store.should_checkpoint(50, 48)
    s = session_of(tiny_engine, PREFIX + list(range(60, 90)))  # 70 tokens
    e = store.put(s, "continued", n_tokens=store.continued_frontier(len(s), 0))
    assert e.n_tokens == 48 and not e.has_logits and len(e.chunks) == 3
    assert StoreOptions(continued_interval_tokens=0, chunk_tokens=16).continued_interval_tokens == 0
    assert Store(tmp_path / "x", StoreOptions(chunk_tokens=16, continued_interval_tokens=0)).continued_frontier(
        10_000, 0) == 0
