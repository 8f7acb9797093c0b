"""kvsession serve for agents: tools, structured output, logprobs, n, the Responses API, through the real SDKs.

The tiny model (random weights, a byte-level vocabulary) drives everything
that does not depend on a model's sense: with a forced tool choice or a JSON
schema the grammar writes valid calls and JSON whatever the logits say. The
real tool-capable model, Qwen2.5-Coder-0.5B, runs agent loops end to end and
the reuse of earlier turns through tool calls, live and after a restart.
"""
from __future__ import annotations

import json
import math

import httpx
import jsonschema
import openai
import pytest
import torch
from server_proc import Server
from tiny import TinySpec

GREEDY = {"temperature": 0}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                           "parameters": CITY}}]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def tiny_long(tiny_factory):
    return tiny_factory(TinySpec(context=4096))  # a tools prompt is ~600 tokens of bytes


@pytest.fixture(scope="module")
def server(tiny_long, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agents")
    s = Server(tiny_long, tmp, "--precision", "f32", "--kv-disk-dir", tmp / "kv", "--kv-disk-min-tokens", 16,
               "--trace", tmp / "trace.jsonl")
    s.tmp = tmp
    yield s
    s.stop()


def ask(server, **kw):
    return server.openai().chat.completions.create(
        model="m", **{"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 200,
                      **GREEDY, **kw})


# --- OpenAI chat: tool calls ----------------------------------------------------------------------


def test_required_tool_calls_plain_and_streamed(server):
    r = ask(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(call.function.arguments), CITY)
    stream = ask(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, stream=True)
    name, args, finish = None, "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            name = d.function.name or name
            args += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, args, finish) == (call.function.name, call.function.arguments, "tool_calls")


def test_a_named_tool_is_the_one_called(server):
    r = ask(server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]


def test_tool_turns_are_rendered_and_reused(server):
    """The history's assistant tool_calls and tool results reach the template; the next turn reuses all of it."""
    messages = [{"role": "user", "content": "What is the weather in Rome?"}]
    r = ask(server, messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    total = r.usage.prompt_tokens + r.usage.completion_tokens
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id, "content": "Sunny."})
    r2 = ask(server, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert r2.usage.prompt_tokens_details.cached_tokens == total
    assert r2.choices[0].message.tool_calls is None and r2.choices[0].finish_reason in ("stop", "length")


def test_tool_call_arguments_that_are_not_json_are_a_400(server):
    bad = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": bad, "tools": TOOLS})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]


# --- structured output --------------------------------------------------------------------------------

SCHEMAS = [
    {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "unit": {"enum": ["m", "s"]}}, "required": ["answer", "unit"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                                      "ok": {"type": "boolean"}}, "required": ["tags", "ok"],
     "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_output_parses_and_validates(server, schema):
    for seed in range(3):
        r = ask(server, temperature=1.0, seed=seed, max_tokens=400, response_format={
            "type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_and_completions_response_format(server):
    r = server.openai().completions.create(model="m", prompt="x", max_tokens=300, temperature=1.0, seed=3,
                                           extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                               "name": "o", "schema": SCHEMAS[0]}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[0])


@pytest.mark.parametrize("schema, words", [
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["a"]},
     "unsatisfiable"),
    ({"type": "nonsense"}, "schema"),
])
def test_a_schema_that_cannot_be_compiled_is_a_400(server, schema, words):
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


# --- probabilities and choices ------------------------------------------------------------------------


def test_logprobs_are_the_models_distribution(server, tiny_long):
    from kvsession.engine import Engine

    r = ask(server, max_tokens=4, logprobs=True, top_logprobs=5)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True) and sum(map(math.exp, tops)) <= 1 + 1e-6
        assert e.logprob == pytest.approx(tops[0])  # greedy: the chosen token is the likeliest
    engine = Engine.load(tiny_long, precision="f32")
    prompt = engine.chat_prompt([{"role": "user", "content": "What is the weather in Paris?"}])
    session = engine.session()
    session.prefill(prompt.tokens)
    expected = torch.log_softmax(session.logits.float(), -1)
    assert entries[0].logprob == pytest.approx(float(expected.max()), abs=1e-4)


def test_completions_echo_and_logprobs(server):
    r = server.openai().completions.create(model="m", prompt="the sea", max_tokens=3, echo=True, logprobs=2, **GREEDY)
    c = r.choices[0]
    assert c.text.startswith("the sea")
    lp = c.logprobs
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "".join(lp.tokens) == c.text


def test_logit_bias_forces_and_forbids(server):
    # the tiny vocabulary's first 256 tokens are the bytes: 120 is "x", 121 is "y"
    assert ask(server, max_tokens=1, logit_bias={"120": 100}).choices[0].message.content == "x"
    both = ask(server, max_tokens=1, logit_bias={"120": 100, "121": 100})
    assert both.choices[0].message.content in ("x", "y")
    assert ask(server, max_tokens=1, logit_bias={"120": -100, "121": 100}).choices[0].message.content == "y"


