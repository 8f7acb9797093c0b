"""The HTTP side of `kvsession serve`: the app, its guard, errors, and the routes every API shares.

Agent clients are stateless: every request resends the whole conversation.
What makes that cheap is ds4-server's arrangement, kept here: HTTP handlers
(FastAPI on uvicorn) only parse, validate and enqueue, then relay what the
worker (worker.py, the one thread that owns the model) emits. Each API lives
in its own module (openai.py, anthropic.py, responses.py) and registers its
routes with the helpers of `Frontend`.

The event loop never waits on work: parsing a body, rendering a chat
template, tokenizing, compiling a grammar and every file-system touch run in
a thread, so no request can hold up another's stream or /health. What a
request may cost is bounded before it is paid: its body (413 before it is
read), its text against the context (before it is tokenized), its schemas
and tool calls (limits.py, before they are compiled or rendered), the tokens
its choices may generate.

A local server is reachable from every web page its user visits, so the
guard (a pure ASGI middleware: under Starlette's BaseHTTPMiddleware a
handler never sees its client leave) refuses what a browser could send on a
page's behalf: a Host that is not the address the server is bound to (DNS
rebinding), an Origin not allowed with --cors, and a POST body that is not
application/json (the "simple requests" a page may send without asking).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import re
import threading
import time
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect

from ..template import ChatPrompt, check_variables
from ..errors import KvsessionError, TemplateError
from ..sampling import SamplerParams
from ..named import list_saved
from . import anthropic, openai, responses
from .connection import with_header_timeout
from .grammar import Compiles, GrammarError, Grammars
from .limits import MAX_ITEMS, TRIM_AFTER_BYTES, check_calls, check_grammar, check_schema, check_tools, give_back_memory, loads
from .options import ServerOptions
from .protocol import ApiError, Sampling, error_response, is_anthropic
from .replies import Reply, ToolPlan
from .tool_formats import format_for
from .tools import ToolCall, ToolCallMemory
from .worker import Generation, Job, Worker, without_folder

log = logging.getLogger("kvsession.server")

SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
TOKEN_ID = re.compile(r"[0-9]{1,10}")  # a logit_bias key, in ASCII digits
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
WILDCARD = {"0.0.0.0", "::", ""}


class Frontend:
    """What the API modules share: the worker, body parsing, prompt building, and relaying a job's events."""

    def __init__(self, engine, options: ServerOptions, worker: Worker):
        self.engine, self.options, self.worker = engine, options, worker
        self.model_id = engine.path.stem
        self.tool_format = format_for(engine.template.source)
        memory = Path(options.kv_disk_dir).expanduser() / "tool_calls.jsonl" if options.kv_disk_dir else None
        self.tool_memory = ToolCallMemory(memory if memory is not None and memory.parent.is_dir() else None)
        # no token is longer than this many characters: a longer text than ctx of them cannot fit
        self.max_token_chars = max(len(t) for t in engine.tokenizer.tokens)
        self.compiles = Compiles(options.grammar_timeout)
        self.body_models: dict[str, type[BaseModel]] = {}  # for the OpenAPI document (and the fuzzer)

    def schema(self, model: type[BaseModel]) -> dict:
        """openapi_extra for a route that reads `model` from its JSON body by itself."""
        self.body_models[model.__name__] = model
        return {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}

    async def off_loop(self, fn: Callable, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def body(self, request: Request, model: type[BaseModel]):
        """The body as `model`, parsed off the loop. It has --read-timeout seconds to arrive (a client sending a byte
        a minute would hold its connection and its buffer for ever); a client that leaves halfway is a log line."""
        raw = bytearray()
        try:
            async with asyncio.timeout(self.options.read_timeout):
                async for part in request.stream():
                    raw += part
                    if len(raw) > self.options.max_body_bytes:
                        raise ApiError(413, f"request body over {self.options.max_body_bytes} bytes",
                                       "request_too_large")
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.options.read_timeout:g} s "
                           f"({len(raw):,} bytes came)") from None
        except ClientDisconnect:
            log.info("%s %s: the client left during its upload, after %d bytes", request.method, request.url.path,
                     len(raw))
            raise ApiError(499, "the client left during its upload") from None
        size = len(raw)
        try:
            return await self.off_loop(_parse, bytes(raw), model)
        except ApiError as e:
            raise e.with_traceback(None)  # _parse's frames, and so the parsed body, go with its traceback
        finally:
            del raw
            if size > TRIM_AFTER_BYTES:
                await self.off_loop(give_back_memory)

    def sampling(self, req: Sampling) -> SamplerParams:
        d = self.options.sampling
        return SamplerParams(temperature=d.temperature if req.temperature is None else req.temperature,
                             top_k=d.top_k if req.top_k is None else req.top_k,
                             top_p=d.top_p if req.top_p is None else req.top_p,
                             min_p=d.min_p if req.min_p is None else req.min_p,
                             seed=d.seed if req.seed is None else None if req.seed == -1 else req.seed)

    def check_length(self, chars: int, field: str = "prompt") -> None:
        """Refuse at once a text that cannot fit the context, before seconds or minutes of tokenizing it (15 MB
        over 250 messages took 23-42 s): more characters than the context's tokens times the longest token cannot
        fit, and more than --max-chars-per-token a token is refused too (prose and code take 3-5)."""
        most = self.worker.ctx * min(self.max_token_chars, self.options.max_chars_per_token)
        if chars > most:
            raise ApiError(400, f"{field}: {chars:,} characters, more than a context of {self.worker.ctx} tokens "
                           f"takes here (at most {most:,})", param=field, code="context_length_exceeded")

    async def tokens(self, text: str, add_bos: bool | None = None) -> list[int]:
        self.check_length(len(text))
        return await self.off_loop(lambda: self.engine.tokenizer.encode(text, add_bos=add_bos))

    async def chat(self, messages: list[dict], plan: ToolPlan, *, continue_final: bool = False,
                   variables: dict | None = None):
        """The rendered and tokenized conversation (the model's template, with the plan's tools and the request's
        template `variables`), built off the loop. System messages before the first reply lead it (_preamble);
        later ones stay in place unless the template refuses them. Tells the plan whether the prompt leaves the
        reply inside the reasoning (DeepSeek-R1's template ends it with `<think>`)."""
        tools = plan.tools

        def build():
            check_tools(tools)  # again: count_tokens renders tools it never compiles
            check_calls(messages)
            self.check_length(_chars(messages, tools), "messages")
            ordered = _preamble(self.tool_format.history(messages))
            try:
                return self.engine.chat_prompt(ordered, tools=tools, continue_final=continue_final,
                                               variables=variables)
            except TemplateError as e:  # a template that refuses system turns in place: all of them first
                merged = _systems_first(ordered)
                if merged is None:
                    raise ApiError(400, str(e), param="messages") from None
            try:
                return self.engine.chat_prompt(merged, tools=tools, continue_final=continue_final,
                                               variables=variables)
            except TemplateError as e:
                raise ApiError(400, str(e), param="messages") from None

        prompt = await self.off_loop(build)
        free = plan.constraint is None or not plan.constraint.from_start  # a grammar from token one leaves no thought
        plan.in_reasoning = free and plan.fmt is not None and plan.fmt.opens_reasoning(prompt.text)
        return prompt

    def template_variables(self, kwargs: dict | None, reasoning_effort: str | None = None) -> dict | None:
        """A request's own variables for the chat template: `chat_template_kwargs` (as llama.cpp's and vLLM's
        servers take it: {"enable_thinking": false} for Qwen3) and `reasoning_effort` (gpt-oss's template reads
        it). A name the server sets itself (messages, tools, ...) is a 400."""
        variables = dict(kwargs or {})
        if reasoning_effort is not None:
            variables["reasoning_effort"] = reasoning_effort
        self.check_length(len(json.dumps(variables)), "chat_template_kwargs")  # they are rendered into the prompt
        try:
            check_variables(variables)
        except TemplateError as e:
            raise ApiError(400, str(e), param="chat_template_kwargs") from None
        return variables or None

    def generation(self, prompt: ChatPrompt, req: Sampling, max_tokens: int | None, **kw) -> Generation:
        tokens = prompt.tokens
        if not tokens:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if len(tokens) + 1 > self.worker.ctx:
            raise ApiError(400, f"the prompt has {len(tokens)} tokens; the context is {self.worker.ctx}",
                           code="context_length_exceeded")
        # a reply ends where the context does: a bigger max_tokens (Claude Code asks for 32,000) is no error
        max_tokens = min(max_tokens or self.options.max_tokens, self.worker.ctx - len(tokens) - 1)
        n = kw.get("n", 1)
        if n * max_tokens > self.options.max_request_tokens:
            raise ApiError(400, f"n: {n} choices of up to {max_tokens:,} tokens are {n * max_tokens:,} tokens, more "
                           f"than this server generates for one request ({self.options.max_request_tokens:,}); ask "
                           "for fewer choices or fewer tokens", param="n")
        return Generation(prompt, self.sampling(req), max_tokens, ignore_eos=req.ignore_eos, **kw)

    # --- tools and grammars ---

    @cached_property
    def grammars(self) -> Grammars:
        """llguidance's view of the vocabulary: built once (about a second for a 150k vocabulary), off the loop."""
        return Grammars(self.engine)

    async def tool_plan(self, tools: list[dict], choice, parallel: bool, json_format,
                        grammar: str | None = None) -> ToolPlan:
        """What a request's tools and response format make of its prompt, its parsing and its decoding.

        choice: "auto", "none", "required" or a function's name; json_format: None, or (schema or None,
        strict) for JSON output; grammar: llama.cpp's GBNF for the whole reply, or None. Schemas over a limit
        (limits.py) and a grammar that cannot be built are a 400 naming the problem, before the response starts;
        the compile runs off the loop (llguidance lets go of the GIL: 0.9 s for 700 KB of schemas left this loop
        free), on grammar.Compiles' deep stack and within --grammar-timeout, bounded by those limits and by the
        context (the tools are part of the prompt)."""
        if json_format is not None and tools and choice != "none":
            raise ApiError(400, "a JSON response format together with tools is not supported; pass "
                           "tool_choice none, or no response format", param="response_format")
        if grammar is not None and (json_format is not None or tools and choice != "none"):
            raise ApiError(400, "grammar together with tools or a JSON response format is not supported",
                           param="grammar")
        field = "grammar" if grammar is not None else "response_format" if json_format is not None else "tools"

        def build() -> ToolPlan:
            check_tools(tools)
            if tools:
                self.check_length(len(json.dumps(tools)), "tools")
            if json_format is not None and json_format[0] is not None:
                check_schema(json_format[0], field)
            if grammar is not None:
                check_grammar(grammar)
            try:
                plan = self._plan(tools, choice, parallel, json_format, grammar)
            except GrammarError as e:
                raise ApiError(400, f"{field}: {e}", param=field) from None
            if plan.constraint is not None:
                plan.constraint.field = field
            return plan

        return await self.compiles.run(build, field)

    def _plan(self, tools: list[dict], choice, parallel: bool, json_format, grammar: str | None) -> ToolPlan:
        fmt = self.tool_format  # every reply is read by it, for its reasoning; for calls where tools are offered
        if grammar is not None:
            return ToolPlan(tools or None, fmt, constraint=self.grammars.gbnf(grammar))
        if json_format is not None:
            return ToolPlan(tools or None, fmt, constraint=self.grammars.json(*json_format))
        if not tools:
            return ToolPlan(fmt=fmt)
        if choice == "none":
            return ToolPlan(tools, fmt, constraint=self.grammars.tool_calls(fmt, tools, "none"))
        named = {"type": "function", "function": {"name": choice}} if choice not in ("auto", "required") else choice
        return ToolPlan(tools, fmt, calls=True, constraint=self.grammars.tool_calls(fmt, tools, named, parallel),
                        forced=choice != "auto")

    async def remember(self, reply: Reply, tokens: list[int]) -> None:
        """Keep the text the model sampled for a reply with tool calls, so that its echo renders back to it.

        Only a reply that wrote its calls in the format's own syntax (Hermes' `<tool_call>` tags): one written as
        bare or fenced JSON renders back as the template writes calls, at the cost of prefilling that turn again
        (tens of tokens). Shown its own fenced call before a tool's result, Qwen2.5-Coder-1.5B calls the tool
        again, greedily, where the same history with the call in tags gets its answer (tool_formats.py)."""
        if not reply.calls:
            return
        raw = self.engine.tokenizer.decode(tokens)
        if not self.tool_format.remembers(raw):
            return
        calls = [ToolCall(c.name, c.arguments) for c in reply.calls]
        try:
            await self.off_loop(self.tool_memory.remember, [c.id for c in reply.calls], raw, calls)
        except OSError as e:  # a failing folder costs reuse after a restart, not the answer
            log.warning("cannot record tool calls on disk: %s", e)

    async def logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        """The bias by token id, checked off the loop: a body of a million keys took this loop 1.5 s."""
        if not bias:
            return None
        n = self.engine.config.vocab_size
        if len(bias) > n:
            raise ApiError(400, f"logit_bias: {len(bias):,} entries, more than the vocabulary of {n}",
                           param="logit_bias")
        return await self.off_loop(self._logit_bias, bias)

    def _logit_bias(self, bias: dict[str, float]) -> dict[int, float]:
        n = self.engine.config.vocab_size
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

    def _bytes(self, token: int) -> bytes:
        """A token's bytes; a control token's name, which stands for no text."""
        tk = self.engine.tokenizer
        raw = tk.token_bytes[token] if token < len(tk.token_bytes) else b""
        return raw or (tk.tokens[token] if token < len(tk.tokens) else "").encode("utf-8")

    def _token(self, token: int, logprob: float) -> dict:
        raw = self._bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def logprob_entries(self, lps: list) -> list[dict]:
        """Chat's logprobs.content: each sampled token with its log-probability and the top alternatives."""
        return [{**self._token(lp.token, lp.logprob), "top_logprobs": [self._token(t, v) for t, v in lp.top]}
                for lp in lps]

    def legacy_logprobs(self, pairs: list) -> dict:
        """Completions' logprobs: parallel lists over (token, TokenLogprob or None for a prompt's first token)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for token, lp in pairs:
            text = self._bytes(token).decode("utf-8", errors="replace")
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            out["top_logprobs"].append(None if lp is None else {
                self._bytes(t).decode("utf-8", errors="replace"): v for t, v in lp.top})
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    @staticmethod
    def session_key(request: Request, *fields: str | None) -> str | None:
        """The client's name for its conversation: the X-Session-Id header, else the first body field given
        (OpenAI's `user`, Anthropic's metadata.user_id, the Responses API's prompt_cache_key). It routes the
        request to that conversation's live session."""
        key = request.headers.get("x-session-id") or next((f for f in fields if f), None)
        if key is not None and len(key) > 256:
            raise ApiError(400, "a session key (X-Session-Id or user) has at most 256 characters", param="user")
        return key

    @staticmethod
    def job(kind: str, payload) -> Job:
        return Job(kind, payload, asyncio.get_running_loop())

    async def run_job(self, request: Request, job: Job, *, watch_disconnect: bool):
        """Submit a job and yield its events, plus ("keepalive",) after each quiet keepalive_seconds.

        A consumer that stops early (a streaming client gone: Starlette cancels
        the response) cancels the job; so does, with watch_disconnect, the
        client of a plain answer hanging up: a task waits on the connection's
        next ASGI message, which after the body can only be its disconnect.
        """
        self.worker.submit(job)
        finished = False
        quiet_since = time.monotonic()
        poll = min(0.1, self.options.keepalive_seconds)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job)) if watch_disconnect else None
        try:
            while not job.cancelled.is_set():
                try:
                    event = await asyncio.wait_for(job.events.get(), timeout=poll)
                except asyncio.TimeoutError:
                    if time.monotonic() - quiet_since >= self.options.keepalive_seconds:
                        quiet_since = time.monotonic()
                        yield ("keepalive",)
                    continue
                finished = event[0] in ("done", "error")
                if event[0] != "progress":
                    quiet_since = time.monotonic()
                yield event
                if finished:
                    return
        finally:
            if watcher is not None:
                watcher.cancel()
            if not finished:
                job.cancelled.set()

    async def answer(self, request: Request, job: Job) -> tuple[list, dict]:
        """A job's deltas and result; raises ApiError (499 when the client left)."""
        deltas = []
        async for event in self.run_job(request, job, watch_disconnect=True):
            if event[0] == "delta":
                deltas.append(event[1:])
            elif event[0] == "error":
                raise event[1]
            elif event[0] == "done":
                if event[1] is None:
                    raise ApiError(499, "cancelled")
                return deltas, event[1]
        raise ApiError(499, "client disconnected")

    def events(self, request: Request, job: Job):
        return self.run_job(request, job, watch_disconnect=False)

    def authorized(self, headers: Headers) -> bool:
        if not self.options.api_keys:
            return True
        key = _key(headers)
        # each key compared, all of them, in constant time: the time taken says nothing of which one matched
        return any([hmac.compare_digest(key, k.encode("utf-8", "surrogateescape")) for k in self.options.api_keys])

    def owner(self, request: Request) -> str | None:
        """Who a stored response belongs to: a digest of the request's API key (the key itself is never written to
        disk); None on a server without keys."""
        return hashlib.sha256(_key(request.headers)).hexdigest()[:32] if self.options.api_keys else None


