"""Chat rendering with the model's own template (tokenizer.chat_template).

The template is Jinja2, rendered in a sandbox the way Hugging Face's
apply_chat_template renders it (same globals: raise_exception, strftime_now;
llama.cpp's date_string and datetime (today());
same filter: tojson, which is json.dumps with ensure_ascii=False and the
default separators), so the templates shipped in GGUF files work unchanged.

Messages are OpenAI-style: a role, a string content (None for an assistant
turn that only calls tools: rendered as "", as llama.cpp does, since Qwen3's
template and others test `'</think>' in message.content`), `tool_calls` with
arguments as a dict, `tool` turns holding a call's result, and an
assistant's `reasoning_content` (its thinking), handed to the template under
the two names templates read it by: `reasoning_content` (Qwen3's, which
shows it for the turns after the last user message) and `thinking`
(gpt-oss's). A template that knows tools (Qwen's) gets `tools` and the
messages as they are; FireFunction v2's, which reads `functions`, gets them
there as llama.cpp writes them (JSON with an indent of 2). One that does not (SmolLM2's, the built-in CHATML and
GEMMA) gets a Hermes-style rewrite, the same text Qwen's template would
produce: a system block listing the tools, each call as
`<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` inside the
assistant's text, results as `<tool_response>` blocks in a user turn. So
tools work, as text, on every model. One that lists tools but renders no
calls (Granite 3's) gets the tools, and each turn's calls in its text as the
template tells the model to write them (`<|tool_call|>[...]`).

A request may set the template's own variables (`variables`: OpenAI's
`chat_template_kwargs`, such as Qwen3's `enable_thinking`, and gpt-oss's
`reasoning_effort`); the names the renderer sets itself are refused.

Guarding control tokens: `render_guarded` wraps every piece of control-token
text found in caller strings (contents, tool arguments, tool definitions)
in two noncharacter markers before rendering, and after rendering turns the
markers into character spans of the output (`literals`). The tokenizer then
reads those spans as plain text (Tokenizer.encode_guarded), so a user who
types `<|im_end|><|im_start|>system` gets those characters, not a new turn,
while the template's own markup keeps its control tokens. Only control text
is wrapped, so an ordinary conversation renders exactly as before.
"""
from __future__ import annotations

import datetime
import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import TemplateError

# Used when a file carries no template. ChatML is what SmolLM2 and Qwen2 use;
# Gemma's turns (the GGUF of Gemma 3 270M ships without a template) put a
# system message in front of the first user turn and call the assistant "model".
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + message['content'] | trim + "
    "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
DEFAULT_TEMPLATES = {"gemma3": GEMMA}

ROLES = ("system", "user", "assistant", "tool")

# The Hermes-style tool block, word for word as Qwen2.5's template writes it (after the system text).
TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                "\"arguments\": <args-json-object>}\n</tool_call>")

# The names render() sets itself, which a request's template variables may not.
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
                      "strftime_now"})

# Noncharacters (never meant for interchange) that bracket control-token text from callers while rendering.
_MARKERS = [(chr(0xFDD0 + 2 * i), chr(0xFDD1 + 2 * i)) for i in range(16)]


def tojson(x: Any, indent: int | None = None) -> str:
    """Hugging Face's tojson filter: what a template writes for a dict (tool definitions, call arguments)."""
    return json.dumps(x, ensure_ascii=False, indent=indent)


def today() -> dict[str, str]:
    """The date as llama.cpp gives it to every template (Llama 3.1's "Today Date: {date_string}", firefunction's
    "Today is {datetime}"); a request's chat_template_kwargs may pin either, so that a conversation's prompt does
    not change at midnight."""
    now = datetime.datetime.now()
    return {"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y")}


def _raise(message: str):
    raise TemplateError(message)


@dataclass(frozen=True)
class Rendered:
    text: str
    literals: tuple[tuple[int, int], ...]  # [start, end) character spans of control-token text typed by callers


@dataclass(frozen=True)
class ChatPrompt:
    text: str  # the rendered prompt
    tokens: list[int]
    literals: tuple[tuple[int, int], ...] = ()  # [start, end) spans of `text` to tokenize as plain text

    def tokens_from(self, tokenizer, start: int) -> list[int]:
        """The tokens of text[start:] (no BOS), with the same guarding: for a prompt whose first `start`
        characters a session already holds."""
        shifted = [(max(a, start) - start, b - start) for a, b in self.literals if b > start]
        return tokenizer.encode_guarded(self.text[start:], shifted, add_bos=False)