def test_n_choices_prefill_once(server):
    r = ask(server, n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=True)
    assert [c.index for c in r.choices] == [0, 1, 2]
    one = ask(server, temperature=1.0, seed=7, max_tokens=6)
    assert r.choices[0].message.content == one.choices[0].message.content  # choice 0 draws with the seed itself
    assert len({c.message.content for c in r.choices}) > 1  # the others with their own seeds
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt is counted once
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    streamed = ask(server, n=2, temperature=1.0, seed=7, max_tokens=6, stream=True)
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] == r.choices[0].message.content and texts[1] == r.choices[1].message.content


# --- Anthropic ----------------------------------------------------------------------------------------------


def test_anthropic_tool_use_plain_streamed_and_tool_result(server):
    a = server.anthropic()
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    m = a.messages.create(model="m", max_tokens=200, messages=msgs, tools=ANTHROPIC_TOOLS,
                          tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    jsonschema.validate(use.input, CITY)
    with a.messages.stream(model="m", max_tokens=200, messages=msgs, tools=ANTHROPIC_TOOLS,
                           tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(use.name, use.input)]
    assert final.stop_reason == "tool_use"
    total = m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.output_tokens
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Snow.",
                                           "is_error": False}]}]
    m2 = a.messages.create(model="m", max_tokens=5, messages=msgs, tools=ANTHROPIC_TOOLS,
                           tool_choice={"type": "none"}, extra_body=GREEDY)
    assert m2.usage.cache_read_input_tokens == total and m2.stop_reason in ("end_turn", "max_tokens")


def test_anthropic_count_tokens_and_message_start(server):
    body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "count me"}],
            "tools": ANTHROPIC_TOOLS}
    counted = httpx.post(server.url + "/v1/messages/count_tokens", json=body).json()["input_tokens"]
    m = server.anthropic().messages.create(**body, extra_body=GREEDY)
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_anthropic_prefill_is_continued(server):
    a = server.anthropic()
    first = a.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "Say it."}],
                              extra_body=GREEDY)
    said = first.content[0].text
    cont = a.messages.create(model="m", max_tokens=4, extra_body=GREEDY, messages=[
        {"role": "user", "content": "Say it."}, {"role": "assistant", "content": said[:4]}])
    # the prompt is the first one plus the partial reply, not a new turn: it extends what the session holds
    assert cont.usage.cache_read_input_tokens >= first.usage.input_tokens + first.usage.cache_read_input_tokens


# --- the Responses API ------------------------------------------------------------------------------------------


def test_responses_function_call_and_previous_response_id(server):
    c = server.openai()
    r = c.responses.create(model="m", input="Weather in Rome?", instructions="Use the tools.",
                           tools=RESPONSES_TOOLS, tool_choice="required", parallel_tool_calls=False,
                           max_output_tokens=200, **GREEDY)
    assert r.status == "completed"
    (call,) = [o for o in r.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), CITY)
    total = r.usage.total_tokens
    r2 = c.responses.create(model="m", previous_response_id=r.id, instructions="Use the tools.",
                            tools=RESPONSES_TOOLS, tool_choice="none", max_output_tokens=5, **GREEDY,
                            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Hot."}])
    assert r2.usage.input_tokens_details.cached_tokens == total
    assert c.responses.retrieve(r2.id).id == r2.id
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="m", input="x", previous_response_id="resp_" + "0" * 32)


def test_responses_stream_events(server):
    c = server.openai()
    kinds, final = [], None
    for event in c.responses.create(model="m", input="Weather in Oslo?", tools=RESPONSES_TOOLS, stream=True,
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=200,
                                    **GREEDY):
        kinds.append(event.type)
        if event.type == "response.completed":
            final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds and "response.output_item.done" in kinds
    (call,) = [o for o in final.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), CITY)
    text = c.responses.create(model="m", input="Say hi.", max_output_tokens=5, stream=True, **GREEDY)
    deltas = [e.delta for e in text if e.type == "response.output_text.delta"]
    assert deltas


# --- discovery, defaults, the trace, fields refused ----------------------------------------------------------


def test_models_discovery(server):
    listed = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert listed["context_length"] == 4096
    assert httpx.get(server.url + f"/v1/models/{listed['id']}").json()["id"] == listed["id"]
    assert httpx.get(server.url + "/v1/models/other").status_code == 404


def test_max_tokens_default_and_trace(tiny_long, tmp_path):
    s = Server(tiny_long, tmp_path, "--precision", "f32", "--max-tokens", 5, "--trace", tmp_path / "t.jsonl")
    try:
        r = s.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": "go on"}],
                                               extra_body={"ignore_eos": True}, **GREEDY)
        assert r.usage.completion_tokens == 5
        s.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": "go on"}], **GREEDY)
    finally:
        s.stop()
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [x["source"] for x in lines] == ["cold", "live"]
    assert lines[1]["reused_tokens"] > 0 and lines[0]["miss"] and lines[0]["prefill_tps"] > 0


