"""OpenAI's API: POST /v1/chat/completions and POST /v1/completions, plain and streamed.

Chat takes tools (`tools`, `tool_choice`, `parallel_tool_calls`) and answers
with `message.tool_calls` / streamed `delta.tool_calls`; assistant tool
calls and `role: "tool"` results in the history are rendered through the
model's template. `response_format` (json_object, json_schema) and forced
tool choices constrain decoding with a grammar, as does llama.cpp's
`grammar` (GBNF). The model's thinking comes back apart from its answer, as
llama.cpp's server returns it (`message.reasoning_content`, streamed
`delta.reasoning_content`), and goes to the template when a client sends it
back; `chat_template_kwargs` and `reasoning_effort` are template variables.
Both endpoints take `logprobs`, `logit_bias` and `n`; completions also `echo`.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from pydantic import Field, field_validator

from ..template import ChatPrompt
from .protocol import ApiError, Body, Sampling, TextPart, sse, sse_data
from .replies import Reply, ToolPlan

if TYPE_CHECKING:
    from .app import Frontend

MAX_N = 16


class FunctionCall(Body):
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant turn's thinking, as this server (and llama.cpp's) returns it


class FunctionDef(Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class NamedChoice(Body):
    type: Literal["function"]
    function: dict = Field(description="{'name': the function to call}")


class JsonSchemaFormat(Body):
    name: str = "response"
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(Body):
    include_usage: bool = False


class Choices(Sampling):
    """What chat and completions share: how many choices, their limits, logit bias, penalties."""

    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    user: str | None = None  # routes the request to the live session of that name
    grammar: str | None = None  # llama.cpp's server's: a GBNF grammar for the whole reply

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, value in (v or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys are token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"token {key}: a bias between -100 and 100, got {value}")
        return v


class ChatRequest(Choices):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    functions: list | None = None  # the deprecated form of tools: refused with a pointer to tools
    function_call: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # the template's own variables ({"enable_thinking": false})
    reasoning_effort: str | None = Field(None, max_length=32)  # gpt-oss's template renders it


class CompletionRequest(Choices):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None


def register(app: FastAPI, fe: "Frontend") -> None:
    @app.post("/v1/chat/completions", openapi_extra=fe.schema(ChatRequest))
    async def chat_completions(request: Request):
        req = await fe.body(request, ChatRequest)
        _unsupported(req)
        if req.functions is not None or req.function_call is not None:
            raise ApiError(400, "functions / function_call are the deprecated form of tools: send tools and "
                           "tool_choice", param="functions")
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        plan = await fe.tool_plan([t.model_dump(exclude_none=True) for t in req.tools or []], _tool_choice(req),
                                  req.parallel_tool_calls, _json_format(req.response_format), req.grammar)
        messages = fe.tool_memory.substitute([_message(m) for m in req.messages])
        prompt = await fe.chat(messages, plan,
                               variables=fe.template_variables(req.chat_template_kwargs, req.reasoning_effort))
        g = fe.generation(prompt, req, req.max_completion_tokens or req.max_tokens,
                          stop=_stops(req.stop), n=req.n, logit_bias=await fe.logit_bias(req.logit_bias),
                          top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                          constraint=plan.constraint, endpoint="chat.completions",
                          session_key=fe.session_key(request, req.user))
        job = fe.job("generate", g)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion", "created": created, "model": fe.model_id}
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return sse(_chat_stream(fe, fe.events(request, job), {**base, "object": "chat.completion.chunk"},
                                    usage, plan, req.n))
        deltas, r = await fe.answer(request, job)
        replies = [Reply(plan, "call_") for _ in range(req.n)]
        logprobs: list[list] = [[] for _ in range(req.n)]
        for index, delta in deltas:
            replies[index].feed(delta.text)
            logprobs[index] += delta.logprobs
        choices = []
        for reply, c, lps in zip(replies, r["choices"], logprobs):
            reply.finish()
            await fe.remember(reply, c["tokens"])
            message: dict[str, Any] = {"role": "assistant", "content": reply.content or (None if reply.calls else "")}
            if reply.reasoning:  # where llama.cpp's server puts it
                message["reasoning_content"] = reply.reasoning
            if reply.calls:
                message["tool_calls"] = [_call_json(call) for call in reply.calls]
            choices.append({"index": c["index"], "message": message,
                            "finish_reason": "tool_calls" if reply.calls else c["finish_reason"],
                            "logprobs": {"content": fe.logprob_entries(lps)} if req.logprobs else None})
        return {**base, "choices": choices, "usage": usage_of(r)}

    @app.post("/v1/completions", openapi_extra=fe.schema(CompletionRequest))
    async def completions(request: Request):
        req = await fe.body(request, CompletionRequest)
        _unsupported(req)
        if req.suffix:
            raise ApiError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
        if (req.best_of or 1) > 1:
            raise ApiError(400, "best_of is not supported: ask for n choices", param="best_of")
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], int):
            tokens = list(req.prompt)
            n_vocab = fe.engine.config.vocab_size
            if any(not 0 <= t < n_vocab for t in tokens):
                raise ApiError(400, f"prompt: token ids must be in [0, {n_vocab})", param="prompt")
            prompt = ChatPrompt(fe.engine.tokenizer.decode(tokens), tokens)
        else:
            text = req.prompt if isinstance(req.prompt, str) else req.prompt[0] if len(req.prompt) == 1 else None
            if text is None:
                raise ApiError(400, "prompt: one prompt per request", param="prompt")
            prompt = ChatPrompt(text, await fe.tokens(text))
        text, tokens = prompt.text, prompt.tokens
        plan = await fe.tool_plan([], "none", False, _json_format(req.response_format), req.grammar)
        g = fe.generation(prompt, req, req.max_tokens, stop=_stops(req.stop), n=req.n,
                          logit_bias=await fe.logit_bias(req.logit_bias), top_logprobs=req.logprobs,
                          prompt_logprobs=req.echo and req.logprobs is not None, constraint=plan.constraint,
                          endpoint="completions", session_key=fe.session_key(request, req.user))
        job = fe.job("generate", g)
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": fe.model_id}
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return sse(_completion_stream(fe, fe.events(request, job), base, usage, req, text))
        deltas, r = await fe.answer(request, job)
        texts: list[list[str]] = [[] for _ in range(req.n)]
        lps: list[list] = [[] for _ in range(req.n)]
        for index, delta in deltas:
            texts[index].append(delta.text)
            lps[index] += delta.logprobs
        choices = []
        for c in r["choices"]:
            i = c["index"]
            out = "".join(texts[i])
            logprobs = None
            if req.logprobs is not None:
                prompt_part = list(zip(tokens, r["prompt_logprobs"])) if req.echo else []
                logprobs = fe.legacy_logprobs(prompt_part + [(lp.token, lp) for lp in lps[i]])
            choices.append({"index": i, "text": (text if req.echo else "") + out,
                            "finish_reason": c["finish_reason"], "logprobs": logprobs})
        return {**base, "choices": choices, "usage": usage_of(r)}


def _unsupported(req: Choices) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name):
            raise ApiError(400, f"{name} is not supported (only 0)", param=name)


def _stops(stop) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def _tool_choice(req: ChatRequest):
    choice = req.tool_choice
    if isinstance(choice, NamedChoice):
        name = choice.function.get("name")
        if not isinstance(name, str) or not any(t.function.name == name for t in req.tools or []):
            raise ApiError(400, f"tool_choice names the function {name!r}, which is not in tools",
                           param="tool_choice")
        return name
    if choice == "required" and not req.tools:
        raise ApiError(400, "tool_choice 'required' needs tools", param="tool_choice")
    return choice or ("auto" if req.tools else "none")


def _json_format(fmt: ResponseFormat | None):
    """None (free text), or (schema or None, strict) for json_object / json_schema."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return None, False
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ApiError(400, "response_format json_schema needs json_schema.schema", param="response_format")
    return fmt.json_schema.schema_, bool(fmt.json_schema.strict)


