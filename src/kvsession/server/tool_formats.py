"""How each template family writes a reply: its reasoning, its content and its tool calls.

One format per family, each with its own detect() on the chat template's
source, registered most specific first, Hermes last as the fallback
(template.py renders tools the Hermes way for templates that know none).
A format gives the reply's parser, stream(), whose events add up to what
parse() makes of the whole reply whatever the chunking, and the pieces
grammar.py builds forced and lazy calls from (Lark, with each tool's
arguments as `%json` of its schema).

    format        detected by                         a call
    qwen3-coder   <tool_call>, <function=, <parameter=  <tool_call>\\n<function=N>\\n<parameter=A>\\nV\\n
                                                      </parameter>\\n</function>\\n</tool_call>
    harmony       <|channel|> (gpt-oss)               <|channel|>commentary to=functions.N <|constrain|>json
                                                      <|message|>{...}
    llama3        <|python_tag|>, Environment: ipython  a reply that is {"name": N, "parameters": {...}}
    granite       <|tool_call|> (Granite 3.x)         <|tool_call|>[{"name": N, "arguments": {...}}, ...]
    hermes        <tool_call>, and every other        <tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>

Reasoning. A template that writes `<think>` (Qwen3, QwQ, SmolLM3,
DeepSeek-R1's distills, Granite 3.3) gets its format with think tags
(for_template): a reply's leading `<think>...</think>` is reasoning, apart
from content, and where the prompt itself ends with `<think>` (DeepSeek-R1's
template opens it for the model) the reply starts inside it. gpt-oss
writes its reasoning in the analysis channel.

What Qwen2.5-Coder really emits. Eleven prompts (weather, read a file,
calculator, two tools, three parallel cities, a tool result to answer, a
haiku with tools present, an agent listing a folder, a web search, fixing a
bug after reading the file, running the tests), rendered by Engine.chat_prompt
with Qwen's own template, each greedy and twice at temperature 0.7:

- 0.5B (33 replies): never the `<tool_call>` tags its template asks for.
  12 bare JSON objects `{"name": ..., "arguments": {...}}` as the whole
  reply: 10 calls (one stopped a `}` short at EOS), 2 calls to a tool that
  does not exist (`add`, after reading add.py). 15 in a ```json fence: 12
  calls (most pretty-printed over several lines; one fence holding three
  calls, one per line), 3 not calls (the tool's definition echoed back,
  `{"type": "file", ...}`). 6 plain text: the haiku (right), and "run the
  tests" answered with a shell snippet instead of a run_shell call.
- 1.5B (33 replies): no tags either. 28 fenced calls (pretty-printed; the
  three-city prompt answered by one call whose string `city` is an array,
  which only the grammar prevents; one call with an extra "response" key),
  2 bare (one a `}` short at EOS, one `{{...}}}`, not JSON), 3 haiku.
- Both call the tool again after its result instead of answering (6/6),
  when the history shows the call as they wrote it. Shown the same call in
  the template's `<tool_call>` tags before the result, the 1.5B answers
  (greedy, a Write call and "File created successfully"); the 0.5B still
  calls again. So a call's echo renders as the template writes it unless
  the model wrote it in tags itself (tools.ToolCallMemory).

So the Hermes parser accepts, besides tagged calls anywhere in the reply
(closing tag optional at the end): a reply that is nothing but one or more
call objects, bare or in a ```json / ``` fence (inside a fence or the tags,
also a JSON list of them); arguments given as a JSON string holding an
object; up to three missing closing braces after a last `}` at the end (not
after other text: a reply cut by max_tokens is not a call). An untagged
object is a call only if it has "name" and "arguments" and, when the
request's tools are known, names one of them: a plain JSON answer stays
text. Text that looks like a call but is not one stays content, character
for character: nothing is ever dropped except the whitespace between
content and calls (which the template puts back when it renders the calls).
Llama 3's bare objects and Granite's lists are read by the same code.
"""
from __future__ import annotations

import copy
import json
import re
from typing import Protocol, Sequence

from .tools import ContentDelta, Event, ParsedReply, ReasoningDelta, ToolCall, ToolCallDelta, ToolCallStart, \
    collect, tool_names

WS = " \t\r\n"
THINK = ("<think>", "</think>")

