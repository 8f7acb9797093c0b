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

import math
import re
import time
import uuid
from typing import Any, Literal

from fastapi import Request
from pydantic import Field, field_validator

from ..generate import TokenLogprob
from ..text.template import ChatPrompt
from ..text.tokenizer import Tokenizer
from .events import ChoiceEnd, Done, Output, Progress, Started
from .http.bodies import BodyRouter
from .http.sse import StreamRenderer, sse_data, stream
from .llama.telemetry import prompt_progress
from .protocol import BUILD, ApiError, Body, Sampling, TextPart
from .replies import CallOpened, Reply, ToolPlan
from .reply_events import ContentDelta, ReasoningDelta, ToolCallDelta
from .request_fields import (
    JsonFormat,
    call_arguments,
    json_format,
    named_tool,
    session_key,
    stops,
    tool_choice,
)
from .serving import Frontend, frontend

MAX_N = 16
TOKEN_ID = re.compile(r"[0-9]{1,10}")  # a logit_bias key, in ASCII digits


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
    schema_: dict | None = Field(None, alias="schema")  # llama-server's: a json_object held to this schema


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
    json_schema: dict | None = None  # llama.cpp's server's: the reply is JSON of this schema
    verbose: bool = False  # llama.cpp's server's: the answer carries __verbose (the prompt as rendered)

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
    # a last assistant message is a reply to go on with (llama-server's assistant prefill, its default) unless
    # continue_final_message is false; vLLM's continue_final_message and add_generation_prompt, both true: a 400
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    return_progress: bool = False  # llama-server's: a stream shows the prefill's progress (prompt_progress chunks)


class CompletionRequest(Choices):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None


router = BodyRouter()


@router.body_post("/v1/chat/completions", ChatRequest)
@router.body_post("/chat/completions", ChatRequest)  # llama-server's path without /v1
async def chat_completions(request: Request):
    fe = frontend(request)
    req = await fe.body(request, ChatRequest)
    _unsupported(req)
    if req.functions is not None or req.function_call is not None:
        raise ApiError(400, "functions / function_call are the deprecated form of tools: send tools and "
                       "tool_choice", param="functions")
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    plan, prompt = await _chat_prompt(fe, req)
    g = fe.generation(prompt, req, req.max_completion_tokens or req.max_tokens,
                      stop=stops(req.stop), n=req.n, logit_bias=await _logit_bias(fe, req.logit_bias),
                      top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                      constraint=plan.constraint, endpoint="chat.completions",
                      session_key=session_key(request.headers, req.user))
    job = fe.job("generate", g)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "object": "chat.completion", "created": created, "model": fe.model_id,
            "system_fingerprint": BUILD}
    verbose = req.verbose or fe.options.verbose
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return stream(fe.events(request, job),
                      ChatStream(fe, {**base, "object": "chat.completion.chunk"}, usage, plan, req.n,
                                 req.return_progress))
    outputs, done = await fe.answer(request, job)
    replies = [Reply(plan, "call_") for _ in range(req.n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(req.n)]
    for o in outputs:
        replies[o.index].feed(o.delta.text)
        logprobs[o.index] += o.delta.logprobs
    choices = []
    for reply, c, lps in zip(replies, done.choices, logprobs):
        reply.finish()
        await fe.remember(reply, c.tokens)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content or (None if reply.calls else "")}
        if reply.reasoning:  # where llama.cpp's server puts it
            message["reasoning_content"] = reply.reasoning
        if reply.calls:
            message["tool_calls"] = [_call_json(call) for call in reply.calls]
        choices.append({"index": c.index, "message": message,
                        "finish_reason": "tool_calls" if reply.calls else c.finish_reason,
                        "logprobs": {"content": logprob_entries(fe.engine.tokenizer, lps)} if req.logprobs else None})
    if verbose:  # llama-server's debugging field: the prompt as rendered, the first choice's text
        base["__verbose"] = {"prompt": prompt.text, "content": replies[0].content}
    return {**base, "choices": choices, "usage": _usage(done)}


