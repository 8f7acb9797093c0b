"""Llama 3.1, 3.2 and 3.3: a reply that is one call object."""
from __future__ import annotations

from .base import ToolFormat


class LlamaFormat(ToolFormat):
    """Llama 3.1 / 3.2 / 3.3: a reply that is one `{"name": ..., "parameters": {...}}` object (the template asks
    for "parameters"; "arguments" is read too), after `<|python_tag|>` where the text stream keeps that token.
    A builtin tool's `<|python_tag|>tool.call(query=...)` is not JSON, so it stays content."""

    name = "llama3"
    single_call = True  # the template refuses an assistant turn with more than one call
    arguments_keys = ("parameters", "arguments")
    bare_opens = "{"
    bare_prefix = "<|python_tag|>"

    def detect(self, template_source: str) -> bool:
        return "<|python_tag|>" in template_source or "Environment: ipython" in template_source
