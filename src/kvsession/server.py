"""`kvsession serve`: an OpenAI- and Anthropic-compatible server that resumes from the disk KV cache.

Agent clients are stateless: every request resends the whole conversation.
What makes that cheap is ds4-server's arrangement, kept here:

- one worker thread owns the engine and the one live session; HTTP handlers
  (FastAPI on uvicorn) only parse, validate and enqueue, then relay what the
  worker emits (text deltas as SSE, or one JSON answer);
- a request reuses, in this order, the live session's tokens (its token
  prefix, else its rendered-text prefix), the disk cache's longest prefix,
  or nothing (a cold prefill);
- checkpoints follow the store's policy: "cold" after a cold prefill (the
  prompt's whole chunks), "continued" as a session grows, "evict" before an
  unrelated request replaces the live session, "shutdown" on SIGTERM or
  Ctrl+C. After a restart the next turn comes from disk.

While a streamed request waits or prefills, an SSE comment goes out every
`keepalive_seconds` so proxies and clients do not give up; a client that
disconnects raises a flag the worker checks between tokens and prefill
chunks, so its generation stops within one token and the worker moves on.
"""
from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import fileformat
from .errors import KvsessionError, SessionFileError, TemplateError
from .generate import Stats, stream
from .sampling import Sampler, SamplerParams
from .session import InvalidSessionName, Session, check_session_name, common_prefix, sessions_dir
from .store import Store, StoreOptions

log = logging.getLogger("kvsession.server")


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    ctx: int | None = None  # tokens per session (default: the model's context)
    kv_disk_dir: str | None = None  # the disk KV cache; None: no store
    kv_disk_space_mb: int = 4096
    kv_disk_min_tokens: int = 512
    api_key: str | None = None
    sessions_dir: str | None = None  # named sessions (/v1/sessions)
    kv_dtype: str = "f16"
    max_body_bytes: int = 16 << 20
    keepalive_seconds: float = 5.0


# --- request bodies ------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class Sampling(_Body):
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stream: bool = False
    ignore_eos: bool = False  # llama.cpp server's extension: generate max_tokens whatever the model says


class StreamOptions(_Body):
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


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[TextPart]


class MessagesRequest(Sampling):
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextPart] | None = None
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


# --- jobs and the worker ----------------------------------------------------------------------


@dataclass
class Generation:
    """What the worker needs for one completion: the whole prompt, as text and tokens."""

    text: str  # the rendered prompt (chat template applied, or the raw prompt)
    tokens: list[int]
    params: SamplerParams
    max_tokens: int
    stop: list[str]
    ignore_eos: bool = False


class Cancelled(Exception):
    pass


