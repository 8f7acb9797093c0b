"""The server against a hostile or careless client: each probe of a careless or hostile user, repeated.

Every answer to something the client sent is a 4xx in the API's own error
shape; nothing a client does can freeze the server, make it 500, or reach
its files through a web page. The last test fuzzes the whole HTTP API from
its OpenAPI document with schemathesis.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_proc import Server, free_port

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    s = Server(tiny_path, tmp, "--precision", "f32", "--kv-disk-dir", tmp / "kv", "--kv-disk-min-tokens", 16,
               "--kv-disk-retry", 0.5)
    s.tmp = tmp
    yield s
    s.stop()


def chat(server, content="hello", headers=None, **kw):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **GREEDY, **kw}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


# --- 1. cross-site writes -------------------------------------------------------------------


def test_a_text_plain_post_from_a_web_page_is_refused(server):
    chat(server, "remember this")
    before = httpx.post(server.url + "/v1/sessions/victim/save").json()
    r = httpx.post(server.url + "/v1/sessions/victim/save", content=b"x",
                   headers={"content-type": "text/plain", "origin": "http://evil.example"})
    assert r.status_code == 403 and "cross-origin" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/sessions/victim/save", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    listed = {d["name"]: d for d in httpx.get(server.url + "/v1/sessions").json()["data"]}
    assert listed["victim"]["tokens"] == before["tokens"]  # not overwritten


def test_a_foreign_host_is_refused(server):
    for method, path in (("GET", "/v1/sessions"), ("POST", "/v1/sessions/victim/restore"), ("GET", "/v1/models")):
        r = httpx.request(method, server.url + path, headers={"host": f"evil.example:{server.port}"})
        assert r.status_code == 403 and "Host" in r.json()["error"]["message"], (path, r.text)
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "127.0.0.1"):
        assert httpx.get(server.url + "/v1/models", headers={"host": host}).status_code == 200


def test_the_web_ui_calls_its_own_server_and_no_other_origin_may(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.text.startswith("<!doctype html>")
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    for path in ("/app.js", "/sw.js", "/manifest.webmanifest", "/icon.svg", "/_app/version.json"):
        assert httpx.get(server.url + path).status_code == 200, path
    assert "/v1/chat/completions" in httpx.get(server.url + "/app.js").text
    # the page's own calls carry its Origin, equal to the Host it was loaded from
    own = {"origin": server.url, "content-type": "application/json"}
    assert chat(server, headers=own).status_code == 200
    for origin in (f"http://localhost:{server.port}", f"http://127.0.0.1:{server.port + 1}", "null",
                   server.url + "/path"):
        r = chat(server, headers={"origin": origin})
        assert r.status_code == 403 and "cross-origin" in r.json()["error"]["message"], origin


def test_no_ui_and_a_rebinding_page_on_a_server_bound_to_every_address(tiny_path, tmp_path):
    s = Server(tiny_path, tmp_path, "--precision", "f32", "--no-ui", "--host", "0.0.0.0")
    try:
        assert httpx.get(s.url + "/").status_code == 404 and httpx.get(s.url + "/app.js").status_code == 404
        assert httpx.head(s.url + "/api/hello").status_code == 200
        # bound to every address the Host is not checked: a page whose name was rebound to this machine sends its
        # own name as Host and Origin both, and must not pass for the server's own page
        evil = {"host": f"evil.example:{s.port}", "origin": f"http://evil.example:{s.port}"}
        r = chat(s, headers=evil)
        assert r.status_code == 403 and "cross-origin" in r.json()["error"]["message"]
        assert chat(s, headers={"origin": s.url}).status_code == 200  # an address: no name to rebind
    finally:
        s.stop()


def test_anthropic_errors_keep_their_shape_at_the_guard(server):
    r = httpx.post(server.url + "/v1/messages", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["type"] == "error"


def test_cors_allows_only_the_named_origin(tiny_path, tmp_path):
    s = Server(tiny_path, tmp_path, "--precision", "f32", "--cors", "http://app.example")
    try:
        ok = httpx.get(s.url + "/v1/models", headers={"origin": "http://app.example"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
        pre = httpx.options(s.url + "/v1/chat/completions", headers={
            "origin": "http://app.example", "access-control-request-method": "POST",
            "access-control-request-headers": "content-type"})
        assert pre.status_code == 200 and "POST" in pre.headers["access-control-allow-methods"]
        assert httpx.get(s.url + "/v1/models", headers={"origin": "http://other.example"}).status_code == 403
        # a preflight from another origin is answered without CORS headers: the browser does not send the request
        pre = httpx.options(s.url + "/v1/chat/completions", headers={
            "origin": "http://other.example", "access-control-request-method": "POST"})
        assert pre.status_code == 200 and "access-control-allow-origin" not in pre.headers
    finally:
        s.stop()


def test_cors_localhost_is_every_loopback_origin(tiny_path, tmp_path):
    s = Server(tiny_path, tmp_path, "--precision", "f32", "--cors", "localhost")
    try:
        for origin in ("http://localhost", "http://127.0.0.1:3000", "https://[::1]:8443"):
            r = httpx.get(s.url + "/v1/models", headers={"origin": origin})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        for origin in ("http://localhost.evil.com", "http://notlocalhost", "http://evil.com", "http://localhost:x",
                       "file://localhost", "http://localhost/path"):
            assert httpx.get(s.url + "/v1/models", headers={"origin": origin}).status_code == 403, origin
    finally:
        s.stop()


# --- 2. the store's folder fails ------------------------------------------------------------------


def test_the_server_survives_its_store_folder_failing_and_recovers(server):
    kv = server.tmp / "kv"
    assert chat(server, "before the failure " * 8).status_code == 200
    for _ in range(100):  # the store's writer may still be adding the turn's checkpoint: delete until it is gone
        try:
            shutil.rmtree(kv)
            break
        except OSError:
            time.sleep(0.1)
    assert not kv.exists()
    kv.write_text("not a folder any more")  # what a failing disk looks like to root, whom chmod does not stop
    try:
        for i in range(3):  # every request is served, without the cache
            r = chat(server, f"unrelated {i} " * 8)
            assert r.status_code == 200, r.text
        h = server.health()
        assert h["status"] == "ok" and h["store"]["status"] == "degraded" and h["store"]["reason"]
    finally:
        kv.unlink()
        kv.mkdir()
    for i in range(600):  # the store is tried again past its retry interval: bounded, not timed
        assert chat(server, f"after the repair {i} " * 8).status_code == 200
        if server.health()["store"]["status"] == "ok":
            break
        time.sleep(0.1)
    assert server.health()["store"]["status"] == "ok"


@pytest.mark.parametrize("make", ["file", "chunks_file"])
def test_start_up_with_an_unusable_store_folder_is_one_line(tiny_path, tmp_path, make):
    kv = tmp_path / "kv"
    if make == "file":
        kv.write_text("x")
    else:
        kv.mkdir()
        (kv / "chunks").write_text("x")
    out = subprocess.run([sys.executable, "-m", "kvsession", "serve", "--model", str(tiny_path), "--port",
                          str(free_port()), "--kv-disk-dir", str(kv)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and str(kv) in out.stderr.strip().splitlines()[-1]


# --- 3. a vanished client is cancelled, streamed or not --------------------------------------------


def test_a_non_streamed_request_is_cancelled_when_its_client_leaves(server):
    # 16 choices of 400 tokens: seconds of work even for the tiny model, all of it for nobody
    body = {"prompt": "hello", "max_tokens": 400, "n": 16, "temperature": 0, "ignore_eos": True}
    served = server.health()["served"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "next", "max_tokens": 2, **GREEDY}, timeout=60)
    h = server.health()
    assert r.status_code == 200 and h["served"] == served + 2
    assert h["last_cancel_tokens"] is not None and h["last_cancel_tokens"] < 16 * 400, h  # stopped, not finished


# --- 4. big prompts never block the event loop -------------------------------------------------------


def preparing_seen_while(server, body: dict) -> tuple[int, dict]:
    """How many /health answers, asked back to back while another process posts `body` to /v1/completions,
    counted calls at work off the event loop ("preparing": parsing, tokenizing): each is an answer the loop
    gave while that work ran. A loop blocked by the work answers none then (their state, not their times:
    a loaded machine slows both). The sender is a process of its own: a client in this process would hold
    this process's GIL while it encodes megabytes."""
    sender = subprocess.Popen([sys.executable, "-c", (
        "import json, sys, httpx; r = httpx.post(sys.argv[1], content=sys.stdin.buffer.read(), timeout=300, "
        "headers={'content-type': 'application/json'}); print(json.dumps([r.status_code, r.json()]))"),
        server.url + "/v1/completions"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    sender.stdin.write(json.dumps(body).encode())
    sender.stdin.close()
    seen = 0
    with httpx.Client(timeout=60) as client:
        while sender.poll() is None:
            seen += client.get(server.url + "/health").json()["preparing"] > 0
    status, answer = json.loads(sender.stdout.read())
    return seen, {"status": status, **answer}


def test_a_15_mb_prompt_is_refused_without_blocking_health(server):
    seen, r = preparing_seen_while(server, {"prompt": "word " * (3 << 20), "max_tokens": 1})
    assert r["status"] == 400 and r["error"]["code"] == "context_length_exceeded"
    assert seen >= 1  # /health answered while the 15 MB were parsed


def test_tokenizing_a_long_prompt_does_not_block_health(smollm2_path, tmp_path):
    s = Server(smollm2_path, tmp_path, "--max-chars-per-token", 1000)  # only the longest token's bound: 81 a token
    try:
        from kvsession.bench.corpus import CORPUS

        text = CORPUS.read_text()
        prompt = (text * (600_000 // len(text) + 1))[:600_000]  # under the character bound: really tokenized
        seen, r = preparing_seen_while(s, {"prompt": prompt, "max_tokens": 1})
        assert r["status"] == 400 and r["error"]["code"] == "context_length_exceeded"
        assert seen >= 2  # /health answered while the prompt was tokenized (seconds)
    finally:
        s.stop()


# --- 5. sparse files -----------------------------------------------------------------------------


def test_a_sparse_session_file_costs_the_server_no_memory(server):
    chat(server, "a real session")
    assert httpx.post(server.url + "/v1/sessions/sparse/save").status_code == 200
    path = server.tmp / "sessions" / "sparse.kvs"
    declare_huge_section(path, 4 << 30)
    idle = server.memory_mb()
    r = httpx.post(server.url + "/v1/sessions/sparse/restore", timeout=60)
    assert r.status_code == 400 and str(server.tmp) not in r.text
    assert server.memory_mb("VmHWM") - idle < 100


def declare_huge_section(path: Path, nbytes: int) -> None:
    """Rewrite a session file so that its last section claims nbytes, checksums valid, the file sparse."""
    from kvsession.files import framing

    with open(path, "rb") as f:
        h = framing.read_header(f, str(path))
        data = [framing.read_section(f, h, s.name, where=str(path)) for s in h.sections]
    sections = [(s.name, [bytes(d)]) for s, d in zip(h.sections, data)]
    framing.write_file(path, h.fields, sections, durable=False)
    with open(path, "rb") as f:
        h = framing.read_header(f, str(path))
    table, offset = [], 0
    for i, sec in enumerate(h.sections):
        length = nbytes if i == len(h.sections) - 1 else sec.length
        table.append({"name": sec.name, "offset": offset, "length": length, "xxh3": f"{sec.xxh3:016x}"})
        offset += length + (-length % framing.ALIGN)
    header = json.dumps({**h.fields, "sections": table}, separators=(",", ":")).encode()
    pre = framing.PREAMBLE.pack(framing.MAGIC, *framing.VERSION, len(header)) + header
    pre += framing.CHECKSUM.pack(framing.checksum([pre]))
    pre += bytes(-len(pre) % framing.ALIGN)
    with open(path, "wb") as f:
        f.write(pre)
        for d in data:
            f.write(bytes(d) + bytes(-len(d) % framing.ALIGN))
        f.truncate(len(pre) + offset)  # the rest is a hole: megabytes on disk, gigabytes declared


# --- 6. odd entries in the sessions folder ---------------------------------------------------------


def test_a_fifo_a_dangling_link_and_a_folder_in_the_sessions_folder(server):
    folder = server.tmp / "sessions"
    folder.mkdir(exist_ok=True)
    os.mkfifo(folder / "pipe.kvs")
    (folder / "gone.kvs").symlink_to(folder / "nowhere.kvs")
    (folder / "dir.kvs").mkdir()
    try:
        r = httpx.get(server.url + "/v1/sessions", timeout=10)
        assert r.status_code == 200
        names = {d["name"] for d in r.json()["data"]}
        assert not names & {"pipe", "gone", "dir"}
        assert len(r.json()["warnings"]) >= 2
        chat(server, "x")
        for method, path in (("POST", "/v1/sessions/dir/save"), ("DELETE", "/v1/sessions/dir"),
                             ("POST", "/v1/sessions/pipe/restore"), ("DELETE", "/v1/sessions/pipe")):
            r = httpx.request(method, server.url + path, timeout=10)
            assert 400 <= r.status_code < 500 and str(folder) not in r.text, (path, r.status_code, r.text)
        assert (folder / "dir.kvs").is_dir() and (folder / "pipe.kvs").exists()
    finally:
        (folder / "pipe.kvs").unlink()
        (folder / "gone.kvs").unlink()
        (folder / "dir.kvs").rmdir()


# --- 7. 500s that were 400s --------------------------------------------------------------------------


@pytest.mark.parametrize("body, words", [
    (b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "surrogate"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "finite"),
    (b'{"messages": [{"role": "user", "content": "x"}], "seed": -2}', "seed"),
])
def test_bodies_that_used_to_500(server, body, words):
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


HUGE = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10**30}}}


@pytest.mark.parametrize("path, body, words", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"²": 1}},
     "not a token id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"9" * 5000: 1}},
     "not a token id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": HUGE}}]}, "tools"),
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
                      "tools": [{"name": "f", "input_schema": HUGE}]}, "tools"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": HUGE}]}, "tools"),
], ids=["superscript-key", "5000-digit-key", "openai-tool-int-past-64-bits", "anthropic-tool", "responses-tool"])
def test_agent_fields_that_used_to_500(server, path, body, words):
    r = httpx.post(server.url + path, content=json.dumps(body), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"], r.text
    assert len(r.text) < 2000  # llguidance's message, cut short: it can quote the whole grammar


def test_seed_minus_one_means_random(server):
    # sampled (GREEDY would hide the seed): a seed repeats its reply, -1 draws a new one each time
    wide = {"temperature": 1.5, "top_p": 1.0, "min_p": 0.0, "max_tokens": 12}
    text = lambda **kw: chat(server, **wide, **kw).json()["choices"][0]["message"]["content"]  # noqa: E731
    assert len({text(seed=7) for _ in range(3)}) == 1
    assert len({text(seed=-1) for _ in range(6)}) > 1


# --- 9. small ones -------------------------------------------------------------------------------------


def test_health_without_the_key_says_only_ok(tiny_path, tmp_path):
    s = Server(tiny_path, tmp_path, "--precision", "f32", "--api-key", "sekrit", "--kv-disk-dir", tmp_path / "kv")
    try:
        assert httpx.get(s.url + "/health").json() == {"status": "ok"}
        full = httpx.get(s.url + "/health", headers={"authorization": "Bearer sekrit"}).json()
        assert full["store"]["status"] == "ok" and "live_tokens" in full
        assert httpx.get(s.url + "/v1/models", headers={"x-api-key": "sekri"}).status_code == 401
        # the web UI's files are public, as llama-server's are: the page asks for the key and sends it
        for path in ("/", "/app.js", "/sw.js", "/manifest.webmanifest", "/_app/version.json"):
            assert httpx.get(s.url + path).status_code == 200, path
    finally:
        s.stop()


# --- the fuzzer ----------------------------------------------------------------------------------------


def test_fuzz_the_api_from_its_openapi_document(tiny_path, tmp_path):
    """schemathesis sends a few hundred generated requests: no 5xx, and the server lives on."""
    # --metrics, --embeddings: their routes served, not refused with llama-server's 501 (which schemathesis counts
    # as a 5xx)
    s = Server(tiny_path, tmp_path, "--precision", "f32", "--ctx", 64, "--max-tokens", 8,
               "--kv-disk-dir", tmp_path / "kv", "--metrics", "--embeddings")
    try:
        schema = httpx.get(s.url + "/openapi.json").json()
        assert {"ChatRequest", "CompletionRequest", "MessagesRequest"} <= set(schema["components"]["schemas"])
        out = subprocess.run([str(Path(sys.executable).parent / "schemathesis"), "run", s.url + "/openapi.json",
                              "--checks", "not_a_server_error", "--max-examples", "25", "--seed", "1",
                              "--request-timeout", "60", "--workers", "1"],
                             capture_output=True, text=True, timeout=900, cwd=tmp_path)
        assert out.returncode == 0, out.stdout[-4000:]
        assert s.health()["status"] == "ok"
    finally:
        s.stop()
