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
import dataclasses
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..template import ChatPrompt
from ..errors import KvsessionError, NotASessionFile, SessionFileError
from ..generate import Stats, TokenRules, prompt_logprobs_of, stream
from ..sampling import Sampler, SamplerParams
from ..named import InvalidSessionName, check_session_name, sessions_dir
from ..session import Session, common_prefix
from ..store import Store, StoreOptions, StoreUnavailable
from .options import ServerOptions
from .protocol import ApiError

log = logging.getLogger("kvsession.server")


@dataclass
class Generation:
    """What the worker needs for one completion: the whole prompt, as text and tokens, and how to answer."""

    prompt: ChatPrompt  # the rendered prompt (chat template applied, or the raw prompt) and its tokens
    params: SamplerParams
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # choices: the prompt is prefilled once, its rows copied into n - 1 forks
    logit_bias: dict[int, float] | None = None
    top_logprobs: int | None = None  # None: no log-probabilities
    constraint: Any = None  # a grammar factory (grammar.py): .new() gives each choice its Constraint
    prompt_logprobs: bool = False  # completions' echo with logprobs: the prompt tokens' own
    checkpoint: bool = False  # checkpoint the session when done (the Responses API's stored state)
    endpoint: str = ""  # for the trace


    @property
    def text(self) -> str:
        return self.prompt.text

    @property
    def tokens(self) -> list[int]:
        return self.prompt.tokens


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


class StoreHealth:
    """Whether the disk KV cache can be used now, and why not.

    A store whose folder fails (full, read-only, deleted, replaced by a file)
    must cost the server its cache, never its requests: the failure is logged
    once, requests are served without the store, and it is tried again after
    `retry_seconds`; the first call that works again clears the state.
    """

    def __init__(self, retry_seconds: float = 10.0):
        self.retry_seconds = retry_seconds
        self.reason: str | None = None
        self.retry_at = 0.0

    def usable(self) -> bool:
        return self.reason is None or time.monotonic() >= self.retry_at

    def failed(self, error: Exception) -> None:
        if self.reason is None:
            log.error("the disk KV cache is unusable, serving without it: %s", error)
        self.reason = str(error)
        self.retry_at = time.monotonic() + self.retry_seconds

    def ok(self) -> None:
        if self.reason is not None:
            log.warning("the disk KV cache works again")
        self.reason = None