@pytest.mark.parametrize("extra, words", [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"top_logprobs": 3}, "logprobs"),
    ({"tool_choice": "required"}, "tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "nope"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"logit_bias": {"999999": 5}}, "vocabulary"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS}, "response format"),
])
def test_fields_we_cannot_honour_are_a_400(server, extra, words):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


# --- Qwen2.5-Coder: agent loops, and reuse through tool turns, live and after a restart ----------------------


def agent_turns(client, messages, turns, stream):
    """Tool turns as an agent runs them: each reply's calls are answered and sent back. Returns the share of the
    previous turn's total tokens each turn found cached."""
    shares, previous = [], None
    for i in range(turns):
        kw = dict(model="m", messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=60, **GREEDY)
        if stream:
            calls, usage = {}, None
            for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
                usage = chunk.usage or usage
                for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    c = calls.setdefault(d.index, {"id": d.id, "type": "function",
                                                   "function": {"name": d.function.name, "arguments": ""}})
                    c["function"]["arguments"] += d.function.arguments or ""
            message = {"role": "assistant", "content": None, "tool_calls": [calls[k] for k in sorted(calls)]}
        else:
            r = client.chat.completions.create(**kw)
            usage, message = r.usage, r.choices[0].message.model_dump(exclude_none=True)
        assert message["tool_calls"], message
        if previous is not None:
            shares.append(usage.prompt_tokens_details.cached_tokens / previous)
        previous = usage.prompt_tokens + usage.completion_tokens
        messages.append(message)
        for call in message["tool_calls"]:
            city = json.loads(call["function"]["arguments"])["city"]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"{city}: 2{i} C, clear"})
    return shares, previous


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_qwen_agent_loop_reuses_every_turn_live_and_after_a_restart(qwen_path, tmp_path, stream):
    s = Server(qwen_path, tmp_path, "--kv-disk-dir", tmp_path / "kv", "--kv-disk-min-tokens", 64)
    messages = [{"role": "system", "content": "You check the weather city by city with the tools."},
                {"role": "user", "content": "What is the weather in Paris, Rome and Oslo, and the time in Oslo?"}]
    try:
        shares, total = agent_turns(s.openai(timeout=600), messages, 5, stream)
        print("live reuse per turn", shares)
        assert len(shares) == 4 and min(shares) >= 0.95, shares
    finally:
        s.stop()  # SIGTERM: a shutdown checkpoint, and the tool-call memory is on disk
    s.start()
    try:
        r = s.openai(timeout=600).chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=40,
                                                          tool_choice="auto", **GREEDY)
        share = r.usage.prompt_tokens_details.cached_tokens / total
        print("after a restart", share)
        assert share >= 0.95
        final = s.openai(timeout=600).chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                              tool_choice="none", max_tokens=40, **GREEDY)
        assert final.choices[0].message.content and final.choices[0].message.tool_calls is None
    finally:
        s.stop()


@pytest.mark.slow
def test_qwen_anthropic_and_responses_tool_loops(qwen_path, tmp_path):
    s = Server(qwen_path, tmp_path, "--kv-disk-dir", tmp_path / "kv")
    try:
        a = s.anthropic(timeout=600)
        msgs = [{"role": "user", "content": "What is the weather in Rome?"}]
        with a.messages.stream(model="m", max_tokens=60, messages=msgs, tools=ANTHROPIC_TOOLS,
                               extra_body=GREEDY) as stream:  # tool_choice auto: the model decides
            m = stream.get_final_message()
        (use,) = [b for b in m.content if b.type == "tool_use"]
        assert use.name == "get_weather" and use.input == {"city": "Rome"} and m.stop_reason == "tool_use"
        msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "24 C"}]}]
        m2 = a.messages.create(model="m", max_tokens=40, messages=msgs, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "none"}, extra_body=GREEDY)
        assert m2.content[0].type == "text" and m2.usage.cache_read_input_tokens >= m.usage.output_tokens
        c = s.openai(timeout=600)
        r = c.responses.create(model="m", input="What time is it in Oslo?", tools=RESPONSES_TOOLS, **GREEDY,
                               max_output_tokens=60)
        (call,) = [o for o in r.output if o.type == "function_call"]
        assert call.name == "get_time" and json.loads(call.arguments) == {"city": "Oslo"}
        events = list(c.responses.create(model="m", previous_response_id=r.id, tools=RESPONSES_TOOLS, stream=True,
                                         input=[{"type": "function_call_output", "call_id": call.call_id,
                                                 "output": "10:42"}], tool_choice="none", max_output_tokens=40,
                                         **GREEDY))
        assert events[-1].type in ("response.completed", "response.incomplete")  # OpenAI's two endings
        r2 = events[-1].response
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r2.output_text
        # the call was bare JSON (tool_choice auto): it renders back in tags, so only the reply is prefilled again
        assert r2.output_text and r2.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens
        schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 40}},
                  "required": ["capital"]}
        j = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "The capital of Italy?"}],
                                      max_tokens=40, **GREEDY, response_format={
                                          "type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
        answer = json.loads(j.choices[0].message.content)
        jsonschema.validate(answer, schema)
        assert "Rome" in answer["capital"]
    finally:
        s.stop()
