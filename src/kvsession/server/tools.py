"""Tool calls in model replies: one format per template family, and the memory of what was sampled.

A format reads a reply two ways that always agree: `parse(text)` for a whole
reply, and `stream()` -> a parser fed text deltas, whose events (content,
call start, arguments) add up to the same content and calls. Formats are
registered in one line each (vLLM's and llama.cpp's habit) and picked by the
chat template's source; Hermes (Qwen2.5's `<tool_call>` JSON) is the first
and the fallback, since template.py renders tools that way for templates
that do not know tools.

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
  the model wrote it in tags itself (ToolCallMemory, below).

So this parser accepts, besides tagged calls anywhere in the reply (closing
tag optional at the end): a reply that is nothing but one or more call
objects, bare or in a ```json / ``` fence (inside a fence or the tags, also
a JSON list of them); arguments
given as a JSON string holding an object; up to three missing closing braces
after a last `}` at the end (not after other text: a reply cut by max_tokens
is not a call). An untagged object is a call only if it has "name" and
"arguments" and, when the request's tools are known, names one of them: a
plain JSON answer stays text. Text that looks like a call but is not one
stays content, character for character: nothing is ever dropped except the
whitespace between content and calls (which the template puts back when it
renders the calls).

ToolCallMemory keeps, per tool-call id, the exact text the model sampled for
the assistant turn that made the call, when it wrote the calls in the
format's tags (Frontend.remember). Agent clients send the calls back as
structured tool_calls; rendered by the template they become
`<tool_call>\\n{...}\\n</tool_call>`, which is not what this model wrote (a
fence, a bare object, other spacing), so the prompt would stop matching the
live session at that turn and everything after it would be prefilled again.
Substituting the sampled text keeps the rendered prompt byte-identical to
the session (ds4 keeps the same map): checked with Qwen's template, the turn
renders as `<|im_start|>assistant\\n` + raw + `<|im_end|>\\n` after the
prompt, and the session's tokens are a prefix of the new prompt's. It cannot
be identical where raw is not the session's text: a reply cut by a stop
string (the session holds the whole last token), control tokens the model
sampled but the text stream skipped (raw should be decode(tokens) with
special tokens kept; they then come back as guarded text, so only the text
prefix matches), and templates that rewrite an assistant's content (Gemma's
`| trim` drops the edges' whitespace). Tokens can also differ from a fresh
tokenization of raw when the model sampled an uncommon split; the text
prefix still matches.
"""
from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol, Sequence

# --- results and events -------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object: json.dumps(arguments, ensure_ascii=False), as tojson renders it


@dataclass(frozen=True)
class ParsedReply:
    content: str
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # 0, 1, ... in the order of the reply
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    arguments: str  # a fragment of the call's arguments JSON; a call's fragments add up to ToolCall.arguments


Event = ContentDelta | ToolCallStart | ToolCallDelta


def collect(events: Iterable[Event]) -> ParsedReply:
    """The content and calls that a stream of events adds up to."""
    content: list[str] = []
    names: list[str] = []
    args: list[list[str]] = []
    for e in events:
        if isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            names.append(e.name)
            args.append([])
        else:
            args[e.index].append(e.arguments)
    return ParsedReply("".join(content), [ToolCall(n, "".join(a)) for n, a in zip(names, args)])


