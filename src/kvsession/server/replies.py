"""A request's tool plan, and one choice's reply as the APIs see it: text, and tool calls with ids.

The plan says what the prompt shows (the tools, rendered by the template),
how the reply is read (the template family's tool-call format, tools.py)
and what decoding may write (the grammar, grammar.py). A Reply feeds the
worker's text deltas through the format's parser and hands each API
module the same three events, which it writes in its own wire format:
("text", str), ("call", Call) when a call's name is known, and
("args", index, fragment) for its arguments.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from .grammar import GrammarFactory
from .tools import ContentDelta, ToolCallDelta, ToolCallStart, ToolFormat


@dataclass
class ToolPlan:
    tools: list[dict] | None = None  # function tools shown in the prompt; None: none
    fmt: ToolFormat | None = None  # how replies write calls; None: a reply is plain text
    constraint: GrammarFactory | None = None  # what decoding may write (tool grammar or JSON); None: anything
    forced: bool = False  # the grammar writes calls only (tool_choice required or named): a reply has no text


@dataclass
class Call:
    index: int
    id: str
    name: str
    arguments: str = ""  # JSON text of an object, complete once the reply is finished


@dataclass
class Reply:
    plan: ToolPlan
    id_prefix: str  # "call_" (OpenAI), "toolu_" (Anthropic)
    calls: list[Call] = field(default_factory=list)
    _text: list[str] = field(default_factory=list)

    def __post_init__(self):
        self._parser = self.plan.fmt.stream(self.plan.tools) if self.plan.fmt is not None else None

    @property
    def content(self) -> str:
        return "".join(self._text)

    def feed(self, text: str) -> list[tuple]:
        if self._parser is None:
            return self._events([ContentDelta(text)] if text else [])
        return self._events(self._parser.feed(text))

    def finish(self) -> list[tuple]:
        return self._events(self._parser.finish()) if self._parser is not None else []

    def _events(self, events) -> list[tuple]:
        out = []
        for e in events:
            if isinstance(e, ContentDelta):
                if self.plan.forced:  # under a forced grammar only a call cut short by max_tokens reads as text
                    continue
                self._text.append(e.text)
                out.append(("text", e.text))
            elif isinstance(e, ToolCallStart):
                call = Call(e.index, f"{self.id_prefix}{uuid.uuid4().hex[:24]}", e.name)
                self.calls.append(call)
                out.append(("call", call))
            elif isinstance(e, ToolCallDelta):
                self.calls[e.index].arguments += e.arguments
                out.append(("args", e.index, e.arguments))
        return out
