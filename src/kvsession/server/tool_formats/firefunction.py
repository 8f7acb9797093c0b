"""FireFunction v2: ` functools` and a JSON list of call objects."""
from __future__ import annotations

from .base import lark_str
from .granite import GraniteFormat


class FireFunctionFormat(GraniteFormat):
    """FireFunction v2 (fireworks-ai's Llama 3 tune): ` functools[{"name": N, "arguments": {...}}, ...]`, the list
    Granite writes after a word of plain text instead of a control token, so the word is never optional."""

    name = "firefunction"
    trigger = "functools"
    bare_opens = ""

    def detect(self, template_source: str) -> bool:
        return "functools[" in template_source

    def forced_lark(self, parallel: bool) -> str:
        return f"start: {lark_str(self.trigger)} {self._list(parallel)}"
