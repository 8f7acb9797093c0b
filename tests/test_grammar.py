"""Constrained decoding: JSON schemas and tool calls, driven by random logits on the tiny model and by Qwen."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvsession.generate import TokenRules, stream
from kvsession.sampling import SamplerParams
from kvsession.server.grammar import GrammarError, Grammars
from kvsession.server.tool_formats import HERMES

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer",
     "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "ok": {"type": "boolean"},
     "none": {"type": "null"}, "x": {"type": "number"}}, "required": ["unit", "ok", "none", "x"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"},
     "minItems": 1, "maxItems": 3}, "inner": {"type": "object", "properties": {"k": {"type": "integer"}},
     "required": ["k"], "additionalProperties": False}}, "required": ["tags", "inner"], "additionalProperties": False},
    {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]}, "maxItems": 4},
    {"type": "object", "properties": {"id": {"$ref": "#/$defs/id"}}, "required": ["id"],
     "$defs": {"id": {"type": "string", "minLength": 2, "maxLength": 6}}},
]


def fn(name, props, required=None):
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": props, "required": list(props) if required is None else required}}}


TOOLS = [
    fn("get_weather", {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
       ["city"]),
    fn("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}),
    {"type": "function", "function": {"name": "now"}},  # no parameters: any object
]


def params_of(name):
    f = next(t["function"] for t in TOOLS if t["function"]["name"] == name)
    return f.get("parameters") or {"type": "object"}


@pytest.fixture(scope="module")
def grammars(tiny_engine):
    return Grammars(tiny_engine)


def assert_tojson_spacing(text):
    """Whitespace only as tojson writes it: one space after each , and : outside strings."""
    bare = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    assert not re.search(r"\s", re.sub(r"[,:] ", "", bare)) and not re.search(r"[,:](?! )", bare), text


def drive(engine, constraint, seed, *, start=(), steps=300):
    """Random logits through the constraint's mask, as the decode loop would: returns (text, ended_by)."""
    tk = engine.tokenizer
    g = torch.Generator().manual_seed(seed)
    n = engine.config.vocab_size
    # closing characters get a head start, so random replies end in tens of tokens rather than hundreds
    bonus = torch.zeros(n)
    for ch in '"}]\n':
        bonus[tk.encode(ch, add_bos=False)[0]] = 2.0
    bonus[sorted(tk.eog_ids)] = 4.0
    ids = list(start)
    for t in start:
        constraint.advance(t)
    for _ in range(steps):
        mask = constraint.allowed()
        logits = torch.randn(n, generator=g) * 2 + bonus
        if mask is not None:
            logits[~mask[:n]] = float("-inf")
        token = int(torch.argmax(logits))
        if token in tk.eog_ids:
            return tk.decode(ids), "eog"
        ids.append(token)
        constraint.advance(token)
        if constraint.done:
            return tk.decode(ids), "done"
    return tk.decode(ids), "length"


@pytest.mark.parametrize("k", range(len(SCHEMAS)))
def test_json_schema_outputs_validate(tiny_engine, grammars, k):
    factory = grammars.json(SCHEMAS[k], strict=True)
    for seed in range(15):
        text, ended = drive(tiny_engine, factory.new(), seed)
        assert ended in ("eog", "done"), text
        jsonschema.validate(json.loads(text), SCHEMAS[k])
        assert_tojson_spacing(text)


def test_any_json_object(tiny_engine, grammars):
    factory = grammars.json(None, strict=False)
    for seed in range(10):
        text, ended = drive(tiny_engine, factory.new(), seed)
        assert ended in ("eog", "done") and isinstance(json.loads(text), dict)


def test_a_finished_object_is_done(tiny_engine, grammars):
    c = grammars.json({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                       "additionalProperties": False}, strict=True).new()
    for t in tiny_engine.tokenizer.encode('{"a": 12', add_bos=False):
        assert not c.done
        c.advance(t)
    mask = c.allowed()
    eog = sorted(tiny_engine.tokenizer.eog_ids)
    assert not mask[eog].any() and mask[tiny_engine.tokenizer.encode("3", add_bos=False)[0]]
    c.advance(tiny_engine.tokenizer.encode("}", add_bos=False)[0])
    assert c.done and mask.dtype == torch.bool and c.allowed()[eog].all()


@pytest.mark.parametrize("schema,strict,match", [
    ({"type": "objekt"}, True, "objekt"),
    ({"type": "string", "pattern": "[a-"}, True, "regex"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, True, "minimum"),
    ({"not": {"type": "string"}}, True, "not"),
    ({"properties": {"a": {"$ref": "#/nowhere"}}}, False, "nowhere"),
    ([1, 2], True, "must be an object"),
])
def test_bad_schemas_raise(grammars, schema, strict, match):
    with pytest.raises(GrammarError, match=match):
        grammars.json(schema, strict=strict)


def test_unimplemented_keywords_are_ignored_when_not_strict(grammars, tiny_engine):
    # "not" is dropped, not enforced: any JSON value is allowed, and each one written is complete
    factory = grammars.json({"not": {"type": "string"}}, strict=False)
    for seed in range(3):
        text, ended = drive(tiny_engine, factory.new(), seed)
        assert ended in ("done", "eog"), text
        json.loads(text)  # a complete value, whatever its type