class Job:
    """One request's trip through the worker: events come back on the request's event loop."""

    def __init__(self, kind: str, payload: Any, loop: asyncio.AbstractEventLoop):
        self.kind, self.payload, self.loop = kind, payload, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def emit(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Worker(threading.Thread):
    """Owns the engine, the live session and the store; runs jobs one at a time."""

    def __init__(self, engine, options: ServerOptions):
        super().__init__(name="kvsession-worker", daemon=True)
        self.engine = engine
        self.options = options
        self.ctx = options.ctx or engine.config.context_length
        self.jobs: queue.Queue = queue.Queue()
        self.session = engine.session(kv_dtype=options.kv_dtype, max_tokens=self.ctx)
        self.saved_at = 0  # the live session's length at its last checkpoint
        self.store = None
        if options.kv_disk_dir:
            self.store = Store(Path(options.kv_disk_dir).expanduser(), StoreOptions(
                min_tokens=options.kv_disk_min_tokens, budget_bytes=options.kv_disk_space_mb << 20))
        self.sessions = sessions_dir(options.sessions_dir)
        self.served = 0
        self.ready = threading.Event()  # set once warmed up; /health says "loading" until then
        self.last_cancel_tokens: int | None = None  # tokens a cancelled request generated (for tests)

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def stop(self) -> None:
        self.jobs.put(None)

    def run(self) -> None:
        # warm-up, as llama.cpp does: the first forward pass picks kernels and allocates buffers,
        # and that cost belongs to start-up, not to the first request's time to first token
        warm = self.engine.session(kv_dtype=self.options.kv_dtype)
        warm.prefill([self.engine.tokenizer.bos_id or 0] * 8)
        warm.append(0)
        del warm
        self.ready.set()
        while True:
            job = self.jobs.get()
            if job is None:
                self._checkpoint("shutdown")
                return
            if job.cancelled.is_set():
                job.emit("done", None)
                continue
            try:
                getattr(self, f"_job_{job.kind}")(job)
            except ApiError as e:
                job.emit("error", e)
            except Cancelled:
                job.emit("done", None)
            except Exception as e:  # a bug must cost one request, never the worker
                log.exception("request failed")
                job.emit("error", ApiError(500, f"internal error: {e}", "server_error"))

    # --- checkpoints ---

    def _checkpoint(self, reason: str) -> None:
        s = self.session
        if self.store is None or len(s) == self.saved_at or not len(s):
            return
        try:
            if self.store.put(s, reason) is not None:
                self.saved_at = len(s)
                log.info("checkpoint (%s): %d tokens", reason, len(s))
        except KvsessionError as e:
            log.warning("checkpoint (%s) failed: %s", reason, e)

    # --- generation ---

    def _prepare(self, g: Generation) -> tuple[list[int], int]:
        """Reuse what we can for g; returns (tokens still to prefill, tokens reused)."""
        rest, reused = self._reuse(g)
        s = self.session
        if not rest and s.logits is None:  # the session is exactly the prompt, without logits: redo one token
            last = s.tokens[-1]
            s.truncate(len(s) - 1)
            rest, reused = [last], reused - 1
        return rest, reused

    def _reuse(self, g: Generation) -> tuple[list[int], int]:
        s = self.session
        ids = g.tokens
        common = common_prefix(ids, s.tokens)
        if s.tokens and common == len(s.tokens):  # 1. the live session is a token prefix of the prompt
            return ids[common:], common
        if s.tokens and g.text.startswith(s.text):  # 2. ... or a rendered-text prefix (ds4's match)
            return self.engine.tokenizer.encode(g.text[len(s.text):], add_bos=False), len(s)
        hit = None
        if self.store is not None:  # 3. the disk cache
            by_tokens = self.store.longest_prefix(ids, self.engine, s.kv_dtype)
            by_text = self.store.longest_text_prefix(g.text, self.engine, s.kv_dtype)
            if by_text is not None and (by_tokens is None or by_text[0].n_tokens > by_tokens.n_tokens):
                hit = by_text
            elif by_tokens is not None:
                hit = (by_tokens, None)
        if hit is not None and hit[0].n_tokens > common:
            self._checkpoint("evict")
            if self.store.restore(hit[0], s):
                self.saved_at = len(s)
                rest = ids[hit[0].n_tokens:] if hit[1] is None else self.engine.tokenizer.encode(hit[1], add_bos=False)
                return rest, len(s)
        if common < len(s.tokens):  # 4. an unrelated request replaces the live session
            self._checkpoint("evict")
            common = s.cut_back(common)
            self.saved_at = min(self.saved_at, common)
        return ids[common:], common

    def _job_generate(self, job: Job) -> None:
        g: Generation = job.payload
        t0 = time.perf_counter()
        prompt, cached = self._prepare(g)
        prepared = time.perf_counter()
        s = self.session
        if cached + len(prompt) >= self.ctx:
            raise ApiError(400, f"the prompt has {cached + len(prompt)} tokens; the context is {self.ctx}",
                           code="context_length_exceeded")
        s.sampler = Sampler(g.params)
        stats = Stats()
        max_tokens = min(g.max_tokens, self.ctx - cached - len(prompt) - 1)

        def progress(done: int, total: int) -> None:
            if job.cancelled.is_set():  # between prefill chunks the session is consistent
                raise Cancelled
            job.emit("progress", done, total)

        generated = 0
        try:
            for delta in stream(s, prompt, max_tokens=max_tokens, stop=g.stop, stats=stats, progress=progress,
                                ignore_eos=g.ignore_eos):
                job.emit("delta", delta.text)
                if generated == 0:
                    log.info("request: %d tokens reused (%.1f ms), %d prefilled, first token at %.1f ms",
                             cached, (prepared - t0) * 1e3, len(prompt), (time.perf_counter() - t0) * 1e3)
                    if len(prompt) > cached:  # mostly a cold prefill: keep its whole chunks
                        self._checkpoint("cold")
                generated = stats.generated_tokens
                if job.cancelled.is_set():
                    self.last_cancel_tokens = generated
                    raise Cancelled
        finally:
            self.served += 1
            if self.store is not None and self.store.should_checkpoint(len(s), self.saved_at):
                self._checkpoint("continued")
        job.emit("done", {"finish_reason": stats.finish_reason, "stop_sequence": stats.stop_sequence,
                          "prompt_tokens": cached + len(prompt), "cached_tokens": cached,
                          "completion_tokens": stats.generated_tokens})

    # --- named sessions ---

    def named_path(self, name: str) -> Path:
        try:
            return self.sessions / (check_session_name(name) + ".kvs")
        except InvalidSessionName as e:
            raise ApiError(400, str(e), param="name") from None

    def _job_save(self, job: Job) -> None:
        path = self.named_path(job.payload)
        path.parent.mkdir(parents=True, exist_ok=True)
        info = self.session.save(path)
        job.emit("done", {"name": job.payload, "tokens": len(self.session), "bytes": info.bytes,
                          "ms": round(info.seconds * 1e3, 2)})

    def _job_restore(self, job: Job) -> None:
        path = self.named_path(job.payload)
        if not path.exists():
            raise ApiError(404, f"no session {job.payload!r}", "not_found_error")
        t0 = time.perf_counter()
        try:
            session = Session.load(path, self.engine, max_tokens=self.ctx)
        except SessionFileError as e:
            raise ApiError(400, str(e)) from None
        self._checkpoint("evict")
        self.session, self.saved_at = session, 0
        job.emit("done", {"name": job.payload, "tokens": len(session), "bytes": path.stat().st_size,
                          "ms": round((time.perf_counter() - t0) * 1e3, 2)})


# --- the HTTP side ---------------------------------------------------------------------------------


def create_app(engine, options: ServerOptions) -> FastAPI:
    worker = Worker(engine, options)
    model_id = engine.path.stem

    async def lifespan(app):
        worker.start()
        yield
        worker.stop()  # the worker writes the shutdown checkpoint, then ends
        await asyncio.get_running_loop().run_in_executor(None, worker.join, 60)

    app = FastAPI(title="kvsession", lifespan=lifespan)
    app.state.worker = worker

    @app.middleware("http")
    async def guard(request: Request, call_next):
        anthropic = request.url.path.startswith("/v1/messages")
        if options.api_key and request.url.path != "/health":
            auth = request.headers.get("authorization", "")
            key = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
            if key != options.api_key:
                return _error(ApiError(401, "invalid or missing API key", "authentication_error"), anthropic)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > options.max_body_bytes:
            return _error(ApiError(413, f"request body over {options.max_body_bytes} bytes",
                                   "request_too_large"), anthropic)
        return await call_next(request)

    async def body(request: Request, model: type[BaseModel]):
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > options.max_body_bytes:
                raise ApiError(413, f"request body over {options.max_body_bytes} bytes", "request_too_large")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"malformed JSON: {e}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise ApiError(400, f"{where}: {first['msg']}", param=where) from None

    def sampling(req: Sampling) -> SamplerParams:
        d = SamplerParams()
        return SamplerParams(temperature=d.temperature if req.temperature is None else req.temperature,
                             top_k=d.top_k if req.top_k is None else req.top_k,
                             top_p=d.top_p if req.top_p is None else req.top_p,
                             min_p=d.min_p if req.min_p is None else req.min_p, seed=req.seed)

    def generation(text: str, req: Sampling, max_tokens: int, stop) -> Generation:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        tokens = engine.tokenizer.encode(text)
        if not tokens:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if len(tokens) + 1 > worker.ctx:
            raise ApiError(400, f"the prompt has {len(tokens)} tokens; the context is {worker.ctx}",
                           code="context_length_exceeded")
        return Generation(text, tokens, sampling(req), max_tokens, stops, req.ignore_eos)

    def render(messages: list[dict]) -> str:
        try:
            return engine.template.render(messages)
        except TemplateError as e:
            raise ApiError(400, str(e), param="messages") from None

    async def run_job(request: Request, job: Job, *, poll_disconnect: bool):
        """Submit a job and yield its events, plus ("keepalive",) after each quiet keepalive_seconds.

        A consumer that stops early (a streaming client gone: Starlette cancels
        the response) or a disconnect seen by polling cancels the job.
        """
        worker.submit(job)
        finished = False
        quiet_since = time.monotonic()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if poll_disconnect and await request.is_disconnected():
                        return
                    if time.monotonic() - quiet_since >= options.keepalive_seconds:
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
            if not finished:
                job.cancelled.set()

    async def answer(request: Request, job: Job) -> tuple[str, dict]:
        """A job's whole text and result; raises ApiError."""
        text = []
        async for event in run_job(request, job, poll_disconnect=True):
            if event[0] == "delta":
                text.append(event[1])
            elif event[0] == "error":
                raise event[1]
            elif event[0] == "done":
                if event[1] is None:
                    raise ApiError(499, "cancelled")
                return "".join(text), event[1]
        raise ApiError(499, "client disconnected")

    def events(request: Request, job: Job):
        return run_job(request, job, poll_disconnect=False)

    # --- endpoints ---

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return _error(e, request.url.path.startswith("/v1/messages"))

    @app.get("/health")
    async def health():
        if not worker.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok", "model": model_id, "queued": worker.jobs.qsize(), "served": worker.served,
                "live_tokens": len(worker.session), "store": str(worker.store.dir) if worker.store else None,
                "last_cancel_tokens": worker.last_cancel_tokens}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0,
                                            "owned_by": "kvsession"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await body(request, ChatRequest)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)}
                    for m in req.messages]
        g = generation(render(messages), req, req.max_completion_tokens or req.max_tokens or 1024, req.stop)
        job = Job("generate", g, asyncio.get_running_loop())
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_id}
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            return _sse(_openai_stream(events(request, job), base, usage, _chat_choice, role))
        text, r = await answer(request, job)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": r["finish_reason"], "logprobs": None}],
                "usage": _openai_usage(r)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await body(request, CompletionRequest)
        prompt = req.prompt if isinstance(req.prompt, str) else req.prompt[0] if len(req.prompt) == 1 else None
        if prompt is None:
            raise ApiError(400, "prompt: one prompt per request", param="prompt")
        g = generation(prompt, req, req.max_tokens or 16, req.stop)
        job = Job("generate", g, asyncio.get_running_loop())
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            base = {"id": rid, "object": "text_completion", "created": created, "model": model_id}
            return _sse(_openai_stream(events(request, job), base, usage, _completion_choice))
        text, r = await answer(request, job)
        return {"id": rid, "object": "text_completion", "created": created, "model": model_id,
                "choices": [{"index": 0, "text": text, "finish_reason": r["finish_reason"], "logprobs": None}],
                "usage": _openai_usage(r)}

    @app.post("/v1/messages")
    async def messages(request: Request):
        req = await body(request, MessagesRequest)
        msgs = ([{"role": "system", "content": _text(req.system)}] if req.system else [])
        msgs += [{"role": m.role, "content": _text(m.content)} for m in req.messages]
        g = generation(render(msgs), req, req.max_tokens, req.stop_sequences)
        job = Job("generate", g, asyncio.get_running_loop())
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        if req.stream:
            return _sse(_anthropic_stream(events(request, job), mid, model_id))
        text, r = await answer(request, job)
        return {"id": mid, "type": "message", "role": "assistant", "model": model_id,
                "content": [{"type": "text", "text": text}], "stop_reason": _stop_reason(r),
                "stop_sequence": r["stop_sequence"], "usage": _anthropic_usage(r)}

    @app.get("/v1/sessions")
    async def list_sessions():
        out = []
        folder = worker.sessions
        for p in sorted(folder.glob("*.kvs")) if folder.is_dir() else []:
            try:
                with open(p, "rb") as f:
                    tokens = fileformat.read_header(f, str(p)).fields.get("n_tokens")
            except (SessionFileError, OSError):
                tokens = None
            out.append({"name": p.stem, "tokens": tokens, "bytes": p.stat().st_size, "modified": p.stat().st_mtime})
        return {"object": "list", "data": out}

    @app.post("/v1/sessions/{name}/save")
    async def save_session(request: Request, name: str):
        worker.named_path(name)
        _, r = await answer(request, Job("save", name, asyncio.get_running_loop()))
        return r

    @app.post("/v1/sessions/{name}/restore")
    async def restore_session(request: Request, name: str):
        worker.named_path(name)
        _, r = await answer(request, Job("restore", name, asyncio.get_running_loop()))
        return r

    @app.delete("/v1/sessions/{name}")
    async def delete_session(name: str):
        path = worker.named_path(name)
        if not path.exists():
            raise ApiError(404, f"no session {name!r}", "not_found_error")
        size = path.stat().st_size
        path.unlink()
        return {"name": name, "deleted": True, "bytes": size}

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return _error(ApiError(404, f"no route {request.method} {request.url.path}", "not_found_error"),
                      request.url.path.startswith("/v1/messages"))

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc):
        return _error(ApiError(405, f"{request.method} is not allowed on {request.url.path}"),
                      request.url.path.startswith("/v1/messages"))

    return app


