"""Several live sessions in the server: interleaved conversations each keep theirs, under a memory budget.

Issue 14: an agent and its sub-agents, or two users, interleave their turns;
with one live session every switch was a checkpoint and a disk restore.
"""
from __future__ import annotations

import json

import httpx
import pytest
from server_proc import Server

GREEDY = {"temperature": 0}


def turn(server, messages, key=None, **kw):
    headers = {"x-session-id": key} if key else {}
    r = httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=60,
                   json={"messages": messages, "max_tokens": 6, "logit_bias": server.whole_characters, **GREEDY, **kw})
    r.raise_for_status()
    body = r.json()
    messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return body["usage"]


def trace(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture()
def server(tiny_path, tmp_path):
    s = Server(tiny_path, tmp_path, "--precision", "f32", "--kv-disk-dir", tmp_path / "kv",
               "--kv-disk-min-tokens", 16, "--trace", tmp_path / "trace.jsonl")
    s.tmp = tmp_path
    yield s
    s.stop()


def test_interleaved_conversations_each_reuse_their_own_session(server):
    a = [{"role": "system", "content": "You answer about the sea."}]
    b = [{"role": "system", "content": "You answer about mountains."}]
    previous = {}
    for i in range(3):
        for name, conv in (("a", a), ("b", b)):
            conv.append({"role": "user", "content": f"question {i} for {name}"})
            usage = turn(server, conv)
            if name in previous:
                assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.95 * previous[name], (name, i)
            previous[name] = usage["prompt_tokens"] + usage["completion_tokens"]
    sources = [line["source"] for line in trace(server.tmp / "trace.jsonl")]
    assert sources[0] == "cold" and set(sources[1:]) == {"live"}  # nothing came back from disk
    assert server.health()["live_sessions"] == 2


def test_a_shared_prefix_is_forked_not_taken(server):
    """B shares A's system prompt: B starts from a copy of it, and A keeps every token of its own."""
    system = {"role": "system", "content": "A long shared system prompt about the sea and its moods."}
    a = [system, {"role": "user", "content": "first"}]
    a_usage = turn(server, a)
    b = [system, {"role": "user", "content": "second"}]
    b_usage = turn(server, b)
    assert b_usage["prompt_tokens_details"]["cached_tokens"] > 10  # the system prompt, forked from A
    a.append({"role": "user", "content": "again"})
    a_again = turn(server, a)
    assert a_again["prompt_tokens_details"]["cached_tokens"] == a_usage["prompt_tokens"] + a_usage["completion_tokens"]


def test_session_keys_route_to_their_own_sessions(server):
    same = [{"role": "user", "content": "the same opening"}]
    first_a = turn(server, list(same), key="agent-a")
    first_b = turn(server, list(same), key="agent-b")
    # its own session, forked from a's at the prompt's end: all of it, the logits there included (a mark)
    assert first_b["prompt_tokens_details"]["cached_tokens"] == first_b["prompt_tokens"]
    assert server.health()["live_sessions"] == 2
    assert first_a["prompt_tokens"] == first_b["prompt_tokens"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": same, "user": "x" * 300})
    assert r.status_code == 400


def test_one_key_for_an_agent_and_its_sub_agent_keeps_both_live(server):
    """Claude Code sends one user_id for its main conversation and a sub-agent's, which shares little with it:
    the sub-agent forks (or starts) a session of its own, and the main conversation keeps all of its tokens."""
    main = [{"role": "system", "content": "You are the main agent of a coding tool."},
            {"role": "user", "content": "fix the bug"}]
    first = turn(server, main, key="claude-1")
    sub = [{"role": "system", "content": "You are a sub-agent that searches files."},
           {"role": "user", "content": "find the bug"}]
    turn(server, sub, key="claude-1")
    main.append({"role": "user", "content": "and now?"})
    again = turn(server, main, key="claude-1")
    assert again["prompt_tokens_details"]["cached_tokens"] == first["prompt_tokens"] + first["completion_tokens"]
    assert trace(server.tmp / "trace.jsonl")[-1]["source"] == "live" and server.health()["live_sessions"] == 2


def test_going_back_keeps_the_sampled_ids_as_far_as_the_text_agrees(server, tiny_engine):
    """The keyed conversation went back (an interrupted turn): its session is cut back where the rendered text
    parts, not where the ids do. The session holds " the" byte by byte, as a model may sample it; the prompt's
    tokenization merges it."""
    tk = tiny_engine.tokenizer
    said = "<|im_start|>user\nsay the words the model said<|im_end|>\n<|im_start|>assistant\nthe sea the sky"
    ids = tk.encode(said, add_bos=False)
    cut = said.index("say") + 4  # " the" of the user message onwards goes byte by byte
    sampled = tk.encode(said[:cut], add_bos=False) + [b for ch in said[cut:].encode() for b in [ch]]
    assert tk.decode(sampled) == said and sampled != ids
    r = httpx.post(server.url + "/v1/completions", headers={"x-session-id": "k"},
                   json={"prompt": sampled, "max_tokens": 1, **GREEDY})
    assert r.status_code == 200
    edited = said[: -len("sky")] + "land"  # the last words went back
    r = httpx.post(server.url + "/v1/completions", headers={"x-session-id": "k"},
                   json={"prompt": edited, "max_tokens": 1, **GREEDY})
    expected, _ = tk.agreeing_prefix(sampled, edited)
    assert expected > len(tk.encode(said[:cut], add_bos=False)) + 10  # well past where the ids part
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == expected


def test_over_the_budget_the_least_recent_leaves_through_the_disk(tiny_path, tmp_path):
    s = Server(tiny_path, tmp_path, "--precision", "f32", "--kv-disk-dir", tmp_path / "kv", "--kv-disk-min-tokens",
               16, "--live-kv-mb", 1, "--trace", tmp_path / "trace.jsonl")
    try:
        convs = [[{"role": "system", "content": f"Conversation number {i} is about topic {i} only."},
                  {"role": "user", "content": f"start {i}"}] for i in range(12)]
        totals = []
        for c in convs:
            u = turn(s, c)
            totals.append(u["prompt_tokens"] + u["completion_tokens"])
        h = s.health()
        assert h["live_kv_mb"] <= 1.0 and h["live_sessions"] < 12
        convs[0].append({"role": "user", "content": "back to the first"})
        u = turn(s, convs[0])
        assert u["prompt_tokens_details"]["cached_tokens"] >= 0.95 * totals[0]
        assert trace(tmp_path / "trace.jsonl")[-1]["source"] == "disk"  # evicted, checkpointed, restored
    finally:
        s.stop()


def test_a_returning_conversation_keeps_its_checkpoint(tiny_factory, tmp_path):
    """Issue 14's evict bug (ds4 #448): room for one conversation in memory and one on disk. A, then an
    unrelated B, then A again: B's checkpoint, written as B leaves memory, must not evict A's from the disk
    while A is coming back from it."""
    from tiny import TinySpec

    model = tiny_factory(TinySpec(context=4096, n_layers=8, d_model=256, n_heads=8, n_kv_heads=8, d_ff=512))
    # 8 KB a token: A (~520 tokens) or B (~310) fits the 6 MB budget, not both; B's cold save (its 256 whole
    # tokens) is under the 280-token minimum, so B reaches the disk only as it leaves memory, when A returns
    s = Server(model, tmp_path, "--precision", "f32", "--kv-disk-dir", tmp_path / "kv", "--kv-disk-min-tokens", 280,
               "--kv-disk-space-mb", 6, "--live-kv-mb", 1, "--trace", tmp_path / "trace.jsonl")
    try:
        a = [{"role": "system", "content": "the sea is wide and the wind is cold " * 20},
             {"role": "user", "content": "first"}]
        first = turn(s, a)
        b = [{"role": "system", "content": "MOUNTAINS ARE HIGH " * 15}, {"role": "user", "content": "unrelated"}]
        turn(s, b)
        a.append({"role": "user", "content": "and again"})
        again = turn(s, a)
        total = first["prompt_tokens"] + first["completion_tokens"]
        assert again["prompt_tokens_details"]["cached_tokens"] >= 0.95 * total, (again, total)
        assert trace(tmp_path / "trace.jsonl")[-1]["source"] == "disk"
    finally:
        s.stop()


def test_the_spare_session_is_made_ahead_within_the_budget(tiny_engine):
    """The next conversation's session is made between requests with its memory touched; it counts in the
    budget, never pushes it over, and is the first to go when the live sessions need the room."""
    from kvsession.server.sessions import LiveSessions, session_bytes

    def new():
        return tiny_engine.session(kv_dtype="f16", max_tokens=512)

    one = new()
    one.prefault(256)
    spare_bytes = session_bytes(one)
    live = LiveSessions(3 * spare_bytes, new, spare_tokens=256)
    live.refill()
    spare = live.spare
    assert spare is not None and len(spare) == 0 and spare.cache[0].capacity >= 256
    assert live.take_new() is spare and live.spare is None
    a = live.add(spare)
    a.session.prefill(list(range(1, 40)))
    live.refill()
    assert live.spare is not None and live.nbytes() <= live.budget_bytes
    b = live.add(live.take_new())
    live.refill()  # a and b hold two thirds of the budget: the third spare fits
    assert live.spare is not None
    c = live.add(new())
    c.session.prefault(256)  # over the budget now: the spare goes first, and no live session
    assert live.over_budget(c) == [] and live.spare is None and len(live) == 3
    live.refill()  # no room: no spare
    assert live.spare is None and len(b.session) == 0


def test_no_spare_when_the_budget_is_too_small(tiny_engine):
    from kvsession.server.sessions import LiveSessions

    live = LiveSessions(1, lambda: tiny_engine.session(kv_dtype="f16", max_tokens=512), spare_tokens=256)
    live.refill()
    assert live.spare is None and live.take_new() is not None


def test_a_reply_cut_inside_a_character_is_not_matched_past_it(server, tmp_path):
    """A reply whose tokens end inside UTF-8 characters is shown as U+FFFD, and comes back in the history as
    that character, which is other bytes and other tokens: the session is reused no further than the text
    before it, and the next reply is the one a server without the session gives."""
    lone = int(next(iter(server.whole_characters)))  # a byte of a character: never a whole one alone
    first = [{"role": "user", "content": "say something"}]
    usage = turn(server, first, logit_bias={str(lone): 100})
    assert "\ufffd" in first[-1]["content"]
    first.append({"role": "user", "content": "and then?"})
    reused, fresh = list(first), list(first)
    again = turn(server, reused)
    assert again["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
    (tmp_path / "alone").mkdir()
    alone = Server(server.model, tmp_path / "alone", "--precision", "f32")
    try:
        assert turn(alone, fresh)["prompt_tokens"] == again["prompt_tokens"] and fresh[-1] == reused[-1]
    finally:
        alone.stop()
