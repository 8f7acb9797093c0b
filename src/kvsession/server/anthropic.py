"""Anthropic's API: POST /v1/messages, plain and streamed with Anthropic's event sequence."""
from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Literal

from fastapi import FastAPI, Request
from pydantic import Field

from .protocol import Body, Sampling, TextPart, sse, sse_event, text_of

if TYPE_CHECKING:
    from .app import Frontend


class AnthropicMessage(Body):
    role: Literal["user", "assistant"]
    content: str | list[TextPart]


class MessagesRequest(Sampling):
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextPart] | None = None
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None


def register(app: FastAPI, fe: "Frontend") -> None:
    @app.post("/v1/messages")
    async def messages(request: Request):
        req = await fe.body(request, MessagesRequest)
        msgs = ([{"role": "system", "content": text_of(req.system)}] if req.system else [])
        msgs += [{"role": m.role, "content": text_of(m.content)} for m in req.messages]
        g = fe.generation(fe.render(msgs), req, req.max_tokens, req.stop_sequences)
        job = fe.job("generate", g)
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        if req.stream:
            return sse(_stream(fe.events(request, job), mid, fe.model_id))
        text, r = await fe.answer(request, job)
        return {"id": mid, "type": "message", "role": "assistant", "model": fe.model_id,
                "content": [{"type": "text", "text": text}], "stop_reason": _stop_reason(r),
                "stop_sequence": r["stop_sequence"], "usage": _usage(r)}


def _usage(r: dict) -> dict:
    return {"input_tokens": r["prompt_tokens"] - r["cached_tokens"], "output_tokens": r["completion_tokens"],
            "cache_read_input_tokens": r["cached_tokens"], "cache_creation_input_tokens": 0}


def _stop_reason(r: dict) -> str:
    if r["finish_reason"] == "length":
        return "max_tokens"
    return "stop_sequence" if r["stop_sequence"] else "end_turn"


async def _stream(events, mid, model):
    """Anthropic's sequence: message_start, content_block_start, ping, deltas, content_block_stop,
    message_delta, message_stop. Input usage is known only when the worker is done."""
    started = False
    async for event in events:
        kind = event[0]
        if not started and kind in ("delta", "done", "progress", "keepalive"):
            started = True
            yield sse_event("message_start", {"type": "message_start", "message": {
                "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0}}})
            yield sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                    "content_block": {"type": "text", "text": ""}})
            yield sse_event("ping", {"type": "ping"})
        if kind == "keepalive":
            yield ": keepalive\n\n"
        elif kind == "delta":
            yield sse_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                    "delta": {"type": "text_delta", "text": event[1]}})
        elif kind == "error":
            yield sse_event("error", {"type": "error", "error": {"type": event[1].kind, "message": event[1].message}})
            return
        elif kind == "done" and event[1] is not None:
            r = event[1]
            yield sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
            yield sse_event("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": _stop_reason(r),
                                                        "stop_sequence": r["stop_sequence"]},
                                              "usage": _usage(r)})
            yield sse_event("message_stop", {"type": "message_stop"})
