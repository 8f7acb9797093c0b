"""A request's tool plan, and one choice's reply as the APIs see it: reasoning, text, and tool calls with ids.

The plan says what the prompt shows (the tools, rendered by the template),
how the reply is read (the template family's format, tool_formats/: its
reasoning, and its calls where tools were offered) and what decoding may
write (the grammar, grammar.py). A Reply feeds the worker's text deltas
through the format's parser and hands each API module the same four events,
which it writes in its own wire format: ReasoningDelta and ContentDelta
(text), CallOpened when a call's name is known (with the id the API gives
it), and ToolCallDelta for its arguments.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from .grammar import GrammarFactory
from .reply_events import ContentDelta, ReasoningDelta, ToolCallDelta, ToolCallStart
from .tool_formats import ToolFormat


@dataclass
class ToolPlan:
    tools: list[dict] | None = None  # function tools shown in the prompt; None: none
    fmt: ToolFormat | None = None  # how replies write reasoning and calls; None: a reply is plain text
    calls: bool = False  # replies are read for calls (tools offered, tool_choice not "none")
    constraint: GrammarFactory | None = None  # what decoding may write (tool grammar or JSON); None: anything
    forced: bool = False  # the grammar writes calls only (tool_choice required or named): a reply has no text
    in_reasoning: bool = False  # the prompt leaves the reply inside the reasoning (Frontend.chat sets it)


@dataclass
class Call:
    index: int
    id: str
    name: str
    arguments: str = ""  # JSON text of an object, complete once the reply is finished


@dataclass(frozen=True)
class CallOpened:
    """A call began: its name is known, its arguments follow as ToolCallDeltas."""

    call: Call


ReplyEvent = ReasoningDelta | ContentDelta | CallOpened | ToolCallDelta


@dataclass
class Reply:
    plan: ToolPlan
    id_prefix: str  # "call_" (OpenAI), "toolu_" (Anthropic)
    calls: list[Call] = field(default_factory=list)
    _text: list[str] = field(default_factory=list)
    _reasoning: list[str] = field(default_factory=list)

    def __post_init__(self):
        p = self.plan
        self._parser = p.fmt.stream(p.tools, calls=p.calls, in_reasoning=p.in_reasoning) \
            if p.fmt is not None else None

    @property
    def content(self) -> str:
        return "".join(self._text)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    def feed(self, text: str) -> list[ReplyEvent]:
        if self._parser is None:
            return self._events([ContentDelta(text)] if text else [])
        return self._events(self._parser.feed(text))

    def finish(self) -> list[ReplyEvent]:
        return self._events(self._parser.finish()) if self._parser is not None else []

    def _events(self, events) -> list[ReplyEvent]:
        out: list[ReplyEvent] = []
        for e in events:
            if isinstance(e, ReasoningDelta):
                self._reasoning.append(e.text)
                out.append(e)
            elif isinstance(e, ContentDelta):
                if self.plan.forced:  # under a forced grammar only a call cut short by max_tokens reads as text
                    continue
                self._text.append(e.text)
                out.append(e)
            elif isinstance(e, ToolCallStart):
                call = Call(e.index, f"{self.id_prefix}{uuid.uuid4().hex[:24]}", e.name)
                self.calls.append(call)
                out.append(CallOpened(call))
            elif isinstance(e, ToolCallDelta):
                self.calls[e.index].arguments += e.arguments
                out.append(e)
        return out