@dataclass
class Reuse:
    """Where a request's prefix came from: "live", "disk" or "cold", and why not better."""

    source: str
    tokens: int
    miss: str | None = None


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
        self.store_health = StoreHealth(options.kv_disk_retry_seconds)
        if options.kv_disk_dir:
            self.store = Store(Path(options.kv_disk_dir).expanduser(), StoreOptions(
                min_tokens=options.kv_disk_min_tokens, budget_bytes=options.kv_disk_space_mb << 20))
        self.sessions = sessions_dir(options.sessions_dir)
        self.trace = open(options.trace, "a", encoding="utf-8") if options.trace else None
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
                if self.trace is not None:
                    self.trace.close()
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
                job.emit("error", ApiError(500, f"internal error: {type(e).__name__}", "server_error"))

    # --- the store, which may fail without failing a request ---

    def _store(self, op: str, *args, default=None):
        """self.store.<op>(*args), or `default` while the store is missing or failing."""
        if self.store is None or not self.store_health.usable():
            return default
        try:
            result = getattr(self.store, op)(*args)
        except (StoreUnavailable, OSError) as e:
            self.store_health.failed(e)
            return default
        self.store_health.ok()
        return result

    def _checkpoint(self, reason: str) -> None:
        s = self.session
        if len(s) == self.saved_at or not len(s):
            return
        if self._store("put", s, reason) is not None:
            self.saved_at = len(s)
            log.info("checkpoint (%s): %d tokens", reason, len(s))

    # --- generation ---

    def _prepare(self, g: Generation) -> tuple[list[int], Reuse]:
        """Reuse what we can for g; returns (tokens still to prefill, where the rest came from)."""
        rest, reuse = self._reuse(g)
        s = self.session
        if not rest and s.logits is None:  # the session is exactly the prompt, without logits: redo one token
            last = s.tokens[-1]
            s.truncate(len(s) - 1)
            rest, reuse.tokens = [last], reuse.tokens - 1
        return rest, reuse

    def _reuse(self, g: Generation) -> tuple[list[int], Reuse]:
        s = self.session
        ids = g.tokens
        common = common_prefix(ids, s.tokens)
        if s.tokens and common == len(s.tokens):  # 1. the live session is a token prefix of the prompt
            return ids[common:], Reuse("live", common)
        if s.tokens and g.text.startswith(s.text):  # 2. ... or a rendered-text prefix (ds4's match)
            return g.prompt.tokens_from(self.engine.tokenizer, len(s.text)), Reuse("live", len(s))
        miss = f"the live session ({len(s)} tokens) differs at token {common}" if s.tokens else "no live session"
        hit = self._disk_hit(g)
        if hit is not None and hit[0].n_tokens > common:
            self._checkpoint("evict")
            if self._store("restore", hit[0], s, default=False):
                self.saved_at = len(s)
                rest = ids[hit[0].n_tokens:] if hit[1] is None else \
                    g.prompt.tokens_from(self.engine.tokenizer, len(g.text) - len(hit[1]))
                return rest, Reuse("disk", len(s))
            miss += "; the disk hit was damaged"
        elif self.store is None:
            miss += "; no disk cache"
        elif self.store_health.reason is not None:
            miss += f"; the disk cache is unusable ({self.store_health.reason})"
        else:
            miss += "; nothing longer on disk"
        if common < len(s.tokens):  # 4. an unrelated request replaces the live session
            self._checkpoint("evict")
            common = s.cut_back(common)
            self.saved_at = min(self.saved_at, common)
        return ids[common:], Reuse("live" if common else "cold", common, miss)

    def _disk_hit(self, g: Generation):
        """The disk cache's longest prefix of g, by tokens or by rendered text: (hit, rest of the text or None)."""
        kv_dtype = self.session.kv_dtype
        by_tokens = self._store("longest_prefix", g.tokens, self.engine, kv_dtype)
        by_text = self._store("longest_text_prefix", g.text, self.engine, kv_dtype)
        if by_text is not None and (by_tokens is None or by_text[0].n_tokens > by_tokens.n_tokens):
            return by_text
        return (by_tokens, None) if by_tokens is not None else None

    def _job_generate(self, job: Job) -> None:
        g: Generation = job.payload
        t0 = time.perf_counter()
        prompt, reuse = self._prepare(g)
        s = self.session
        total = reuse.tokens + len(prompt)
        if total >= self.ctx:
            raise ApiError(400, f"the prompt has {total} tokens; the context is {self.ctx}",
                           code="context_length_exceeded")
        job.emit("start", {"prompt_tokens": total, "cached_tokens": reuse.tokens, "source": reuse.source})

        def progress(done: int, n: int) -> None:
            if job.cancelled.is_set():  # between prefill chunks the session is consistent
                raise Cancelled
            job.emit("progress", done, n)

        prepared = time.perf_counter()
        s.prefill(prompt, progress=progress)
        marks = {"start": t0, "prepared": prepared, "prefilled": time.perf_counter()}

        def first_token() -> None:
            marks["first"] = time.perf_counter()
            if len(prompt) > reuse.tokens:  # after a mostly cold prefill, keep its whole chunks (not before a token)
                self._checkpoint("cold")

        prompt_logprobs = prompt_logprobs_of(self.engine, g.tokens, g.top_logprobs or 0) \
            if g.prompt_logprobs else None
        # forks share the prompt's rows; the live session keeps choice 0, the one a client sends back
        forks = [s] + [s.fork() for _ in range(g.n - 1)]
        choices, stats_all = [], []
        try:
            for i, session in enumerate(forks):
                stats = Stats()
                choices.append(self._choice(job, g, i, session, stats, self.ctx - total - 1,
                                            first_token if i == 0 else None))
                stats_all.append(stats)
        finally:
            self.served += 1
            if g.checkpoint or self._store("should_checkpoint", len(s), self.saved_at, default=False):
                self._checkpoint("continued")
        generated = sum(c["completion_tokens"] for c in choices)
        self._trace(g, reuse, len(prompt), marks, generated, sum(st.decode_seconds for st in stats_all),
                    choices[0]["finish_reason"])
        job.emit("done", {"choices": choices, "prompt_tokens": total, "cached_tokens": reuse.tokens,
                          "completion_tokens": generated, "prompt_logprobs": prompt_logprobs,
                          "source": reuse.source})

    def _choice(self, job: Job, g: Generation, index: int, s: Session, stats: Stats, room: int,
                after_first=None) -> dict:
        """Generate choice `index` in session s, emitting ("delta", index, Delta) events."""
        seed = None if g.params.seed is None else g.params.seed + index
        s.sampler = Sampler(g.params if seed == g.params.seed else dataclasses.replace(g.params, seed=seed))
        rules = TokenRules(logit_bias=g.logit_bias, top_logprobs=g.top_logprobs,
                           constraint=g.constraint.new() if g.constraint is not None else None)
        start = len(s)
        for delta in stream(s, [], max_tokens=min(g.max_tokens, room), stop=g.stop, stats=stats,
                            ignore_eos=g.ignore_eos, rules=rules):
            job.emit("delta", index, delta)
            if after_first is not None:
                after_first()
                after_first = None
            if job.cancelled.is_set():
                self.last_cancel_tokens = stats.generated_tokens
                raise Cancelled
        return {"index": index, "finish_reason": stats.finish_reason, "stop_sequence": stats.stop_sequence,
                "completion_tokens": stats.generated_tokens, "tokens": s.tokens[start:]}

    def _trace(self, g: Generation, reuse: Reuse, prefilled: int, marks: dict, generated: int, decode_s: float,
               finish: str | None) -> None:
        """A log line, and with --trace a JSON line: where the prefix came from, what it cost, how fast."""
        reuse_ms = (marks["prepared"] - marks["start"]) * 1e3  # lookup, and a disk restore when there was one
        prefill_s = marks["prefilled"] - marks["prepared"]
        first_ms = (marks["first"] - marks["start"]) * 1e3 if "first" in marks else None
        log.info("request: %d tokens reused (%s, %.1f ms), %d prefilled in %.1f ms, %d generated",
                 reuse.tokens, reuse.source, reuse_ms, prefilled, prefill_s * 1e3, generated)
        if self.trace is None:
            return
        self.trace.write(json.dumps({
            "time": round(time.time(), 3), "endpoint": g.endpoint, "prompt_tokens": reuse.tokens + prefilled,
            "source": reuse.source, "reused_tokens": reuse.tokens, "miss": reuse.miss, "reuse_ms": round(reuse_ms, 1),
            "prefilled_tokens": prefilled, "prefill_tps": round(prefilled / prefill_s, 1) if prefilled else None,
            "first_token_ms": round(first_ms, 1) if first_ms is not None else None, "completion_tokens": generated,
            "decode_tps": round(generated / decode_s, 1) if decode_s and generated else None,
            "finish_reason": finish}) + "\n")
        self.trace.flush()

    # --- named sessions ---

    def named_path(self, name: str) -> Path:
        try:
            return self.sessions / (check_session_name(name) + ".kvs")
        except InvalidSessionName as e:
            raise ApiError(400, str(e), param="name") from None

    def _job_save(self, job: Job) -> None:
        path = self.named_path(job.payload)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            info = self.session.save(path)
        except (KvsessionError, OSError) as e:
            raise ApiError(409, f"cannot save session {job.payload!r}: {without_folder(str(e), self.sessions)}",
                           code="session_not_saved") from None
        job.emit("done", {"name": job.payload, "tokens": len(self.session), "bytes": info.bytes,
                          "ms": round(info.seconds * 1e3, 2)})

    def _job_restore(self, job: Job) -> None:
        path = self.named_path(job.payload)
        t0 = time.perf_counter()
        try:
            session = Session.load(path, self.engine, max_tokens=self.ctx)
        except NotASessionFile as e:
            if not path.exists():
                raise ApiError(404, f"no session {job.payload!r}", "not_found_error") from None
            raise ApiError(400, f"session {job.payload!r}: {without_folder(str(e), self.sessions)}") from None
        except SessionFileError as e:
            raise ApiError(400, f"session {job.payload!r}: {without_folder(str(e), self.sessions)}") from None
        self._checkpoint("evict")
        self.session, self.saved_at = session, 0
        job.emit("done", {"name": job.payload, "tokens": len(session), "bytes": path.stat().st_size,
                          "ms": round((time.perf_counter() - t0) * 1e3, 2)})


def without_folder(text: str, folder: Path) -> str:
    """A message without the server's sessions folder in it: a client names sessions, never paths."""
    return text.replace(str(folder.resolve()) + "/", "").replace(str(folder) + "/", "")