# --- reading call objects -----------------------------------------------------

_FENCE = re.compile(r"```(json)?[ \t]*\n")
_MAX_REPAIR = 3  # closing braces added to an object that ended short at EOS


def _call(obj, names: frozenset[str] | None, keys: tuple[str, ...]) -> ToolCall | None:
    """A call from one decoded JSON value: {"name": str, KEY: object or JSON text of one}, KEY the first of
    `keys` the object has."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in keys if k in obj), None)
    if key is None:
        return None
    args = obj[key]
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict) or (names is not None and obj["name"] not in names):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _calls_in(body: str, names: frozenset[str] | None, keys: tuple[str, ...], *,
              complete: bool) -> list[ToolCall] | None:
    """The calls `body` consists of (objects or lists of them, separated by whitespace), or None if it holds
    anything else. complete=False: the body ended at EOS, so its last object may lack closing braces."""
    dec = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos, n = 0, len(body)
    while True:
        while pos < n and body[pos] in WS:
            pos += 1
        if pos == n:
            return calls or None
        try:
            value, pos = dec.raw_decode(body, pos)
        except json.JSONDecodeError:
            rest = body[pos:].rstrip()
            if complete or not rest.endswith("}"):  # repair only an object whose inner ones all closed
                return None
            for k in range(1, _MAX_REPAIR + 1):
                try:
                    value, end = dec.raw_decode(rest + "}" * k)
                except json.JSONDecodeError:
                    continue
                if end == len(rest) + k:
                    break
            else:
                return None
            pos = n
        for item in value if isinstance(value, list) else [value]:
            call = _call(item, names, keys)
            if call is None:
                return None
            calls.append(call)


def _partial_suffix(text: str, word: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `word`."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:n]):
            return n
    return 0


def lark_str(s: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(s, ensure_ascii=False)


def _seq(*pieces: str) -> str:
    """Lark pieces in a row, the empty ones left out ("" is not a literal llguidance takes)."""
    return " ".join(p for p in pieces if p)


# --- the format interface -----------------------------------------------------


class ToolCallStream(Protocol):
    def feed(self, delta: str) -> list[Event]:
        """Events for what `delta` settles; text that may still belong to a call (or a tag) is held back."""

    def finish(self) -> list[Event]:
        """The reply ended: events for everything held back."""


class ToolFormat:
    """How one template family writes replies: its parser, and the pieces grammar.py builds calls from.

    The methods' defaults read calls between tags (Hermes, Qwen3-Coder, Granite): `trigger` opens one anywhere
    in a reply, `closer` ends it (or the next trigger, or the reply's end), body_calls() reads what is between;
    a family that writes calls another way (harmony) overrides stream()."""

    name: str = ""
    trigger: str = ""  # text that opens a call anywhere in a reply ("": calls stand alone): the lazy trigger
    closer: str = ""  # text that closes a call ("": it runs to the next trigger or the reply's end)
    call_open: str = ""  # a forced call's text before its body (beginning with the trigger, where there is one)
    call_close: str = ""  # ... and after it
    separator: str = ""  # between two calls of one reply
    single_call: bool = False  # a reply holds at most one call
    arguments_keys: tuple[str, ...] = ("arguments",)  # a call object's arguments, under the first key it has
    bare_opens: str = ""  # characters a reply made only of call objects may open with ("": it never is)
    bare_prefix: str = ""  # a marker such a reply may begin with
    bare_fences: tuple[str, ...] = ()  # fences it may sit in, closed by "\n```"
    think: tuple[str, str] | None = None  # reasoning tags, where the template writes them (for_template)

    def detect(self, template_source: str) -> bool:
        raise NotImplementedError

    def for_template(self, template_source: str) -> "ToolFormat":
        """This format as the template uses it: with think tags when the template writes them."""
        if THINK[0] in template_source and THINK[1] in template_source:
            fmt = copy.copy(self)
            fmt.think = THINK
            return fmt
        return self

    def stream(self, tools: Sequence[dict] | None = None, *, calls: bool = True,
               in_reasoning: bool = False) -> ToolCallStream:
        """A parser for one reply. calls=False: the request offered no tools to call, so none are read.
        in_reasoning: the prompt ends inside the think tags (opens_reasoning)."""
        inner = TaggedStream(self, tools) if calls else PlainStream()
        return ThinkStream(inner, self.think, in_reasoning) if self.think else inner

    def parse(self, text: str, tools: Sequence[dict] | None = None, *, calls: bool = True,
              in_reasoning: bool = False) -> ParsedReply:
        """The whole reply's content, calls and reasoning; equal to what stream() makes of it, whatever the
        chunking."""
        p = self.stream(tools, calls=calls, in_reasoning=in_reasoning)
        return collect([*p.feed(text), *p.finish()])

    def opens_reasoning(self, prompt_text: str) -> bool:
        """Whether a prompt leaves its reply inside the reasoning (the template wrote the opening tag)."""
        return self.think is not None and prompt_text.rstrip(WS).endswith(self.think[0])

    def remembers(self, raw: str) -> bool:
        """Whether the text sampled for a call turn may stand in for its calls when the turn comes back
        (tools.ToolCallMemory): only text in the format's own syntax (Frontend.remember says why)."""
        return self.trigger in raw

    def history(self, messages: list[dict]) -> list[dict]:
        """The conversation as the family's template takes it: as it is, unless the family says otherwise."""
        return messages

    # --- reading ---

    def body_calls(self, body: str, *, complete: bool, tools: Sequence[dict] | None) -> list[ToolCall] | None:
        """The calls between a trigger and its closer (None: not calls). complete=False: cut by the reply's
        end. Names are not checked: the tags say these are calls."""
        inner = body.strip(WS)
        m = _FENCE.match(inner)
        if m is not None and inner.endswith("```"):
            inner = inner[m.end():-3]
        return _calls_in(inner, None, self.arguments_keys, complete=complete)

    def _bare_body(self, text: str) -> tuple[str, bool] | None:
        """A maybe-bare reply without its marker and fence opening: (the objects, whether a fence holds them)."""
        s = text.strip(WS)
        if self.bare_prefix and s.startswith(self.bare_prefix):
            s = s[len(self.bare_prefix):].lstrip(WS)
        if self.bare_fences and s.startswith("```"):
            m = _FENCE.match(s)
            return (s[m.end():], True) if m is not None else None
        return (s, False) if s[:1] and s[0] in self.bare_opens else None

    def reply_start(self, text: str) -> bool | None:
        """Whether a reply beginning with `text` is call objects without the trigger (True), is not (False), or
        cannot tell yet (None)."""
        if not self.bare_opens:
            return False
        s = text.lstrip(WS)
        if self.bare_prefix:
            if s.startswith(self.bare_prefix):
                s = s[len(self.bare_prefix):].lstrip(WS)
            elif self.bare_prefix.startswith(s):
                return None
        if not s:
            return None
        if s[0] in self.bare_opens:
            return True
        if self.bare_fences and s.startswith("```"):
            if "\n" not in s:
                return None if len(s) < 16 else False
            return _FENCE.match(s) is not None
        return None if self.bare_fences and "```".startswith(s) else False

    def bare_calls(self, text: str, names: frozenset[str] | None) -> list[ToolCall] | None:
        """The calls of a reply that is nothing but call objects (bare, or fenced)."""
        found = self._bare_body(text)
        if found is None:
            return None
        inner, fenced = found
        closed = fenced and inner.endswith("```")
        return _calls_in(inner[:-3] if closed else inner, names, self.arguments_keys, complete=closed)

    def not_bare(self, text: str, names: frozenset[str] | None) -> bool:
        """Early answer for a reply held as maybe-bare: its first JSON value is complete and is not a call."""
        found = self._bare_body(text)
        s = found[0] if found is not None else text.strip(WS)
        try:
            value, _ = json.JSONDecoder().raw_decode(s)
        except json.JSONDecodeError:
            return False
        values = value if isinstance(value, list) else [value]
        return any(_call(v, names, self.arguments_keys) is None for v in values)

    # --- grammar (grammar.py) ---

    def body_lark(self, k: int, name: str, params: dict) -> str:
        """Lark rules defining `body_k`: one call of the tool `name`, whose arguments match `params`."""
        prefix = '{"name": "' + name + '", "' + self.arguments_keys[0] + '": '
        return f"body_{k}: {lark_str(prefix)} %json {json.dumps(params)} \"}}\""

    def _more(self, call: str, parallel: bool) -> str:
        return f" ({_seq(lark_str(self.separator) if self.separator else '', call)})*" \
            if parallel and not self.single_call else ""

    def forced_lark(self, parallel: bool) -> str:
        """The start rule of a reply made of calls from its first token (tool_choice required or named)."""
        call = _seq(lark_str(self.call_open) if self.call_open else "", "body",
                    lark_str(self.call_close) if self.call_close else "")
        return f"start: {call}{self._more(call, parallel)}"

    def after_trigger_lark(self, parallel: bool) -> str | None:
        """The start rule of what follows the trigger (tool_choice auto); None: no trigger."""
        if not self.trigger:
            return None
        rest = self.call_open[len(self.trigger):]
        close = lark_str(self.call_close) if self.call_close else ""
        call = _seq(lark_str(self.call_open), "body", close)
        return f"start: {_seq(lark_str(rest) if rest else '', 'body', close)}{self._more(call, parallel)}"

    def bare_lark(self, parallel: bool) -> str | None:
        """The start rule of a reply made of bare or fenced call objects (tool_choice auto); None: no such
        replies."""
        if not self.bare_opens:
            return None
        objects = "body" + self._more("body", parallel)
        fenced = f" | ({' | '.join(lark_str(f) for f in self.bare_fences)}) {objects} {lark_str(chr(10) + '```')}" \
            if self.bare_fences else ""
        return f"start: WS? ({objects}{fenced})\nWS: /[ \\t\\r\\n]+/"


# --- calls between tags, and plain text -----------------------------------------


class TaggedStream:
    """The tagged-calls parser, incremental. Holds back only what may still turn out to be part of a call: a
    reply that may be bare call objects, a partial trigger, a call until it closes, whitespace next to a call."""

    def __init__(self, fmt: ToolFormat, tools: Sequence[dict] | None):
        self.fmt = fmt
        self.tools = tools
        self.names = tool_names(tools)
        self.mode = "start" if fmt.bare_opens else "text"  # start | bare | text | call
        self.buf = ""  # start/bare: the whole reply so far; text: not yet emitted; call: the call's body so far
        self.held_ws = ""  # text mode: whitespace held back, dropped if a call follows
        self.after_call = False  # the last thing parsed was a valid call
        self.count = 0  # calls emitted

    def feed(self, delta: str) -> list[Event]:
        self.buf += delta
        return self._run(final=False)

    def finish(self) -> list[Event]:
        out = self._run(final=True)
        if self.mode == "call":
            out += self._close_call(self.buf, complete=False)
            self.buf = ""
            self.mode = "text"
        if self.mode == "text":
            out += self._content(self.buf, final=True)
            self.buf = ""
        return out

    def _run(self, final: bool) -> list[Event]:
        fmt = self.fmt
        out: list[Event] = []
        while True:
            if self.mode == "start":
                verdict = fmt.reply_start(self.buf)
                if verdict is None and not final:
                    return out
                self.mode = "bare" if verdict else "text"
            elif self.mode == "bare":
                calls = fmt.bare_calls(self.buf, self.names) if final else None
                if calls is not None:
                    for c in calls:
                        out += self._emit_call(c)
                    self.buf = ""
                    return out
                if final or fmt.not_bare(self.buf, self.names):
                    self.mode = "text"
                    continue
                return out
            elif self.mode == "text":
                i = self.buf.find(fmt.trigger) if fmt.trigger else -1
                if i < 0:
                    keep = _partial_suffix(self.buf, fmt.trigger) if fmt.trigger and not final else 0
                    out += self._content(self.buf[: len(self.buf) - keep], final=False)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                out += self._content(self.buf[:i], final=False)
                self.buf = self.buf[i + len(fmt.trigger):]
                self.mode = "call"
            else:  # call: its body runs to the closer, or to the next trigger (a call left open)
                j = self.buf.find(fmt.closer) if fmt.closer else -1
                k = self.buf.find(fmt.trigger)
                if j < 0 and k < 0:
                    return out
                if j >= 0 and (k < 0 or j < k):
                    body, rest, closer = self.buf[:j], self.buf[j + len(fmt.closer):], fmt.closer
                else:
                    body, rest, closer = self.buf[:k], self.buf[k:], ""
                out += self._close_call(body, complete=True, closer=closer)
                self.buf = rest
                self.mode = "text"

    def _close_call(self, body: str, *, complete: bool, closer: str = "") -> list[Event]:
        calls = self.fmt.body_calls(body, complete=complete, tools=self.tools)
        if calls is None:  # not a call after all: all of it is content
            return self._content(self.fmt.trigger + body + closer, final=False)
        out: list[Event] = []
        for c in calls:
            out += self._emit_call(c)
        return out

    def _emit_call(self, call: ToolCall) -> list[Event]:
        self.held_ws = ""
        self.after_call = True
        self.count += 1
        return [ToolCallStart(self.count - 1, call.name), ToolCallDelta(self.count - 1, call.arguments)]

    def _content(self, text: str, *, final: bool) -> list[Event]:
        """Emit text, holding back trailing whitespace (dropped if a call comes next, or if the reply ends right
        after a call)."""
        if final:
            text, self.held_ws = ("" if self.after_call and not text.strip() else self.held_ws + text), ""
            return [ContentDelta(text)] if text else []
        body = text.rstrip(WS)
        if not body:
            self.held_ws += text
            return []
        out = self.held_ws + body
        self.held_ws = text[len(body):]
        self.after_call = False
        return [ContentDelta(out)]


class PlainStream:
    """A reply read for no calls: all of it is content."""

    def feed(self, delta: str) -> list[Event]:
        return [ContentDelta(delta)] if delta else []

    def finish(self) -> list[Event]:
        return []


class ThinkStream:
    """A reply's leading `<think>...</think>` as reasoning; what follows goes to the format's own parser.

    The whitespace inside the tags' edges and right after the closing tag is the template's layout, not
    the model's words (Qwen3's renders `<think>\\n` + reasoning + `\\n</think>\\n\\n` + content): dropped."""

    def __init__(self, inner: ToolCallStream, tags: tuple[str, str], in_reasoning: bool):
        self.inner = inner
        self.open, self.close = tags
        self.mode = "think" if in_reasoning else "start"  # start | think | after | rest
        self.buf = ""
        self.held = ""  # think: the reasoning's trailing whitespace so far
        self.began = False  # think: some reasoning was emitted (leading whitespace is dropped until then)

    def feed(self, delta: str) -> list[Event]:
        self.buf += delta
        return self._run(final=False)

    def finish(self) -> list[Event]:
        return self._run(final=True) + self.inner.finish()

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self.mode == "start":
                s = self.buf.lstrip(WS)
                if s.startswith(self.open):
                    self.buf, self.mode = s[len(self.open):], "think"
                elif self.open.startswith(s) and not final:
                    return out
                else:
                    self.mode = "rest"
            elif self.mode == "think":
                i = self.buf.find(self.close)
                if i < 0:  # a reply cut inside the reasoning (max_tokens) is all reasoning
                    keep = 0 if final else _partial_suffix(self.buf, self.close)
                    out += self._reasoning(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                out += self._reasoning(self.buf[:i])
                self.buf, self.mode = self.buf[i + len(self.close):], "after"
            elif self.mode == "after":
                s = self.buf.lstrip(WS)
                if not s and not final:
                    self.buf = ""
                    return out
                self.buf, self.mode = s, "rest"
            else:
                if self.buf:
                    out += self.inner.feed(self.buf)
                    self.buf = ""
                return out

    def _reasoning(self, text: str) -> list[Event]:
        if not self.began:
            text = text.lstrip(WS)
        body = text.rstrip(WS)
        if not body:
            self.held += text
            return []
        out, self.held, self.began = self.held + body, text[len(body):], True
        return [ReasoningDelta(out)]


# --- the families -------------------------------------------------------------


class HermesFormat(ToolFormat):
    """Qwen2.5 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several in a row for
    parallel calls (results come back as `<tool_response>` blocks in a user turn); also bare and fenced call
    objects, as Qwen2.5-Coder writes them. Granite 4.0's and SmolLM3's templates write calls this way too."""

    name = "hermes"
    trigger = "<tool_call>"
    closer = "</tool_call>"
    call_open = "<tool_call>\n"
    call_close = "\n</tool_call>"
    separator = "\n"
    bare_opens = "{"
    bare_fences = ("```json\n", "```\n")

    def detect(self, template_source: str) -> bool:
        return "<tool_call>" in template_source


class LlamaFormat(ToolFormat):
    """Llama 3.1 / 3.2 / 3.3: a reply that is one `{"name": ..., "parameters": {...}}` object (the template asks
    for "parameters"; "arguments" is read too), after `<|python_tag|>` where the text stream keeps that token.
    A builtin tool's `<|python_tag|>tool.call(query=...)` is not JSON, so it stays content."""

    name = "llama3"
    single_call = True  # the template refuses an assistant turn with more than one call
    arguments_keys = ("parameters", "arguments")
    bare_opens = "{"
    bare_prefix = "<|python_tag|>"

    def detect(self, template_source: str) -> bool:
        return "<|python_tag|>" in template_source or "Environment: ipython" in template_source


class GraniteFormat(ToolFormat):
    """Granite 3.x: `<|tool_call|>` and a JSON list of call objects. The template lists the tools but renders no
    calls, so template.py writes a turn's calls into its text the same way. Where the tokenizer treats
    `<|tool_call|>` as a control token the text stream drops it, and the list stands alone: read as bare."""

    name = "granite"
    trigger = "<|tool_call|>"
    separator = ", "
    bare_opens = "[{"

    def detect(self, template_source: str) -> bool:
        return "<|tool_call|>" in template_source

    def _list(self, parallel: bool) -> str:
        return f'"[" body{self._more("body", parallel)} "]"'

    def forced_lark(self, parallel: bool) -> str:
        # the marker is optional: where it is a control token no text spells it, and the list alone parses
        return f"start: {lark_str(self.trigger)}? {self._list(parallel)}"

    def after_trigger_lark(self, parallel: bool) -> str:
        return f"start: WS? {self._list(parallel)}\nWS: /[ \\t\\r\\n]+/"

    def bare_lark(self, parallel: bool) -> str:
        return self.after_trigger_lark(parallel)


class XmlFormat(ToolFormat):
    """Qwen3-Coder: `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n...</function>\\n
    </tool_call>`. A value is text, unless the tool's schema makes the parameter something else (a number,
    boolean, object, array, or a union without string): then it is JSON, and text where it does not decode.
    The grammar writes parameters in the schema's order, the required ones always; the parser takes any."""

    name = "qwen3-coder"
    trigger = "<tool_call>"
    closer = "</tool_call>"
    call_open = "<tool_call>\n"
    call_close = "\n</tool_call>"
    separator = "\n"

    def detect(self, template_source: str) -> bool:
        return all(s in template_source for s in ("<tool_call>", "<function=", "<parameter="))

    def body_calls(self, body: str, *, complete: bool, tools: Sequence[dict] | None) -> list[ToolCall] | None:
        schemas = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties") or {}
                   for t in tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)}
        calls: list[ToolCall] = []
        pos = 0
        while (m := _XML_FUNCTION.match(body, pos)) is not None:
            name, pos = m.group(1).strip(), m.end()
            props = schemas.get(name, {})
            args = {}
            while (p := _XML_PARAMETER.match(body, pos)) is not None:
                key = p.group(1).strip()
                # a value ends where the grammar ends it, at the first "\n</parameter>\n"; looser where not written so
                ends = [(j, e) for e in (_XML_VALUE_END, _XML_VALUE_END[:-1], _XML_VALUE_END[1:-1])
                        if (j := body.find(e, p.end())) >= 0]
                if not ends:
                    return None
                end, close = ends[0]
                args[key] = _xml_value(body[p.end():end], props.get(key))
                pos = end + len(close)
            if (f := _XML_FUNCTION_END.match(body, pos)) is None:
                return None
            pos = f.end()
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls if calls and not body[pos:].strip(WS) else None

    def body_lark(self, k: int, name: str, params: dict) -> str:
        # each parameter's schema is a piece of the whole: it keeps the shared definitions and JSON style
        shared = {key: params[key] for key in ("$defs", "definitions", "x-guidance") if key in params}
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        rules, parts = [], []
        for j, (key, schema) in enumerate(props.items()):
            rule = f"p_{k}_{j}"
            rules += [f"{rule}: {lark_str('<parameter=' + key + '>' + chr(10))} v_{k}_{j}",
                      _xml_value_lark(f"v_{k}_{j}", schema if isinstance(schema, dict) else {}, shared)]
            parts.append(rule if key in required else rule + "?")
        if not props and params.get("additionalProperties", True) is not False:  # any parameters, as text
            rules += [f'p_{k}_any: "<parameter=" /[A-Za-z0-9_.:-]+/ ">\\n" v_{k}_any',
                      _xml_value_lark(f"v_{k}_any", {}, shared)]
            parts.append(f"p_{k}_any*")
        head = lark_str(f"<function={name}>\n")
        return "\n".join([f'body_{k}: {_seq(head, *parts)} "</function>"', *rules])


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?")
_XML_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?")
_XML_FUNCTION_END = re.compile(r"\s*</function>")
_XML_VALUE_END = "\n</parameter>\n"


