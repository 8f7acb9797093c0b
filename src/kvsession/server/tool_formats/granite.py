"""Granite 3.x: `<|tool_call|>` and a JSON list of call objects."""
from __future__ import annotations

from .base import ToolFormat, lark_str


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
