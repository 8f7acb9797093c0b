"""Tool calls in model replies: what a reply is made of.

A reply is read by its template family's format (tool_formats/) two ways
that always agree: `parse(text)` for a whole reply, and `stream()` -> a
parser fed text deltas, whose events (reasoning, content, call start,
arguments) add up to the same reasoning, content and calls. This module
holds those results and events, shared by the formats and by replies.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

# --- results and events -------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object: json.dumps(arguments, ensure_ascii=False), as tojson renders it


@dataclass(frozen=True)
class ParsedReply:
    content: str
    tool_calls: list[ToolCall]
    reasoning: str = ""  # the model's thinking (`<think>...</think>`, gpt-oss's analysis channel), apart from content


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # 0, 1, ... in the order of the reply
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    arguments: str  # a fragment of the call's arguments JSON; a call's fragments add up to ToolCall.arguments


Event = ContentDelta | ReasoningDelta | ToolCallStart | ToolCallDelta


def collect(events: Iterable[Event]) -> ParsedReply:
    """The content, calls and reasoning that a stream of events adds up to."""
    content: list[str] = []
    reasoning: list[str] = []
    names: list[str] = []
    args: list[list[str]] = []
    for e in events:
        if isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ReasoningDelta):
            reasoning.append(e.text)
        elif isinstance(e, ToolCallStart):
            names.append(e.name)
            args.append([])
        else:
            args[e.index].append(e.arguments)
    return ParsedReply("".join(content), [ToolCall(n, "".join(a)) for n, a in zip(names, args)], "".join(reasoning))


def tool_names(tools: Sequence[dict] | None) -> frozenset[str] | None:
    """The function names of OpenAI-style tools (None: not known)."""
    if tools is None:
        return None
    return frozenset(t["function"]["name"] for t in tools
                     if isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"])
