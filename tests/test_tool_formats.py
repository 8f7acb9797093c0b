"""Each model family's reply format: detected from its real chat template (tests/vectors/templates), whole and
streamed parses that agree at every chunking, reasoning apart from content, calls the template renders read
back, forced-call grammars that take a valid call, and the server's reasoning output on the tiny model."""
from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import jsonschema
import pytest
from server_proc import Server
from test_grammar import drive
from tiny import TinySpec

from kvsession.errors import TemplateError
from kvsession.server.grammar import Grammars
from kvsession.server.reply_events import ParsedReply, ToolCall, collect
from kvsession.server.tool_formats import (
    FIREFUNCTION,
    FORMATS,
    GRANITE,
    HARMONY,
    HERMES,
    LLAMA3,
    QWEN3_CODER,
    format_for,
)
from kvsession.text.template import ChatTemplate

TEMPLATES = Path(__file__).parent / "vectors" / "templates"


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


# (gpt-oss's template writes every tool's description: without one it fails, as under Hugging Face's Jinja)
WEATHER = fn("get_weather", "The weather of a city", {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hot": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}}, "unit": {"enum": ["c", "f"]},
    "note": {"type": ["string", "null"]}}, ["city"])
ADD = fn("add", "a + b", {"a": {"type": "integer"}, "b": {"type": "integer", "minimum": 0}}, ["a", "b"])
TOOLS = [WEATHER, ADD]

QWEN3 = format_for(template("Qwen-Qwen3-0.6B"))


def calls(*pairs) -> list[ToolCall]:
    return [ToolCall(n, json.dumps(a, ensure_ascii=False)) for n, a in pairs]


def reply(content="", tool_calls=(), reasoning="") -> ParsedReply:
    return ParsedReply(content, list(tool_calls), reasoning)


# --- detection ------------------------------------------------------------------


@pytest.mark.parametrize("name,fmt,thinks", [
    ("Qwen-Qwen3-0.6B", "hermes", True),
    ("Qwen-QwQ-32B", "hermes", True),
    ("Qwen3-Coder", "qwen3-coder", False),
    ("meta-llama-Llama-3.1-8B-Instruct", "llama3", False),
    ("meta-llama-Llama-3.2-3B-Instruct", "llama3", False),
    ("ibm-granite-granite-3.3-2B-Instruct", "granite", True),  # its thinking mode asks for <think></think>
    ("ibm-granite-granite-4.0", "hermes", False),  # Granite 4 writes Hermes' <tool_call> tags: Hermes reads them
    ("openai-gpt-oss-120b", "harmony", False),
    ("fireworks-ai-llama-3-firefunction-v2", "firefunction", False),
    ("HuggingFaceTB-SmolLM3-3B", "hermes", True),  # knows no tools: template.py writes them the Hermes way
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "hermes", True),
    ("microsoft-Phi-3.5-mini-instruct", "hermes", False),
    ("google-gemma-2-2b-it", "hermes", False),
    ("mistralai-Mistral-Nemo-Instruct-2407", "hermes", False),  # its [TOOL_CALLS] is not read: the fallback
])
def test_each_template_finds_its_format(name, fmt, thinks):
    found = format_for(template(name))
    assert found.name == fmt and (found.think is not None) is thinks
    assert FORMATS[fmt].think is None  # the registered formats stay as they are; a template gets a copy


# --- whole replies ----------------------------------------------------------------