@router.body_post("/v1/chat/completions/input_tokens", ChatRequest)
@router.body_post("/chat/completions/input_tokens", ChatRequest)  # llama-server's
async def chat_input_tokens(request: Request):
    """The prompt's length in tokens, as the chat completion of this body would render it, without running it."""
    fe = frontend(request)
    _, prompt = await _chat_prompt(fe, await fe.body(request, ChatRequest))
    return {"input_tokens": len(prompt.tokens)}


async def _chat_prompt(fe: Frontend, req: ChatRequest) -> tuple[ToolPlan, ChatPrompt]:
    """The request's tool plan and its rendered, tokenized conversation."""
    plan = await fe.tool_plan([t.model_dump(exclude_none=True) for t in req.tools or []], _tool_choice(req),
                              req.parallel_tool_calls, _json_format(req.response_format, req.json_schema),
                              req.grammar)
    messages = fe.tool_memory.substitute([_message(m) for m in req.messages])
    return plan, await fe.chat(messages, plan, continue_final=_continues(req),
                               variables=fe.template_variables(req.chat_template_kwargs, req.reasoning_effort))


def _continues(req: ChatRequest) -> bool:
    """Whether the last message, an assistant's text, is the start of the reply (llama-server's assistant
    prefill) rather than a turn before a new one."""
    if req.continue_final_message and req.add_generation_prompt:
        raise ApiError(400, "continue_final_message and add_generation_prompt are both true: choose one",
                       param="continue_final_message")
    last = req.messages[-1]
    prefill = last.role == "assistant" and not last.tool_calls
    if req.continue_final_message and not prefill:
        raise ApiError(400, "continue_final_message: the last message must be an assistant's, without tool_calls",
                       param="continue_final_message")
    return prefill and req.continue_final_message is not False


@router.body_post("/v1/completions", CompletionRequest)
async def completions(request: Request):
    fe = frontend(request)
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
    plan = await fe.tool_plan([], "none", False, _json_format(req.response_format, req.json_schema), req.grammar)
    g = fe.generation(prompt, req, req.max_tokens, stop=stops(req.stop), n=req.n,
                      logit_bias=await _logit_bias(fe, req.logit_bias), top_logprobs=req.logprobs,
                      prompt_logprobs=req.echo and req.logprobs is not None, constraint=plan.constraint,
                      endpoint="completions", session_key=session_key(request.headers, req.user))
    job = fe.job("generate", g)
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": fe.model_id, "system_fingerprint": BUILD}
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return stream(fe.events(request, job), CompletionStream(fe, base, usage, req, text))
    outputs, done = await fe.answer(request, job)
    texts: list[list[str]] = [[] for _ in range(req.n)]
    lps: list[list[TokenLogprob]] = [[] for _ in range(req.n)]
    for o in outputs:
        texts[o.index].append(o.delta.text)
        lps[o.index] += o.delta.logprobs
    choices = []
    for c in done.choices:
        i = c.index
        out = "".join(texts[i])
        logprobs = None
        if req.logprobs is not None:
            prompt_part = list(zip(tokens, done.prompt_logprobs)) if req.echo else []
            logprobs = legacy_logprobs(fe.engine.tokenizer, prompt_part + [(lp.token, lp) for lp in lps[i]])
        choices.append({"index": i, "text": (text if req.echo else "") + out,
                        "finish_reason": c.finish_reason, "logprobs": logprobs})
    return {**base, "choices": choices, "usage": _usage(done)}


def _unsupported(req: Choices) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name):
            raise ApiError(400, f"{name} is not supported (only 0)", param=name)


def _tool_choice(req: ChatRequest) -> str:
    names = [t.function.name for t in req.tools or []]
    if isinstance(req.tool_choice, NamedChoice):
        return named_tool(req.tool_choice.function.get("name"), names)
    return tool_choice(req.tool_choice, names)


