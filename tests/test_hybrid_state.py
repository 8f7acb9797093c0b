"""A hybrid's recurrent state beside its KV rows, everywhere a session goes: session files, raw exports, the
disk KV cache, forks -- and resumed exactly, token for token, in this process and in a fresh one.

The recurrent layers' conv and SSM states (float32, llama.cpp's layout) are saved at the session's end
(header field `recurrent`, sections `state.N`); the disk cache's manifests carry them at their end, so a
restore is exact at a checkpoint (a turn's end). A recurrent state cannot be taken back to a chunk boundary
inside a checkpoint, so for a hybrid the store offers whole checkpoints only.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import TINY_HYBRID_SPECS, TINY_HYBRID_TEXT

from kvsession.engine import Engine
from kvsession.errors import CorruptSession, SessionMismatch
from kvsession.files import framing
from kvsession.generate import generate_tokens
from kvsession.sampling import GREEDY
from kvsession.session import Session, common_prefix
from kvsession.store import Store, StoreOptions

NAMES = ["lfm2_f32", "granitehybrid_f32", "nemotron_h_f32", "falcon_h1_f32", "qwen3next_f32", "qwen35_f32",
         "qwen35moe_f32"]
HELPER = Path(__file__).parent / "helpers" / "resume.py"


@pytest.fixture(scope="module", params=NAMES)
def hybrid(request, tiny_factory):
    path = tiny_factory(TINY_HYBRID_SPECS[request.param])
    engine = Engine.load(path, device="cpu", precision="f32")
    return engine, engine.tokenizer.encode(TINY_HYBRID_TEXT)


def _session(engine: Engine, ids: list[int]) -> Session:
    s = engine.session(kv_dtype="f32", sampler=GREEDY)
    s.prefill(ids)
    return s


def test_session_files_and_raw_exports_resume_exactly(hybrid, tmp_path):
    engine, ids = hybrid
    s = _session(engine, ids[:37])
    s.meta = {"title": "hybrid"}
    s.save(tmp_path / "h.kvs")
    s.save(tmp_path / "h.raw", format="raw")
    header = framing.read_header(open(tmp_path / "h.kvs", "rb"), "h.kvs").fields
    recurrent = [i for i, spec in enumerate(engine.config.layers) if spec.recurrent]
    assert [r["index"] for r in header["recurrent"]] == recurrent
    assert [d["index"] for d in header["layers"]] == [i for i, spec in enumerate(engine.config.layers)
                                                      if spec.attention]
    for path in (tmp_path / "h.kvs", tmp_path / "h.raw"):
        loaded = Session.load(path, engine)
        assert loaded.tokens == s.tokens and torch.equal(loaded.logits, s.logits) and loaded.meta == s.meta
        for a, b in zip(s.cache.states, loaded.cache.states):
            if a is not None:
                assert a.end == b.end == 37
                for name, arr in a.read_state().items():
                    assert np.array_equal(arr, b.read_state()[name])
    want = list(generate_tokens(s, 6, ignore_eos=True))
    for path in (tmp_path / "h.kvs", tmp_path / "h.raw"):
        assert list(generate_tokens(Session.load(path, engine), 6, ignore_eos=True)) == want


def test_a_saved_conversation_resumes_in_a_fresh_process(tiny_factory, tmp_path):
    """Turn 1 saved, turn 2 generated in another process from the file: the tokens of the run that never
    stopped, with no forward pass during the load."""
    for name in ("lfm2_f32", "qwen35_f32"):
        path = tiny_factory(TINY_HYBRID_SPECS[name])
        engine = Engine.load(path, device="cpu", precision="f32")
        s = _session(engine, engine.tokenizer.encode(TINY_HYBRID_TEXT)[:29])
        s.save(tmp_path / f"{name}.kvs")
        want = list(generate_tokens(s, 8, ignore_eos=True))
        out = subprocess.run([sys.executable, str(HELPER), str(path), "f32", "8", str(tmp_path / f"{name}.kvs")],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        run = json.loads(out.stdout)["runs"][0]
        assert run == {"tokens": want, "forwards_during_load": 0}, name


def test_a_file_must_carry_the_models_states(hybrid, tmp_path):
    engine, ids = hybrid
    s = _session(engine, ids[:20])
    s.save(tmp_path / "h.kvs")
    raw = (tmp_path / "h.kvs").read_bytes()
    header = framing.read_header(open(tmp_path / "h.kvs", "rb"), "h.kvs")
    first = header.fields["recurrent"][0]
    for change, error in ((lambda r: r.update(kind="conv" if r["kind"] != "conv" else "mamba2"), SessionMismatch),
                          (lambda r: r["arrays"].update(conv=[r["arrays"]["conv"][0] + 1, r["arrays"]["conv"][1]]),
                           (SessionMismatch, CorruptSession))):
        fields = json.loads(json.dumps(header.fields))
        change(fields["recurrent"][0])
        bad = tmp_path / "bad.kvs"
        bad.write_bytes(_reframed(raw, header, fields, tmp_path))
        with pytest.raises(error):
            Session.load(bad, engine)
    fields = json.loads(json.dumps(header.fields))
    fields["recurrent"] = [r for r in fields["recurrent"] if r["index"] != first["index"]]
    bad = tmp_path / "missing.kvs"
    bad.write_bytes(_reframed(raw, header, fields, tmp_path))
    with pytest.raises(CorruptSession):
        Session.load(bad, engine)


def _reframed(raw: bytes, header: framing.Header, fields: dict, tmp: Path) -> bytes:
    """The file's sections under another header (its checksums made again): a forged or damaged file."""
    sections = [(sec.name, [np.frombuffer(raw, np.uint8, sec.length, header.data_start + sec.offset)])
                for sec in header.sections]
    framing.write_file(tmp / "reframed.kvs", fields, sections, durable=False)
    return (tmp / "reframed.kvs").read_bytes()