# (format, reply, what it parses to, stream options)
CASES = [
    # Qwen3: Hermes calls after a <think> block
    (QWEN3, '<think>\nThe user wants Paris.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris"}}\n</tool_call>', reply("", calls(("get_weather", {"city": "Paris"})), "The user wants Paris."),
     {}),
    (QWEN3, "<think>\n\n</think>\n\nHello.", reply("Hello."), {}),
    (QWEN3, "<think>\nFirst this.\n\nThen that.\n</think>\n\nThe answer is 4.",
     reply("The answer is 4.", reasoning="First this.\n\nThen that."), {}),
    (QWEN3, "No tags: 2 < 3, and <thinking> is a word.", reply("No tags: 2 < 3, and <thinking> is a word."), {}),
    (QWEN3, "  <think>cut off by max_tok", reply(reasoning="cut off by max_tok"), {}),
    (QWEN3, "still thinking\n</think>\n\nDone.", reply("Done.", reasoning="still thinking"), {"in_reasoning": True}),
    (QWEN3, '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
     reply('<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>', reasoning="hm"), {"calls": False}),
    # Qwen3-Coder's XML: values typed by the schema
    (QWEN3_CODER, "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew <York>\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n<parameter=hot>\ntrue\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n"
     "</parameter>\n<parameter=unit>\nc\n</parameter>\n<parameter=note>\n42\n</parameter>\n</function>\n</tool_call>",
     reply("Let me check.", calls(("get_weather", {"city": "New <York>", "days": 3, "hot": True, "tags": ["a", "b"],
                                                   "unit": "c", "note": "42"}))), {}),
    (QWEN3_CODER, "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
     "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
     "<parameter=hot>\nFalse\n</parameter>\n</function>\n</tool_call>",
     reply("", calls(("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome", "hot": False}))), {}),
    # not JSON where the schema says integer: the text; a tool the request does not know: text values
    (QWEN3_CODER, "<tool_call>\n<function=add>\n<parameter=a>\nthree\n</parameter>\n</function>\n</tool_call>",
     reply("", calls(("add", {"a": "three"}))), {}),
    (QWEN3_CODER, "<tool_call>\n<function=other>\n<parameter=n>\n5\n</parameter>\n</function>",
     reply("", calls(("other", {"n": "5"}))), {}),  # the closing tag missing at the end
    (QWEN3_CODER, "<tool_call>\n<function=add>\n<parameter=a>\n1\n", reply(
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n"), {}),  # cut inside a value: not a call
    (QWEN3_CODER, '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
     reply('<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'), {}),
    # Llama 3: a reply that is one object
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     reply("", calls(("get_weather", {"city": "Paris"}))), {}),
    (LLAMA3, '<|python_tag|>{"name": "add", "arguments": {"a": 1, "b": 2}}',
     reply("", calls(("add", {"a": 1, "b": 2}))), {}),
    (LLAMA3, '<|python_tag|>brave_search.call(query="paris")', reply('<|python_tag|>brave_search.call(query="paris")'),
     {}),
    (LLAMA3, '{"name": "nope", "parameters": {}}', reply('{"name": "nope", "parameters": {}}'), {}),
    (LLAMA3, "The set {1, 2} has two members.", reply("The set {1, 2} has two members."), {}),
    # Granite 3: a list after <|tool_call|>, or alone where the tokenizer drops that control token
    (GRANITE, '<|tool_call|>[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": '
     '{"city": "Oslo"}}]', reply("", calls(("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"}))), {}),
    (GRANITE, '[{"name": "add", "arguments": {"a": 1, "b": 2}}]', reply("", calls(("add", {"a": 1, "b": 2}))), {}),
    (GRANITE, 'Sure. <|tool_call|>[{"name": "add", "arguments": {"a": 1, "b": 2}}]',
     reply("Sure.", calls(("add", {"a": 1, "b": 2}))), {}),
    (GRANITE, "<|tool_call|> is how I call tools.", reply("<|tool_call|> is how I call tools."), {}),
    # FireFunction v2: the same list after a word of plain text, which a reply may also just use
    (FIREFUNCTION, ' functools[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": '
     '{"city": "Oslo"}}]', reply("", calls(("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"}))), {}),
    (FIREFUNCTION, "Python's functools has lru_cache.", reply("Python's functools has lru_cache."), {}),
    # gpt-oss: channels
    (HARMONY, "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>"
     "Hello, world!", reply("Hello, world!", reasoning="I'm\nthinking"), {}),
    (HARMONY, '<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}',
     reply("", calls(("get_weather", {"city": "Paris"})), "Need the weather."), {}),
    (HARMONY, ' to=functions.add<|channel|>commentary json<|message|>{"a": 1, "b": 2}',
     reply("", calls(("add", {"a": 1, "b": 2}))), {}),  # the recipient in the role, as the template writes it
    (HARMONY, "<|channel|>analysis<|message|>short<|start|>assistant<|channel|>final<|message|>no end markers",
     reply("no end markers", reasoning="short"), {}),  # a text stream without the <|end|> control token
    (HARMONY, "<|channel|>commentary to=assistant<|channel|>analysis<|message|>a<|end|><|start|>assistant"
     "<|channel|>commentary<|message|>Looking it up.<|end|>", reply("Looking it up.", reasoning="a"), {}),
    (HARMONY, "<|channel|>analysis<|message|>run it<|end|><|start|>assistant to=container.exec<|channel|>commentary"
     "<|message|>ls -la", reply(reasoning="run it"), {}),  # a builtin tool's call: no place in the API
    (HARMONY, "<|channel|>commentary to=functions.add <|constrain|>json<|message|>{not json",
     reply("{not json"), {}),
    (HARMONY, '<|channel|>commentary to=functions.add<|message|>{"a": 1}', reply(), {"calls": False}),
    (HARMONY, '{"answer": 42}', reply('{"answer": 42}'), {}),  # no header at all (a JSON format forced it)
    (HARMONY, "<|channel|>final<|message|>cut at <|en", reply("cut at <|en"), {}),
]


