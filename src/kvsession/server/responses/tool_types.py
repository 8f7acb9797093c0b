"""The Responses API's tool types: what a local model is offered for each, and the items its calls become.

The model sees function tools only (the template renders them, grammar.py
constrains their calls); each request tool becomes one or more of them:

- `function`: as it is.
- `custom` (freeform): a function of one string, `input`. A `grammar` format
  is told in the string's description (Lark) or kept as its pattern
  (regex); the call is a `custom_tool_call` item with that string.
- `namespace` (Codex's multi-agent tools): its function and custom tools,
  named `namespace.name`; their call items carry `namespace` and the plain
  name.
- `local_shell`: a function of `command` (an argv list), `workdir` and
  `timeout_ms`; the call is a `local_shell_call` item with an exec action.

Hosted tools (web search, file search, code interpreter, image generation,
computer use, MCP, tool search, ...) run on OpenAI's side, where this
server is not: they are dropped, with a warning in the trace, and their
items in a conversation's history are skipped the same way.

A call item that comes back in the history renders as the call the model
made: the same name and the same arguments, keys in the schema's order (as
the grammar wrote them), so that the prompt keeps matching the session.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, TypeAdapter, ValidationError

from ..protocol import ApiError, Body
from ..request_fields import named_tool, tool_choice

NAME = r"^[A-Za-z0-9_.:-]+$"
# history items of hosted tools: skipped (the model never made them here)
HOSTED_ITEMS = frozenset({
    "web_search_call", "file_search_call", "code_interpreter_call", "image_generation_call", "computer_call",
    "computer_call_output", "mcp_call", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response",
    "tool_search_call", "tool_search_output"})
SHELL = {"type": "object", "properties": {
    "command": {"type": "array", "items": {"type": "string"}, "description": "The program and its arguments."},
    "workdir": {"type": "string", "description": "The directory to run it in."},
    "timeout_ms": {"type": "integer", "description": "How long it may run, in milliseconds."}},
    "required": ["command"], "additionalProperties": False}
SHELL_DESCRIPTION = "Runs a command on the user's machine and returns what it printed."


class FunctionTool(Body):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class CustomFormat(Body):
    type: Literal["text", "grammar"] = "text"
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = Field(None, max_length=100_000)


class CustomTool(Body):
    type: Literal["custom"]
    name: str = Field(min_length=1, max_length=64, pattern=NAME)
    description: str | None = None
    format: CustomFormat | None = None


class NamespaceTool(Body):
    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=64, pattern=NAME)
    description: str | None = None
    tools: list[FunctionTool | CustomTool] = Field(max_length=128)


class LocalShellTool(Body):
    type: Literal["local_shell"]


OFFERED = {"function": FunctionTool, "custom": CustomTool, "namespace": NamespaceTool, "local_shell": LocalShellTool}
_ADAPTERS = {k: TypeAdapter(v) for k, v in OFFERED.items()}


@dataclass(frozen=True)
class Kind:
    """What a function the model sees stands for."""

    kind: str  # "function", "custom" or "local_shell"
    name: str  # the tool's own name
    namespace: str | None = None


def model_name(name: str, namespace: str | None) -> str:
    return f"{namespace}.{name}" if namespace else name


class ToolSet:
    """A request's tools: the function tools the model is offered, what each stands for, and what was dropped."""

    def __init__(self, tools: list[Any] | None):
        self.functions: list[dict] = []
        self.kinds: dict[str, Kind] = {}
        self.warnings: list[str] = []
        for i, raw in enumerate(tools or []):
            kind = raw.get("type") if isinstance(raw, dict) else None
            if not isinstance(kind, str):
                raise ApiError(400, f"tools.{i}: a tool is an object with a type", param=f"tools.{i}")
            if kind not in OFFERED:
                self.warnings.append(f"tools.{i}: a {kind!r} tool runs on OpenAI's side, not here: dropped")
                continue
            try:
                tool = _ADAPTERS[kind].validate_python(raw)
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(x) for x in (f"tools.{i}", *first["loc"]))
                raise ApiError(400, f"{where}: {first['msg']}", param=where) from None
            if isinstance(tool, NamespaceTool):
                for inner in tool.tools:
                    self._add(inner, tool.name, i)
            else:
                self._add(tool, None, i)

    def _add(self, tool, namespace: str | None, i: int) -> None:
        if isinstance(tool, LocalShellTool):
            name, fn = "local_shell", {"description": SHELL_DESCRIPTION, "parameters": SHELL}
            kind = Kind("local_shell", "local_shell")
        elif isinstance(tool, CustomTool):
            name, kind = model_name(tool.name, namespace), Kind("custom", tool.name, namespace)
            fn = {"description": tool.description or "", "parameters": _custom_parameters(tool.format)}
        else:
            name, kind = model_name(tool.name, namespace), Kind("function", tool.name, namespace)
            fn = {"description": tool.description or "", "parameters": tool.parameters or {"type": "object"},
                  **({"strict": tool.strict} if tool.strict is not None else {})}
        if name in self.kinds:
            raise ApiError(400, f"tools.{i}: a second tool named {name!r}", param=f"tools.{i}")
        self.kinds[name] = kind
        self.functions.append({"type": "function", "function": {"name": name, **fn}})

    def choice(self, choice: Any) -> str:
        """tool_choice as Frontend.tool_plan takes it: "auto", "required", "none" or the offered function's name."""
        if choice is None or isinstance(choice, str):
            if choice is not None and choice not in ("auto", "required", "none"):
                raise ApiError(400, f"tool_choice {choice!r}: choose auto, required, none or a tool",
                               param="tool_choice")
            return tool_choice(choice, self.kinds)
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind in ("function", "custom"):
            name = model_name(str(choice.get("name")), choice.get("namespace"))
            return named_tool(name, [n for n, k in self.kinds.items() if k.kind == kind], f"{kind} tool")
        if kind == "local_shell" and "local_shell" in self.kinds:
            return "local_shell"
        raise ApiError(400, f"tool_choice of type {kind!r} is not supported here: choose auto, required, none, "
                       "or a function, custom or local_shell tool", param="tool_choice")

    def call_item(self, call, status: str = "completed") -> dict:
        """The output item of one of the model's calls (a replies.Call)."""
        kind = self.kinds.get(call.name, Kind("function", call.name))
        done = status == "completed"
        args = _object(call.arguments) if done else {}
        suffix = call.id[5:]  # after "call_"
        ns = {"namespace": kind.namespace} if kind.namespace else {}
        if kind.kind == "custom":
            return {"type": "custom_tool_call", "id": f"ctc_{suffix}", "call_id": call.id, "name": kind.name,
                    "input": str(args.get("input", "")) if done else "", "status": status, **ns}
        if kind.kind == "local_shell":
            action = {"type": "exec", "command": args.get("command", []), "env": {}, "user": None,
                      "working_directory": args.get("workdir"), "timeout_ms": args.get("timeout_ms")}
            return {"type": "local_shell_call", "id": f"lsh_{suffix}", "call_id": call.id, "status": status,
                    "action": action}
        return {"type": "function_call", "id": f"fc_{suffix}", "call_id": call.id, "name": kind.name,
                "arguments": call.arguments if done else "", "status": status, **ns}


