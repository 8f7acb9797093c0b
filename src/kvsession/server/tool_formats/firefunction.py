"""FireFunction v2: ` functools[` and a JSON list of call objects."""
from __future__ import annotations

from typing import Sequence

from ..reply_events import ToolCall
from .base import lark_str
from .granite import GraniteFormat


class FireFunctionFormat(GraniteFormat):
    """FireFunction v2 (fireworks-ai's Llama 3 tune): ` functools[{"name": N, "arguments": {...}}, ...]`, the list
    Granite writes after a word of plain text instead of a control token. The trigger is the word with the list's
    bracket, as llama.cpp's is: a reply may name Python's functools and stay text."""

    name = "firefunction"
    trigger = "functools["
    bare_opens = ""

    def detect(self, template_source: str) -> bool:
        return "functools[" in template_source

    def body_calls(self, body: str, *, complete: bool, tools: Sequence[dict] | None) -> list[ToolCall] | None:
        return super().body_calls("[" + body, complete=complete, tools=tools)  # the trigger took its bracket

    def forced_lark(self, parallel: bool) -> str:
        return f'start: {lark_str(self.trigger)} body{self._more("body", parallel)} "]"'

    def after_trigger_lark(self, parallel: bool) -> str:
        return f'start: WS? body{self._more("body", parallel)} "]"\nWS: /[ \\t\\r\\n]+/'