def _xml_kind(schema: dict | None) -> str:
    """How a parameter's value is written: "text" (as is), "enum" (one of its strings), or "json"."""
    if not isinstance(schema, dict):
        return "text"
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return "enum"
    kind = schema.get("type")
    if kind is None:
        return "json" if any(k in schema for k in ("anyOf", "oneOf", "allOf", "$ref", "properties", "items")) \
            else "text"
    return "text" if kind == "string" or (isinstance(kind, list) and "string" in kind) else "json"


def _xml_value(text: str, schema: dict | None):
    if _xml_kind(schema) != "json":
        return text
    if schema.get("type") == "boolean" and text in ("True", "False"):  # how Python's Jinja renders a boolean
        return text == "True"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _xml_value_lark(rule: str, schema: dict, shared: dict) -> str:
    kind = _xml_kind(schema)
    end = lark_str(_XML_VALUE_END)
    if kind == "enum":
        values = schema.get("enum", [schema.get("const")])
        return f"{rule}: ({' | '.join(lark_str(v) for v in values)}) {end}"
    if kind == "json":
        return f"{rule}: %json {json.dumps({**schema, **shared})} {end}"
    return f"{rule}[suffix={end}]: /(?s:.*)/"  # text up to the first closing tag, which ends it


# --- gpt-oss: the harmony format ------------------------------------------------

