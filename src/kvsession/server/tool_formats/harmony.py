"""gpt-oss: the harmony format, its messages on channels, calls addressed to functions."""
from __future__ import annotations

import json
import re
from typing import Sequence

from ..reply_events import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallStart,
)
from .base import ToolFormat, lark_str
from .calls import WS
from .streams import partial_suffix

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
                    keep = 0 if final else max(partial_suffix(self.buf, e) for e in _H_ENDS)
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