def _json_format(fmt: ResponseFormat | None, schema: dict | None = None) -> JsonFormat | None:
    """response_format as Frontend.tool_plan takes it; llama-server's json_object with a schema, and its
    json_schema field (the format when response_format names none), are that schema."""
    if fmt is None:
        return None if schema is None else json_format("json_schema", schema, False, field="json_schema", missing="")
    if fmt.type == "json_object" and fmt.schema_ is not None:
        return json_format("json_schema", fmt.schema_, False, field="response_format", missing="")
    s = fmt.json_schema
    return json_format(fmt.type, s.schema_ if s else None, s.strict if s else None, field="response_format",
                       missing="response_format json_schema needs json_schema.schema")


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
    return call_arguments(arguments, "tool call arguments", "messages", quoted=True)


def _call_json(call) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


# --- logit bias and log-probabilities ---


async def _logit_bias(fe: Frontend, bias: dict[str, float] | None) -> dict[int, float] | None:
    """The bias by token id, checked off the loop: a body of a million keys took this loop 1.5 s."""
    if not bias:
        return None
    n = fe.engine.config.vocab_size
    if len(bias) > n:
        raise ApiError(400, f"logit_bias: {len(bias):,} entries, more than the vocabulary of {n}",
                       param="logit_bias")
    return await fe.off_loop(_bias_by_id, bias, n)


def _bias_by_id(bias: dict[str, float], n: int) -> dict[int, float]:
    out = {}
    for k, v in bias.items():
        if not TOKEN_ID.fullmatch(k):  # str.isdigit() takes "²", and int() takes 5,000 digits slowly
            raise ApiError(400, f"logit_bias: key {k[:40]!r} is not a token id", param="logit_bias")
        if not math.isfinite(v):
            raise ApiError(400, f"logit_bias: the bias of token {k} is {v}", param="logit_bias")
        out[int(k)] = float(v)
    bad = next((t for t in out if not 0 <= t < n), None)
    if bad is not None:
        raise ApiError(400, f"logit_bias: token {bad} is outside the vocabulary of {n}", param="logit_bias")
    return out


def _token(tk: Tokenizer, token: int, logprob: float) -> dict:
    raw = tk.piece(token)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def logprob_entries(tk: Tokenizer, lps: list[TokenLogprob]) -> list[dict]:
    """Chat's logprobs.content: each sampled token with its log-probability and the top alternatives."""
    return [{**_token(tk, lp.token, lp.logprob), "top_logprobs": [_token(tk, t, v) for t, v in lp.top]}
            for lp in lps]