@pytest.mark.parametrize("fmt,text,expected,kw", CASES)
def test_whole_replies(fmt, text, expected, kw):
    assert fmt.parse(text, TOOLS, **kw) == expected


@pytest.mark.parametrize("fmt,text,expected,kw", CASES)
def test_every_chunking_parses_as_the_whole(fmt, text, expected, kw):
    p = fmt.stream(TOOLS, **kw)
    events = [e for ch in text for e in p.feed(ch)] + p.finish()
    assert collect(events) == expected
    rng = random.Random(len(text))
    for _ in range(5):
        p, i, events = fmt.stream(TOOLS, **kw), 0, []
        while i < len(text):
            n = rng.randint(1, 9)
            events += p.feed(text[i:i + n])
            i += n
        assert collect(events + p.finish()) == expected


def test_reasoning_streams_before_the_reply_ends():
    p = QWEN3.stream(TOOLS)
    assert [e.text for e in p.feed("<think>\nstep one")] == ["step one"]
    assert [e.text for e in p.feed(" and two\n</thi")] == [" and two"]  # the whitespace waits: an edge maybe
    p = HARMONY.stream(TOOLS)
    assert [e.text for e in p.feed("<|channel|>analysis<|message|>thinking ab<|e")] == ["thinking ab"]


# --- calls the templates render read back ------------------------------------------

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "days": 2}}}
TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