def test_the_disk_cache_restores_a_turn_exactly(hybrid, tmp_path):
    """A checkpoint at the end of turn 1 restores turn 1's rows and states; turn 2 then continues as the
    uninterrupted session does. A prompt that leaves turn 1 inside it finds no hit: no state is there."""
    engine, ids = hybrid
    turn1, turn2 = ids[:45], ids[45:60]
    s = _session(engine, turn1)
    store = Store(tmp_path / "kv", StoreOptions(chunk_tokens=16, min_tokens=1))
    try:
        assert store.put(s, "continued") is not None
        hit = store.longest_prefix(turn1 + turn2, engine, "f32")
        assert hit is not None and hit.n_tokens == 45
        restored = engine.session(kv_dtype="f32", sampler=GREEDY)
        before = engine.model.n_forward
        assert store.restore(hit, restored)
        assert engine.model.n_forward == before and torch.equal(restored.logits, s.logits)
        restored.prefill(turn2)
        s.prefill(turn2)
        assert torch.equal(restored.logits, s.logits)
        assert store.longest_prefix(turn1[:40] + turn2, engine, "f32") is None
    finally:
        store.close()


@pytest.mark.parametrize("name", ["lfm2_f32", "qwen35_f32"])
def test_a_restarted_server_resumes_the_next_turn_from_disk(name, tiny_factory, tmp_path):
    """Turns reuse the live session; after a restart the next turn's prefix comes from the disk cache (its
    state from the shutdown checkpoint), and its reply is the one the same conversation gets with no restart.
    (Not necessarily a cold server's: a recurrent layer's chunked scan sums in an order its chunks set, and a
    cold prefill cuts the conversation into other chunks than its turns did.)"""
    from server_proc import Server
    from test_server import conversation_reuse

    path = tiny_factory(TINY_HYBRID_SPECS[name])
    s = Server(path, tmp_path, "--precision", "f32", "--kv-disk-dir", tmp_path / "kv", "--kv-disk-min-tokens", 16)
    try:
        shares, messages, total = conversation_reuse(s)
        assert all(x >= 0.95 for x in shares), shares
    finally:
        s.stop()  # SIGTERM: a shutdown checkpoint
    s.start()
    try:
        shares, restarted, _ = conversation_reuse(s, turns=1, messages=list(messages), previous=total)
        assert shares[0] >= 0.95, shares
    finally:
        s.stop()
    (tmp_path / "alone").mkdir()
    alone = Server(path, tmp_path / "alone", "--precision", "f32")
    try:
        _, first, total = conversation_reuse(alone)  # the same turns, then the same next turn, live
        _, uninterrupted, _ = conversation_reuse(alone, turns=1, messages=first, previous=total)
        assert uninterrupted == restarted
    finally:
        alone.stop()


