"""Tool-call formats (whole and streamed parses agree) and the memory of sampled tool-call turns."""
from __future__ import annotations

import json
import random
import threading

import pytest

from kvsession.server.call_memory import ToolCallMemory
from kvsession.server.reply_events import (
    ContentDelta,
    ParsedReply,
    ToolCall,
    ToolCallDelta,
    ToolCallStart,
    collect,
)
from kvsession.server.tool_formats import FORMATS, HERMES, format_for
from kvsession.text.template import CHATML


def fn(name: str, **props) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {k: {"type": v} for k, v in props.items()}, "required": list(props)}}}


WEATHER = fn("get_weather", city="string", unit="string")
CALC = fn("calculator", expression="string")
LS = fn("list_dir", path="string")
READ = fn("read_file", path="string")
WRITE = fn("write_file", path="string", content="string")
TOOLS = [WEATHER, CALC, LS, READ, WRITE]

# What Qwen2.5-Coder-0.5B-Instruct wrote for tool prompts rendered with its own template (greedy and at
# temperature 0.7; see the summary in server/tool_formats/calls.py), with what the parser must make of each.
REAL_05B = [
    ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Tokyo",\n    "unit": "celsius"\n  }\n}\n```',
     [("get_weather", {"city": "Tokyo", "unit": "celsius"})]),
    ('```json\n{"name": "list_dir", "arguments": {"path": "src"}}\n```', [("list_dir", {"path": "src"})]),
    ('```json\n{"name": "get_weather", "arguments": {\n  "city": "Paris",\n  "unit": "celsius"\n}}\n'
     '{"name": "get_weather", "arguments": {\n  "city": "London",\n  "unit": "celsius"\n}}\n'
     '{"name": "get_weather", "arguments": {\n  "city": "Berlin",\n  "unit": "celsius"\n}}\n```',
     [("get_weather", {"city": c, "unit": "celsius"}) for c in ("Paris", "London", "Berlin")]),
    # EOS one brace short
    ('{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}',
     [("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    ('{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}',
     [("calculator", {"expression": "1234 * 5678"})]),
    # a tool that does not exist: text
    ('{"name": "add", "arguments": {"a": 5, "b": 3}}\n', []),
    # the tool's definition echoed back: text
    ('```json\n{\n  "type": "function",\n  "function": {\n    "name": "read_file",\n    "description": "Read a text '
     'file and return its contents",\n    "parameters": {\n      "type": "object",\n      "properties": {\n        '
     '"path": {"type": "string"}\n      },\n      "required": ["path"]\n    }\n  }\n}\n```', []),
    ('```json\n{\n  "type": "file",\n  "path": "config.yaml"\n}\n```', []),
    ('Sea whispers,\nWhispers of the sea,\nWhispers of the sea.', []),
    ('To run the test suite with pytest, you can use the following command:\n\n```sh\npytest\n```\n\nThis command '
     'will execute all the tests.', []),
]

# ... and what Qwen2.5-Coder-1.5B-Instruct wrote
REAL_15B = [
    ('```json\n{\n    "name": "write_file",\n    "arguments": {\n        "path": "add.py",\n        "content": '
     '"def add(a, b):\\n    return a - b\\n"\n    }\n}\n```',
     [("write_file", {"path": "add.py", "content": "def add(a, b):\n    return a - b\n"})]),
    ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": ["Paris", "London", "Berlin"],\n    '
     '"unit": "celsius"\n  }\n}\n```', [("get_weather", {"city": ["Paris", "London", "Berlin"], "unit": "celsius"})]),
    ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Oslo",\n    "unit": "celsius"\n  },\n  '
     '"response": {\n    "temperature": 4,\n    "condition": "light snow",\n    "unit": "celsius"\n  }\n}\n```',
     [("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    ('{"name": "write_file", "arguments": {"path": "add.py", "content": "x = 1"}', [("write_file", {"path": "add.py",
                                                                                           "content": "x = 1"})]),
    ('{{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}}', []),
]

