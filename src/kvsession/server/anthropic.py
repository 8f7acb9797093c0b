"""Anthropic's API: POST /v1/messages (plain and streamed, with tools) and POST /v1/messages/count_tokens.

Content blocks map onto the conversation the template renders: `tool_use`
blocks of an assistant message become its tool calls, `tool_result` blocks
of a user message become tool messages (before the user's own text), and a
trailing assistant message is a prefill the reply continues. What Claude
Code sends besides: `system` entries inside `messages` (its environment,
after the first user message: merged into the system prompt when they come
before the first reply, else rendered in place where the template allows,
see serving._preamble), `thinking` blocks (this server's own, unsigned, go back to
the template as the turn's reasoning; signed ones are another model's and are
dropped, as are `redacted_thinking` blocks), images inside tool results (a placeholder line; an image anywhere else is a
400), `document` blocks (their text, when the source is text), and a first system block
`x-anthropic-billing-header: ...` whose last characters change with every
conversation: client metadata, not instructions, dropped unless
--keep-billing-header, or no two conversations would share a prefix. Tools
of Anthropic's own types (web search, code execution, ...) run on
Anthropic's side: they are dropped, with a warning in the trace.

The model's reasoning (tool_formats/) comes back as a `thinking` block
before the text, with an empty `signature`, streamed as `thinking_delta`s.

A long prefill streams `ping` events after `message_start`, which Claude
Code counts as activity only 30 in a row; every tenth keepalive is a
`message_delta` with no stop reason yet, which it counts too.
"""
from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, Union

from fastapi import Request
from pydantic import Field

from .events import ChoiceEnd, Done, Output, Started
from .http.bodies import BodyRouter
from .http.sse import StreamRenderer, sse_event, stream
from .protocol import ApiError, Body, Sampling, TextPart
from .replies import CallOpened, Reply, ReplyEvent, ToolPlan
from .reply_events import ContentDelta, ReasoningDelta, ToolCallDelta
from .request_fields import named_tool, session_key, stops, tool_choice
from .serving import Frontend, frontend

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


router = BodyRouter()


