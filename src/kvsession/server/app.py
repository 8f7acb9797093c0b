"""The app of `kvsession serve`: its routers, its guard, its errors, and the worker's lifetime.

Agent clients are stateless: every request resends the whole conversation.
What makes that cheap is ds4-server's arrangement, kept here: HTTP handlers
(FastAPI on uvicorn) only parse, validate and enqueue, then relay what the
worker (worker.py, the one thread that owns the model) emits. Each API is a
router (openai.py, anthropic.py, responses/, and the server's own
routes.py) over one serving object (serving.py's Frontend), which the app
keeps in its state; this module only puts them together.

What a request may cost is bounded before it is paid: its body (413 before
it is read), its text against the context (before it is tokenized), its
schemas and tool calls (limits.py, before they are compiled or rendered),
the tokens its choices may generate.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import anyio
from fastapi import FastAPI, Request

from ..errors import KvsessionError
from . import anthropic, embeddings, openai, routes, webui
from .http.connection import with_header_timeout
from .http.guard import Guard
from .llama import metrics as llama_metrics
from .llama import router as llama
from .options import ServerOptions
from .protocol import ApiError, error_response
from .responses import router as responses
from .serving import Frontend
from .worker import Worker

log = logging.getLogger("kvsession.server")

# in the order they are matched; their bodies' models go into the OpenAPI document
API_ROUTERS = (openai.router, anthropic.router, responses.router, embeddings.router, llama.router)


def create_app(engine, options: ServerOptions, *, start_worker: bool = True) -> FastAPI:
    """The app and its worker. start_worker: the app's lifespan runs the worker in a thread of its own; else the
    caller runs it (serve: on the thread that loaded the model, see there)."""
    worker = Worker(engine, options)

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
    app.state.frontend = Frontend(engine, options, worker)
    app.state.metrics = llama_metrics.registry(worker)
    app.state.started = time.time()
    app.add_middleware(Guard, options=options)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(e, request.url.path)

    @app.exception_handler(KvsessionError)
    async def kvsession_error(request: Request, e: KvsessionError):
        return error_response(ApiError(400, str(e)), request.url.path)

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return error_response(ApiError(404, f"no route {request.method} {request.url.path}", "not_found_error"),
                              request.url.path)

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc):
        return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}"),
                              request.url.path)

    app.include_router(routes.router)
    if options.webui:
        app.include_router(webui.router)
    for router in API_ROUTERS:
        app.include_router(router)
    _document_bodies(app)
    return app


def _document_bodies(app: FastAPI) -> None:
    """The OpenAPI document: FastAPI's, plus the bodies the API routes parse themselves (their $defs hoisted)."""
    default_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = default_openapi()
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for router in API_ROUTERS:
                for name, model in router.body_models.items():
                    s = model.model_json_schema(ref_template="#/components/schemas/{model}")
                    schemas.update(s.pop("$defs", {}))
                    schemas[name] = s
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi


def serve(engine, options: ServerOptions) -> int:
    """Serve until SIGINT or SIGTERM. The worker runs on this thread and HTTP on another: OpenMP keeps a pool of
    threads per thread that starts parallel work, and the pool of the thread that loaded the model, left
    behind, cost every product run from a second thread 30-90% (Qwen2.5-Coder-0.5B decoded 30 tokens a second
    in the server where the same loop on the loading thread did 54)."""
    import signal

    import uvicorn

    app = create_app(engine, options, start_worker=False)
    worker: Worker = app.state.worker
    configs = [uvicorn.Config(app, host=host, port=options.port, log_level="info", timeout_graceful_shutdown=30,
                              http=with_header_timeout(options.read_timeout)) for host in options.hosts]
    server = uvicorn.Server(configs[0])

    def http() -> None:
        try:  # several addresses (llama-server's --host "127.0.0.1,::1"): one server on a socket for each
            server.run([c.bind_socket() for c in configs] if len(configs) > 1 else None)
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