def _custom_parameters(fmt: CustomFormat | None) -> dict:
    """A freeform tool's input as the one string argument of a function."""
    text: dict[str, Any] = {"type": "string", "description": "The tool's input, as free text."}
    if fmt is not None and fmt.type == "grammar" and fmt.definition:
        if fmt.syntax == "regex":
            text["pattern"] = f"^(?:{fmt.definition})$"  # the whole input matches (JSON Schema's is a search)
        else:
            text["description"] = "The tool's input, following this Lark grammar:\n" + fmt.definition
    return {"type": "object", "properties": {"input": text}, "required": ["input"], "additionalProperties": False}


def _object(arguments: str) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except (json.JSONDecodeError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def history_call(item, where: str) -> dict | None:
    """A call item of a conversation's history (an InputItem) as a template tool call; None for other items."""
    if item.type == "custom_tool_call":
        if not item.call_id or not item.name:
            raise ApiError(400, f"{where}: a custom_tool_call needs call_id and name", param="input")
        return _call(item.call_id, model_name(item.name, item.namespace), {"input": item.input or ""})
    if item.type == "local_shell_call":
        action = item.action or {}
        if not item.call_id or not isinstance(action.get("command"), list):
            raise ApiError(400, f"{where}: a local_shell_call needs call_id and action.command", param="input")
        args = {"command": action["command"]}
        for key, field in (("workdir", "working_directory"), ("timeout_ms", "timeout_ms")):
            if action.get(field) is not None:
                args[key] = action[field]
        return _call(item.call_id, "local_shell", args)
    return None


def _call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