class ChatTemplate:
    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "", arch: str = ""):
        self.source = source or DEFAULT_TEMPLATES.get(arch, CHATML)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: tojson(x, indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            tree = env.parse(self.source)  # parsed once: compiled, and read for the variables it takes
            self._template = env.from_string(tree)
            read = meta.find_undeclared_variables(tree)
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template does not compile: {e}") from e
        self.bos_token = bos_token
        self.eos_token = eos_token
        # A template that reads `tools` lists them itself, and one that reads `tool_calls` renders calls; one that
        # does neither gets the Hermes rewrite, one that only lists tools gets each turn's calls as text.
        # FireFunction v2's reads `functions` instead: the tools as JSON text, as llama.cpp gives it
        self.reads_functions = "functions" in read
        self.lists_tools = bool(re.search(r"\btools\b", self.source)) or self.reads_functions
        self.renders_calls = bool(re.search(r"\btool_calls\b", self.source))
        self.supports_tools = self.lists_tools and self.renders_calls

    def render(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
               add_generation_prompt: bool = True, continue_final: bool = False,
               variables: dict | None = None) -> str:
        """The prompt text: `messages` (and `tools`) through the template, with the caller's own template
        `variables` (check_variables).

        continue_final: the last message is an assistant turn to be continued; the text ends with its content,
        the turn left open."""
        return self.render_guarded(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                   continue_final=continue_final, variables=variables).text

    def render_guarded(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                       add_generation_prompt: bool = True, continue_final: bool = False,
                       variables: dict | None = None, control: re.Pattern | None = None) -> Rendered:
        """`render`, plus the spans of the text where caller strings held control-token text (`control`
        matches it; None: no guarding)."""
        messages = [_checked_message(i, m) for i, m in enumerate(messages)]
        tools = _checked_tools(tools)
        variables = check_variables(variables)
        partial = None
        if continue_final:
            if not messages or messages[-1]["role"] != "assistant" or messages[-1].get("tool_calls"):
                raise TemplateError("continue_final: the last message must be an assistant message with text "
                                    "content and no tool_calls")
            partial = messages.pop()["content"] or ""
            add_generation_prompt = True
        open_, close = _markers_for(messages, tools, partial, variables)
        if control is not None:
            wrap = _wrapper(control, open_, close)
            messages, tools, partial, variables = wrap(messages), wrap(tools), wrap(partial), wrap(variables)
        # after the guarding: what the rewrites write around the callers' strings is markup, not their text
        if not self.lists_tools:
            messages, tools = hermes_messages(messages, tools), None
        elif not self.renders_calls:
            messages = calls_as_text(messages, granite="<|tool_call|>" in self.source)
        if not messages and not add_generation_prompt:
            raise TemplateError("no messages to render")
        if self.reads_functions:  # llama.cpp's: the tools dumped with an indent of 2 (keys sorted), "" for none
            variables = {"functions": json.dumps(tools, ensure_ascii=False, indent=2, sort_keys=True)
                         if tools else ""} | variables
            tools = None
        try:
            text = self._template.render(
                **(today() | variables),
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError) as e:
            raise TemplateError(f"chat template failed: {e}") from e
        return _unmark(text + (partial or ""), open_, close)


# --- validation ---------------------------------------------------------------


def check_variables(variables: dict | None) -> dict:
    """A request's template variables, refused where they would replace what the renderer sets."""
    variables = dict(variables or {})
    for name in variables:
        if not isinstance(name, str) or not name.isidentifier():
            raise TemplateError(f"chat_template_kwargs: {name!r} is not a template variable name")
        if name in RESERVED:
            raise TemplateError(f"chat_template_kwargs: {name!r} is set by the server, not the request")
    return variables


def _checked_message(i: int, m: Any) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise TemplateError(f"message {i}: needs a role in {ROLES}, got {m!r}")
    out = dict(m)
    reasoning = out.pop("reasoning_content", None)
    if reasoning is not None:
        if m["role"] != "assistant" or not isinstance(reasoning, str):
            raise TemplateError(f"message {i}: reasoning_content is an assistant message's string, got {reasoning!r}")
        if reasoning:
            out["reasoning_content"] = out["thinking"] = reasoning
    calls = m.get("tool_calls")
    if calls:
        if m["role"] != "assistant":
            raise TemplateError(f"message {i}: only an assistant message can have tool_calls")
        if not isinstance(calls, list):
            raise TemplateError(f"message {i}: tool_calls must be a list, got {calls!r}")
        out["tool_calls"] = [_checked_call(i, j, c) for j, c in enumerate(calls)]
        if m.get("content") is not None and not isinstance(m["content"], str):
            raise TemplateError(f"message {i}: content must be a string or null, got {m['content']!r}")
        out["content"] = m.get("content") or ""
    else:
        out.pop("tool_calls", None)
        if not isinstance(m.get("content"), str):
            raise TemplateError(f"message {i}: needs a string content, got {m!r}")
    return out


def _checked_call(i: int, j: int, c: Any) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise TemplateError(f"message {i}: tool_calls[{j}] needs function.name, got {c!r}")
    args = fn.get("arguments", {})
    if isinstance(args, str):  # arguments as OpenAI sends them, JSON text
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise TemplateError(f"message {i}: tool_calls[{j}].function.arguments is not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise TemplateError(f"message {i}: tool_calls[{j}].function.arguments must be a JSON object, got {args!r}")
    return {**c, "type": c.get("type", "function"), "function": {**fn, "arguments": args}}


def _checked_tools(tools: Sequence[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    for k, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise TemplateError(f"tools[{k}]: needs {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                                f"got {t!r}")
    return list(tools)


# --- the Hermes rewrite -------------------------------------------------------


def tools_system_text(system: str | None, tools: Sequence[dict]) -> str:
    """A system message's text with the tool block after it, as Qwen2.5's template writes it."""
    block = TOOLS_HEADER + "".join("\n" + tojson(t) for t in tools) + TOOLS_FOOTER
    return f"{system}\n\n{block}" if system is not None else block


def tool_call_text(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {tojson(arguments)}}}\n</tool_call>'


def hermes_calls_text(calls: list[dict]) -> str:
    return "\n".join(tool_call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls)


def granite_calls_text(calls: list[dict]) -> str:
    """A turn's calls as Granite 3's template asks the model for them: the marker and a JSON list."""
    return "<|tool_call|>" + tojson([{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                     for c in calls])


def calls_as_text(messages: list[dict], *, granite: bool) -> list[dict]:
    """Messages whose assistant calls are written into the assistant's text, for a template that lists tools but
    renders no calls: as Granite 3's writes them, else in Hermes tags."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = (granite_calls_text if granite else hermes_calls_text)(m["tool_calls"])
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{m['content']}\n{calls}" if m.get("content") else calls
        out.append(m)
    return out


def hermes_messages(messages: list[dict], tools: Sequence[dict] | None) -> list[dict]:
    """Messages with tools, tool calls and tool results written as plain text, for a template without tools.

    The text equals what Qwen2.5's template makes of the same conversation: without a system message the tool
    block stands alone (Qwen would add its own default system line first)."""
    out: list[dict] = []
    if tools:
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": tools_system_text(messages[0]["content"], tools)})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": tools_system_text(None, tools)})
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = hermes_calls_text(m["tool_calls"])
            out.append({"role": "assistant", "content": f"{m['content']}\n{calls}" if m.get("content") else calls})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    for m in out:
        m.pop("_tool_results", None)
    return out


# --- guarding control-token text ----------------------------------------------


def _strings(x: Any):
    if isinstance(x, str):
        yield x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _strings(v)


def _markers_for(*values: Any) -> tuple[str, str]:
    """A pair of markers that no caller string contains (a string holding all 32 is refused)."""
    used = set()
    for s in _strings(values):
        used.update(c for c in s if "\ufdd0" <= c <= "\ufdef")
    for pair in _MARKERS:
        if pair[0] not in used and pair[1] not in used:
            return pair
    raise TemplateError("message contents use every character U+FDD0..U+FDEF; cannot render them safely")


def _wrapper(control: re.Pattern, open_: str, close: str):
    def wrap(x: Any) -> Any:
        if isinstance(x, str):
            return control.sub(lambda m: open_ + m.group() + close, x)
        if isinstance(x, dict):
            return {k: wrap(v) for k, v in x.items()}
        if isinstance(x, list):
            return [wrap(v) for v in x]
        return x

    return wrap


def _unmark(text: str, open_: str, close: str) -> Rendered:
    if open_ not in text:
        return Rendered(text, ())
    out: list[str] = []
    spans: list[tuple[int, int]] = []
    n = 0
    start = None
    for piece in re.split(f"({re.escape(open_)}|{re.escape(close)})", text):
        if piece == open_ or piece == close:
            if (piece == open_) != (start is None):
                raise TemplateError("the chat template split a message's control-token text; cannot render it "
                                    "safely")
            if piece == open_:
                start = n
            else:
                spans.append((start, n))
                start = None
            continue
        out.append(piece)
        n += len(piece)
    if start is not None:
        raise TemplateError("the chat template cut a message's control-token text; cannot render it safely")
    return Rendered("".join(out), tuple(spans))
