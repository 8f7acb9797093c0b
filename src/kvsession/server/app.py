"""The HTTP side of `kvsession serve`: the app, its guard, errors, and the routes every API shares.

Agent clients are stateless: every request resends the whole conversation.
What makes that cheap is ds4-server's arrangement, kept here: HTTP handlers
(FastAPI on uvicorn) only parse, validate and enqueue, then relay what the
worker (worker.py, the one thread that owns the model) emits: text deltas
as SSE, or one JSON answer. Each API lives in its own module (openai.py,
anthropic.py) and registers its routes on the app with the helpers of
`Frontend`.

While a streamed request waits or prefills, an SSE comment goes out every
`keepalive_seconds` so proxies and clients do not give up; a client that
disconnects raises its job's cancelled flag.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from .. import fileformat
from ..errors import SessionFileError, TemplateError
from ..sampling import SamplerParams
from . import anthropic, openai
from .options import ServerOptions
from .protocol import ApiError, Sampling, error_response, is_anthropic
from .worker import Generation, Job, Worker

log = logging.getLogger("kvsession.server")


class Frontend:
    """What the API modules share: the worker, body parsing, prompt building, and relaying a job's events."""

    def __init__(self, engine, options: ServerOptions, worker: Worker):
        self.engine, self.options, self.worker = engine, options, worker
        self.model_id = engine.path.stem

    async def body(self, request: Request, model: type[BaseModel]):
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > self.options.max_body_bytes:
                raise ApiError(413, f"request body over {self.options.max_body_bytes} bytes", "request_too_large")
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

    @staticmethod
    def sampling(req: Sampling) -> SamplerParams:
        d = SamplerParams()
        return SamplerParams(temperature=d.temperature if req.temperature is None else req.temperature,
                             top_k=d.top_k if req.top_k is None else req.top_k,
                             top_p=d.top_p if req.top_p is None else req.top_p,
                             min_p=d.min_p if req.min_p is None else req.min_p, seed=req.seed)

    def generation(self, text: str, req: Sampling, max_tokens: int, stop) -> Generation:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        tokens = self.engine.tokenizer.encode(text)
        if not tokens:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if len(tokens) + 1 > self.worker.ctx:
            raise ApiError(400, f"the prompt has {len(tokens)} tokens; the context is {self.worker.ctx}",
                           code="context_length_exceeded")
        return Generation(text, tokens, self.sampling(req), max_tokens, stops, req.ignore_eos)

    def render(self, messages: list[dict]) -> str:
        try:
            return self.engine.template.render(messages)
        except TemplateError as e:
            raise ApiError(400, str(e), param="messages") from None

    @staticmethod
    def job(kind: str, payload) -> Job:
        return Job(kind, payload, asyncio.get_running_loop())

    async def run_job(self, request: Request, job: Job, *, poll_disconnect: bool):
        """Submit a job and yield its events, plus ("keepalive",) after each quiet keepalive_seconds.

        A consumer that stops early (a streaming client gone: Starlette cancels
        the response) or a disconnect seen by polling cancels the job.
        """
        self.worker.submit(job)
        finished = False
        quiet_since = time.monotonic()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if poll_disconnect and await request.is_disconnected():
                        return
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
            if not finished:
                job.cancelled.set()

    async def answer(self, request: Request, job: Job) -> tuple[str, dict]:
        """A job's whole text and result; raises ApiError."""
        text = []
        async for event in self.run_job(request, job, poll_disconnect=True):
            if event[0] == "delta":
                text.append(event[1])
            elif event[0] == "error":
                raise event[1]
            elif event[0] == "done":
                if event[1] is None:
                    raise ApiError(499, "cancelled")
                return "".join(text), event[1]
        raise ApiError(499, "client disconnected")

    def events(self, request: Request, job: Job):
        return self.run_job(request, job, poll_disconnect=False)


def create_app(engine, options: ServerOptions) -> FastAPI:
    worker = Worker(engine, options)
    fe = Frontend(engine, options, worker)

    async def lifespan(app):
        worker.start()
        yield
        worker.stop()  # the worker writes the shutdown checkpoint, then ends
        await asyncio.get_running_loop().run_in_executor(None, worker.join, 60)

    app = FastAPI(title="kvsession", lifespan=lifespan)
    app.state.worker = worker

    @app.middleware("http")
    async def guard(request: Request, call_next):
        anthropic_shape = is_anthropic(request.url.path)
        if options.api_key and request.url.path != "/health":
            auth = request.headers.get("authorization", "")
            key = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
            if key != options.api_key:
                return error_response(ApiError(401, "invalid or missing API key", "authentication_error"),
                                      anthropic_shape)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > options.max_body_bytes:
            return error_response(ApiError(413, f"request body over {options.max_body_bytes} bytes",
                                           "request_too_large"), anthropic_shape)
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(e, is_anthropic(request.url.path))

    @app.get("/health")
    async def health():
        if not worker.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok", "model": fe.model_id, "queued": worker.jobs.qsize(), "served": worker.served,
                "live_tokens": len(worker.session), "store": str(worker.store.dir) if worker.store else None,
                "last_cancel_tokens": worker.last_cancel_tokens}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": fe.model_id, "object": "model", "created": 0,
                                            "owned_by": "kvsession"}]}

    openai.register(app, fe)
    anthropic.register(app, fe)

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
        _, r = await fe.answer(request, fe.job("save", name))
        return r

    @app.post("/v1/sessions/{name}/restore")
    async def restore_session(request: Request, name: str):
        worker.named_path(name)
        _, r = await fe.answer(request, fe.job("restore", name))
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
        return error_response(ApiError(404, f"no route {request.method} {request.url.path}", "not_found_error"),
                              is_anthropic(request.url.path))

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc):
        return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}"),
                              is_anthropic(request.url.path))

    return app


def serve(engine, options: ServerOptions) -> int:
    import uvicorn

    app = create_app(engine, options)
    log.info("serving %s on http://%s:%d", engine.path.name, options.host, options.port)
    uvicorn.run(app, host=options.host, port=options.port, log_level="info", timeout_graceful_shutdown=30)
    return 0