_H_MESSAGE = "<|message|>"
# A message's body ends at <|end|>, <|call|> or <|return|>, or where the next message starts: the text stream
# may lack <|end|> (llama.cpp renders <|channel|>, <|message|>, <|start|> and <|constrain|> as text, not it).
_H_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_H_OPENERS = ("<|start|>", "<|channel|>", " to=", "to=")  # how a reply's first header may begin
_H_RECIPIENT = re.compile(r"to=([^\s<]+)")
_H_CHANNEL = re.compile(r"<\|channel\|>([A-Za-z0-9_]+)")


class HarmonyFormat(ToolFormat):
    """gpt-oss: messages `[<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>
    BODY<|end|>`, the recipient also before the channel. The final channel (and commentary without a
    recipient, a preamble) is content, analysis is reasoning, a message to `functions.NAME` is a call of NAME
    with the JSON body as its arguments; a message to another recipient (a builtin tool: python, browser) has
    no place in the API and is dropped, as llama.cpp does. The prompt ends with `<|start|>assistant`, so the
    reply usually begins at `<|channel|>`; a reply with no header at all is content."""

    name = "harmony"
    single_call = True  # <|call|> ends the turn: it is an end-of-generation token

    def detect(self, template_source: str) -> bool:
        return "<|channel|>" in template_source

    def for_template(self, template_source: str) -> "ToolFormat":
        return self

    def stream(self, tools: Sequence[dict] | None = None, *, calls: bool = True,
               in_reasoning: bool = False) -> "HarmonyStream":
        return HarmonyStream(calls)

    def remembers(self, raw: str) -> bool:
        return False  # the template refuses channel markup in a message's content, and writes calls itself

    def history(self, messages: list[dict]) -> list[dict]:
        # The template refuses a call turn with both text (a preamble) and thinking; llama.cpp keeps the thinking,
        # which is what the turn's analysis message held
        return [{**m, "content": ""} if m.get("tool_calls") and m.get("reasoning_content") else m for m in messages]

    def body_lark(self, k: int, name: str, params: dict) -> str:
        head = f"<|channel|>commentary to=functions.{name} <|constrain|>json{_H_MESSAGE}"
        return f"body_{k}: {lark_str(head)} %json {json.dumps(params)}"


