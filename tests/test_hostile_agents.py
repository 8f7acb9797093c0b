"""The server's agent surfaces against a hostile or careless client: grammars, nesting, stored responses, costs.

Each answer to what the client sent is a 4xx in the API's own shape naming
the field, given before the work it would cost; a failure that can only
show while generating ends the stream with an error event; nothing here
may make a 500 or cost a client its keep-alive connection.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_proc import Server
from test_hostile_http import preparing_seen_while
from tiny import TinySpec

from kvsession.testing import wait_until

GREEDY = {"temperature": 0}
CTX = 1024  # room for a tool's schema in the prompt (the tiny model's tokens are about a character each)
# a schema llguidance compiles and cannot follow: either branch, once chosen, is an endless required recursion
# ("Too many items" at the fourth token); its first tokens are forced, so only generating finds it
DEFS = {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]},
        "b": {"type": "object", "properties": {"y": {"$ref": "#/$defs/b"}}, "required": ["y"]}}
EITHER = {"$defs": DEFS, "anyOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}]}
# the same recursion with nothing to choose: forced from the first token, so found before the response starts
RECURSION = {"$defs": {"a": DEFS["a"]}, "$ref": "#/$defs/a"}


def ref_chain(n: int) -> dict:
    """n definitions, each an object two levels deep whose inner value refers to the next: llguidance follows the
    chain by native recursion, and 600 links (90 kB, under every size limit) overflowed an 8 MB thread stack."""
    def link(i: int) -> dict:
        inner = {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "integer"}]}
        return {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": inner}}}}
    return {"$defs": {**{f"d{i}": link(i) for i in range(n)}, f"d{n}": {"type": "null"}}, "$ref": "#/$defs/d0"}


def rule_chain(n: int) -> str:
    """A GBNF grammar of n rules each nesting the next: its compile time grows with the square of n."""
    return "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1} | "b"\n' for i in range(n)) + f'r{n} ::= "c"\n'


def properties(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


def nested(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


@pytest.fixture(scope="module")
def server(tiny_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agents")
    s = Server(tiny_factory(TinySpec(context=4096)), tmp, "--precision", "f32", "--ctx", CTX,
               "--kv-disk-dir", tmp / "kv")
    s.tmp = tmp
    yield s
    s.stop()


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def chat_body(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "x"}], "max_tokens": 20, **GREEDY, **kw}


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def messages_body(**kw) -> dict:
    return {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "x"}], **GREEDY, **kw}


def error_of(r: httpx.Response) -> str:
    """The message of an error in either API's shape."""
    return r.json()["error"]["message"]


# --- one connection, several requests -------------------------------------------------------------------


