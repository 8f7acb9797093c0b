"""OpenAI's API: POST /v1/chat/completions and POST /v1/completions, plain and streamed."""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Literal

from fastapi import FastAPI, Request
from pydantic import Field

from .protocol import ApiError, Body, Sampling, TextPart, sse, sse_data, text_of

if TYPE_CHECKING:
    from .app import Frontend


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class StreamOptions(Body):
    include_usage: bool = False


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)


class CompletionRequest(Sampling):
    prompt: str | list[str]
    max_tokens: int | None = Field(16, ge=1)
    stop: str | list[str] | None = None
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)


def register(app: FastAPI, fe: "Frontend") -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await fe.body(request, ChatRequest)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": text_of(m.content)}
                    for m in req.messages]
        g = fe.generation(fe.render(messages), req, req.max_completion_tokens or req.max_tokens or 1024, req.stop)
        job = fe.job("generate", g)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": fe.model_id}
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            return sse(_stream(fe.events(request, job), base, usage, _chat_choice, role))
        text, r = await fe.answer(request, job)
        return {"id": rid, "object": "chat.completion", "created": created, "model": fe.model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": r["finish_reason"], "logprobs": None}],
                "usage": usage_of(r)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await fe.body(request, CompletionRequest)
        prompt = req.prompt if isinstance(req.prompt, str) else req.prompt[0] if len(req.prompt) == 1 else None
        if prompt is None:
            raise ApiError(400, "prompt: one prompt per request", param="prompt")
        g = fe.generation(prompt, req, req.max_tokens or 16, req.stop)
        job = fe.job("generate", g)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            base = {"id": rid, "object": "text_completion", "created": created, "model": fe.model_id}
            return sse(_stream(fe.events(request, job), base, usage, _completion_choice))
        text, r = await fe.answer(request, job)
        return {"id": rid, "object": "text_completion", "created": created, "model": fe.model_id,
                "choices": [{"index": 0, "text": text, "finish_reason": r["finish_reason"], "logprobs": None}],
                "usage": usage_of(r)}


def usage_of(r: dict) -> dict:
    return {"prompt_tokens": r["prompt_tokens"], "completion_tokens": r["completion_tokens"],
            "total_tokens": r["prompt_tokens"] + r["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": r["cached_tokens"]}}


def _chat_choice(text: str | None, finish: str | None) -> dict:
    return {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish}


def _completion_choice(text: str | None, finish: str | None) -> dict:
    return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}


async def _stream(events, base: dict, usage: bool, choice, first: dict | None = None):
    """OpenAI's stream: a chunk per delta, a last chunk with the finish reason, usage if asked, [DONE]."""
    if first is not None:
        yield sse_data({**base, "choices": [first]})
    async for event in events:
        kind = event[0]
        if kind == "keepalive":
            yield ": keepalive\n\n"
        elif kind == "delta":
            yield sse_data({**base, "choices": [choice(event[1], None)]})
        elif kind == "error":
            yield sse_data({"error": {"message": event[1].message, "type": event[1].kind, "code": event[1].code}})
            return
        elif kind == "done" and event[1] is not None:
            r = event[1]
            yield sse_data({**base, "choices": [choice(None, r["finish_reason"])]})
            if usage:
                yield sse_data({**base, "choices": [], "usage": usage_of(r)})
            yield "data: [DONE]\n\n"
