"""kvsession serve, driven by the real OpenAI and Anthropic SDKs and by raw HTTP."""
from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import openai
import pytest
from server_proc import Server

from kvsession.testing import wait_until


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    s = Server(tiny_path, tmp, "--precision", "f32", "--kv-disk-dir", tmp / "kv", "--kv-disk-min-tokens", 16,
               "--keepalive", 0.5, "--trace", tmp / "trace.jsonl")
    s.trace = tmp / "trace.jsonl"
    yield s
    s.stop()


GREEDY = {"temperature": 0}


def test_models_and_health(server, tiny_path):
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [tiny_path.stem]
    assert server.health()["status"] == "ok"


def test_openai_chat(server):
    c = server.openai()
    r = c.chat.completions.create(model="tiny0", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
                                  **GREEDY)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    assert r.choices[0].finish_reason in ("stop", "length")
    chunks = list(c.chat.completions.create(model="tiny0", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=8, stream=True, stream_options={"include_usage": True},
                                            **GREEDY))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content  # greedy: the same answer, streamed
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason


def test_openai_completions(server):
    c = server.openai()
    r = c.completions.create(model="tiny0", prompt="the sea", max_tokens=6, **GREEDY)
    assert r.object == "text_completion" and r.usage.completion_tokens <= 6
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny0", prompt="the sea", max_tokens=6, stream=True, **GREEDY) if ch.choices)
    assert streamed == r.choices[0].text


def test_stop_sequences(server):
    c = server.openai()
    full = c.completions.create(model="tiny0", prompt="the sea", max_tokens=20, **GREEDY).choices[0].text
    stop = full[5:7]
    cut = c.completions.create(model="tiny0", prompt="the sea", max_tokens=20, stop=[stop], **GREEDY)
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_anthropic_messages(server):
    a = server.anthropic()
    m = a.messages.create(model="tiny0", max_tokens=8, system="be brief",
                          messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
                          extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text"
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens <= 8
    with a.messages.stream(model="tiny0", max_tokens=8, system="be brief",
                           messages=[{"role": "user", "content": "hello"}], extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text and final.stop_reason == m.stop_reason
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: read from the live session


def test_anthropic_event_sequence(server):
    body = {"model": "x", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0}
    names, start = [], None
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line[7:])
            elif line.startswith("data: ") and start is None:
                start = json.loads(line[6:])
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    usage = start["message"]["usage"]  # known before the first token: the prompt is counted at message_start
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] > 5
    assert set(names[3:-3]) <= {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def conversation_reuse(server, turns=3, messages=None, previous=None):
    """Each turn resends the whole conversation, our replies included; returns cached/previous totals."""
    c = server.openai()
    messages = messages or [{"role": "system", "content": "You answer about the sea."}]
    shares = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i}: the sea is on the string of words"})
        r = c.chat.completions.create(model="m", messages=messages, max_tokens=10, logit_bias=server.whole_characters,
                                      **GREEDY)
        if previous is not None:
            shares.append(r.usage.prompt_tokens_details.cached_tokens / previous)
            print(f"turn {i}: {r.usage.prompt_tokens_details.cached_tokens} cached of {previous} "
                  f"(prompt {r.usage.prompt_tokens})")
        previous = r.usage.prompt_tokens + r.usage.completion_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    return shares, messages, previous


def test_multi_turn_reuse_live_and_after_a_restart(tiny_path, tmp_path):
    s = Server(tiny_path, tmp_path, "--precision", "f32", "--kv-disk-dir", tmp_path / "kv",
               "--kv-disk-min-tokens", 16)
    try:
        shares, messages, total = conversation_reuse(s)
        assert all(x >= 0.95 for x in shares), shares
        other = s.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": "unrelated"}],
                                                   max_tokens=4, **GREEDY)
        assert other.usage.prompt_tokens_details.cached_tokens < 10  # the live session was replaced (evicted)
    finally:
        s.stop()  # SIGTERM: a shutdown checkpoint
    s.start()
    try:  # the next turn of the first conversation comes back from disk
        shares, _, _ = conversation_reuse(s, turns=1, messages=messages, previous=total)
        assert shares[0] >= 0.95, shares
    finally:
        s.stop()