# (reply, calls, content) for shapes the model did not happen to produce here, but Hermes models do
EDGES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [("get_weather", {"city": "Paris"})], ""),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [("get_weather", {"city": "Paris"})], "Let me check."),
    ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n'
     '</tool_call>', [("a", {}), ("b", {"x": 1})], ""),
    # closing tag missing at EOS
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}', [("get_weather", {"city": "Rome"})], ""),
    # arguments as a JSON string
    ('<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"2+2\\"}"}\n</tool_call>',
     [("calculator", {"expression": "2+2"})], ""),
    # a fence inside the tags
    ('<tool_call>\n```json\n{"name": "list_dir", "arguments": {"path": "."}}\n```\n</tool_call>',
     [("list_dir", {"path": "."})], ""),
    # a call left open, then the next one
    ('<tool_call>\n{"name": "a", "arguments": {}}\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
     [("a", {}), ("b", {})], ""),
    # text after a call keeps its own words
    ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\nDone, see above.', [("a", {})], "\nDone, see above."),
    # not calls: every character stays content
    ('<tool_call>\nnot json at all\n</tool_call>', [], '<tool_call>\nnot json at all\n</tool_call>'),
    ('See <tool_call>{"oops": 1}</tool_call> here', [], 'See <tool_call>{"oops": 1}</tool_call> here'),
    ('a <toolbox> b <tool', [], 'a <toolbox> b <tool'),
    ('<tool_call>\n{"name": "a", "arguments": {"x": ', [], '<tool_call>\n{"name": "a", "arguments": {"x": '),
    ('{"answer": 42}', [], '{"answer": 42}'),
    # cut by max_tokens inside the arguments: not a call
    ('{"name": "calculator", "arguments": {"expression": "1 +', [],
     '{"name": "calculator", "arguments": {"expression": "1 +'),
    ('{"answer": 42} and more', [], '{"answer": 42} and more'),
    ('```python\nprint(1)\n```', [], '```python\nprint(1)\n```'),
    ('  \n', [], '  \n'),
    ('', [], ''),
    ('``', [], '``'),
    ('Hello\n\n', [], 'Hello\n\n'),
]


def expected(calls) -> list[ToolCall]:
    return [ToolCall(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]


def streamed(text: str, chunks: list[int], tools=TOOLS) -> ParsedReply:
    p = HERMES.stream(tools)
    events, i = [], 0
    for n in chunks:
        events += p.feed(text[i:i + n])
        i += n
    events += p.feed(text[i:])
    events += p.finish()
    assert all(isinstance(e, (ContentDelta, ToolCallStart, ToolCallDelta)) for e in events)
    return collect(events)


def splits(text: str, seed: int) -> list[int]:
    rng = random.Random(seed)
    out, n = [], len(text)
    while n > 0:
        k = rng.randint(1, 7)
        out.append(k)
        n -= k
    return out


@pytest.mark.parametrize("text,calls", REAL_05B + REAL_15B)
def test_real_qwen_replies(text, calls):
    got = HERMES.parse(text, TOOLS)
    assert got.tool_calls == expected(calls)
    assert got.content == ("" if calls else text)


@pytest.mark.parametrize("text,calls,content", EDGES)
def test_edge_cases(text, calls, content):
    assert HERMES.parse(text, TOOLS) == ParsedReply(content, expected(calls))


@pytest.mark.parametrize("text", [t for t, _ in REAL_05B + REAL_15B] + [t for t, _, _ in EDGES])
def test_streamed_events_add_up_to_the_whole_parse(text):
    whole = HERMES.parse(text, TOOLS)
    assert streamed(text, [1] * len(text)) == whole
    for seed in range(12):
        assert streamed(text, splits(text, seed)) == whole


def test_call_events_come_in_order_with_their_index():
    p = HERMES.stream(TOOLS)
    text = EDGES[2][0]
    events = [e for k in range(0, len(text), 5) for e in p.feed(text[k:k + 5])] + p.finish()
    assert [e for e in events if not isinstance(e, ContentDelta)] == [
        ToolCallStart(0, "a"), ToolCallDelta(0, "{}"), ToolCallStart(1, "b"), ToolCallDelta(1, '{"x": 1}')]


def test_content_streams_before_the_reply_ends():
    p = HERMES.stream(TOOLS)
    assert collect(p.feed("Hello there, ")).content == "Hello there,"
    assert collect(p.feed("how <tool")).content == " how"  # a partial trigger is held back, not lost
    assert collect(p.feed("kit>")).content == " <toolkit>"


def test_bare_objects_need_a_known_name_only_when_tools_are_known():
    text = '{"name": "add", "arguments": {"a": 1}}'
    assert HERMES.parse(text, TOOLS).tool_calls == []
    assert HERMES.parse(text).tool_calls == expected([("add", {"a": 1})])
    # tagged calls are calls whatever their name: the client answers an unknown one
    assert HERMES.parse(f"<tool_call>\n{text}\n</tool_call>", TOOLS).tool_calls == expected([("add", {"a": 1})])


def test_format_lookup():
    assert FORMATS["hermes"] is HERMES
    assert format_for(QWEN_TOOL_SNIPPET) is HERMES
    assert format_for(CHATML) is HERMES  # the fallback renders tools the Hermes way


QWEN_TOOL_SNIPPET = "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}"


# --- ToolCallMemory -----------------------------------------------------------


def assistant(ids, calls, content=None):
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in zip(ids, calls)]}


