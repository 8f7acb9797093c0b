"""What Claude Code and Codex CLI send, in the shapes they send it, on the tiny model.

The bodies here are cut down from captured requests of Claude Code 2.1 and
Codex CLI 0.171: system entries inside Anthropic `messages`, the billing
header, thinking blocks, hosted tools, Codex's namespace, custom and
local_shell tools and their history items. The clients themselves run
against a real model in test_agent_clients_real.py.
"""
from __future__ import annotations

import json
import re
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from server_proc import Server
from tiny import TinySpec

GREEDY = {"temperature": 0}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}, "required": ["city"]}
WRITE = {"name": "Write", "description": "Write a file", "input_schema": {
    "type": "object", "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["file_path", "content"]}}
BILLING = "x-anthropic-billing-header: cc_version=2.1.332.{}; cc_entrypoint=sdk-cli;"


@pytest.fixture(scope="module")
def server(tiny_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clients")
    s = Server(tiny_factory(TinySpec(context=4096)), tmp, "--precision", "f32", "--kv-disk-dir", tmp / "kv",
               "--kv-disk-min-tokens", 16, "--trace", tmp / "trace.jsonl", "--keepalive", 0.05,
               "--parallel", 1)  # one request at a time: a second one waits, as it would behind a long prefill
    s.tmp = tmp
    yield s
    s.stop()


def trace(server) -> list[dict]:
    return [json.loads(line) for line in (server.tmp / "trace.jsonl").read_text().splitlines()]


def count(server, **body) -> int:
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": "m", **body})
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def sse_events(response, until=None) -> list[tuple[str, dict]]:
    """The (name, data) events of a stream; until(events) is called after each one."""
    out, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[6:])))
            if until is not None:
                until(out)
    return out


@contextmanager
def busy(server):
    """A long generation that holds the worker, while another request waits behind it, until let go: calling
    what this yields closes its stream, which cancels it."""
    started, release = threading.Event(), threading.Event()

    def run():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
                "prompt": "busy", "max_tokens": 4000, "n": 4, "ignore_eos": True, "stream": True, **GREEDY}) as r:
            for line in r.iter_lines():
                started.set()
                if release.is_set():
                    return
    t = threading.Thread(target=run)
    t.start()
    started.wait(60)
    try:
        yield release.set
    finally:
        release.set()
        t.join()


# --- Claude Code --------------------------------------------------------------------------------------------


def test_claude_codes_first_request_is_served(server):
    body = {"model": "qwen2.5-coder-0.5b", "max_tokens": 32000, "stream": True,
            "system": [{"type": "text", "text": BILLING.format("fa9")},
                       {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>x</system-reminder>"},
                                                      {"type": "text", "text": "Create hello.txt"}]},
                         {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /tmp",
                                                         "cache_control": {"type": "ephemeral"}}]}],
            "tools": [WRITE, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
            "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s1"})},
            "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "temperature": 0}
    body["max_tokens"] = 8
    with httpx.stream("POST", server.url + "/v1/messages?beta=true", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(r)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert trace(server)[-1]["warnings"] == ["tool 'web_search' of type 'web_search_20250305' runs on Anthropic's "
                                             "side: dropped"]


def test_the_billing_header_is_dropped_so_conversations_share_their_prefix(server):
    msgs = [{"role": "user", "content": "hi"}]
    plain = count(server, system=[{"type": "text", "text": "You are an agent."}], messages=msgs)
    for tag in ("fa9", "bd3"):
        system = [{"type": "text", "text": BILLING.format(tag)}, {"type": "text", "text": "You are an agent."}]
        assert count(server, system=system, messages=msgs) == plain


def test_the_billing_header_is_kept_on_request(tiny_path, tmp_path):
    s = Server(tiny_path, tmp_path, "--precision", "f32", "--keep-billing-header")
    try:
        msgs = [{"role": "user", "content": "hi"}]
        plain = count(s, system="You are an agent.", messages=msgs)
        kept = count(s, system=[{"type": "text", "text": BILLING.format("fa9")},
                                {"type": "text", "text": "You are an agent."}], messages=msgs)
        assert kept > plain
    finally:
        s.stop()


def test_system_entries_before_the_first_reply_join_the_system_prompt(server):
    merged = count(server, system="Be brief.\n\n# Environment", messages=[{"role": "user", "content": "hi"}])
    inline = count(server, system="Be brief.", messages=[{"role": "user", "content": "hi"},
                                                         {"role": "system", "content": "# Environment"}])
    assert inline == merged
    later = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "system", "content": "# Environment"}, {"role": "user", "content": "again"}]
    in_place = count(server, system="Be brief.", messages=later)
    assert in_place > count(server, system="Be brief.", messages=[later[0], later[1], later[3]])


def test_thinking_blocks_and_images_in_tool_results_are_taken(server):
    msgs = [{"role": "user", "content": "Look at the picture."},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                                              {"type": "redacted_thinking", "data": "abc"},
                                              {"type": "tool_use", "id": "toolu_1", "name": "Write",
                                               "input": {"file_path": "a", "content": "b"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "text", "text": "here:"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}}]}]}]
    r = httpx.post(server.url + "/v1/messages", json={"model": "m", "max_tokens": 3, "messages": msgs,
                                                      "tools": [WRITE], **GREEDY})
    assert r.status_code == 200, r.text


