"""Qwen3-Coder (also Qwen3.5 and Nemotron Nano 3): calls in XML, a parameter at a time."""
from __future__ import annotations

import json
import re
from typing import Sequence

from ..reply_events import ToolCall
from .base import ToolFormat, lark_seq, lark_str
from .calls import WS


class XmlFormat(ToolFormat):
    """Qwen3-Coder: `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n...</function>\\n
    </tool_call>`. A value is text, unless the tool's schema makes the parameter something else (a number,
    boolean, object, array, or a union without string): then it is JSON, and text where it does not decode.
    The grammar writes parameters in the schema's order, the required ones always; the parser takes any."""

    name = "qwen3-coder"
    trigger = "<tool_call>"
    closer = "</tool_call>"
    call_open = "<tool_call>\n"
    call_close = "\n</tool_call>"
    separator = "\n"

    def detect(self, template_source: str) -> bool:
        return all(s in template_source for s in ("<tool_call>", "<function=", "<parameter="))

    def body_calls(self, body: str, *, complete: bool, tools: Sequence[dict] | None) -> list[ToolCall] | None:
        schemas = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties") or {}
                   for t in tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)}
        calls: list[ToolCall] = []
        pos = 0
        while (m := _XML_FUNCTION.match(body, pos)) is not None:
            name, pos = m.group(1).strip(), m.end()
            props = schemas.get(name, {})
            args = {}
            while (p := _XML_PARAMETER.match(body, pos)) is not None:
                key = p.group(1).strip()
                # a value ends where the grammar ends it, at the first "\n</parameter>\n"; looser where not written so
                ends = [(j, e) for e in (_XML_VALUE_END, _XML_VALUE_END[:-1], _XML_VALUE_END[1:-1])
                        if (j := body.find(e, p.end())) >= 0]
                if not ends:
                    return None
                end, close = ends[0]
                args[key] = _xml_value(body[p.end():end], props.get(key))
                pos = end + len(close)
            if (f := _XML_FUNCTION_END.match(body, pos)) is None:
                return None
            pos = f.end()
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls if calls and not body[pos:].strip(WS) else None

    def body_lark(self, k: int, name: str, params: dict) -> str:
        # each parameter's schema is a piece of the whole: it keeps the shared definitions and JSON style
        shared = {key: params[key] for key in ("$defs", "definitions", "x-guidance") if key in params}
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        rules, parts = [], []
        for j, (key, schema) in enumerate(props.items()):
            rule = f"p_{k}_{j}"
            rules += [f"{rule}: {lark_str('<parameter=' + key + '>' + chr(10))} v_{k}_{j}",
                      _xml_value_lark(f"v_{k}_{j}", schema if isinstance(schema, dict) else {}, shared)]
            parts.append(rule if key in required else rule + "?")
        if not props and params.get("additionalProperties", True) is not False:  # any parameters, as text
            rules += [f'p_{k}_any: "<parameter=" /[A-Za-z0-9_.:-]+/ ">\\n" v_{k}_any',
                      _xml_value_lark(f"v_{k}_any", {}, shared)]
            parts.append(f"p_{k}_any*")
        head = lark_str(f"<function={name}>\n")
        return "\n".join([f'body_{k}: {lark_seq(head, *parts)} "</function>"', *rules])


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?")
_XML_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?")
_XML_FUNCTION_END = re.compile(r"\s*</function>")
_XML_VALUE_END = "\n</parameter>\n"


def _xml_kind(schema: dict | None) -> str:
    """How a parameter's value is written: "text" (as is), "enum" (one of its strings), or "json"."""
    if not isinstance(schema, dict):
        return "text"
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return "enum"
    kind = schema.get("type")
    if kind is None:
        return "json" if any(k in schema for k in ("anyOf", "oneOf", "allOf", "$ref", "properties", "items")) \
            else "text"
    return "text" if kind == "string" or (isinstance(kind, list) and "string" in kind) else "json"


def _xml_value(text: str, schema: dict | None):
    if _xml_kind(schema) != "json":
        return text
    if schema.get("type") == "boolean" and text in ("True", "False"):  # how Python's Jinja renders a boolean
        return text == "True"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _xml_value_lark(rule: str, schema: dict, shared: dict) -> str:
    kind = _xml_kind(schema)
    end = lark_str(_XML_VALUE_END)
    if kind == "enum":
        values = schema.get("enum", [schema.get("const")])
        return f"{rule}: ({' | '.join(lark_str(v) for v in values)}) {end}"
    if kind == "json":
        return f"{rule}: %json {json.dumps({**schema, **shared})} {end}"
    return f"{rule}[suffix={end}]: /(?s:.*)/"  # text up to the first closing tag, which ends it