def _key(headers: Headers) -> bytes:
    auth = headers.get("authorization", "")
    key = auth[7:] if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
    return key.encode("utf-8", "surrogateescape")


def _chars(messages: list[dict], tools: list[dict] | None) -> int:
    """About the characters a conversation renders to: its texts, its tool calls' arguments, its tools."""
    n = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    n += sum(len(json.dumps((c.get("function") or {}).get("arguments"))) for m in messages
             for c in m.get("tool_calls") or ())
    return n + (len(json.dumps(tools)) if tools else 0)


def _systems_first(messages: list[dict], upto: int | None = None) -> list[dict] | None:
    """The system messages among messages[:upto] (all of them when None) merged, in order, into one system
    message at the start; None if that changes nothing."""
    upto = len(messages) if upto is None else upto
    if not any(m.get("role") == "system" for m in messages[1:upto]):
        return None
    systems = [m.get("content") or "" for m in messages[:upto] if m.get("role") == "system"]
    return [{"role": "system", "content": "\n\n".join(systems)}] + \
        [m for m in messages[:upto] if m.get("role") != "system"] + list(messages[upto:])


def _preamble(messages: list[dict]) -> list[dict]:
    """System messages before the first assistant turn are the system prompt: Claude Code sends its environment
    as one after the user's first message, which a model reads as the last thing said and answers by echoing
    it (Qwen2.5-Coder-1.5B did). They never change within a conversation, so merging them keeps its prefix; later
    ones render in place, as the conversation had them."""
    first_reply = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return _systems_first(messages, first_reply) or list(messages)


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancelled.set()