# --- answers -------------------------------------------------------------------------------------------


def _error(e: ApiError, anthropic: bool) -> JSONResponse:
    if anthropic:
        return JSONResponse({"type": "error", "error": {"type": e.kind, "message": e.message}}, status_code=e.status)
    return JSONResponse({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}},
                        status_code=e.status)


def _openai_usage(r: dict) -> dict:
    return {"prompt_tokens": r["prompt_tokens"], "completion_tokens": r["completion_tokens"],
            "total_tokens": r["prompt_tokens"] + r["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": r["cached_tokens"]}}


def _anthropic_usage(r: dict) -> dict:
    return {"input_tokens": r["prompt_tokens"] - r["cached_tokens"], "output_tokens": r["completion_tokens"],
            "cache_read_input_tokens": r["cached_tokens"], "cache_creation_input_tokens": 0}


def _stop_reason(r: dict) -> str:
    if r["finish_reason"] == "length":
        return "max_tokens"
    return "stop_sequence" if r["stop_sequence"] else "end_turn"


def _sse(gen) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _data(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _chat_choice(text: str | None, finish: str | None) -> dict:
    return {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish}


def _completion_choice(text: str | None, finish: str | None) -> dict:
    return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}


async def _openai_stream(events, base: dict, usage: bool, choice, first: dict | None = None):
    """OpenAI's stream: a chunk per delta, a last chunk with the finish reason, usage if asked, [DONE]."""
    if first is not None:
        yield _data({**base, "choices": [first]})
    async for event in events:
        kind = event[0]
        if kind == "keepalive":
            yield ": keepalive\n\n"
        elif kind == "delta":
            yield _data({**base, "choices": [choice(event[1], None)]})
        elif kind == "error":
            yield _data({"error": {"message": event[1].message, "type": event[1].kind, "code": event[1].code}})
            return
        elif kind == "done" and event[1] is not None:
            r = event[1]
            yield _data({**base, "choices": [choice(None, r["finish_reason"])]})
            if usage:
                yield _data({**base, "choices": [], "usage": _openai_usage(r)})
            yield "data: [DONE]\n\n"