def _checkpointed(folder: Path, n_tokens: int) -> bool:
    """Whether the store in `folder` holds a checkpoint of n_tokens (its manifest renamed into place whole)."""
    for path in (folder / "manifests").glob("*.kvm"):
        with open(path, "rb") as f:
            if framing.read_header(f, str(path)).fields["n_tokens"] == n_tokens:
                return True
    return False


def test_a_retried_turn_and_a_killed_server_restore_from_the_turns_checkpoints(tiny_factory, tmp_path):
    """A hybrid's session cannot be cut back in place, so the server checkpoints each prompt's end and each
    turn's end: a retried turn restores its prompt from disk (nothing recomputed, the same reply), and a server
    killed with SIGKILL -- no shutdown checkpoint -- still finds its last turn on restart."""
    from server_proc import Server
    from test_server import conversation_reuse

    path = tiny_factory(TINY_HYBRID_SPECS["lfm2_f32"])
    kv = tmp_path / "kv"
    s = Server(path, tmp_path, "--precision", "f32", "--kv-disk-dir", kv, "--kv-disk-min-tokens", 16)
    try:
        c = s.openai()
        messages = [{"role": "system", "content": "You answer about the sea."},
                    {"role": "user", "content": "question: the sea is on the string of words"}]
        first = c.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0)
        again = c.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
        assert again.choices[0].message.content == first.choices[0].message.content
        _, messages, total = conversation_reuse(s, turns=2)
        deadline = time.monotonic() + 120  # written by the store's thread: wait for it, with a bound
        while not _checkpointed(kv, total):
            assert time.monotonic() < deadline, "the last turn's checkpoint never landed"
            time.sleep(0.1)
    finally:
        s.proc.kill()
        s.proc.wait()
    s.start()
    try:
        shares, _, _ = conversation_reuse(s, turns=1, messages=messages, previous=total)
        assert shares[0] >= 0.95, shares
    finally:
        s.stop()