def _parse(raw: bytes, model: type[BaseModel]):
    """A JSON body as `model`; any fault is an ApiError 400 naming it (never a 500)."""
    try:
        data = loads(raw)
    except RecursionError:
        raise ApiError(400, "malformed JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of thousands of digits
        raise ApiError(400, f"malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    for key, value in data.items():  # before pydantic, which holds the GIL 0.5 s over a million entries
        if isinstance(value, (dict, list)) and len(value) > MAX_ITEMS:
            raise ApiError(400, f"{key[:64]}: {len(value):,} entries; at most {MAX_ITEMS:,}", param=key[:64])
    if SURROGATE_ESCAPE.search(raw):  # only an escape can make one; then look whether it was paired
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(400, f"the body holds a lone surrogate ({e.object[e.start:e.end]!r}): "
                           "not valid Unicode") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}", param=where) from None
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply") from None


class Guard:
    """Refuses, before any route runs: a foreign Host or Origin, a non-JSON POST body, a missing API key, a body
    over the limit. Adds CORS headers for the origins --cors allows. Answers a bug's exception as a 500 in the
    API's shape, and keeps the connection: Starlette's handler for Exception re-raises after answering, and
    uvicorn then closes the connection, so a keep-alive client lost it with its one failed request."""

    def __init__(self, app, fe: Frontend):
        self.app, self.fe, self.options = app, fe, fe.options
        host = self.options.host.strip("[]")
        self.hosts = None if host in WILDCARD else (LOOPBACK | {host} if host in LOOPBACK else {host})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        problem = self.check(scope, headers, origin)
        if problem is not None:
            return await error_response(problem, is_anthropic(scope["path"]))(scope, receive, send)
        if origin is None:
            return await self.run(scope, receive, send)
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:  # a preflight
            return await Response(status_code=204, headers=self.cors_headers(origin) | {
                "access-control-allow-methods": "GET, POST, DELETE, OPTIONS",
                "access-control-allow-headers": headers.get("access-control-request-headers", ""),
                "access-control-max-age": "600"})(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + [
                    (k.encode(), v.encode()) for k, v in self.cors_headers(origin).items()]
            await send(message)

        await self.run(scope, receive, send_with_cors)

    async def run(self, scope, receive, send) -> None:
        started = False

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:
            if started:  # half a response cannot become an error: uvicorn closes the connection
                raise
            log.exception("%s %s failed", scope["method"], scope["path"])
            await error_response(ApiError(500, f"internal error: {type(e).__name__}", "server_error"),
                                 is_anthropic(scope["path"]))(scope, receive, send)

    def check(self, scope, headers: Headers, origin: str | None) -> ApiError | None:
        if self.hosts is not None and "host" in headers:
            name = _hostname(headers["host"])
            if name not in self.hosts:
                return ApiError(403, f"Host {name!r} is not this server's address (DNS rebinding is refused; bind "
                                "with --host to serve another name)", "permission_error")
        if origin is not None and origin not in self.options.cors:
            return ApiError(403, f"cross-origin request from {origin!r} refused (allow an origin with --cors ORIGIN)",
                            "permission_error")
        if scope["method"] == "OPTIONS":
            return None
        if scope["path"] != "/health" and not self.fe.authorized(headers):
            return ApiError(401, "invalid or missing API key", "authentication_error")
        size = headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.options.max_body_bytes:
            return ApiError(413, f"request body over {self.options.max_body_bytes} bytes", "request_too_large")
        has_body = (size is not None and size != "0") or "transfer-encoding" in headers
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        if scope["method"] in ("POST", "PUT", "PATCH") and has_body and not (
                kind == "application/json" or kind.endswith("+json")):
            return ApiError(415, f"the body must be application/json, not {kind or 'untyped'}",
                            "invalid_request_error")
        return None

    @staticmethod
    def cors_headers(origin: str) -> dict[str, str]:
        return {"access-control-allow-origin": origin, "vary": "Origin"}


def _hostname(host: str) -> str:
    """The name of a Host header without its port: "[::1]:8000" -> "::1", "localhost:80" -> "localhost"."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def create_app(engine, options: ServerOptions, *, start_worker: bool = True) -> FastAPI:
    """The app and its worker. start_worker: the app's lifespan runs the worker in a thread of its own; else the
    caller runs it (serve: on the thread that loaded the model, see there)."""
    worker = Worker(engine, options)
    fe = Frontend(engine, options, worker)

    async def lifespan(app):
        if start_worker:
            worker.start()
        # Starlette streams a response in an anyio task group, and anyio loads its asyncio backend on first use:
        # loaded here, not by the first streamed reply after a restart (25-40 ms of its first token on SmolLM2).
        async with anyio.create_task_group():
            pass
        yield
        worker.stop()  # the worker writes the shutdown checkpoint, then ends
        if start_worker:
            await asyncio.get_running_loop().run_in_executor(None, worker.join, 60)

    app = FastAPI(title="kvsession", lifespan=lifespan)
    app.state.worker = worker
    app.add_middleware(Guard, fe=fe)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(e, is_anthropic(request.url.path))

    @app.exception_handler(KvsessionError)
    async def kvsession_error(request: Request, e: KvsessionError):
        return error_response(ApiError(400, str(e)), is_anthropic(request.url.path))

    @app.api_route("/", methods=["GET", "HEAD"])
    @app.api_route("/api/hello", methods=["GET", "HEAD"])
    async def root():  # Claude Code probes both at start
        return {"name": "kvsession", "model": fe.model_id, "health": "/health", "docs": "/docs"}

    @app.get("/health")
    async def health(request: Request):
        if not worker.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        if not fe.authorized(request.headers):
            return {"status": "ok"}
        store = None
        if worker.store is not None:
            reason = worker.store_health.reason
            store = {"status": "degraded" if reason else "ok", "reason": reason, "dir": str(worker.store.dir)}
        latest = worker.live.latest
        return {"status": "ok", "model": fe.model_id, "queued": worker.jobs.qsize() + len(worker.waiting),
                "running": len(worker.running), "served": worker.served,
                "live_tokens": len(latest.session) if latest else 0, "live_sessions": len(worker.live),
                "live_kv_mb": round(worker.live.nbytes() / 2**20, 1), "store": store,
                "last_cancel_tokens": worker.last_cancel_tokens}

    def model_entry() -> dict:
        return {"id": fe.model_id, "object": "model", "created": 0, "owned_by": "kvsession",
                "context_length": worker.ctx}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_entry()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != fe.model_id:
            raise ApiError(404, f"no model {model_id!r}; this server serves {fe.model_id!r}", "not_found_error",
                           param="model", code="model_not_found")
        return model_entry()

    openai.register(app, fe)
    anthropic.register(app, fe)
    responses.register(app, fe)
    _register_sessions(app, fe)

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return error_response(ApiError(404, f"no route {request.method} {request.url.path}", "not_found_error"),
                              is_anthropic(request.url.path))

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc):
        return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}"),
                              is_anthropic(request.url.path))

    default_openapi = app.openapi

    def openapi() -> dict:
        """FastAPI's document plus the bodies our routes parse themselves (their $defs hoisted)."""
        if app.openapi_schema is None:
            doc = default_openapi()
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for name, model in fe.body_models.items():
                s = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(s.pop("$defs", {}))
                schemas[name] = s
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
    return app


def _register_sessions(app: FastAPI, fe: Frontend) -> None:
    """Named sessions: /v1/sessions (list), /v1/sessions/{name}/save|restore, DELETE /v1/sessions/{name}."""
    worker = fe.worker

    def hide(text: str) -> str:
        return without_folder(text, worker.sessions)

    @app.get("/v1/sessions")
    async def list_sessions():
        saved, warnings = await fe.off_loop(list_saved, worker.sessions)
        return {"object": "list", "warnings": [hide(w) for w in warnings],
                "data": [{"name": e.name, "tokens": e.n_tokens, "bytes": e.size, "modified": e.mtime} for e in saved]}

    @app.post("/v1/sessions/{name}/save")
    async def save_session(request: Request, name: str):
        worker.named_path(name)
        _, r = await fe.answer(request, fe.job("save", name))
        return r

    @app.post("/v1/sessions/{name}/restore")
    async def restore_session(request: Request, name: str):
        worker.named_path(name)
        _, r = await fe.answer(request, fe.job("restore", name))
        return r

    @app.delete("/v1/sessions/{name}")
    async def delete_session(request: Request, name: str):
        worker.named_path(name)
        _, r = await fe.answer(request, fe.job("delete", name))  # on the worker: never beside a restore of it
        return r


def serve(engine, options: ServerOptions) -> int:
    """Serve until SIGINT or SIGTERM. The worker runs on this thread and HTTP on another: OpenMP keeps a pool of
    threads per thread that starts parallel work, and the pool of the thread that loaded the model, left
    behind, cost every product run from a second thread 30-90% (Qwen2.5-Coder-0.5B decoded 30 tokens a second
    in the server where the same loop on the loading thread did 54)."""
    import signal

    import uvicorn

    app = create_app(engine, options, start_worker=False)
    worker: Worker = app.state.worker
    server = uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port, log_level="info",
                                           timeout_graceful_shutdown=30,
                                           http=with_header_timeout(options.read_timeout)))

    def http() -> None:
        try:
            server.run()
        finally:
            worker.stop()  # HTTP is over (or never started): so is the worker

    def stop(signum, frame) -> None:
        if server.should_exit:  # a second signal: leave now, as uvicorn does
            server.force_exit = True
        server.should_exit = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    thread = threading.Thread(target=http, name="kvsession-http", daemon=True)
    log.info("serving %s on http://%s:%d", engine.path.name, options.host, options.port)
    thread.start()
    worker.run()
    thread.join(60)
    return 0 if server.started else 1
