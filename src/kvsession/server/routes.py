"""The server's own routes, beside the APIs: /api/hello, /health, /v1/models and the named sessions (the web UI at
/ is webui/).

/health (and llama-server's /v1/health) answers without an API key (the
guard lets it through), but says only "ok", or "loading" with a 503 in
llama-server's error shape, to a caller without one; with a key it tells the
queue, the live sessions and the store's state. A named session
(/v1/sessions/{name}/save, restore, DELETE) is a job on the worker like a
generation, so that a restore and a delete of one name never interleave.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..files.named import list_saved
from .http.guard import authorized
from .protocol import ApiError
from .serving import Frontend, frontend
from .worker import without_folder

router = APIRouter()


@router.api_route("/api/hello", methods=["GET", "HEAD"])
async def hello(request: Request):  # Claude Code probes it, and /, at start
    return {"name": "kvsession", "model": frontend(request).model_id, "health": "/health", "docs": "/docs"}


@router.get("/health")
@router.get("/v1/health")
async def health(request: Request):
    fe = frontend(request)
    worker = fe.worker
    if not worker.ready.is_set():
        return JSONResponse({"status": "loading", "error": {"code": 503, "message": "Loading model",
                                                            "type": "unavailable_error"}}, status_code=503)
    if not authorized(request.headers, fe.options.api_keys):
        return {"status": "ok"}
    store = None
    if worker.store is not None:
        reason = worker.store_health.reason
        shared = worker.store.shared
        store = {"status": "degraded" if reason else "ok", "reason": reason, "dir": str(worker.store.dir),
                 "shared": shared.state() if shared is not None else None}
    latest = worker.live.latest
    return {"status": "ok", "model": fe.model_id, "queued": worker.jobs.qsize() + len(worker.waiting),
            "running": len(worker.running), "preparing": fe.preparing, "served": worker.served,
            "live_tokens": len(latest.session) if latest else 0, "live_sessions": len(worker.live),
            "live_kv_mb": round(worker.live.nbytes() / 2**20, 1), "store": store,
            "last_cancel_tokens": worker.last_cancel_tokens}


def _model_entry(fe: Frontend) -> dict:
    return {"id": fe.model_id, "object": "model", "created": 0, "owned_by": "kvsession",
            "context_length": fe.worker.ctx, "aliases": fe.aliases, "tags": list(fe.options.tags)}


@router.get("/v1/models")
@router.get("/models")
async def models(request: Request):
    return {"object": "list", "data": [_model_entry(frontend(request))]}


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str):
    fe = frontend(request)
    if model_id != fe.model_id and model_id not in fe.aliases:
        raise ApiError(404, f"no model {model_id!r}; this server serves {fe.model_id!r}", "not_found_error",
                       param="model", code="model_not_found")
    return _model_entry(fe)


# --- named sessions ---


@router.get("/v1/sessions")
async def list_sessions(request: Request):
    fe = frontend(request)
    folder = fe.worker.sessions
    saved, warnings = await fe.off_loop(list_saved, folder)
    return {"object": "list", "warnings": [without_folder(w, folder) for w in warnings],
            "data": [{"name": e.name, "tokens": e.n_tokens, "bytes": e.size, "modified": e.mtime} for e in saved]}


async def _session_job(request: Request, kind: str, name: str) -> dict:
    """A named session's save, restore or delete, run on the worker (never beside another job on that name)."""
    fe = frontend(request)
    fe.worker.named_path(name)  # a bad name is a 400 before the job is queued
    _, answer = await fe.answer(request, fe.job(kind, name))
    return answer.body


@router.post("/v1/sessions/{name}/save")
async def save_session(request: Request, name: str):
    return await _session_job(request, "save", name)


@router.post("/v1/sessions/{name}/restore")
async def restore_session(request: Request, name: str):
    return await _session_job(request, "restore", name)


@router.delete("/v1/sessions/{name}")
async def delete_session(request: Request, name: str):
    return await _session_job(request, "delete", name)