RAW = ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
       '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```')
CALLS = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]


def test_memory_substitutes_turns_sampled_together():
    mem = ToolCallMemory()
    mem.remember(["c1", "c2"], RAW, expected(CALLS))
    user = {"role": "user", "content": "weather?"}
    results = [{"role": "tool", "tool_call_id": "c1", "content": "sun"}]
    out = mem.substitute([user, assistant(["c1", "c2"], CALLS), *results])
    assert out == [user, {"role": "assistant", "content": RAW}, *results]
    # arguments as JSON text, as OpenAI clients send them, are the same calls
    as_text = assistant(["c1", "c2"], [(n, json.dumps(a)) for n, a in CALLS])
    assert mem.substitute([as_text]) == [{"role": "assistant", "content": RAW}]
    assert mem.raw("c2") == RAW and len(mem) == 2


@pytest.mark.parametrize("message", [
    assistant(["c1"], CALLS[:1]),  # only some of the turn's calls
    assistant(["c2", "c1"], CALLS[::-1]),  # another order
    assistant(["c1", "c9"], CALLS),  # an unknown id
    assistant(["c1", "c2"], [CALLS[0], ("get_weather", {"city": "Rome"})]),  # the client changed a call
])
def test_memory_leaves_other_turns_alone(message):
    mem = ToolCallMemory()
    mem.remember(["c1", "c2"], RAW, expected(CALLS))
    assert mem.substitute([message]) == [message]


def test_memory_persists_and_ignores_a_torn_line(tmp_path):
    path = tmp_path / "calls.jsonl"
    mem = ToolCallMemory(path)
    mem.remember(["a"], "raw a", expected(CALLS[:1]))
    mem.remember(["b", "c"], "raw bc")
    with open(path, "a") as f:
        f.write('{"ids": ["d"], "raw": "torn')  # a crash in the middle of a write
    again = ToolCallMemory(path)
    assert again.raw("a") == "raw a" and again.raw("c") == "raw bc" and again.raw("d") is None
    assert again.substitute([assistant(["a"], CALLS[:1])]) == [{"role": "assistant", "content": "raw a"}]
    assert path.read_text().endswith("\n") and len(path.read_text().splitlines()) == 2  # compacted on open
    again.remember(["e"], "raw e")
    assert ToolCallMemory(path).raw("e") == "raw e"