def check_calls(text, *, only=None):
    reply = HERMES.parse(text, TOOLS)
    assert reply.tool_calls and reply.content == "", text
    for call in reply.tool_calls:
        assert only is None or call.name == only
        jsonschema.validate(json.loads(call.arguments), params_of(call.name))
    return reply.tool_calls


def test_required_calls(tiny_engine, grammars):
    for parallel in (True, False):
        factory = grammars.tool_calls(HERMES, TOOLS, "required", parallel)
        for seed in range(10):
            text, ended = drive(tiny_engine, factory.new(), seed)
            assert text.startswith('<tool_call>\n{"name": "') and ended in ("eog", "done")
            calls = check_calls(text)
            if not parallel:
                assert len(calls) == 1 and ended == "done"


def test_named_call(tiny_engine, grammars):
    factory = grammars.tool_calls(HERMES, TOOLS, {"type": "function", "function": {"name": "add"}}, True)
    for seed in range(8):
        text, ended = drive(tiny_engine, factory.new(), seed)
        assert ended == "done" and len(check_calls(text, only="add")) == 1


def test_tool_choice_errors(grammars):
    with pytest.raises(GrammarError, match="'nope', which is not among the tools"):
        grammars.tool_calls(HERMES, TOOLS, {"type": "function", "function": {"name": "nope"}}, True)
    with pytest.raises(GrammarError, match="no tools"):
        grammars.tool_calls(HERMES, [], "required", True)
    with pytest.raises(GrammarError, match="tool_choice must be"):
        grammars.tool_calls(HERMES, TOOLS, "sometimes", True)
    with pytest.raises(GrammarError, match=r"tools\[0\] \(bad\)"):
        grammars.tool_calls(HERMES, [fn("bad", {"x": {"type": "objekt"}})], "auto", True)
    with pytest.raises(GrammarError, match=r"tools\[1\]: needs"):
        grammars.tool_calls(HERMES, [TOOLS[0], {"type": "function"}], "auto", True)
    assert grammars.tool_calls(HERMES, [], "auto", True) is None
    assert grammars.tool_calls(HERMES, TOOLS, "none", True) is None  # the tiny vocabulary has no <tool_call> token


@pytest.mark.parametrize("opening", ["Let me look.\n<tool_call>", "<tool_call>", '{"', "```json\n", "  {"])
def test_auto_constrains_once_a_call_begins(tiny_engine, grammars, opening):
    factory = grammars.tool_calls(HERMES, TOOLS, "auto", False)
    tk = tiny_engine.tokenizer
    for seed in range(6):
        c = factory.new()
        assert bool(c.allowed().all())  # every opening the tiny vocabulary has begins free text or a call
        text, ended = drive(tiny_engine, c, seed, start=tk.encode(opening, add_bos=False))
        assert ended == "done", text
        reply = HERMES.parse(text, TOOLS)
        assert reply.content == (opening.split("<tool_call>")[0].strip() if "<tool_call>" in opening else "")
        assert len(reply.tool_calls) == 1
        jsonschema.validate(json.loads(reply.tool_calls[0].arguments), params_of(reply.tool_calls[0].name))


def test_auto_leaves_other_replies_free(tiny_engine, grammars):
    factory = grammars.tool_calls(HERMES, TOOLS, "auto", False)
    tk = tiny_engine.tokenizer
    for text in ["```python\nprint(1)\n", "Hello {world}", "[1, 2]"]:
        c = factory.new()
        for t in tk.encode(text, add_bos=False):
            c.advance(t)
            assert c.allowed() is None and not c.done


def test_auto_after_one_call_ends_or_goes_on(tiny_engine, grammars):
    tk = tiny_engine.tokenizer
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    eog = sorted(tk.eog_ids)
    for parallel in (True, False):
        c = grammars.tool_calls(HERMES, TOOLS, "auto", parallel).new()
        for t in tk.encode(call, add_bos=False):
            c.advance(t)
        assert c.done is (not parallel)
        if parallel:
            mask = c.allowed()
            assert mask[eog].all() and mask[tk.encode("\n", add_bos=False)[0]] and int(mask.sum()) == 1 + len(eog)


# --- Qwen: its real vocabulary and logits -----------------------------------------


@pytest.mark.slow
def test_qwen_tool_choices(qwen):
    g = Grammars(qwen)
    assert g.n_vocab == 151_936
    weather = [TOOLS[0]]
    prompt = qwen.chat_prompt([{"role": "user", "content": "What's the weather in Paris?"}], tools=weather)
    trigger = qwen.tokenizer.tokens.index("<tool_call>")
    none = g.tool_calls(HERMES, weather, "none", True).new()
    assert not none.allowed()[trigger] and int(none.allowed().sum()) == 151_935

    auto = g.tool_calls(HERMES, weather, "auto", True).new()  # a reply opened by `{` must open a call
    tk = qwen.tokenizer
    opening = auto.allowed()
    assert not opening[tk.tokens.index("{{")] and opening[tk.tokens.index("{")] and opening[tk.tokens.index('{"')]
    assert opening[tk.tokens.index("Hello")] and opening[trigger]
    auto.advance(tk.tokens.index("Hello"))
    assert auto.allowed() is None  # free text from there on costs nothing

    factory = g.tool_calls(HERMES, weather, "required", False)
    session = qwen.session(sampler=SamplerParams(temperature=0))
    text = "".join(d.text for d in stream(session, prompt.tokens, max_tokens=40,
                                          rules=TokenRules(constraint=factory.new())))
    assert text == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                    '</tool_call>')
