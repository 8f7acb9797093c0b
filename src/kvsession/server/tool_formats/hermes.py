"""Hermes (Qwen2.5, Qwen3, QwQ, Granite 4, SmolLM3, and the fallback for every other template)."""
from __future__ import annotations

from .base import ToolFormat


class HermesFormat(ToolFormat):
    """Qwen2.5 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several in a row for
    parallel calls (results come back as `<tool_response>` blocks in a user turn); also bare and fenced call
    objects, as Qwen2.5-Coder writes them. Granite 4.0's and SmolLM3's templates write calls this way too."""

    name = "hermes"
    trigger = "<tool_call>"
    closer = "</tool_call>"
    call_open = "<tool_call>\n"
    call_close = "\n</tool_call>"
    separator = "\n"
    bare_opens = "{"
    bare_fences = ("```json\n", "```\n")

    def detect(self, template_source: str) -> bool:
        return "<tool_call>" in template_source