class HarmonyStream:
    """The harmony parser, incremental: headers are held until `<|message|>`, a body streams as it comes
    (a call's is held until its message ends), holding back only what may begin an end marker."""

    def __init__(self, calls: bool):
        self.calls = calls
        self.mode = "start"  # start | header | body | plain
        self.buf = ""
        self.kind = ""  # body: "reasoning" | "content" | "call" | "drop"
        self.name = ""  # a call's function
        self.args = ""  # a call's body so far
        self.count = 0  # calls emitted

    def feed(self, delta: str) -> list[Event]:
        self.buf += delta
        return self._run(final=False)

    def finish(self) -> list[Event]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self.mode == "start":
                if self.buf.startswith(_H_OPENERS):
                    self.mode = "header"
                elif not final and any(o.startswith(self.buf) for o in _H_OPENERS):
                    return out
                else:
                    self.mode = "plain"
            elif self.mode == "plain":
                out += [ContentDelta(self.buf)] if self.buf else []
                self.buf = ""
                return out
            elif self.mode == "header":
                i = self.buf.find(_H_MESSAGE)
                if i < 0:
                    if final:  # a header the reply ended in says nothing
                        self.buf = ""
                    return out
                self._open(self.buf[:i])
                self.buf, self.mode = self.buf[i + len(_H_MESSAGE):], "body"
            else:
                ends = [(j, e) for e in _H_ENDS if (j := self.buf.find(e)) >= 0]
                if not ends:
                    keep = 0 if final else max(_partial_suffix(self.buf, e) for e in _H_ENDS)
                    out += self._body(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    if final:
                        out += self._close()
                    return out
                j, end = min(ends)
                out += self._body(self.buf[:j]) + self._close()
                self.buf, self.mode = self.buf[j + len(end):], "header"

    def _open(self, header: str) -> None:
        recipients = [r for r in _H_RECIPIENT.findall(header) if r != "assistant"]  # `to=assistant`: stray
        channels = _H_CHANNEL.findall(header)
        self.kind = "content"
        if recipients:
            self.name = recipients[-1].removeprefix("functions.")
            self.kind = "call" if self.calls and recipients[-1].startswith("functions.") else "drop"
        elif channels and channels[-1] == "analysis":
            self.kind = "reasoning"
        self.args = ""

    def _body(self, text: str) -> list[Event]:
        if not text or self.kind == "drop":
            return []
        if self.kind == "call":
            self.args += text
            return []
        return [ReasoningDelta(text) if self.kind == "reasoning" else ContentDelta(text)]

    def _close(self) -> list[Event]:
        if self.kind != "call":
            return []
        try:
            args = json.loads(self.args) if self.args.strip(WS) else {}
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):  # not a call after all: what the model wrote is content
            return [ContentDelta(self.args)] if self.args else []
        self.count += 1
        return [ToolCallStart(self.count - 1, self.name),
                ToolCallDelta(self.count - 1, json.dumps(args, ensure_ascii=False))]


# --- the registry -------------------------------------------------------------

FORMATS: dict[str, ToolFormat] = {}


def register(fmt: ToolFormat) -> ToolFormat:
    FORMATS[fmt.name] = fmt
    return fmt


# Most specific first: Qwen3-Coder's template also holds `<tool_call>`, and Hermes is the fallback.
QWEN3_CODER = register(XmlFormat())
HARMONY = register(HarmonyFormat())
LLAMA3 = register(LlamaFormat())
GRANITE = register(GraniteFormat())
HERMES = register(HermesFormat())


def format_for(template_source: str) -> ToolFormat:
    """The format whose template this is, with think tags where the template writes them; Hermes for templates
    that know no tools (template.py renders tools the Hermes way for them)."""
    fmt = next((f for f in FORMATS.values() if f.detect(template_source)), HERMES)
    return fmt.for_template(template_source)
