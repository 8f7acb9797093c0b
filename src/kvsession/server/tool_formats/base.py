"""The format interface: what one template family says about its replies, and the defaults most share.

A format is a set of facts about a family's syntax (its trigger and closer,
how a forced call is opened and closed, which keys hold the arguments, what
a reply made only of call objects may look like) and a few methods over
them: the reply's parser (stream(), parse()) and the pieces grammar.py
builds forced and lazy calls from. The defaults read calls between tags
(streams.TaggedStream) and JSON call objects (calls.py); a family that
writes calls another way overrides what differs.
"""
from __future__ import annotations

import copy
import json
from typing import Protocol, Sequence

from ..reply_events import Event, ParsedReply, ToolCall, collect
from .calls import FENCE, WS, call_of, calls_in
from .streams import PlainStream, TaggedStream, ThinkStream

THINK = ("<think>", "</think>")


def lark_str(s: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(s, ensure_ascii=False)


def lark_seq(*pieces: str) -> str:
    """Lark pieces in a row, the empty ones left out ("" is not a literal llguidance takes)."""
    return " ".join(p for p in pieces if p)


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
        (call_memory.ToolCallMemory): only text in the format's own syntax (Frontend.remember says why)."""
        return self.trigger in raw

    def history(self, messages: list[dict]) -> list[dict]:
        """The conversation as the family's template takes it: as it is, unless the family says otherwise."""
        return messages

    # --- reading ---

    def body_calls(self, body: str, *, complete: bool, tools: Sequence[dict] | None) -> list[ToolCall] | None:
        """The calls between a trigger and its closer (None: not calls). complete=False: cut by the reply's
        end. Names are not checked: the tags say these are calls."""
        inner = body.strip(WS)
        m = FENCE.match(inner)
        if m is not None and inner.endswith("```"):
            inner = inner[m.end():-3]
        return calls_in(inner, None, self.arguments_keys, complete=complete)

    def _bare_body(self, text: str) -> tuple[str, bool] | None:
        """A maybe-bare reply without its marker and fence opening: (the objects, whether a fence holds them)."""
        s = text.strip(WS)
        if self.bare_prefix and s.startswith(self.bare_prefix):
            s = s[len(self.bare_prefix):].lstrip(WS)
        if self.bare_fences and s.startswith("```"):
            m = FENCE.match(s)
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
            return FENCE.match(s) is not None
        return None if self.bare_fences and "```".startswith(s) else False

    def bare_calls(self, text: str, names: frozenset[str] | None) -> list[ToolCall] | None:
        """The calls of a reply that is nothing but call objects (bare, or fenced)."""
        found = self._bare_body(text)
        if found is None:
            return None
        inner, fenced = found
        closed = fenced and inner.endswith("```")
        return calls_in(inner[:-3] if closed else inner, names, self.arguments_keys, complete=closed)

    def not_bare(self, text: str, names: frozenset[str] | None) -> bool:
        """Early answer for a reply held as maybe-bare: its first JSON value is complete and is not a call."""
        found = self._bare_body(text)
        s = found[0] if found is not None else text.strip(WS)
        try:
            value, _ = json.JSONDecoder().raw_decode(s)
        except json.JSONDecodeError:
            return False
        values = value if isinstance(value, list) else [value]
        return any(call_of(v, names, self.arguments_keys) is None for v in values)

    # --- grammar (grammar.py) ---

    def body_lark(self, k: int, name: str, params: dict) -> str:
        """Lark rules defining `body_k`: one call of the tool `name`, whose arguments match `params`."""
        prefix = '{"name": "' + name + '", "' + self.arguments_keys[0] + '": '
        return f"body_{k}: {lark_str(prefix)} %json {json.dumps(params)} \"}}\""

    def _more(self, call: str, parallel: bool) -> str:
        return f" ({lark_seq(lark_str(self.separator) if self.separator else '', call)})*" \
            if parallel and not self.single_call else ""

    def forced_lark(self, parallel: bool) -> str:
        """The start rule of a reply made of calls from its first token (tool_choice required or named)."""
        call = lark_seq(lark_str(self.call_open) if self.call_open else "", "body",
                    lark_str(self.call_close) if self.call_close else "")
        return f"start: {call}{self._more(call, parallel)}"

    def after_trigger_lark(self, parallel: bool) -> str | None:
        """The start rule of what follows the trigger (tool_choice auto); None: no trigger."""
        if not self.trigger:
            return None
        rest = self.call_open[len(self.trigger):]
        close = lark_str(self.call_close) if self.call_close else ""
        call = lark_seq(lark_str(self.call_open), "body", close)
        return f"start: {lark_seq(lark_str(rest) if rest else '', 'body', close)}{self._more(call, parallel)}"

    def bare_lark(self, parallel: bool) -> str | None:
        """The start rule of a reply made of bare or fenced call objects (tool_choice auto); None: no such
        replies."""
        if not self.bare_opens:
            return None
        objects = "body" + self._more("body", parallel)
        fenced = f" | ({' | '.join(lark_str(f) for f in self.bare_fences)}) {objects} {lark_str(chr(10) + '```')}" \
            if self.bare_fences else ""
        return f"start: WS? ({objects}{fenced})\nWS: /[ \\t\\r\\n]+/"