def test_memory_is_bounded(tmp_path):
    path = tmp_path / "calls.jsonl"
    mem = ToolCallMemory(path, capacity=10)
    for k in range(40):
        mem.remember([f"x{k}", f"y{k}"], f"raw {k}")
    assert len(mem) == 10
    assert mem.raw("x34") is None and mem.raw("y39") == "raw 39" and mem.raw("x35") == "raw 35"
    assert len(path.read_text().splitlines()) <= 20  # rewritten once it held twice the capacity
    reopened = ToolCallMemory(path, capacity=10)
    assert len(reopened) == 10 and reopened.raw("x35") == "raw 35"


def test_memory_threads(tmp_path):
    mem = ToolCallMemory(tmp_path / "calls.jsonl", capacity=500)
    stop = threading.Event()
    errors = []

    def read():
        try:
            while not stop.is_set():
                mem.substitute([assistant(["w5"], [("f", {})])])
        except Exception as e:  # noqa: BLE001 - any error from a reader thread fails the test
            errors.append(e)

    readers = [threading.Thread(target=read) for _ in range(3)]
    for t in readers:
        t.start()
    for k in range(600):
        mem.remember([f"w{k}"], f"raw {k}")
    stop.set()
    for t in readers:
        t.join()
    assert errors == [] and len(mem) == 500


# --- with Qwen's real template and model ----------------------------------------


# Token ids Qwen2.5-Coder-0.5B sampled for two prompts (greedy for the weather, temperature 0.7 seed 1 for three
# cities, through kvsession.generate.stream): the live session holds prompt + these after the reply.
SAMPLED = [
    ("What's the weather like in Paris right now?",
     [4913, 606, 788, 330, 455, 69364, 497, 330, 16370, 788, 5212, 8926, 788, 330, 59604, 497, 330, 3843, 788, 330, 66,
      40247, 30975]),
    ("Get me the weather in Paris, London and Berlin.",
     [73594, 2236, 198, 4913, 606, 788, 330, 455, 69364, 497, 330, 16370, 788, 341, 220, 330, 8926, 788, 330, 59604,
      756, 220, 330, 3843, 788, 330, 66, 40247, 698, 11248, 4913, 606, 788, 330, 455, 69364, 497, 330, 16370, 788, 341,
      220, 330, 8926, 788, 330, 39572, 756, 220, 330, 3843, 788, 330, 66, 40247, 698, 11248, 4913, 606, 788, 330, 455,
      69364, 497, 330, 16370, 788, 341, 220, 330, 8926, 788, 330, 94409, 756, 220, 330, 3843, 788, 330, 66, 40247, 698,
      11248, 73594]),
]


@pytest.mark.slow
@pytest.mark.parametrize("question,sampled", SAMPLED)
def test_substituted_turn_renders_as_the_session_holds_it(qwen, question, sampled):
    """Prefix reuse through a tool turn: the next request's prompt starts with the live session's text and
    tokens, which it does not without the memory."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a "
              "city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {
                  "type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]
    msgs = [{"role": "user", "content": question}]
    prompt = qwen.chat_prompt(msgs, tools=tools)
    session_tokens = prompt.tokens + sampled
    session_text = qwen.tokenizer.decode(session_tokens)
    raw = qwen.tokenizer.decode(sampled, skip_special=True)
    reply = HERMES.parse(raw, tools)
    assert reply.tool_calls and reply.content == ""
    ids = [f"call_{k}" for k in range(len(reply.tool_calls))]
    mem = ToolCallMemory()
    mem.remember(ids, raw, reply.tool_calls)
    turn = assistant(ids, [(c.name, json.loads(c.arguments)) for c in reply.tool_calls])
    nxt = [*msgs, turn, *({"role": "tool", "tool_call_id": i, "content": "18 C, cloudy"} for i in ids)]
    substituted = mem.substitute(nxt)
    assert substituted[1] == {"role": "assistant", "content": raw}
    again = qwen.chat_prompt(substituted, tools=tools)
    assert again.text.startswith(session_text)
    assert again.text[len(session_text):].startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n")
    assert again.tokens[:len(session_tokens)] == session_tokens
    assert not qwen.chat_prompt(nxt, tools=tools).text.startswith(session_text)  # what the memory is for
