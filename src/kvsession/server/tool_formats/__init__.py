"""How each template family writes a reply: its reasoning, its content and its tool calls.

One format per family, each with its own detect() on the chat template's
source, registered most specific first, Hermes last as the fallback
(template.py renders tools the Hermes way for templates that know none).
A format gives the reply's parser, stream(), whose events add up to what
parse() makes of the whole reply whatever the chunking, and the pieces
grammar.py builds forced and lazy calls from (Lark, with each tool's
arguments as `%json` of its schema).

    format        detected by                         a call
    qwen3-coder   <tool_call>, <function=, <parameter=  <tool_call>\\n<function=N>\\n<parameter=A>\\nV\\n
                                                      </parameter>\\n</function>\\n</tool_call>
    harmony       <|channel|> (gpt-oss)               <|channel|>commentary to=functions.N <|constrain|>json
                                                      <|message|>{...}
    llama3        <|python_tag|>, Environment: ipython  a reply that is {"name": N, "parameters": {...}}
    granite       <|tool_call|> (Granite 3.x)         <|tool_call|>[{"name": N, "arguments": {...}}, ...]
    firefunction  functools[ (FireFunction v2)        functools[{"name": N, "arguments": {...}}, ...]
    hermes        <tool_call>, and every other        <tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>

Reasoning. A template that writes `<think>` (Qwen3, QwQ, SmolLM3,
DeepSeek-R1's distills, Granite 3.3) gets its format with think tags
(for_template): a reply's leading `<think>...</think>` is reasoning, apart
from content, and where the prompt itself ends with `<think>` (DeepSeek-R1's
template opens it for the model) the reply starts inside it. gpt-oss
writes its reasoning in the analysis channel.

    base.py          the ToolFormat interface and the defaults most families share
    calls.py         call objects in JSON text (and what Qwen2.5-Coder really writes)
    streams.py       the incremental parsers: calls between tags, plain text, reasoning
    qwen3_coder.py, harmony.py, llama3.py, granite.py, firefunction.py, hermes.py: one family each
"""
from __future__ import annotations

from .base import ToolFormat
from .firefunction import FireFunctionFormat
from .granite import GraniteFormat
from .harmony import HarmonyFormat
from .hermes import HermesFormat
from .llama3 import LlamaFormat
from .qwen3_coder import XmlFormat

FORMATS: dict[str, ToolFormat] = {}


def register(fmt: ToolFormat) -> ToolFormat:
    FORMATS[fmt.name] = fmt
    return fmt


# Most specific first: Qwen3-Coder's template also holds `<tool_call>`, and Hermes is the fallback.
QWEN3_CODER = register(XmlFormat())
HARMONY = register(HarmonyFormat())
LLAMA3 = register(LlamaFormat())
GRANITE = register(GraniteFormat())
FIREFUNCTION = register(FireFunctionFormat())
HERMES = register(HermesFormat())


def format_for(template_source: str) -> ToolFormat:
    """The format whose template this is, with think tags where the template writes them; Hermes for templates
    that know no tools (template.py renders tools the Hermes way for them)."""
    fmt = next((f for f in FORMATS.values() if f.detect(template_source)), HERMES)
    return fmt.for_template(template_source)


__all__ = ["FIREFUNCTION", "FORMATS", "GRANITE", "HARMONY", "HERMES", "LLAMA3", "QWEN3_CODER", "ToolFormat", "format_for", "register"]