def _message(m: ChatMessage) -> dict:
    """A request message as the template takes it: text content, tool calls with parsed arguments."""
    role = "system" if m.role == "developer" else m.role
    content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
    out: dict[str, Any] = {"role": role, "content": content if content is not None or m.tool_calls else ""}
    if m.tool_calls:
        if role != "assistant":
            raise ApiError(400, f"tool_calls in a {role} message: only assistant messages have them",
                           param="messages")
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    if role == "tool":
        out["tool_call_id"] = m.tool_call_id or ""
    if role == "assistant" and m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content
    if m.name:
        out["name"] = m.name
    return out


def _arguments(arguments: str | dict) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except (json.JSONDecodeError, RecursionError):
        raise ApiError(400, f"tool call arguments are not JSON: {arguments[:80]!r}", param="messages") from None
    if not isinstance(value, dict):
        raise ApiError(400, "tool call arguments must be a JSON object", param="messages")
    return value


def _call_json(call) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def usage_of(r: dict) -> dict:
    return {"prompt_tokens": r["prompt_tokens"], "completion_tokens": r["completion_tokens"],
            "total_tokens": r["prompt_tokens"] + r["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": r["cached_tokens"]}}


async def _frames(events, base: dict, usage: bool, on_delta, on_done):
    """OpenAI's stream around an API's choices: a chunk per choice dict on_delta(index, Delta) and
    on_done(choice result) return (async), usage if asked, [DONE]; keepalives and errors as OpenAI writes them."""
    async for event in events:
        kind = event[0]
        if kind == "keepalive":
            yield ": keepalive\n\n"
        elif kind == "delta":
            for choice in on_delta(event[1], event[2]):
                yield sse_data({**base, "choices": [choice]})
        elif kind == "error":
            e = event[1]
            yield sse_data({"error": {"message": e.message, "type": e.kind, "code": e.code}})
            return
        elif kind == "done" and event[1] is not None:
            r = event[1]
            for c in r["choices"]:
                for choice in await on_done(c):
                    yield sse_data({**base, "choices": [choice]})
            if usage:
                yield sse_data({**base, "choices": [], "usage": usage_of(r)})
            yield "data: [DONE]\n\n"