@pytest.mark.parametrize("name,written", [
    ("Qwen-Qwen3-0.6B", HERMES_CALL),
    ("Qwen3-Coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
                    "</parameter>\n</function>\n</tool_call>"),
    ("meta-llama-Llama-3.1-8B-Instruct", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'),
    ("meta-llama-Llama-3.2-3B-Instruct", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'),
    ("ibm-granite-granite-3.3-2B-Instruct",
     '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]'),  # written by template.py
    ("ibm-granite-granite-4.0", HERMES_CALL),
    ("openai-gpt-oss-120b", '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                            '{"city": "Paris", "days": 2}'),
    ("fireworks-ai-llama-3-firefunction-v2", ' functools[{"name": "get_weather", "arguments": {"city": "Paris", '
                                             '"days": 2}}]'),
    ("HuggingFaceTB-SmolLM3-3B", HERMES_CALL),  # the Hermes rewrite
    ("microsoft-Phi-3.5-mini-instruct", HERMES_CALL),
])
def test_rendered_calls_read_back(name, written):
    source = template(name)
    text = ChatTemplate(source, bos_token="<s>").render(TURNS, tools=TOOLS)
    assert written in text
    assert format_for(source).parse(written, TOOLS).tool_calls == calls(("get_weather", {"city": "Paris", "days": 2}))


def test_firefunction_gets_the_tools_as_llama_cpp_writes_them():
    """FireFunction v2's template reads `functions` (the tools as JSON text, which llama.cpp dumps with an indent
    of 2 and its keys sorted), not `tools`, and gets no Hermes block; without tools, an empty string."""
    source = template("fireworks-ai-llama-3-firefunction-v2")
    text = ChatTemplate(source).render(TURNS[1:2], tools=[ADD])
    assert "Available functions as JSON spec:\n" + json.dumps([ADD], indent=2, sort_keys=True) + "\nToday is" in text
    assert "<tools>" not in text
    text = ChatTemplate(source).render(TURNS[1:2])
    assert "Available functions as JSON spec:\n\nToday is" in text


def test_gpt_oss_call_turns_keep_their_thinking():
    """gpt-oss's template refuses a call turn with both a preamble and thinking: the thinking stays, as in
    llama.cpp (Frontend.chat applies the format's history())."""
    source = template("openai-gpt-oss-120b")
    turns = [TURNS[1], {**TURNS[2], "content": "Looking it up.", "reasoning_content": "Need the weather."}, TURNS[3]]
    with pytest.raises(TemplateError, match="both content and thinking"):
        ChatTemplate(source).render(turns, tools=TOOLS)
    text = ChatTemplate(source).render(format_for(source).history(turns), tools=TOOLS)
    assert "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather" in text
    assert HERMES.history(turns) is turns


@pytest.mark.parametrize("name,variables,opened", [
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", {"enable_thinking": True}, True),  # the prompt ends with <think>
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", None, False),  # llama.cpp's edit closes it unless asked
    ("Qwen-Qwen3-0.6B", None, False),
    ("Qwen-Qwen3-0.6B", {"enable_thinking": False}, False),  # <think>\n\n</think>: closed, the reply is content
    ("openai-gpt-oss-120b", None, False),
])
def test_a_prompt_may_open_the_reasoning(name, variables, opened):
    source = template(name)
    text = ChatTemplate(source).render([{"role": "user", "content": "hi"}], variables=variables)
    assert format_for(source).opens_reasoning(text) is opened


# --- forced-call grammars take a valid call ----------------------------------------


@pytest.fixture(scope="module")
def grammars(tiny_engine):
    return Grammars(tiny_engine)


def takes(engine, constraint, text: str) -> bool:
    """Whether the constraint lets `text` through token by token and may end after it."""
    tk = engine.tokenizer
    for t in tk.encode(text, add_bos=False):
        mask = constraint.allowed()
        if mask is not None and not mask[t]:
            return False
        constraint.advance(t)
    mask = constraint.allowed()
    return constraint.done or (mask is not None and bool(mask[sorted(tk.eog_ids)].all()))


FORCED = [
    (QWEN3_CODER, "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew <York>\n</parameter>\n"
                  "<parameter=days>\n3\n</parameter>\n<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>\n"
                  "<tool_call>\n<function=add>\n<parameter=a>\n-1\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
                  "</function>\n</tool_call>"),
    (HARMONY, '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
              '{"city": "Paris", "days": 2}'),
    (LLAMA3, '{"name": "add", "parameters": {"a": 1, "b": 2}}'),
    (GRANITE, '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "add", "arguments": '
              '{"a": 1, "b": 2}}]'),
    (GRANITE, '[{"name": "add", "arguments": {"a": 1, "b": 2}}]'),  # the marker is optional
    (FIREFUNCTION, 'functools[{"name": "add", "arguments": {"a": 1, "b": 2}}]'),
    (HERMES, HERMES_CALL),
]


@pytest.mark.parametrize("fmt,text", FORCED)
def test_a_forced_grammar_takes_a_valid_call(tiny_engine, grammars, fmt, text):
    assert takes(tiny_engine, grammars.tool_calls(fmt, TOOLS, "required", True).new(), text)
    assert fmt.parse(text, TOOLS).tool_calls and fmt.parse(text, TOOLS).content == ""


@pytest.mark.parametrize("fmt,bad", [
    (QWEN3_CODER, "<tool_call>\n<function=add>\n<parameter=b>\n2\n"),  # a required parameter skipped
    (QWEN3_CODER, "<tool_call>\n<function=add>\n<parameter=a>\nx"),  # not an integer
    (QWEN3_CODER, "<tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n<parameter=unit>\nk"),
    (LLAMA3, '{"name": "add", "arguments": '),  # Llama's key is "parameters"
    (HARMONY, "<|channel|>analysis"),
    (FIREFUNCTION, '[{"name": "add", "arguments": {"a": 1, "b": 2}}]'),  # its marker is a word: never optional
])
def test_a_forced_grammar_refuses_what_is_not_a_call(tiny_engine, grammars, fmt, bad):
    assert not takes(tiny_engine, grammars.tool_calls(fmt, TOOLS, "required", True).new(), bad)


def test_forced_xml_calls_match_their_schema(tiny_engine, grammars):
    factory = grammars.tool_calls(QWEN3_CODER, [ADD], {"type": "function", "function": {"name": "add"}}, True)
    for seed in range(8):
        text, ended = drive(tiny_engine, factory.new(), seed)
        assert ended == "done", text
        [call] = QWEN3_CODER.parse(text, [ADD]).tool_calls
        jsonschema.validate(json.loads(call.arguments), ADD["function"]["parameters"])


def test_lazy_grammars_per_format(tiny_engine, grammars):
    tk = tiny_engine.tokenizer
    assert grammars.tool_calls(HARMONY, TOOLS, "auto", True) is None  # no text opens a call in free text
    assert grammars.tool_calls(HARMONY, TOOLS, "none", True) is None and grammars.tool_calls(
        LLAMA3, TOOLS, "none", True) is None
    for fmt, opening in [(QWEN3_CODER, "Let me add.\n<tool_call>"), (LLAMA3, '{"'), (GRANITE, "<|tool_call|>"),
                         (FIREFUNCTION, " functools[")]:
        factory = grammars.tool_calls(fmt, [ADD], "auto", False)
        for seed in range(4):
            text, ended = drive(tiny_engine, factory.new(), seed, start=tk.encode(opening, add_bos=False))
            assert ended == "done", text
            [call] = fmt.parse(text, [ADD]).tool_calls
            jsonschema.validate(json.loads(call.arguments), ADD["function"]["parameters"])


# --- the server: reasoning out, template variables in --------------------------------

THINKING = (  # ChatML whose generation prompt opens <think>, as DeepSeek-R1's does, unless enable_thinking is false
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and "
    "not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% else %}{{ '<think>\n' }}{% endif %}{% endif %}"
)
PROMPT = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def server(tiny_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("thinking")
    s = Server(tiny_factory(TinySpec(template=THINKING)), tmp, "--precision", "f32")
    yield s
    s.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "m", **body}, timeout=60)


def sse(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def raw(server, prompt: str) -> str:
    r = post(server, "/v1/completions", {"prompt": prompt, **GREEDY})
    return r.json()["choices"][0]["text"]


def test_reasoning_in_each_api(server):
    thought = raw(server, PROMPT + "<think>\n").strip(" \t\r\n")
    assert thought and "</think>" not in thought
    hello = [{"role": "user", "content": "hello"}]

    m = post(server, "/v1/chat/completions", {"messages": hello, **GREEDY}).json()["choices"][0]["message"]
    assert m["reasoning_content"] == thought and m["content"] == ""
    chunks = sse(post(server, "/v1/chat/completions", {"messages": hello, "stream": True, **GREEDY}))
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thought
    assert "".join(d.get("content") or "" for d in deltas) == ""

    body = {"messages": hello, "max_tokens": 12, "temperature": 0}
    a = post(server, "/v1/messages", body).json()
    assert a["content"] == [{"type": "thinking", "thinking": thought, "signature": ""}]
    events = sse(post(server, "/v1/messages", {**body, "stream": True}))
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""}]
    assert "".join(e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta") == thought

    rbody = {"input": "hello", "max_output_tokens": 12, "temperature": 0}
    out = post(server, "/v1/responses", rbody).json()["output"]
    assert [o["type"] for o in out] == ["reasoning"] and out[0]["content"] == [{"type": "reasoning_text",
                                                                                 "text": thought}]
    events = sse(post(server, "/v1/responses", {**rbody, "stream": True}))
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == thought
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done[0]["type"] == "reasoning" and done[0]["content"][0]["text"] == thought


def test_a_grammar_from_the_first_token_leaves_no_reasoning(server):
    """The prompt opened <think>, but a JSON format writes the reply from its first token: it is content."""
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}],
                                               "response_format": {"type": "json_object"}, **GREEDY})
    m = r.json()["choices"][0]["message"]
    assert m["content"].startswith("{") and "reasoning_content" not in m


