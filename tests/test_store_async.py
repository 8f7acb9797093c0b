"""Checkpoints written off the compute thread: snapshots, the writer, flush, and a writer killed mid-write."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from test_store import PREFIX, SMALL, WORKER, _check_store, session_of

from kvsession.generate import generate_tokens
from kvsession.sampling import GREEDY
from kvsession.store import Store, StoreOptions


def test_a_snapshot_does_not_change_when_the_session_does(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    ids = PREFIX + list(range(60, 95))
    s = session_of(tiny_engine, ids)
    reference = session_of(tiny_engine, ids)
    gate = threading.Event()
    real = store._commit
    store._commit = lambda snap: gate.wait() and real(snap)  # the writer waits while the session changes
    future = store.checkpoint_async(s, "continued")
    s.truncate(30)  # back into the snapshot's chunks, then other tokens over the same rows
    s.prefill(list(range(200, 260)))
    gate.set()
    entry = future.result(timeout=30)
    assert entry.n_tokens == len(ids) and entry.tokens.tolist() == ids
    r = tiny_engine.session(sampler=GREEDY)
    assert store.restore(store.longest_prefix(ids, tiny_engine), r)
    assert torch.equal(r.logits, reference.logits)
    assert list(generate_tokens(r, 10, ignore_eos=True)) == list(generate_tokens(reference, 10, ignore_eos=True))


def test_a_snapshot_copies_only_what_is_not_on_disk(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    s = session_of(tiny_engine, PREFIX + list(range(60, 100)))  # 80 tokens: 5 chunks
    store.put(s, "continued")
    s.prefill(list(range(100, 120)))  # 100 tokens: one more whole chunk
    snap = store._snapshot(s, "continued", None, None, copy=True, skip_pending=True)
    assert len(snap.keys) == 6 and list(snap.chunk_rows) == [snap.keys[5]]
    k, v = snap.chunk_rows[snap.keys[5]][2][0]
    assert not (k.base is not None and k.base is s.cache[0].k)  # a copy, not a view of the cache
    assert store.checkpoint_async(s, "continued").result(timeout=30).n_tokens == 100


def test_snapshots_of_one_timeline_queued_behind_a_write_are_superseded(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    gate, started = threading.Event(), threading.Event()
    commits = []
    real = store._commit

    def slow(snap):
        commits.append(snap.n_tokens)
        started.set()
        gate.wait()
        return real(snap)

    store._commit = slow
    s = session_of(tiny_engine, PREFIX)
    first = store.checkpoint_async(s, "continued")  # running
    assert started.wait(10)
    futures = []
    for step in range(3):  # queued one after the other: each supersedes the one before
        s.prefill(list(range(100 + 20 * step, 120 + 20 * step)))
        futures.append(store.checkpoint_async(s, "continued"))
    other = store.checkpoint_async(session_of(tiny_engine, list(range(150, 200))), "evict")  # another timeline
    gate.set()
    assert store.flush(timeout=30)
    assert commits == [40, 100, 50]
    assert first.result().n_tokens == 40 and {f.result().key for f in futures} == {futures[-1].result().key}
    assert other.result().n_tokens == 50
    hit = store.longest_prefix(s.tokens, tiny_engine)
    r = tiny_engine.session(sampler=GREEDY)
    assert hit.n_tokens == 100 and store.restore(hit, r) and torch.equal(r.logits, s.logits)


B = PREFIX + list(range(100, 120))


def test_an_eviction_leaves_the_chunks_a_queued_snapshot_left_to_the_one_before_it(tiny_engine, tmp_path):
    """A is being written; C (another timeline) and then B (A's timeline, grown) queue behind it, B without A's
    chunks (A writes them). C does not fit beside A: the eviction C's write makes must not take A's chunks,
    or B is left with a gap and not kept."""
    sizes = {}
    for name, checkpoints in (("a", [PREFIX]), ("c", [list(range(150, 214))]), ("ab", [PREFIX, B])):
        scratch = Store(tmp_path / name, SMALL)
        for tokens in checkpoints:
            scratch.put(session_of(tiny_engine, tokens), "continued")
        sizes[name] = scratch.local.total_bytes()
    budget = sizes["ab"]  # A and B fit together; A and C do not
    assert sizes["a"] + sizes["c"] > budget
    store = Store(tmp_path / "kv", StoreOptions(chunk_tokens=16, min_tokens=16, budget_bytes=budget))
    gate, started = threading.Event(), threading.Event()
    real = store._commit

    def slow(snap):
        started.set()
        gate.wait()
        return real(snap)

    store._commit = slow
    s = session_of(tiny_engine, PREFIX)
    a = store.checkpoint_async(s, "continued")
    assert started.wait(10)
    c = store.checkpoint_async(session_of(tiny_engine, list(range(150, 214))), "evict")
    s.prefill(B[40:])
    b = store.checkpoint_async(s, "continued")
    gate.set()
    assert store.flush(timeout=30)
    assert a.result().n_tokens == 40 and b.result() is not None and b.result().n_tokens == 60
    assert c.result() is None or c.result().key not in {e.key for e in store.ls()}  # C was the one that went
    hit = store.longest_prefix(s.tokens, tiny_engine)
    r = tiny_engine.session(sampler=GREEDY)
    assert hit.n_tokens == 60 and store.restore(hit, r) and torch.equal(r.logits, s.logits)


def test_a_failed_write_is_the_futures_and_the_next_snapshot_copies_again(tiny_engine, tmp_path, monkeypatch):
    from kvsession.files import framing

    store = Store(tmp_path, SMALL)
    real = framing.write_file
    fail = {"on": True}

    def failing(path, *a, **kw):
        if fail["on"]:
            raise OSError(28, "No space left on device")
        return real(path, *a, **kw)

    monkeypatch.setattr(framing, "write_file", failing)
    s = session_of(tiny_engine, PREFIX + list(range(60, 90)))
    future = store.checkpoint_async(s, "continued")
    assert "No space left" in str(future.exception(timeout=30))
    fail["on"] = False
    assert store.checkpoint_async(s, "continued").result(timeout=30).n_tokens == 70
    assert store.restore(store.longest_prefix(s.tokens, tiny_engine), tiny_engine.session())


def test_nothing_to_keep_resolves_at_once(tiny_engine, tmp_path):
    store = Store(tmp_path, StoreOptions(chunk_tokens=16, min_tokens=100))
    assert store.checkpoint_async(session_of(tiny_engine, PREFIX), "continued").result(timeout=1) is None
    assert store.close()


def test_a_writer_killed_mid_write_leaves_the_last_checkpoint(tiny_engine, tiny_path, tmp_path):
    """12 times: a process grows one session and checkpoints it asynchronously; SIGKILL at a random moment.
    The store opens whole, and the last checkpoint the process saw written restores."""
    rnd = random.Random(3)
    for i in range(12):
        folder = tmp_path / f"kv{i}"
        p = subprocess.Popen([sys.executable, str(WORKER), str(tiny_path), str(folder), str(i), "0", str(1 << 30),
                              "async"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        saved = [int(p.stdout.readline().split()[1]) for _ in range(rnd.randint(1, 4))]
        time.sleep(rnd.uniform(0, 0.05))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        p.stdout.close()
        p.stderr.close()
        assert _check_store(tiny_engine, folder) >= 1
        store = Store(folder, SMALL)
        last = [e for e in store.ls() if e.n_tokens == saved[-1]]
        assert last, (saved, [e.n_tokens for e in store.ls()])
        r = tiny_engine.session()
        assert store.restore(store.longest_prefix(last[0].tokens.tolist(), tiny_engine), r)
        assert r.tokens == last[0].tokens.tolist() and r.logits is not None


def test_close_waits_for_pending_checkpoints(tiny_engine, tmp_path):
    store = Store(tmp_path, SMALL)
    futures = [store.checkpoint_async(session_of(tiny_engine, PREFIX + [i] * 20), "continued") for i in range(4)]
    assert store.close(timeout=60)
    assert all(f.done() and f.result() is not None for f in futures)
    assert len(Store(tmp_path, SMALL).ls()) == 4
    assert Path(tmp_path / "manifests").is_dir()
