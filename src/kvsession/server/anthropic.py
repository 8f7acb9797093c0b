"""Anthropic's API: POST /v1/messages (plain and streamed, with tools) and POST /v1/messages/count_tokens.

Content blocks map onto the conversation the template renders: `tool_use`
blocks of an assistant message become its tool calls, `tool_result` blocks
of a user message become tool messages (before the user's own text), and a
trailing assistant message is a prefill the reply continues. What Claude
Code sends besides: `system` entries inside `messages` (its environment,
after the first user message: merged into the system prompt when they come
before the first reply, else rendered in place where the template allows,
see app._preamble), `thinking` blocks (this server's own, unsigned, go back to
the template as the turn's reasoning; signed ones are another model's and are
dropped, as are `redacted_thinking` blocks), images inside tool results (a placeholder line; an image anywhere else is a
400), `document` blocks (their text, when the source is text), and a first system block
`x-anthropic-billing-header: ...` whose last characters change with every
conversation: client metadata, not instructions, dropped unless
--keep-billing-header, or no two conversations would share a prefix. Tools
of Anthropic's own types (web search, code execution, ...) run on
Anthropic's side: they are dropped, with a warning in the trace.

The model's reasoning (tool_formats.py) comes back as a `thinking` block
before the text, with an empty `signature`, streamed as `thinking_delta`s.

A long prefill streams `ping` events after `message_start`, which Claude
Code counts as activity only 30 in a row; every tenth keepalive is a
`message_delta` with no stop reason yet, which it counts too.
"""
from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from fastapi import FastAPI, Request
from pydantic import Field

from .protocol import ApiError, Body, Sampling, TextPart, sse, sse_event
from .replies import Reply, ToolPlan

if TYPE_CHECKING:
    from .app import Frontend

BILLING_HEADER = "x-anthropic-billing-header:"
IMAGE_PLACEHOLDER = "[an image or document was here: this model reads text only]"
DELTA_EVERY = 10  # keepalives: every tenth one during a prefill is a message_delta, the others pings


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict = Field(default_factory=dict)


class ImageBlock(Body):
    type: Literal["image"]


class DocumentSource(Body):
    type: str  # "text" and "content" are read; "base64" (a PDF), "url", "file" are not text
    data: str | None = None  # a text source's text
    content: str | list[Annotated[Union[TextPart, ImageBlock], Field(discriminator="type")]] | None = None


class DocumentBlock(Body):
    type: Literal["document"]
    source: DocumentSource
    title: str | None = None
    context: str | None = None

    def as_text(self) -> str | None:
        """The document as the model reads it: its title, context and text; None for a source that is not text."""
        src = self.source
        if src.type == "text" and src.data is not None:
            body = src.data
        elif src.type == "content" and src.content is not None:
            if not isinstance(src.content, str) and any(isinstance(p, ImageBlock) for p in src.content):
                return None
            body = _text(src.content)
        else:
            return None
        return "\n\n".join(x for x in (self.title, self.context, body) if x)


class ThinkingBlock(Body):
    type: Literal["thinking", "redacted_thinking"]
    thinking: str = ""
    signature: str = ""  # Anthropic signs its models' thinking; this server's is unsigned


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[Union[TextPart, ImageBlock, DocumentBlock], Field(discriminator="type")]] = ""
    is_error: bool = False


Block = Annotated[Union[TextPart, ToolUseBlock, ToolResultBlock, ImageBlock, DocumentBlock, ThinkingBlock],
                  Field(discriminator="type")]


class AnthropicMessage(Body):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolDef(Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    input_schema: dict = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None  # "custom" or absent: a client tool; Anthropic's own types run on Anthropic's side


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class CountRequest(Body):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextPart] | None = None
    tools: list[ToolDef] | None = None


class MessagesRequest(Sampling):
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextPart] | None = None
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=16)
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict | None = None  # its user_id routes the request to the live session of that name
    grammar: str | None = None  # llama.cpp's server's: a GBNF grammar for the whole reply