def _event(name: str, obj: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _anthropic_stream(events, mid, model):
    """Anthropic's sequence: message_start, content_block_start, ping, deltas, content_block_stop,
    message_delta, message_stop. Input usage is known only when the worker is done."""
    started = False
    out = 0
    async for event in events:
        kind = event[0]
        if not started and kind in ("delta", "done", "progress", "keepalive"):
            started = True
            yield _event("message_start", {"type": "message_start", "message": {
                "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0}}})
            yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                                 "content_block": {"type": "text", "text": ""}})
            yield _event("ping", {"type": "ping"})
        if kind == "keepalive":
            yield ": keepalive\n\n"
        elif kind == "delta":
            out += 1
            yield _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                 "delta": {"type": "text_delta", "text": event[1]}})
        elif kind == "error":
            yield _event("error", {"type": "error", "error": {"type": event[1].kind, "message": event[1].message}})
            return
        elif kind == "done" and event[1] is not None:
            r = event[1]
            yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            yield _event("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": _stop_reason(r), "stop_sequence": r["stop_sequence"]},
                                           "usage": _anthropic_usage(r)})
            yield _event("message_stop", {"type": "message_stop"})


def serve(engine, options: ServerOptions) -> int:
    import uvicorn

    app = create_app(engine, options)
    log.info("serving %s on http://%s:%d", engine.path.name, options.host, options.port)
    uvicorn.run(app, host=options.host, port=options.port, log_level="info", timeout_graceful_shutdown=30)
    return 0