def legacy_logprobs(tk: Tokenizer, pairs: list[tuple[int, TokenLogprob | None]]) -> dict:
    """Completions' logprobs: parallel lists over (token, TokenLogprob or None for a prompt's first token)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token, lp in pairs:
        text = tk.piece(token).decode("utf-8", errors="replace")
        out["tokens"].append(text)
        out["token_logprobs"].append(None if lp is None else lp.logprob)
        out["top_logprobs"].append(None if lp is None else {
            tk.piece(t).decode("utf-8", errors="replace"): v for t, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


# --- streams ---


class OpenAIStream(StreamRenderer):
    """OpenAI's stream around an endpoint's choices: a chunk per choice dict that choice_deltas and choice_end
    return, usage if asked, [DONE]; keepalives (comments) and errors as OpenAI writes them."""

    def __init__(self, fe: Frontend, base: dict, usage: bool):
        self.fe, self.base, self.usage = fe, base, usage
        self.tokenizer = fe.engine.tokenizer

    def chunk(self, choice: dict) -> str:
        return sse_data({**self.base, "choices": [choice]})

    def choice_deltas(self, e: Output) -> list[dict]:
        raise NotImplementedError

    async def choice_end(self, c: ChoiceEnd) -> list[dict]:
        raise NotImplementedError

    def keepalive(self) -> list[str]:
        return [": keepalive\n\n"]

    def output(self, e: Output) -> list[str]:
        return [self.chunk(choice) for choice in self.choice_deltas(e)]

    async def done(self, e: Done) -> list[str]:
        out = []
        for c in e.choices:
            out += [self.chunk(choice) for choice in await self.choice_end(c)]
        if self.usage:
            out.append(sse_data({**self.base, "choices": [], "usage": _usage(e)}))
        return out + ["data: [DONE]\n\n"]

    def failed(self, e: ApiError) -> list[str]:
        return [sse_data({"error": {"message": e.message, "type": e.kind, "code": e.code}})]


class ChatStream(OpenAIStream):
    """Chat's chunks: a role chunk per choice, content and tool-call deltas, a finish chunk per choice."""

    def __init__(self, fe: Frontend, base: dict, usage: bool, plan: ToolPlan, n: int, progress: bool = False):
        super().__init__(fe, base, usage)
        self.replies = [Reply(plan, "call_") for _ in range(n)]
        # a reply that can only be calls has no content, null as OpenAI sends it then; text starts as ""
        self.content = None if plan.forced else ""
        self.show_progress = progress  # llama-server's return_progress: chunks without choices, during the prefill
        self.start: Started | None = None
        self.started_at = time.perf_counter()

    def started(self, e: Started) -> list[str]:
        self.start, self.started_at = e, time.perf_counter()
        return self._progress(0)

    def progress(self, e: Progress) -> list[str]:
        return self._progress(e.prefilled)

    def _progress(self, prefilled: int) -> list[str]:
        if not self.show_progress or self.start is None:
            return []
        seconds = time.perf_counter() - self.started_at if prefilled else 0.0
        return [sse_data({**self.base, "choices": [],
                          "prompt_progress": prompt_progress(self.start, prefilled, seconds)})]

    def opening(self) -> list[str]:
        return [self.chunk({"index": i, "delta": {"role": "assistant", "content": self.content}, "logprobs": None,
                            "finish_reason": None}) for i in range(len(self.replies))]

    def choice_deltas(self, e: Output) -> list[dict]:
        parts = _chat_deltas(self.replies[e.index].feed(e.delta.text))
        logprobs = {"content": logprob_entries(self.tokenizer, e.delta.logprobs)} if e.delta.logprobs else None
        return [{"index": e.index, "delta": part, "finish_reason": None, "logprobs": logprobs if j == 0 else None}
                for j, part in enumerate(parts or ([{}] if logprobs else []))]

    async def choice_end(self, c: ChoiceEnd) -> list[dict]:
        reply = self.replies[c.index]
        out = [{"index": c.index, "delta": part, "finish_reason": None} for part in _chat_deltas(reply.finish())]
        await self.fe.remember(reply, c.tokens)
        return out + [{"index": c.index, "delta": {},
                       "finish_reason": "tool_calls" if reply.calls else c.finish_reason}]


def _chat_deltas(events: list) -> list[dict]:
    """Reply events as delta objects: reasoning and content text, a tool call's start (id, name), argument
    fragments."""
    out = []
    for e in events:
        match e:
            case ReasoningDelta(text=text):
                out.append({"reasoning_content": text})
            case ContentDelta(text=text):
                out.append({"content": text})
            case CallOpened(call=call):
                out.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            case ToolCallDelta(index=index, arguments=fragment):
                out.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
    return out


class CompletionStream(OpenAIStream):
    """Completions' chunks: the echoed prompt, text deltas (with legacy logprobs), a finish chunk per choice."""

    def __init__(self, fe: Frontend, base: dict, usage: bool, req: CompletionRequest, text: str):
        super().__init__(fe, base, usage)
        self.req, self.text = req, text

    def opening(self) -> list[str]:
        if not self.req.echo:
            return []
        return [self.chunk({"index": i, "text": self.text, "finish_reason": None, "logprobs": None})
                for i in range(self.req.n)]

    def choice_deltas(self, e: Output) -> list[dict]:
        logprobs = legacy_logprobs(self.tokenizer, [(lp.token, lp) for lp in e.delta.logprobs]) \
            if self.req.logprobs is not None else None
        return [{"index": e.index, "text": e.delta.text, "finish_reason": None, "logprobs": logprobs}] \
            if e.delta.text or logprobs else []

    async def choice_end(self, c: ChoiceEnd) -> list[dict]:
        return [{"index": c.index, "text": "", "finish_reason": c.finish_reason, "logprobs": None}]