@router.body_post("/v1/messages", MessagesRequest)
async def messages(request: Request):
    fe = frontend(request)
    req = await fe.body(request, MessagesRequest)
    tools, warnings = _tools(req.tools)
    choice = req.tool_choice or ToolChoice(type="auto" if tools else "none")
    plan = await fe.tool_plan(tools, _tool_choice(choice, tools), not choice.disable_parallel_tool_use, None,
                              req.grammar)
    msgs, prefill = _conversation(req.system, req.messages, fe.options.keep_billing_header)
    prompt = await fe.chat(fe.tool_memory.substitute(msgs), plan, continue_final=prefill)
    g = fe.generation(prompt, req, req.max_tokens, stop=stops(req.stop_sequences),
                      constraint=plan.constraint, endpoint="messages", warnings=warnings,
                      session_key=session_key(request.headers, _user_id(req.metadata)))
    job = fe.job("generate", g)
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    if req.stream:
        return stream(fe.events(request, job), MessagesStream(fe, mid, Reply(plan, "toolu_"), len(prompt.tokens)))
    outputs, done = await fe.answer(request, job)
    reply = Reply(plan, "toolu_")
    for o in outputs:
        reply.feed(o.delta.text)
    reply.finish()
    c = done.choices[0]
    await fe.remember(reply, c.tokens)
    content = ([{"type": "thinking", "thinking": reply.reasoning, "signature": ""}] if reply.reasoning else [])
    content += ([{"type": "text", "text": reply.content}] if reply.content else [])
    content += [{"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)}
                for call in reply.calls]
    return {"id": mid, "type": "message", "role": "assistant", "model": fe.model_id, "content": content,
            "stop_reason": _stop_reason(c, reply), "stop_sequence": c.stop_sequence, "usage": _usage(done)}


@router.body_post("/v1/messages/count_tokens", CountRequest)
async def count_tokens(request: Request):
    fe = frontend(request)
    req = await fe.body(request, CountRequest)
    msgs, prefill = _conversation(req.system, req.messages, fe.options.keep_billing_header)
    prompt = await fe.chat(msgs, ToolPlan(_tools(req.tools)[0] or None), continue_final=prefill)
    return {"input_tokens": len(prompt.tokens)}


def _tool_choice(choice: ToolChoice, tools: list[dict]) -> str:
    """Anthropic's tool_choice as Frontend.tool_plan takes it: "any" is "required", "tool" names one."""
    names = [t["function"]["name"] for t in tools]
    if choice.type == "tool":
        return named_tool(choice.name, names, "tool")
    return tool_choice("required" if choice.type == "any" else choice.type, names, required="any")


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


def _usage(done: Done) -> dict:
    return {"input_tokens": done.prompt_tokens - done.cached_tokens, "output_tokens": done.completion_tokens,
            "cache_read_input_tokens": done.cached_tokens, "cache_creation_input_tokens": 0}


def _stop_reason(c: ChoiceEnd, reply: Reply) -> str:
    if reply.calls:
        return "tool_use"
    if c.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if c.stop_sequence else "end_turn"


class MessagesStream(StreamRenderer):
    """Anthropic's sequence: message_start (with the prompt's usage), then per content block (thinking, text or
    tool_use) content_block_start, its deltas, content_block_stop; then message_delta and message_stop.

    message_start goes out when the worker starts the request, or at the first keepalive if it waits in the
    queue (then with the whole prompt as input tokens: message_delta's usage says what was cached)."""

    def __init__(self, fe: Frontend, mid: str, reply: Reply, prompt_tokens: int):
        self.fe, self.mid, self.reply, self.prompt_tokens = fe, mid, reply, prompt_tokens
        self.block: tuple[str, int] | None = None  # ("thinking" | "text" | "tool", index) of the open block
        self.count = 0  # blocks opened
        self.begun = False  # message_start went out
        self.quiet = 0  # keepalives since the last output

    def _start(self, prompt_tokens: int, cached_tokens: int) -> list[str]:
        self.begun = True
        return [sse_event("message_start", {"type": "message_start", "message": {
            "id": self.mid, "type": "message", "role": "assistant", "model": self.fe.model_id, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": 0,
                      "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}}}),
            sse_event("ping", {"type": "ping"})]

    def started(self, e: Started) -> list[str]:
        return [] if self.begun else self._start(e.prompt_tokens, e.cached_tokens)

    def keepalive(self) -> list[str]:
        if not self.begun:
            return self._start(self.prompt_tokens, 0)
        self.quiet += 1
        if self.quiet % DELTA_EVERY:
            return [sse_event("ping", {"type": "ping"})]
        return [sse_event("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": None, "stop_sequence": None},
                                            "usage": {"output_tokens": 0}})]

    def output(self, e: Output) -> list[str]:
        self.quiet = 0
        return self._render(self.reply.feed(e.delta.text))

    async def done(self, e: Done) -> list[str]:
        c = e.choices[0]
        out = self._render(self.reply.finish()) + self._close()
        await self.fe.remember(self.reply, c.tokens)
        return out + [sse_event("message_delta", {"type": "message_delta",
                                                  "delta": {"stop_reason": _stop_reason(c, self.reply),
                                                            "stop_sequence": c.stop_sequence},
                                                  "usage": _usage(e)}),
                      sse_event("message_stop", {"type": "message_stop"})]

    def failed(self, e: ApiError) -> list[str]:
        return [sse_event("error", {"type": "error", "error": {"type": e.kind, "message": e.message}})]

    def _close(self) -> list[str]:
        if self.block is None:
            return []
        out = [sse_event("content_block_stop", {"type": "content_block_stop", "index": self.block[1]})]
        self.block = None
        return out

    def _open(self, kind: str, content: dict) -> list[str]:
        out = self._close()
        self.block = (kind, self.count)
        self.count += 1
        return out + [sse_event("content_block_start", {"type": "content_block_start", "index": self.block[1],
                                                        "content_block": content})]

    def _delta(self, delta: dict) -> str:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.block[1],
                                                 "delta": delta})

    def _render(self, events: list[ReplyEvent]) -> list[str]:
        out = []
        for e in events:
            match e:
                case ReasoningDelta(text=text):
                    if self.block is None or self.block[0] != "thinking":
                        out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                    out.append(self._delta({"type": "thinking_delta", "thinking": text}))
                case ContentDelta(text=text) if text:
                    if self.block is None or self.block[0] != "text":
                        out += self._open("text", {"type": "text", "text": ""})
                    out.append(self._delta({"type": "text_delta", "text": text}))
                case CallOpened(call=call):
                    out += self._open("tool", {"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
                case ToolCallDelta(arguments=fragment):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": fragment}))
        return out