def test_named_sessions(server):
    c = server.openai()
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "remember the sea"}], max_tokens=5,
                              **GREEDY)
    saved = httpx.post(server.url + "/v1/sessions/notes/save").json()
    assert saved["tokens"] > 0 and saved["bytes"] > 0 and "ms" in saved
    listed = httpx.get(server.url + "/v1/sessions").json()["data"]
    assert {"notes"} <= {d["name"] for d in listed}
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "something else"}], max_tokens=3,
                              **GREEDY)
    restored = httpx.post(server.url + "/v1/sessions/notes/restore").json()
    assert restored["tokens"] == saved["tokens"] and server.health()["live_tokens"] == saved["tokens"]
    assert httpx.delete(server.url + "/v1/sessions/notes").json()["deleted"] is True
    assert httpx.post(server.url + "/v1/sessions/notes/restore").status_code == 404
    for bad in (".hidden", "a%20b", "x" * 80, "..%2F..%2Fetc"):
        r = httpx.post(server.url + f"/v1/sessions/{bad}/save")
        assert r.status_code in (400, 404), (bad, r.text)
        assert "error" in r.json()


@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/chat/completions", b"{not json", 400, "malformed JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", b'{"model": "m"}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, "role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400,
     "temperature"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400,
     "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 17}', 400, "n"),
    ("/v1/completions", b'{"prompt": 42}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": ""}', 400, "empty"),
])
def test_bad_input_openai(server, path, body, status, words):
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"


def test_bad_input_anthropic_style(server):
    r = httpx.post(server.url + "/v1/messages", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400
    assert r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/messages", content=b"{{{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/messages", content=b"{{{")  # a body must say it is JSON
    assert r.status_code == 415 and r.json()["type"] == "error"


def test_prompt_longer_than_the_context(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "the sea " * 600, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_body_over_the_limit_is_413(server):
    r = httpx.post(server.url + "/v1/completions", content=b"x" * (17 << 20),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_unknown_route(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_the_worker_survives_bad_input(server):
    r = server.openai().completions.create(model="m", prompt="still fine", max_tokens=3, **GREEDY)
    assert r.usage.completion_tokens >= 1


def test_api_key(tiny_path, tmp_path):
    s = Server(tiny_path, tmp_path, "--precision", "f32", "--api-key", "sekrit")
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(s.url + "/v1/messages", json={}, headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["type"] == "error"
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit").completions.create(
            model="m", prompt="x", max_tokens=1)
        assert ok.usage.completion_tokens == 1
        ok = anthropic.Anthropic(base_url=s.url, api_key="sekrit").messages.create(
            model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}])
        assert ok.usage.output_tokens == 1
    finally:
        s.stop()


def test_disconnect_stops_generation_and_frees_the_worker(server):
    body = {"prompt": "hello", "max_tokens": 480, "stream": True, "temperature": 0, "ignore_eos": True}
    traced = len(server.trace.read_text().splitlines()) if server.trace.exists() else 0
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break
    r = server.openai().completions.create(model="m", prompt="next", max_tokens=2, **GREEDY)
    assert r.usage.completion_tokens >= 1
    # the request's own line: cancelled, not run to its 480 tokens (how many it made before the server saw the
    # client go depends on the machine's speed, so no tighter bound: the tiny model makes 60 in a blink)
    def mine() -> list[dict]:  # the lines since the stream began, but "next"'s
        lines = [json.loads(x) for x in server.trace.read_text().splitlines()[traced:]]
        return [x for x in lines if not (x["completion_tokens"] == 2 and x["finish_reason"] == "length")]

    # its line comes when the worker next looks, which may be after "next" is answered
    wait_until(mine, 30, "the stream's request wrote no trace line")
    lines = mine()
    assert [x["finish_reason"] for x in lines] == ["cancelled"] and lines[0]["completion_tokens"] < 480, lines


def test_sixteen_concurrent_streaming_clients(server):
    results, errors = [None] * 16, []

    def client(i):
        try:
            c = server.openai(timeout=300)
            text, done = "", False
            for ch in c.chat.completions.create(model="m", max_tokens=12, stream=True, temperature=0,
                                                messages=[{"role": "user", "content": f"client {i}"}]):
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    done = done or ch.choices[0].finish_reason is not None
            results[i] = (text, done)
        except Exception as e:  # collected, then asserted
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == []
    assert all(r is not None and r[1] for r in results)


def test_keepalive_comments_while_prefilling(smollm2_path, tmp_path):
    s = Server(smollm2_path, tmp_path, "--keepalive", 0.5)
    try:
        from kvsession.bench.corpus import CORPUS

        text = CORPUS.read_text()[:18000]  # ~4,000 tokens: seconds of prefill on a quiet machine too
        comments, first_data = 0, None
        t0 = time.time()
        with httpx.stream("POST", s.url + "/v1/completions", timeout=120,
                          json={"prompt": text, "max_tokens": 2, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith(":") and first_data is None:
                    comments += 1
                if line.startswith("data: ") and first_data is None:
                    first_data = time.time() - t0
        # a comment every 0.5 s of silence; how long the prefill takes is the machine's business
        assert comments >= (2 if first_data > 1.5 else 1), (first_data, comments)
    finally:
        s.stop()