async def _chat_stream(fe: "Frontend", events, base: dict, usage: bool, plan: ToolPlan, n: int):
    """Chat's chunks: a role chunk per choice, content and tool-call deltas, a finish chunk per choice."""
    replies = [Reply(plan, "call_") for _ in range(n)]

    def on_delta(index: int, delta) -> list[dict]:
        parts = _chat_deltas(replies[index].feed(delta.text))
        logprobs = {"content": fe.logprob_entries(delta.logprobs)} if delta.logprobs else None
        return [{"index": index, "delta": part, "finish_reason": None, "logprobs": logprobs if j == 0 else None}
                for j, part in enumerate(parts or ([{}] if logprobs else []))]

    async def on_done(c: dict) -> list[dict]:
        reply = replies[c["index"]]
        out = [{"index": c["index"], "delta": part, "finish_reason": None} for part in _chat_deltas(reply.finish())]
        await fe.remember(reply, c["tokens"])
        return out + [{"index": c["index"], "delta": {},
                       "finish_reason": "tool_calls" if reply.calls else c["finish_reason"]}]

    for i in range(n):
        yield sse_data({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
    async for frame in _frames(events, base, usage, on_delta, on_done):
        yield frame


def _chat_deltas(events: list) -> list[dict]:
    """Reply events as delta objects: reasoning and content text, a tool call's start (id, name), argument
    fragments."""
    out = []
    for e in events:
        if e[0] == "reasoning":
            out.append({"reasoning_content": e[1]})
        elif e[0] == "text":
            out.append({"content": e[1]})
        elif e[0] == "call":
            call = e[1]
            out.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
        elif e[0] == "args":
            out.append({"tool_calls": [{"index": e[1], "function": {"arguments": e[2]}}]})
    return out


async def _completion_stream(fe: "Frontend", events, base: dict, usage: bool, req: CompletionRequest, text: str):
    """Completions' chunks: the echoed prompt, text deltas (with legacy logprobs), a finish chunk per choice."""

    def on_delta(index: int, delta) -> list[dict]:
        logprobs = fe.legacy_logprobs([(lp.token, lp) for lp in delta.logprobs]) \
            if req.logprobs is not None else None
        return [{"index": index, "text": delta.text, "finish_reason": None, "logprobs": logprobs}] \
            if delta.text or logprobs else []

    async def on_done(c: dict) -> list[dict]:
        return [{"index": c["index"], "text": "", "finish_reason": c["finish_reason"], "logprobs": None}]

    if req.echo:
        for i in range(req.n):
            yield sse_data({**base, "choices": [{"index": i, "text": text, "finish_reason": None, "logprobs": None}]})
    async for frame in _frames(events, base, usage, on_delta, on_done):
        yield frame