def register(app: FastAPI, fe: "Frontend") -> None:
    @app.post("/v1/messages", openapi_extra=fe.schema(MessagesRequest))
    async def messages(request: Request):
        req = await fe.body(request, MessagesRequest)
        tools, warnings = _tools(req.tools)
        choice = req.tool_choice or ToolChoice(type="auto" if tools else "none")
        if choice.type == "tool" and not any(t["function"]["name"] == choice.name for t in tools):
            raise ApiError(400, f"tool_choice names the tool {choice.name!r}, which is not in tools",
                           param="tool_choice")
        if choice.type == "any" and not tools:
            raise ApiError(400, "tool_choice 'any' needs tools", param="tool_choice")
        mode = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type, choice.name)
        plan = await fe.tool_plan(tools, mode, not choice.disable_parallel_tool_use, None, req.grammar)
        msgs, prefill = _conversation(req.system, req.messages, fe.options.keep_billing_header)
        prompt = await fe.chat(fe.tool_memory.substitute(msgs), plan, continue_final=prefill)
        g = fe.generation(prompt, req, req.max_tokens, stop=list(req.stop_sequences or []),
                          constraint=plan.constraint, endpoint="messages", warnings=warnings,
                          session_key=fe.session_key(request, _user_id(req.metadata)))
        job = fe.job("generate", g)
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        if req.stream:
            return sse(_stream(fe, fe.events(request, job), mid, Reply(plan, "toolu_"), len(prompt.tokens)))
        deltas, r = await fe.answer(request, job)
        reply = Reply(plan, "toolu_")
        for _, delta in deltas:
            reply.feed(delta.text)
        reply.finish()
        c = r["choices"][0]
        await fe.remember(reply, c["tokens"])
        content = ([{"type": "thinking", "thinking": reply.reasoning, "signature": ""}] if reply.reasoning else [])
        content += ([{"type": "text", "text": reply.content}] if reply.content else [])
        content += [{"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)}
                    for call in reply.calls]
        return {"id": mid, "type": "message", "role": "assistant", "model": fe.model_id, "content": content,
                "stop_reason": _stop_reason(c, reply), "stop_sequence": c["stop_sequence"], "usage": _usage(r)}

    @app.post("/v1/messages/count_tokens", openapi_extra=fe.schema(CountRequest))
    async def count_tokens(request: Request):
        req = await fe.body(request, CountRequest)
        msgs, prefill = _conversation(req.system, req.messages, fe.options.keep_billing_header)
        prompt = await fe.chat(msgs, ToolPlan(_tools(req.tools)[0] or None), continue_final=prefill)
        return {"input_tokens": len(prompt.tokens)}


def _user_id(metadata: dict | None) -> str | None:
    user = (metadata or {}).get("user_id")
    return user if isinstance(user, str) else None


def _tools(tools: list[ToolDef] | None) -> tuple[list[dict], list[str]]:
    """Anthropic's client tools as the OpenAI function tools the template and grammar take; a warning for each
    tool of Anthropic's own types, which are dropped."""
    out, warnings = [], []
    for t in tools or []:
        if t.type not in (None, "custom"):
            warnings.append(f"tool {t.name!r} of type {t.type!r} runs on Anthropic's side: dropped")
            continue
        out.append({"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                     "parameters": t.input_schema}})
    return out, warnings


def _text(content: str | list) -> str:
    """A block list's text; an image in it, or a document that is not text (a tool's result), is a placeholder
    line."""
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, TextPart) else
                   (p.as_text() if isinstance(p, DocumentBlock) else None) or IMAGE_PLACEHOLDER for p in content)


def _document(b: DocumentBlock, i: int) -> str:
    text = b.as_text()
    if text is None:
        raise ApiError(400, f"messages.{i}: a document with a {b.source.type!r} source is not supported by this "
                       "text-only model: send its text (a \"text\" source)", param="messages")
    return text


def _system(system: str | list[TextPart] | None, keep_billing_header: bool) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "".join(p.text for p in system if keep_billing_header or not p.text.startswith(BILLING_HEADER))


def _conversation(system, messages: list[AnthropicMessage], keep_billing_header: bool = False
                  ) -> tuple[list[dict], bool]:
    """The request as template messages, and whether its last (assistant) message is a prefill to continue."""
    text = _system(system, keep_billing_header)
    out: list[dict[str, Any]] = [{"role": "system", "content": text}] if text else []
    for i, m in enumerate(messages):
        blocks = [TextPart(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if any(isinstance(b, ImageBlock) for b in blocks):
            raise ApiError(400, f"messages.{i}: image content is not supported by this text-only model",
                           param="messages")
        text = "".join(b.text if isinstance(b, TextPart) else _document(b, i) for b in blocks
                       if isinstance(b, (TextPart, DocumentBlock)))
        if m.role == "system":
            if any(isinstance(b, (ToolUseBlock, ToolResultBlock)) for b in blocks):
                raise ApiError(400, f"messages.{i}: a system message holds text only", param="messages")
            out.append({"role": "system", "content": text})
            continue
        if m.role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            reasoning = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock) and b.type == "thinking"
                                and not b.signature)  # this server's own: its text is what the model wrote
            out.append({"role": "assistant", "content": text or (None if calls else "")}
                       | ({"tool_calls": calls} if calls else {})
                       | ({"reasoning_content": reasoning} if reasoning else {}))
            continue
        if any(isinstance(b, ToolUseBlock) for b in blocks):
            raise ApiError(400, f"messages.{i}: tool_use blocks belong to assistant messages", param="messages")
        for b in blocks:
            if isinstance(b, ToolResultBlock):
                result = _text(b.content)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": f"Error: {result}" if b.is_error else result})
        if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append({"role": "user", "content": text})
    last = messages[-1]
    prefill = last.role == "assistant" and "tool_calls" not in out[-1]
    if last.role == "assistant" and not prefill:
        raise ApiError(400, "the last message is an assistant tool call: send its tool_result in a user message",
                       param="messages")
    return out, prefill


def _usage(r: dict) -> dict:
    return {"input_tokens": r["prompt_tokens"] - r["cached_tokens"], "output_tokens": r["completion_tokens"],
            "cache_read_input_tokens": r["cached_tokens"], "cache_creation_input_tokens": 0}


def _stop_reason(c: dict, reply: Reply) -> str:
    if reply.calls:
        return "tool_use"
    if c["finish_reason"] == "length":
        return "max_tokens"
    return "stop_sequence" if c["stop_sequence"] else "end_turn"


async def _stream(fe: "Frontend", events, mid: str, reply: Reply, prompt_tokens: int):
    """Anthropic's sequence: message_start (with the prompt's usage), then per content block (thinking, text or
    tool_use) content_block_start, its deltas, content_block_stop; then message_delta and message_stop.

    message_start goes out when the worker starts the request, or at the first keepalive if it waits in the
    queue (then with the whole prompt as input tokens: message_delta's usage says what was cached)."""
    block = None  # ("text" | "tool", index) of the open block
    count = 0
    started = False
    quiet = 0  # keepalives since the last delta

    def start(u: dict) -> list[str]:
        nonlocal started
        started = True
        return [sse_event("message_start", {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": fe.model_id, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": u["prompt_tokens"] - u["cached_tokens"], "output_tokens": 0,
                      "cache_read_input_tokens": u["cached_tokens"], "cache_creation_input_tokens": 0}}}),
            sse_event("ping", {"type": "ping"})]

    def keepalive() -> list[str]:
        nonlocal quiet
        if not started:
            return start({"prompt_tokens": prompt_tokens, "cached_tokens": 0})
        quiet += 1
        if quiet % DELTA_EVERY:
            return [sse_event("ping", {"type": "ping"})]
        return [sse_event("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": None, "stop_sequence": None},
                                            "usage": {"output_tokens": 0}})]

    def close():
        nonlocal block
        if block is None:
            return []
        out = [sse_event("content_block_stop", {"type": "content_block_stop", "index": block[1]})]
        block = None
        return out

    def open_block(kind: str, content: dict):
        nonlocal block, count
        out = close()
        block = (kind, count)
        count += 1
        return out + [sse_event("content_block_start", {"type": "content_block_start", "index": block[1],
                                                        "content_block": content})]

    def render(parts) -> list[str]:
        out = []
        for e in parts:
            if e[0] == "reasoning":
                if block is None or block[0] != "thinking":
                    out += open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": block[1],
                                                             "delta": {"type": "thinking_delta", "thinking": e[1]}}))
            elif e[0] == "text" and e[1]:
                if block is None or block[0] != "text":
                    out += open_block("text", {"type": "text", "text": ""})
                out.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": block[1],
                                                             "delta": {"type": "text_delta", "text": e[1]}}))
            elif e[0] == "call":
                out += open_block("tool", {"type": "tool_use", "id": e[1].id, "name": e[1].name, "input": {}})
            elif e[0] == "args":
                out.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": block[1],
                                                             "delta": {"type": "input_json_delta",
                                                                       "partial_json": e[2]}}))
        return out

    async for event in events:
        kind = event[0]
        if kind == "keepalive":
            for line in keepalive():
                yield line
        elif kind == "start" and not started:
            for line in start(event[1]):
                yield line
        elif kind == "delta":
            quiet = 0
            for line in render(reply.feed(event[2].text)):
                yield line
        elif kind == "error":
            yield sse_event("error", {"type": "error", "error": {"type": event[1].kind, "message": event[1].message}})
            return
        elif kind == "done" and event[1] is not None:
            r = event[1]
            c = r["choices"][0]
            for line in render(reply.finish()) + close():
                yield line
            await fe.remember(reply, c["tokens"])
            yield sse_event("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": _stop_reason(c, reply),
                                                        "stop_sequence": c["stop_sequence"]},
                                              "usage": _usage(r)})
            yield sse_event("message_stop", {"type": "message_stop"})
