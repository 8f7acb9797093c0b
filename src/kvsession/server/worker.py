"""The worker: the one thread that owns the engine, the live session and the store.

HTTP handlers parse, validate and enqueue Jobs; the worker runs them one at
a time and sends events back to the request's event loop. A request reuses,
in this order, the live session's tokens (its token prefix, else its
rendered-text prefix, ds4's match), the disk cache's longest prefix, or
nothing (a cold prefill). Checkpoints follow the store's policy: "cold"
after a cold prefill (the prompt's whole chunks), "continued" as a session
grows, "evict" before an unrelated request replaces the live session,
"shutdown" when the server stops. After a restart the next turn comes from
disk.

A client that goes away raises its job's `cancelled` flag; the worker checks
it between tokens and between prefill chunks, so the generation stops within
one token and the next job starts.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import KvsessionError, SessionFileError
from ..generate import Stats, stream
from ..sampling import Sampler, SamplerParams
from ..session import InvalidSessionName, Session, check_session_name, common_prefix, sessions_dir
from ..store import Store, StoreOptions
from .options import ServerOptions
from .protocol import ApiError

log = logging.getLogger("kvsession.server")


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