def tool_names(tools: Sequence[dict] | None) -> frozenset[str] | None:
    """The function names of OpenAI-style tools (None: not known)."""
    if tools is None:
        return None
    return frozenset(t["function"]["name"] for t in tools
                     if isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"])


# --- reading call objects -----------------------------------------------------

_FENCE = re.compile(r"```(json)?[ \t]*\n")
_MAX_REPAIR = 3  # closing braces added to an object that ended short at EOS


def _call(obj, names: frozenset[str] | None) -> ToolCall | None:
    """A call from one decoded JSON value: {"name": str, "arguments": object or JSON text of one}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"] or "arguments" not in obj:
        return None
    args = obj["arguments"]
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict) or (names is not None and obj["name"] not in names):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _calls_in(body: str, names: frozenset[str] | None, *, complete: bool) -> list[ToolCall] | None:
    """The calls `body` consists of (objects or lists of them, separated by whitespace), or None if it holds
    anything else. complete=False: the body ended at EOS, so its last object may lack closing braces."""
    dec = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos, n = 0, len(body)
    while True:
        while pos < n and body[pos] in " \t\r\n":
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
            call = _call(item, names)
            if call is None:
                return None
            calls.append(call)


def _reply_start(text: str) -> bool | None:
    s = text.lstrip()
    if not s:
        return None
    if s.startswith("{"):
        return True
    if s.startswith("```"):
        if "\n" not in s:
            return None if len(s) < 16 else False
        return _FENCE.match(s) is not None
    return None if "```".startswith(s) else False


def _bare_calls(text: str, names: frozenset[str] | None) -> list[ToolCall] | None:
    """The calls of a reply that is nothing but call objects, bare or fenced (```json ... ```)."""
    s = text.strip()
    if s.startswith("```"):
        m = _FENCE.match(s)
        if m is None:
            return None
        inner = s[m.end():]
        closed = inner.endswith("```")
        return _calls_in(inner[:-3] if closed else inner, names, complete=closed)
    if s.startswith("{"):
        return _calls_in(s, names, complete=False)
    return None


# --- formats ------------------------------------------------------------------


class ToolCallStream(Protocol):
    def feed(self, delta: str) -> list[Event]:
        """Events for what `delta` settles; text that may still belong to a call is held back."""

    def finish(self) -> list[Event]:
        """The reply ended: events for everything held back."""


class ToolFormat:
    """How one template family writes tool calls: its parser, and the pieces grammar.py builds calls from."""

    name: str = ""
    trigger: str = ""  # text that opens a call anywhere in a reply: the lazy grammar's trigger
    call_open: str = ""  # a call's text before its {"name": ..., "arguments": ...} object ...
    call_close: str = ""  # ... and after it
    separator: str = ""  # between two calls of one reply
    bare_fences: tuple[str, ...] = ()  # fences a reply made only of call objects may sit in, closed by "\n```"

    def detect(self, template_source: str) -> bool:
        raise NotImplementedError

    def stream(self, tools: Sequence[dict] | None = None) -> ToolCallStream:
        raise NotImplementedError

    def reply_start(self, text: str) -> bool | None:
        """Whether a reply beginning with `text` is call objects without the trigger (True), is not (False), or
        cannot tell yet (None)."""
        return False

    def parse(self, text: str, tools: Sequence[dict] | None = None) -> ParsedReply:
        """The whole reply's content and calls; equal to what stream() makes of it, whatever the chunking."""
        p = self.stream(tools)
        return collect([*p.feed(text), *p.finish()])


class HermesFormat(ToolFormat):
    """Qwen2.5 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several in a row for
    parallel calls (results come back as `<tool_response>` blocks in a user turn); also bare and fenced call
    objects, as Qwen2.5-Coder writes them."""

    name = "hermes"
    trigger = "<tool_call>"
    closer = "</tool_call>"
    call_open = "<tool_call>\n"
    call_close = "\n</tool_call>"
    separator = "\n"
    bare_fences = ("```json\n", "```\n")

    def detect(self, template_source: str) -> bool:
        return "<tool_call>" in template_source

    def stream(self, tools: Sequence[dict] | None = None) -> "HermesStream":
        return HermesStream(tool_names(tools))

    def reply_start(self, text: str) -> bool | None:
        return _reply_start(text)


class HermesStream:
    """The Hermes parser, incremental. Holds back only what may still turn out to be part of a call: a reply
    that may be bare call objects, a partial `<tool_call>`, a call until it closes, whitespace next to a call."""

    def __init__(self, names: frozenset[str] | None):
        self.names = names
        self.mode = "start"  # start | bare | text | call
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
        out: list[Event] = []
        while True:
            if self.mode == "start":
                verdict = _reply_start(self.buf)
                if verdict is None and not final:
                    return out
                self.mode = "bare" if verdict else "text"
            elif self.mode == "bare":
                calls = _bare_calls(self.buf, self.names) if final else None
                if calls is not None:
                    for c in calls:
                        out += self._emit_call(c)
                    self.buf = ""
                    return out
                if final or self._not_bare():
                    self.mode = "text"
                    continue
                return out
            elif self.mode == "text":
                i = self.buf.find(HermesFormat.trigger)
                if i < 0:
                    keep = _partial_suffix(self.buf, HermesFormat.trigger) if not final else 0
                    out += self._content(self.buf[: len(self.buf) - keep], final=False)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                out += self._content(self.buf[:i], final=False)
                self.buf = self.buf[i + len(HermesFormat.trigger):]
                self.mode = "call"
            else:  # call: its body runs to </tool_call>, or to the next <tool_call> (a call left open)
                j = self.buf.find(HermesFormat.closer)
                k = self.buf.find(HermesFormat.trigger)
                if j < 0 and k < 0:
                    return out
                if j >= 0 and (k < 0 or j < k):
                    body, rest, closer = self.buf[:j], self.buf[j + len(HermesFormat.closer):], HermesFormat.closer
                else:
                    body, rest, closer = self.buf[:k], self.buf[k:], ""
                out += self._close_call(body, complete=True, closer=closer)
                self.buf = rest
                self.mode = "text"

    def _not_bare(self) -> bool:
        """Early answer for a reply held as maybe-bare: its first JSON value is complete and is not a call."""
        s = self.buf.strip()
        if s.startswith("```"):
            m = _FENCE.match(s)
            s = s[m.end():] if m else s
        try:
            value, _ = json.JSONDecoder().raw_decode(s)
        except json.JSONDecodeError:
            return False
        return any(_call(v, self.names) is None for v in (value if isinstance(value, list) else [value]))

    def _close_call(self, body: str, *, complete: bool, closer: str = "") -> list[Event]:
        inner = body.strip()
        m = _FENCE.match(inner)
        if m is not None and inner.endswith("```"):
            inner = inner[m.end():-3]
        calls = _calls_in(inner, None, complete=complete)
        if calls is None:  # not a call after all: all of it is content
            return self._content(HermesFormat.trigger + body + closer, final=False)
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
        body = text.rstrip(" \t\r\n")
        if not body:
            self.held_ws += text
            return []
        out = self.held_ws + body
        self.held_ws = text[len(body):]
        self.after_call = False
        return [ContentDelta(out)]


def _partial_suffix(text: str, word: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `word`."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:n]):
            return n
    return 0


FORMATS: dict[str, ToolFormat] = {}


def register(fmt: ToolFormat) -> ToolFormat:
    FORMATS[fmt.name] = fmt
    return fmt


HERMES = register(HermesFormat())


def format_for(template_source: str) -> ToolFormat:
    """The format whose template this is; Hermes for templates that know no tools (template.py renders tools
    the Hermes way for them)."""
    return next((f for f in FORMATS.values() if f.detect(template_source)), HERMES)


# --- the memory of sampled tool-call turns ------------------------------------


class ToolCallMemory:
    """Tool-call id -> the exact text the model sampled for the assistant turn that made the call.

    remember() after a reply with calls; substitute() before rendering a request: an assistant message whose
    tool_calls ids are all known, sampled together in that order, becomes {"role": "assistant", "content": raw}
    and renders as the session holds it. With a path, entries are appended to a JSON-lines file and reloaded
    at start; the file is rewritten without its oldest entries (and any torn last line) when opened and when
    it has grown to twice the capacity. Thread-safe: the worker writes while request threads read.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, capacity: int = 10_000):
        self.capacity = capacity
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._turns: OrderedDict[tuple[str, ...], dict] = OrderedDict()  # ids -> {"raw", "calls"}, oldest first
        self._by_id: dict[str, tuple[str, ...]] = {}
        self._ids = 0  # ids held
        self._lines = 0  # lines in the file
        if self.path is not None:
            self._load()

    def remember(self, ids: Sequence[str], raw_text: str, calls: Sequence[ToolCall] | None = None) -> None:
        """The turn that made the calls `ids` was sampled as `raw_text`. With `calls` (what was parsed from it),
        substitute() also checks that a client sent those calls back unchanged."""
        ids = tuple(ids)
        if not ids:
            return
        entry = {"raw": raw_text, "calls": [[c.name, json.loads(c.arguments)] for c in calls] if calls else None}
        with self._lock:
            self._put(ids, entry)
            if self.path is not None:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"ids": list(ids), **entry}, ensure_ascii=False) + "\n")
                self._lines += 1
                if self._lines > 2 * self.capacity:
                    self._rewrite()

    def raw(self, call_id: str) -> str | None:
        with self._lock:
            ids = self._by_id.get(call_id)
            return self._turns[ids]["raw"] if ids is not None else None

    def substitute(self, messages: Sequence[dict]) -> list[dict]:
        """`messages` with each assistant tool-call turn the memory holds replaced by its sampled text."""
        out = []
        with self._lock:
            for m in messages:
                out.append(self._substituted(m) if m.get("role") == "assistant" and m.get("tool_calls") else m)
        return out

    def __len__(self) -> int:
        with self._lock:
            return self._ids

    def _substituted(self, m: dict) -> dict:
        calls = m["tool_calls"]
        ids = tuple(c.get("id") for c in calls if isinstance(c, dict))
        entry = self._turns.get(ids) if len(ids) == len(calls) else None
        if entry is None:
            return m
        if entry["calls"] is not None:
            try:
                sent = [[c["function"]["name"], _arguments(c["function"].get("arguments", {}))] for c in calls]
            except (KeyError, TypeError, json.JSONDecodeError):
                return m
            if sent != entry["calls"]:
                return m
        return {"role": "assistant", "content": entry["raw"]}

    def _put(self, ids: tuple[str, ...], entry: dict) -> None:
        for i in ids:  # an id seen again (it should not be) belongs to its newest turn
            old = self._by_id.pop(i, None)
            if old is not None and old in self._turns:
                self._drop(old)
        self._turns[ids] = entry
        for i in ids:
            self._by_id[i] = ids
        self._ids += len(ids)
        while self._ids > self.capacity and len(self._turns) > 1:
            self._drop(next(iter(self._turns)))

    def _drop(self, ids: tuple[str, ...]) -> None:
        del self._turns[ids]
        for i in ids:
            if self._by_id.get(i) == ids:
                del self._by_id[i]
        self._ids -= len(ids)

    def _load(self) -> None:
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                lines = f.read().split("\n")
        except FileNotFoundError:
            lines = []
        for line in lines:
            try:
                rec = json.loads(line)
                ids, entry = tuple(rec["ids"]), {"raw": rec["raw"], "calls": rec.get("calls")}
                if not ids or not all(isinstance(i, str) for i in ids) or not isinstance(entry["raw"], str):
                    continue
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a torn last line, or a damaged one: that entry is lost, the rest are not
            self._put(ids, entry)
        self._rewrite()

    def _rewrite(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for ids, entry in self._turns.items():
                f.write(json.dumps({"ids": list(ids), **entry}, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._lines = len(self._turns)


def _arguments(args) -> object:
    return json.loads(args) if isinstance(args, str) else args