def test_a_waiting_stream_sends_events_claude_code_counts(server):
    """message_start at once, then pings; Claude Code counts 30 pings in a row, so every tenth keepalive is a
    message_delta with no stop reason yet."""
    with busy(server) as release:
        body = {"model": "m", "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "hi"}],
                **GREEDY}
        with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=120) as r:
            events = sse_events(r, until=lambda seen: len(seen) > 25 and release())
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    first_block = names.index("content_block_start") if "content_block_start" in names else names.index(
        "message_delta", 12)
    waiting = names[1:first_block]
    assert waiting.count("ping") >= 9 and "message_delta" in waiting
    early = next(d for n, d in events if n == "message_delta")
    assert early["delta"]["stop_reason"] is None
    final = [d for n, d in events if n == "message_delta"][-1]
    assert final["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert final["usage"]["input_tokens"] + final["usage"]["cache_read_input_tokens"] == \
        events[0][1]["message"]["usage"]["input_tokens"]


def test_forced_calls_cut_by_max_tokens_leave_no_text(server):
    m = server.anthropic().messages.create(
        model="m", max_tokens=6, messages=[{"role": "user", "content": "Weather?"}],
        tools=[{"name": "get_weather", "input_schema": CITY}], tool_choice={"type": "any"}, extra_body=GREEDY)
    assert m.content == [] and m.stop_reason == "max_tokens"


def test_head_on_the_base_url(server):
    assert httpx.head(server.url + "/").status_code == 200
    assert httpx.head(server.url + "/api/hello").status_code == 200


def test_a_cancelled_request_leaves_a_trace_line(server):
    body = {"model": "m", "max_tokens": 2000, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "write forever"}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        for n, line in enumerate(r.iter_lines()):
            if n > 40:
                break
    deadline = time.time() + 30
    while time.time() < deadline and trace(server)[-1].get("finish_reason") != "cancelled":
        time.sleep(0.1)
    last = trace(server)[-1]
    assert last["finish_reason"] == "cancelled" and 0 < last["completion_tokens"] < 2000


# --- Codex CLI ----------------------------------------------------------------------------------------------

CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Runs a command", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                    "additionalProperties": False}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
        {"type": "function", "name": "spawn_agent", "description": "Spawn one", "strict": False,
         "parameters": {"type": "object", "properties": {"task": {"enum": ["a", "b"]}}, "required": ["task"]}}]},
    {"type": "custom", "name": "apply_patch", "description": "Edit files",
     "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z]{1,6}"}},
    {"type": "custom", "name": "note", "description": "Take a note",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /[a-z ]+/"}},
    {"type": "local_shell"},
    {"type": "web_search", "external_web_access": False},
]


def respond(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/responses", timeout=60,
                   json={"model": "m", "tools": CODEX_TOOLS, "store": False, "max_output_tokens": 200, **GREEDY,
                         **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("choice, kind, fields", [
    ({"type": "custom", "name": "apply_patch"}, "custom_tool_call", {"name": "apply_patch"}),
    ({"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"}, "function_call",
     {"name": "spawn_agent", "namespace": "multi_agent_v1"}),
    ({"type": "local_shell"}, "local_shell_call", {}),
])
def test_codex_tool_types_are_offered_and_their_calls_are_their_items(server, choice, kind, fields):
    r = respond(server, input=[{"type": "message", "role": "developer", "content": "You are Codex."},
                               {"type": "message", "role": "user", "content": [
                                   {"type": "input_text", "text": "do it"}]}], tool_choice=choice)
    (item,) = r["output"]
    assert item["type"] == kind and {k: item[k] for k in fields} == fields
    if kind == "custom_tool_call":  # the regex format holds the input
        assert re.fullmatch("[a-z]{1,6}", item["input"])
    if kind == "local_shell_call":
        assert item["action"]["type"] == "exec" and isinstance(item["action"]["command"], list)
    assert any("'web_search' tool runs on OpenAI's side" in w for w in trace(server)[-1]["warnings"])


def test_codex_history_items_render_back_to_the_session(server):
    """Each kind of call the model made comes back as its item; the next turn reuses every token before it."""
    convo = [{"type": "message", "role": "user", "content": "go"}]
    for choice in ({"type": "custom", "name": "apply_patch"}, {"type": "local_shell"},
                   {"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"}):
        r = respond(server, input=convo, tool_choice=choice, prompt_cache_key="codex-1")
        (item,) = r["output"]
        total = r["usage"]["total_tokens"]
        output = {"custom_tool_call": "custom_tool_call_output", "local_shell_call": "local_shell_call_output",
                  "function_call": "function_call_output"}[item["type"]]
        convo += [{k: v for k, v in item.items() if k not in ("status",)},
                  {"type": output, "call_id": item["call_id"], "output": "ok"},
                  {"type": "web_search_call", "id": "ws_1", "status": "completed"}]
        nxt = respond(server, input=convo, tool_choice="none", max_output_tokens=2, prompt_cache_key="codex-1")
        assert nxt["usage"]["input_tokens_details"]["cached_tokens"] == total
        convo.append({"type": "message", "role": "user", "content": "more"})


def test_codex_stream_while_waiting_repeats_in_progress(server):
    with busy(server) as release:
        with httpx.stream("POST", server.url + "/v1/responses", timeout=120, json={
                "model": "m", "input": "hi", "stream": True, "max_output_tokens": 3, **GREEDY}) as r:
            events = sse_events(r, until=lambda seen: len(seen) > 8 and release())
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.incomplete"
    assert names.count("response.in_progress") >= 5
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))


def test_an_unknown_item_or_tool_shape_is_a_400(server):
    r = httpx.post(server.url + "/v1/responses", json={"model": "m", "input": [{"type": "telepathy"}]})
    assert r.status_code == 400 and "telepathy" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/responses", json={"model": "m", "input": "x", "tools": [
        {"type": "custom", "name": "bad name!"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools.0")
    r = httpx.post(server.url + "/v1/responses", json={"model": "m", "input": "x", "tools": CODEX_TOOLS,
                                                       "tool_choice": {"type": "web_search"}})
    assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"]