def test_chat_template_kwargs(server):
    hello = [{"role": "user", "content": "hello"}]
    answer = raw(server, PROMPT + "<think>\n\n</think>\n\n")
    r = post(server, "/v1/chat/completions", {"messages": hello, "chat_template_kwargs": {"enable_thinking": False},
                                               **GREEDY}).json()
    m = r["choices"][0]["message"]
    assert m["content"] == answer and "reasoning_content" not in m
    for kwargs, match in [({"messages": []}, "set by the server"), ({"two words": 1}, "not a template variable"),
                          ("enable_thinking", "")]:  # not an object: the validation's own words
        r = post(server, "/v1/chat/completions", {"messages": hello, "chat_template_kwargs": kwargs, **GREEDY})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "chat_template_kwargs" and match in error["message"], r.text
    r = post(server, "/v1/chat/completions", {"messages": hello, "reasoning_effort": ["high"], **GREEDY})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


OPENS = (  # DeepSeek-R1's and QwQ's way: the generation prompt always opens <think> (and earlier replies lose
    # their thinking); it also shows enable_thinking
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'].split('</think>')[-1]"
    " + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and "
    "not enable_thinking %}{{ '/no_think\n' }}{% endif %}{{ '<think>\n' }}{% endif %}"
)


def test_reasoning_off_server_wide_as_llama_servers_flag(tiny_factory, tmp_path):
    """--reasoning off: the template's enable_thinking is false and a think block it opens anyway is closed, in
    the prompt every API renders and in /apply-template's; a request's own chat_template_kwargs still decide."""
    s = Server(tiny_factory(TinySpec(template=OPENS)), tmp_path, "--precision", "f32", "--reasoning", "off")
    try:
        hello = [{"role": "user", "content": "hello"}]
        off = PROMPT + "/no_think\n<think>\n</think>"
        assert post(s, "/apply-template", {"messages": hello}).json()["prompt"] == off
        asked = post(s, "/apply-template", {"messages": hello, "chat_template_kwargs": {"enable_thinking": True}})
        assert asked.json()["prompt"] == PROMPT + "<think>\n"
        answer = raw(s, off)
        m = post(s, "/v1/chat/completions", {"messages": hello, **GREEDY}).json()["choices"][0]["message"]
        assert m["content"] == answer and "reasoning_content" not in m
        a = post(s, "/v1/messages", {"messages": hello, "max_tokens": 12, "temperature": 0}).json()
        assert [b["type"] for b in a["content"]] in (["text"], [])  # no thinking block
        m = post(s, "/v1/chat/completions", {"messages": hello, "chat_template_kwargs": {"enable_thinking": True},
                                             **GREEDY}).json()["choices"][0]["message"]
        assert m["reasoning_content"] == raw(s, PROMPT + "<think>\n").strip(" \t\r\n")
    finally:
        s.stop()


