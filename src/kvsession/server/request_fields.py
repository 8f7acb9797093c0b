"""What the APIs' requests ask for in the same terms, read once for all of them.

Each API names these its own way (OpenAI's `tool_choice: "required"` is
Anthropic's `{"type": "any"}`, chat's `response_format` is the Responses
API's `text.format`); the API module picks the fields out of its request,
and these functions turn them into what the serving side takes
(Frontend.tool_plan, Frontend.generation, the worker's Generation), each
fault a 400 naming the field in the API's own words.
"""
from __future__ import annotations

import json
from typing import Collection

from starlette.datastructures import Headers

from ..sampling import SamplerParams
from .protocol import ApiError, Sampling

JsonFormat = tuple[dict | None, bool]  # (schema or None for any JSON object, strict), as grammar.py takes it
MAX_SESSION_KEY = 256


def tool_choice(mode: str | None, offered: Collection[str], *, required: str = "required") -> str:
    """A tool choice that names no tool as Frontend.tool_plan takes it: "auto", "none" or "required"; None is the
    default, "auto" when tools are offered. required: the API's word for it, for the message ("any")."""
    if mode == "required" and not offered:
        raise ApiError(400, f"tool_choice {required!r} needs tools", param="tool_choice")
    return mode or ("auto" if offered else "none")


def named_tool(name: object, offered: Collection[str], what: str = "function") -> str:
    """The name of the tool a tool choice names, which must be one of those `offered`."""
    if not isinstance(name, str) or name not in offered:
        raise ApiError(400, f"tool_choice names the {what} {name!r}, which is not in tools", param="tool_choice")
    return name


def json_format(kind: str | None, schema: dict | None, strict: bool | None, *, field: str,
                missing: str) -> JsonFormat | None:
    """An output format as Frontend.tool_plan takes it: None for free text ("text", or none given), else JSON:
    any object for "json_object", the schema for "json_schema" (`missing`: the message when it has none)."""
    if kind is None or kind == "text":
        return None
    if kind == "json_object":
        return None, False
    if schema is None:
        raise ApiError(400, missing, param=field)
    return schema, bool(strict)


def call_arguments(text: str | None, what: str, param: str, *, quoted: bool = False) -> dict:
    """A history tool call's arguments, JSON text of an object, as the dict the template renders; a 400 naming
    `what` when they are not one (quoted: with the text's first 80 characters)."""
    try:
        value = json.loads(text or "{}")
    except (json.JSONDecodeError, RecursionError):
        shown = f": {text[:80]!r}" if quoted else ""
        raise ApiError(400, f"{what} are not JSON{shown}", param=param) from None
    if not isinstance(value, dict):
        raise ApiError(400, f"{what} must be a JSON object", param=param)
    return value


def stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def sampler_params(req: Sampling, defaults: SamplerParams) -> SamplerParams:
    """The request's sampling, the server's defaults (--temperature, ...) for what it leaves out; seed -1 is a
    random one, as in llama.cpp."""
    d = defaults
    return SamplerParams(temperature=d.temperature if req.temperature is None else req.temperature,
                         top_k=d.top_k if req.top_k is None else req.top_k,
                         top_p=d.top_p if req.top_p is None else req.top_p,
                         min_p=d.min_p if req.min_p is None else req.min_p,
                         seed=d.seed if req.seed is None else None if req.seed == -1 else req.seed)


def session_key(headers: Headers, *fields: str | None) -> str | None:
    """The client's name for its conversation: the X-Session-Id header, else the first body field given
    (OpenAI's `user`, Anthropic's metadata.user_id, the Responses API's prompt_cache_key). It routes the
    request to that conversation's live session."""
    key = headers.get("x-session-id") or next((f for f in fields if f), None)
    if key is not None and len(key) > MAX_SESSION_KEY:
        raise ApiError(400, f"a session key (X-Session-Id or user) has at most {MAX_SESSION_KEY} characters",
                       param="user")
    return key