def test_a_prompt_sharing_part_of_a_stored_one_restores_from_a_frontier(tiny_factory, tmp_path):
    """A hybrid's prefill is checkpointed whole at its snapshot frontiers, so a second conversation with the same
    system prompt and another question restores the shared part up to the last frontier before they part --
    less than one step recomputed of what they share -- and answers as a server that computed it all does."""
    from server_proc import Server

    path = tiny_factory(TINY_HYBRID_SPECS["lfm2_f32"])
    engine = Engine.load(path, device="cpu", precision="f32")
    flags = ("--precision", "f32", "--kv-disk-min-tokens", 16, "--kv-cache-chunk-tokens", 16)
    step = Store(tmp_path / "probe", StoreOptions(chunk_tokens=16)).snapshot_step(engine, "f16")
    system = {"role": "system", "content": TINY_HYBRID_TEXT}
    shared = common_prefix(*(engine.chat_tokens([system, {"role": "user", "content": q}])
                             for q in ("the first question", "another question, which parts from the first")))

    def ask(server, question):
        r = server.openai().chat.completions.create(
            model="m", messages=[system, {"role": "user", "content": question}], max_tokens=8, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content

    s = Server(path, tmp_path, *flags, "--kv-disk-dir", tmp_path / "kv")
    try:
        ask(s, "the first question")
        deadline = time.monotonic() + 120  # the frontier's checkpoint, written by the store's thread
        while not _checkpointed(tmp_path / "kv", shared // step * step):
            assert time.monotonic() < deadline, "the frontier's checkpoint never landed"
            time.sleep(0.1)
        cached, reply = ask(s, "another question, which parts from the first")
    finally:
        s.stop()
    assert step <= shared and shared - step < cached <= shared and cached % step == 0, (step, shared, cached)
    (tmp_path / "cold").mkdir()
    cold = Server(path, tmp_path / "cold", *flags, "--kv-disk-dir", tmp_path / "cold" / "kv")
    try:
        assert ask(cold, "another question, which parts from the first") == (0, reply)
    finally:
        cold.stop()


def test_the_clis_prefill_checkpoints_a_hybrid_at_its_frontiers(tiny_factory, tmp_path):
    """run and chat prefill a hybrid through its snapshot frontiers and checkpoint it whole at each (what the
    server does): a second prompt sharing part of the first restores up to the last frontier before they part,
    and from there computes what a run that never saw the first prompt computes, to the bit."""
    from kvsession.cli.diskprefix import DiskPrefix
    from kvsession.generate import stream

    engine = Engine.load(tiny_factory(TINY_HYBRID_SPECS["lfm2_f32"]), device="cpu", precision="f32")
    options = StoreOptions(min_tokens=1, chunk_tokens=16)  # the CLI's store, with small chunks
    step = Store(tmp_path / "probe", options).snapshot_step(engine, "f16")
    text = TINY_HYBRID_TEXT * 3
    first = engine.tokenizer.encode(text + " and the first question")
    second = engine.tokenizer.encode(text + " but another question, which parts from the first")
    shared = common_prefix(first, second)
    assert 2 * step < shared < len(first), (step, shared)

    def reply(folder: Path, prompt: list[int]) -> tuple[int, torch.Tensor, str]:
        prefix = DiskPrefix(Store(folder, options))
        s = engine.session(sampler=GREEDY)
        start = prefix.start(s, prompt)
        progress = []  # the caller's own progress still runs: the logits after the prompt, from it

        def at(done: int, total: int) -> None:
            progress.append((done, s.logits.clone()))

        text = "".join(d.text for d in stream(s, start.rest, max_tokens=6, chunk_size=40,
                                              **prefix.prefill_hooks(s, at)))
        assert progress[-1][0] == len(start.rest)
        prefix.store.store.close()
        return start.restored, progress[-1][1], text

    assert reply(tmp_path / "kv", first)[0] == 0
    frontiers = {framing.read_header(open(p, "rb"), str(p)).fields["n_tokens"]
                 for p in (tmp_path / "kv" / "manifests").glob("*.kvm")}
    assert set(range(step, len(first), step)) <= frontiers  # a whole checkpoint at every frontier
    restored, logits, text_ = reply(tmp_path / "kv", second)
    assert restored == shared // step * step
    cold_restored, cold_logits, cold_text = reply(tmp_path / "cold", second)
    assert cold_restored == 0 and torch.equal(logits, cold_logits) and text_ == cold_text


def test_marks_take_a_live_session_back_exactly(hybrid, tiny_engine):
    """A mark keeps the recurrent states and logits at a point of the timeline: truncate, cut_back, state and
    fork come back to it with nothing recomputed, and what follows is what followed the first time. Between
    marks a session goes back to the latest one before; at most MAX_MARKS are kept, in its memory."""
    from kvsession.session import MAX_MARKS

    engine, ids = hybrid
    s = _session(engine, ids[:30])
    bare = s.memory_bytes
    s.mark()
    at30 = s.state()
    reply = list(generate_tokens(s, 6, ignore_eos=True))
    s.mark()
    s.prefill(ids[30:50])
    assert s.memory_bytes > bare and s.holds(30) and s.holds(36) and not s.holds(33) and s.reach(40) == 36
    fork = s.fork(30)
    before = engine.model.n_forward
    assert s.cut_back(33) == 30 and engine.model.n_forward == before  # the latest mark before 33
    for back in (s, fork):
        assert back.tokens == ids[:30] and torch.equal(back.logits, torch.from_numpy(at30.logits))
        for a, b in zip(at30.recurrent, back.state().recurrent):
            assert all(np.array_equal(a.arrays[k], b.arrays[k]) for k in a.arrays)
        assert list(generate_tokens(back, 6, ignore_eos=True)) == reply
    assert list(s.marks) == [30]  # the mark at 36 belonged to the timeline the cut dropped
    for n in range(37, 37 + MAX_MARKS + 2):
        s.prefill([ids[n]])
        s.mark()
    assert len(s.marks) == MAX_MARKS and 30 not in s.marks and s.reach(33) == 0
    plain = tiny_engine.session(sampler=GREEDY)  # no recurrent layer: its rows truncate anywhere, a mark keeps logits
    plain.prefill(list(range(1, 11)))
    at10 = plain.logits.clone()
    plain.mark()
    plain.prefill([11, 12])
    before = tiny_engine.model.n_forward
    plain.truncate(10)
    assert list(plain.marks) == [10] and plain.holds(5) and plain.reach(5) == 5
    assert tiny_engine.model.n_forward == before and torch.equal(plain.logits, at10)


@pytest.mark.parametrize("name", ["lfm2_f32", "granitehybrid_f32", "qwen35_f32"])
def test_speculative_decoding_replays_what_it_keeps_of_a_draft(name, tiny_factory, monkeypatch):
    """Drafts a hybrid refuses, one token or more: the session goes back to the mark made before the verifying
    pass and replays what it keeps, so the tokens are plain decoding's and the state is the one plain decoding
    leaves (within the float order of one pass over several tokens), and no mark is left behind."""
    from kvsession.generate import Stats, generate
    from kvsession.speculative import NgramDraft

    engine = Engine.load(tiny_factory(TINY_HYBRID_SPECS[name]), device="cpu", precision="f32")
    ids = engine.tokenizer.encode(TINY_HYBRID_TEXT)
    plain, spec = engine.session(sampler=GREEDY), engine.session(sampler=GREEDY)
    want = generate(plain, ids[:40], max_tokens=16, ignore_eos=True)
    guesses = list(plain.tokens[40:])  # the draft after position n: guesses[n - 39:], wrong at 46-48
    for j in (6, 7, 8):
        guesses[j] = (guesses[j] + 1) % engine.config.vocab_size
    monkeypatch.setattr(NgramDraft, "propose",
                        lambda self, token, room: guesses[len(self.tokens) - 39:][:min(3, room)])
    stats = Stats()
    assert generate(spec, ids[:40], max_tokens=16, ignore_eos=True, speculative=True, stats=stats) == want
    assert plain.tokens == spec.tokens and stats.draft_tokens > stats.accepted_tokens > 0 and spec.marks == {}
    for a, b in zip(plain.state().recurrent, spec.state().recurrent):
        for k in a.arrays:
            np.testing.assert_allclose(a.arrays[k], b.arrays[k], rtol=1e-4, atol=1e-5)


def test_a_retried_or_edited_turn_comes_back_from_the_live_sessions_marks(tiny_factory, tmp_path):
    """Without a disk cache a hybrid's live session goes back to its marks: a retried turn recomputes nothing
    and answers the same; a turn whose last message was edited restarts from the previous turn's end and answers
    as a server that never saw the first version does."""
    from server_proc import Server

    path = tiny_factory(TINY_HYBRID_SPECS["qwen35_f32"])
    system = {"role": "system", "content": "You answer about the sea."}
    first = [system, {"role": "user", "content": "question: the sea is on the string of words"}]

    def ask(server, messages):
        r = server.openai().chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                                    logit_bias=server.whole_characters)
        return r.usage, r.choices[0].message.content

    s = Server(path, tmp_path, "--precision", "f32", "--no-kv-disk")
    try:
        usage1, reply1 = ask(s, first)
        again, reply = ask(s, first)
        assert again.prompt_tokens_details.cached_tokens == again.prompt_tokens and reply == reply1
        turn = first + [{"role": "assistant", "content": reply1}]
        ask(s, turn + [{"role": "user", "content": "and the words of the sea?"}])
        edited, reply2 = ask(s, turn + [{"role": "user", "content": "what of the string?"}])
        assert edited.prompt_tokens_details.cached_tokens == usage1.prompt_tokens + usage1.completion_tokens
    finally:
        s.stop()
    (tmp_path / "alone").mkdir()
    alone = Server(path, tmp_path / "alone", "--precision", "f32", "--no-kv-disk")
    try:
        ask(alone, first)
        assert ask(alone, turn + [{"role": "user", "content": "what of the string?"}])[1] == reply2
    finally:
        alone.stop()