def test_reasoning_sent_back_is_accepted(server):
    """A client echoes the thinking it was given (each API's own shape); the tiny template does not render it."""
    history = [{"role": "user", "content": "hello"}]
    r = post(server, "/v1/chat/completions", {"messages": [
        *history, {"role": "assistant", "content": "hi", "reasoning_content": "greet back"},
        {"role": "user", "content": "again"}], **GREEDY})
    assert r.status_code == 200, r.text
    r = post(server, "/v1/messages", {"max_tokens": 4, "messages": [
        *history, {"role": "assistant", "content": [{"type": "thinking", "thinking": "greet", "signature": ""},
                                                    {"type": "text", "text": "hi"}]},
        {"role": "user", "content": "again"}]})
    assert r.status_code == 200, r.text
    r = post(server, "/v1/responses", {"max_output_tokens": 4, "input": [
        {"type": "message", "role": "user", "content": "hello"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "greet"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
        {"type": "message", "role": "user", "content": "again"}]})
    assert r.status_code == 200, r.text


def test_which_sampled_turns_stand_in_for_their_calls():
    """call_memory.ToolCallMemory keeps a call turn's sampled text only where it is in the format's own syntax."""
    assert HERMES.remembers(HERMES_CALL) and not HERMES.remembers('{"name": "add", "arguments": {}}')
    assert LLAMA3.remembers('{"name": "add", "parameters": {}}')  # a bare object is Llama's own syntax
    # gpt-oss's template refuses channel markup in a message's content, and writes calls its own way
    assert not HARMONY.remembers('<|channel|>commentary to=functions.add <|constrain|>json<|message|>{}')


# --- gpt-oss end to end: a tiny gpt-oss file with harmony's markers and gpt-oss's own template ---------------

HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>")


@pytest.fixture(scope="module")
def gpt_oss(tiny_factory, tmp_path_factory):
    spec = TinySpec(arch="gpt-oss", n_heads=4, head_dim=32, sliding_window=8, experts_used=4, yarn=32.0, tied=False,
                    context=2048, specials=HARMONY_MARKERS, template=template("openai-gpt-oss-120b"), seed=40)
    s = Server(tiny_factory(spec), tmp_path_factory.mktemp("gpt-oss"), "--precision", "f32")
    yield s
    s.stop()


def test_gpt_oss_calls_a_tool_through_its_harmony_format(gpt_oss):
    """The whole path of a gpt-oss tool call: its template renders the tools, the forced grammar writes a harmony
    call (markers and all: the tokenizer renders them), the parser reads it back as the API's tool call, and the
    call goes back into the next turn through the template."""
    ask = [{"role": "user", "content": "add 2 and 3"}]
    body = {"messages": ask, "tools": [ADD], "tool_choice": "required", "max_tokens": 300, "temperature": 0}
    r = post(gpt_oss, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "add"
    jsonschema.validate(json.loads(call["function"]["arguments"]), ADD["function"]["parameters"])
    nxt = {**body, "tool_choice": "auto", "max_tokens": 4, "messages": [
        *ask, choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "5"}]}
    r = post(gpt_oss, "/v1/chat/completions", nxt)
    assert r.status_code == 200, r.text