def on_one_connection(server, requests: list[tuple[str, str, dict | None]]) -> list[tuple[int, bytes] | None]:
    """Send each (method, path, body) in turn on one TCP connection; (status, body) of each answer, None for one
    that never came because the server closed the connection."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    f = sock.makefile("rb")
    out: list[tuple[int, bytes] | None] = []
    try:
        for method, path, body in requests:
            raw = json.dumps(body).encode() if body is not None else b""
            sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
            line = f.readline()
            if not line:
                out.append(None)
                break
            headers = {}
            while (h := f.readline()) not in (b"\r\n", b""):
                k, v = h.decode().split(":", 1)
                headers[k.strip().lower()] = v.strip()
            if headers.get("transfer-encoding") == "chunked":
                data = b""
                while (size := int(f.readline().split(b";")[0], 16)) > 0:
                    data += f.read(size)
                    f.readline()
                f.readline()
            else:
                data = f.read(int(headers.get("content-length", 0)))
            out.append((int(line.split()[1]), data))
    finally:
        sock.close()
    return out


# --- 1. grammars that cannot be followed ----------------------------------------------------------------


@pytest.mark.parametrize("schema, words", [
    (RECURSION, "Too many items"),
    (properties(1000), "1000 properties"),
    (nested(100), "nested 100 levels"),
    ({"type": "object", "description": "x" * (200 << 10)}, "bytes"),
], ids=["required-recursion", "1000-properties", "100-deep", "200-kb"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_over_the_limits_is_a_400_before_the_response(server, schema, words, stream):
    for path, body, field in (
            ("/v1/chat/completions", chat_body(response_format=json_format(schema), stream=stream), "response_format"),
            ("/v1/messages", messages_body(tools=[{"name": "f", "input_schema": schema}], stream=stream), "tools"),
            ("/v1/responses", {"input": "x", "max_output_tokens": 8, "stream": stream,
                               "tools": [{"type": "function", "name": "f", "parameters": schema}]}, "tools")):
        r = post(server, path, body)
        assert r.status_code == 400, (path, r.text[:300])
        assert words in error_of(r) and field in error_of(r), (path, r.text[:300])
        assert len(r.text) < 1000


def test_a_deep_reference_chain_is_compiled_not_a_crash(server):
    """Under the size limits, a chain of 600 references killed the process (SIGSEGV) when compiled on an ordinary
    thread; compiled on the deep stack it is served, and a chain past MAX_REFS is refused by name."""
    r = post(server, "/v1/chat/completions", chat_body(response_format=json_format(ref_chain(600)), max_tokens=4))
    assert r.status_code == 200, r.text[:300]
    links = {"$defs": {**{f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(1001)}, "d1001": {"type": "null"}},
             "$ref": "#/$defs/d0"}
    r = post(server, "/v1/messages", messages_body(tools=[{"name": "f", "input_schema": links}]))
    assert r.status_code == 400 and "$ref" in error_of(r) and "tools" in error_of(r), r.text[:300]
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200  # alive


def test_a_grammar_over_its_size_is_refused_and_one_under_it_compiles(server):
    big = rule_chain(1400)  # 34 kB, ~1.5 s to compile
    assert len(big) > 32 << 10
    r = post(server, "/v1/chat/completions", chat_body(grammar=big))
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar" and "at most" in error_of(r), r.text[:300]
    r = post(server, "/v1/chat/completions", chat_body(grammar=rule_chain(200), max_tokens=4))
    assert r.status_code == 200, r.text[:300]


def test_a_grammar_past_the_compile_deadline_is_a_400_and_frees_its_slot(tiny_path, tmp_path):
    s = Server(tiny_path, tmp_path, "--precision", "f32", "--grammar-timeout", "0.1")
    try:
        slow = rule_chain(1200)  # ~1 s to compile here, under the size limit
        assert len(slow) < 32 << 10
        r = post(s, "/v1/chat/completions", chat_body(grammar=slow))
        # this 400 is only raised while the compile still runs: answered at its deadline, not when it ends
        assert r.status_code == 400 and "--grammar-timeout" in error_of(r), r.text[:300]
        # the abandoned compiles keep their slots until they end; then every slot is free again
        for _ in range(6):
            assert post(s, "/v1/chat/completions", chat_body(grammar=slow)).status_code in (400, 429)
        # (while abandoned compiles still run, even a small grammar can miss a 0.1 s deadline on a busy machine)
        deadline = time.monotonic() + 60
        while ((r := post(s, "/v1/chat/completions", chat_body(grammar='root ::= "yes" | "no"'))).status_code == 429
               or (r.status_code == 400 and "--grammar-timeout" in error_of(r))) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no"), r.text
    finally:
        s.stop()


def test_400_properties_are_served(server):
    r = post(server, "/v1/chat/completions", chat_body(response_format=json_format(properties(400))))
    assert r.status_code == 200, r.text[:300]


def test_a_grammar_that_fails_while_generating_is_a_400_and_an_error_event(server):
    oa = chat_body(response_format=json_format(EITHER))
    r = post(server, "/v1/chat/completions", oa)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert "could not go on after 4 tokens" in error_of(r) and len(r.text) < 1000

    r = post(server, "/v1/chat/completions", {**oa, "stream": True})
    assert r.status_code == 200
    last = [line for line in r.text.splitlines() if line.startswith("data: ")][-1]
    assert "could not go on" in json.loads(last[6:])["error"]["message"]

    an = messages_body(tools=[{"name": "f", "input_schema": EITHER}], tool_choice={"type": "any"}, max_tokens=80)
    r = post(server, "/v1/messages", an)
    assert r.status_code == 400 and r.json()["type"] == "error" and "tools" in error_of(r), r.text
    r = post(server, "/v1/messages", {**an, "stream": True})
    assert r.status_code == 200 and "event: error" in r.text and "could not go on" in r.text

    log = open(server.log.name).read()
    assert "Traceback" not in log and "<grammar>" not in log
    line = next(x for x in log.splitlines() if "could not go on" in x)
    assert len(line) < 400


def test_a_failed_grammar_keeps_the_connection(server):
    oa = chat_body(response_format=json_format(EITHER))
    answers = on_one_connection(server, [("POST", "/v1/chat/completions", oa),
                                         ("POST", "/v1/chat/completions", {**oa, "stream": True}),
                                         ("POST", "/v1/chat/completions", chat_body(response_format=json_format(
                                             RECURSION))),
                                         ("GET", "/v1/models", None)])
    assert [a and a[0] for a in answers] == [400, 200, 400, 200]
    assert b"could not go on" in answers[1][1]


# --- 2. deep nesting ----------------------------------------------------------------------------------------


def test_tool_calls_nested_past_the_limit_are_refused(server):
    deep = nested(500)
    oa = {"messages": [{"role": "user", "content": "x"},
                       {"role": "assistant", "content": None, "tool_calls": [
                           {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps(deep)}}]},
                       {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "max_tokens": 2}
    an = messages_body(messages=[{"role": "user", "content": "x"},
                                 {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                                    "input": deep}]},
                                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                               "content": "ok"}]}])
    rs = {"input": [{"type": "message", "role": "user", "content": "x"},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": json.dumps(deep)},
                    {"type": "function_call_output", "call_id": "c1", "output": "ok"}], "max_output_tokens": 2}
    count = {k: v for k, v in an.items() if k in ("model", "messages")}
    answers = on_one_connection(server, [("POST", "/v1/chat/completions", oa), ("POST", "/v1/messages", an),
                                         ("POST", "/v1/messages/count_tokens", count), ("POST", "/v1/responses", rs),
                                         ("GET", "/v1/models", None)])
    assert [a and a[0] for a in answers] == [400, 400, 400, 400, 200], answers
    for status, body in answers[:4]:
        assert b"nested 500 levels deep; at most 64" in body and b"messages" in body, body
    r = post(server, "/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                   "tools": [{"name": "f", "input_schema": nested(500)}]})
    assert r.status_code == 400 and "tools: the parameters of 'f': nested 500 levels" in error_of(r), r.text
    ok = dict(an, messages=[an["messages"][0], {**an["messages"][1], "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": nested(64)}]}, an["messages"][2]])
    assert post(server, "/v1/messages/count_tokens", {"model": "m", "messages": ok["messages"]}).status_code == 200


# --- 3. restore against DELETE of the same name ---------------------------------------------------------


def test_restore_and_delete_of_one_name_never_both(server):
    assert post(server, "/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "hi " * 40}],
                                                          max_tokens=2)).status_code == 200
    seen = Counter()
    for _ in range(40):
        assert httpx.post(server.url + "/v1/sessions/race/save").status_code == 200
        out = {}
        threads = [threading.Thread(target=lambda: out.update(r=httpx.post(server.url + "/v1/sessions/race/restore"))),
                   threading.Thread(target=lambda: out.update(d=httpx.delete(server.url + "/v1/sessions/race")))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seen[out["r"].status_code, out["d"].status_code] += 1
        if out["r"].status_code == 200:
            assert out["r"].json()["bytes"] == out["d"].json()["bytes"]  # restored the file that was then deleted
    assert set(seen) <= {(200, 200), (404, 200)}, seen


# --- 5. costs bounded before they are paid --------------------------------------------------------------


def test_text_past_the_context_is_refused_before_tokenizing(server):
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 600} for i in range(249)]
    for path, body in (("/v1/chat/completions", {"messages": many, "max_tokens": 1}),
                       ("/v1/messages", messages_body(messages=many)),
                       ("/v1/messages/count_tokens", {"model": "m", "messages": many})):
        r = post(server, path, body)
        assert r.status_code == 400 and "characters" in error_of(r) and "messages" in error_of(r), r.text
    r = post(server, "/v1/chat/completions", chat_body(tools=[
        {"type": "function", "function": {"name": f"f{i}", "description": "d" * 100}} for i in range(100)]))
    assert r.status_code == 400 and error_of(r).startswith("tools:") and "characters" in error_of(r), r.text


@pytest.mark.slow
def test_15_mb_over_250_messages_is_refused_at_once(smollm2_path, tmp_path):
    s = Server(smollm2_path, tmp_path)
    try:
        many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 12_000} for i in range(250)]
        for path, body in (("/v1/chat/completions", {"messages": many, "max_tokens": 1}),
                           ("/v1/messages/count_tokens", {"model": "m", "messages": many})):
            r = post(s, path, body)
            # the count of characters is the check made before anything is tokenized (it took 23-42 s)
            assert r.status_code == 400 and "15,000,000 characters" in error_of(r), r.text
    finally:
        s.stop()


def test_max_tokens_past_the_context_is_served(server):
    r = post(server, "/v1/chat/completions", chat_body(max_tokens=10**12, n=2, ignore_eos=True))
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 2 * (CTX - usage["prompt_tokens"] - 1)


def test_a_million_logit_bias_keys_are_refused_without_blocking_health(server):
    body = {"prompt": "x", "max_tokens": 1, "logit_bias": {str(i): 1 for i in range(1_000_000)}}  # 14 MB
    idle, seen = server.memory_mb(), []
    for _ in range(4):
        answered, r = preparing_seen_while(server, body)
        assert r["status"] == 400 and "logit_bias" in r["error"]["message"], r
        assert answered >= 1  # /health answered while the 14 MB were parsed and the keys checked
        seen.append(server.memory_mb())
    # within 400 MB of idle, and the rounds after the first (which pays for what is made once) do not add up
    assert max(seen) - idle < 400 and max(seen[1:]) - min(seen[1:]) < 100, (idle, seen)


def test_request_budget_body_limit(tiny_path, tmp_path):
    s = Server(tiny_path, tmp_path, "--precision", "f32", "--max-request-tokens", 1000, "--max-body-mb", 1)
    try:
        r = post(s, "/v1/completions", {"prompt": "x", "n": 4, "max_tokens": 300})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "1,200 tokens" in error_of(r), r.text
        assert post(s, "/v1/completions", {"prompt": "x", "n": 3, "max_tokens": 300}).status_code == 200
        r = httpx.post(s.url + "/v1/completions", content=json.dumps({"prompt": "x" * (1 << 20)}),
                       headers={"content-type": "application/json"})
        assert r.status_code == 413
    finally:
        s.stop()


# --- 6. stored responses ----------------------------------------------------------------------------------


def test_a_stored_response_can_be_read_and_deleted(server):
    rid = post(server, "/v1/responses", {"input": "hello", "max_output_tokens": 2, **GREEDY}).json()["id"]
    assert httpx.get(server.url + f"/v1/responses/{rid}").json()["id"] == rid
    r = httpx.delete(server.url + f"/v1/responses/{rid}")
    assert r.status_code == 200 and r.json() == {"id": rid, "object": "response", "deleted": True}
    assert not (server.tmp / "kv" / "responses" / f"{rid}.json").exists()
    for method in ("GET", "DELETE"):
        r = httpx.request(method, server.url + f"/v1/responses/{rid}")
        assert r.status_code == 404 and rid in error_of(r)
    r = post(server, "/v1/responses", {"input": "again", "previous_response_id": rid})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_stored_responses_belong_to_their_key_and_keep_to_their_budget(tiny_path, tmp_path):
    s = Server(tiny_path, tmp_path, "--precision", "f32", "--api-key", "alice", "--api-key", "bob",
               "--kv-disk-dir", tmp_path / "kv", "--responses-space-mb", 1)
    alice, bob = ({"authorization": f"Bearer {k}"} for k in ("alice", "bob"))
    try:
        rid = post(s, "/v1/responses", {"input": "mine", "max_output_tokens": 2}, headers=alice).json()["id"]
        assert httpx.get(s.url + f"/v1/responses/{rid}", headers=alice).status_code == 200
        assert httpx.get(s.url + f"/v1/responses/{rid}", headers=bob).status_code == 404
        assert httpx.delete(s.url + f"/v1/responses/{rid}", headers=bob).status_code == 404
        r = post(s, "/v1/responses", {"input": "next", "max_output_tokens": 2, "previous_response_id": rid},
                 headers=bob)
        assert r.status_code == 404
        assert post(s, "/v1/responses", {"input": "next", "max_output_tokens": 2, "previous_response_id": rid},
                    headers=alice).status_code == 200
        assert b"alice" not in (tmp_path / "kv" / "responses" / f"{rid}.json").read_bytes()

        # records of 300 KB (metadata is stored, not rendered): a 1 MB budget keeps the newest three
        ids = [post(s, "/v1/responses", {"input": f"{i}", "max_output_tokens": 1, "metadata": {"pad": "x" * 300_000}},
                    headers=alice).json()["id"] for i in range(6)]
        kept = [httpx.get(s.url + f"/v1/responses/{i}", headers=alice).status_code for i in ids]
        assert kept == [404, 404, 404, 200, 200, 200]
        files = list((tmp_path / "kv" / "responses").iterdir())
        assert sum(f.stat().st_size for f in files) <= 1 << 20 and len(files) == 3
    finally:
        s.stop()


# --- 7. Anthropic's content blocks, llama.cpp's grammar ------------------------------------------------------


def test_an_image_is_refused_by_name_and_a_text_document_is_read(server):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}}
    r = post(server, "/v1/messages", messages_body(messages=[{"role": "user", "content": [image]}]))
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "image content is not supported by this text-only model" in error_of(r)

    doc = {"type": "document", "title": "notes", "source": {"type": "text", "media_type": "text/plain",
                                                            "data": "the moon is a balloon"}}
    with_doc = [{"role": "user", "content": [doc, {"type": "text", "text": "what is the moon?"}]}]
    without = [{"role": "user", "content": [{"type": "text", "text": "what is the moon?"}]}]
    counts = [post(server, "/v1/messages/count_tokens", {"model": "m", "messages": m}).json()["input_tokens"]
              for m in (with_doc, without)]
    assert counts[0] - counts[1] >= len("notes\n\nthe moon is a balloon") // 4
    assert post(server, "/v1/messages", messages_body(messages=with_doc, max_tokens=2)).status_code == 200

    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBER"}}
    r = post(server, "/v1/messages", messages_body(messages=[{"role": "user", "content": [pdf]}]))
    assert r.status_code == 400 and "'base64' source" in error_of(r) and "document" in error_of(r)


def test_llama_cpp_grammar_field(server):
    yes_no = 'root ::= "yes" | "no"'
    r = post(server, "/v1/chat/completions", chat_body(grammar=yes_no))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no"), r.text
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 8, "grammar": yes_no})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
    r = post(server, "/v1/messages", messages_body(grammar=yes_no))
    assert r.status_code == 200 and r.json()["content"][0]["text"] in ("yes", "no"), r.text
    for bad, words in (("root ::= (", "grammar"), ("root ::= foo", "foo")):
        r = post(server, "/v1/chat/completions", chat_body(grammar=bad))
        assert r.status_code == 400 and r.json()["error"]["param"] == "grammar" and words in error_of(r), r.text
    r = post(server, "/v1/chat/completions", chat_body(grammar=yes_no, response_format={"type": "json_object"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar"


# --- 8. slow and vanishing clients -------------------------------------------------------------------------


def test_slow_headers_a_slow_body_and_a_vanished_upload(tiny_path, tmp_path):
    s = Server(tiny_path, tmp_path, "--precision", "f32", "--read-timeout", 1)
    try:
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            assert sock.recv(100) == b""  # closed, no answer
        assert time.monotonic() - t0 > 0.9  # at the read timeout, not at once (the socket's 10 s bound a hang)
        post_head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{\"messages\": [")
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            sock.sendall(post_head)
            answer = b""
            while chunk := sock.recv(4096):  # the server closes the connection after its answer
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer, answer
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            sock.sendall(post_head)
            time.sleep(0.2)  # the head read before the client leaves
        wait_until(lambda: "left during its upload" in open(s.log.name).read(), 60, "no log line of the upload left")
        assert httpx.get(s.url + "/health").status_code == 200
        log = open(s.log.name).read()
        line = next(x for x in log.splitlines() if "left during its upload" in x)
        assert " INFO " in line and "Traceback" not in log and "Exception in ASGI" not in log
    finally:
        s.stop()


# --- 9. the fuzzer, on the fields the OpenAPI document leaves open ---------------------------------------
# schemathesis (test_hostile_http.py) fills a schema field with any object; these strategies write the
# schemas, tool lists and logit_bias maps a hostile client would: every keyword llguidance reads, integers past
# 64 bits, bad references, patterns that do not compile, keys that look like token ids and are not.

NUMBERS = st.one_of(st.integers(-10 ** 30, 10 ** 30), st.floats(allow_nan=False, allow_infinity=False),
                    st.sampled_from([0, -1, 2 ** 63, 2 ** 64, 1e308]))
NAMES = st.text(max_size=6)
VALUES = st.recursive(st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=6)),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAMES, inner, max_size=3),
                      max_leaves=6)
KEYWORDS = {"minimum": NUMBERS, "maximum": NUMBERS, "exclusiveMinimum": NUMBERS, "multipleOf": NUMBERS,
            "minLength": NUMBERS, "maxLength": NUMBERS, "minItems": NUMBERS, "maxItems": NUMBERS,
            "minProperties": NUMBERS, "enum": st.lists(VALUES, max_size=4), "const": VALUES,
            "pattern": st.sampled_from(["a+", "(", "[a-z]{1,9999}", "^(a|b)*$", "\\p{L}+", ".*"]),
            "format": st.sampled_from(["date-time", "email", "uuid", "ipv4", "no-such-format"]),
            "description": st.text(max_size=20), "default": VALUES}
LEAF = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object",
                                                    "array", "bogus"])}, optional=KEYWORDS),
    st.sampled_from([{"$ref": "#/$defs/x"}, {"$ref": "#/nowhere"}, {"$ref": "http://example.com/s.json"},
                     {}, {"not": {"type": "string"}}, True, False]))
SCHEMAS = st.recursive(LEAF, lambda inner: st.one_of(
    st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(NAMES, inner, max_size=4)},
                          optional={"required": st.lists(NAMES, max_size=3),
                                    "additionalProperties": st.booleans() | inner}),
    st.fixed_dictionaries({"type": st.just("array"), "items": inner},
                          optional={"minItems": NUMBERS, "prefixItems": st.lists(inner, max_size=3)}),
    st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=3)}),
    st.fixed_dictionaries({"oneOf": st.lists(inner, max_size=3)}),
    st.fixed_dictionaries({"allOf": st.lists(inner, max_size=3)}),
    st.fixed_dictionaries({"$defs": st.fixed_dictionaries({"x": inner}), "$ref": st.just("#/$defs/x")}),
    st.fixed_dictionaries({"type": st.just("object"), "properties": st.fixed_dictionaries({"a": inner})},
                          optional={"required": st.just(["a"])})), max_leaves=10)
BIAS_KEYS = st.one_of(st.integers(-10, 10 ** 6).map(str), st.text(max_size=5),
                      st.sampled_from(["²", "١٢", "-1", "1e3", " 5", "0x10", "9" * 40]))
LOGIT_BIAS = st.dictionaries(BIAS_KEYS, st.one_of(NUMBERS, st.text(max_size=3), st.none(), st.booleans()),
                             max_size=5)
CHOICES = st.one_of(st.sampled_from(["auto", "required", "none", "any", 7]),
                    st.builds(lambda n: {"type": "function", "function": {"name": n}}, st.sampled_from(["f", "g"])))


@st.composite
def agent_requests(draw) -> tuple[str, dict]:
    schema = draw(SCHEMAS)
    api = draw(st.sampled_from(["chat-format", "chat-tools", "messages", "responses"]))
    base = {"max_tokens": 4, "temperature": 0}
    if api == "chat-format":
        return "/v1/chat/completions", {**chat_body(**base), "logit_bias": draw(LOGIT_BIAS),
                                        "response_format": json_format(schema)}
    if api == "chat-tools":
        return "/v1/chat/completions", {**chat_body(**base), "logit_bias": draw(LOGIT_BIAS),
                                        "tool_choice": draw(CHOICES),
                                        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}
    if api == "messages":
        choice = draw(st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "f"},
                                       {"type": "tool", "name": "g"}, {"type": "none"}, "auto"]))
        return "/v1/messages", {**messages_body(**base), "tools": [{"name": "f", "input_schema": schema}],
                                "tool_choice": choice}
    fmt = {"type": "json_schema", "name": "x", "schema": schema}
    return "/v1/responses", {"input": "x", "max_output_tokens": 4, "temperature": 0,
                             **draw(st.sampled_from([{"text": {"format": fmt}},
                                                     {"tools": [{"type": "function", "name": "f",
                                                                 "parameters": schema}]}]))}


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(request=agent_requests())
def test_fuzz_schemas_tools_and_logit_bias(server, request):
    path, body = request
    r = httpx.post(server.url + path, content=json.dumps(body).encode(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, json.dumps(body)[:500], r.text[:500])
    if r.status_code >= 400:
        assert error_of(r) and len(r.text) < 2000, r.text[:500]
