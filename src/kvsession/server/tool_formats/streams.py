"""The incremental parsers of a reply: calls between tags, plain text, and a leading reasoning block.

Each is fed the reply's text deltas and gives events (reply_events.py) that add up
to the same reasoning, content and calls whatever the chunking: it holds
back only what may still turn out to be a marker, a call or the layout
around one (partial_suffix), and lets the rest go at once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..reply_events import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStart,
    tool_names,
)
from .calls import WS

if TYPE_CHECKING:
    from .base import ToolCallStream, ToolFormat


def partial_suffix(text: str, word: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `word`."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:n]):
            return n
    return 0


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
                    keep = partial_suffix(self.buf, fmt.trigger) if fmt.trigger and not final else 0
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
                    keep = 0 if final else partial_suffix(self.buf, self.close)
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
