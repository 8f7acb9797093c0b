"""The worker: the one thread that owns the engine, the live sessions and the store.

HTTP handlers parse, validate and enqueue Jobs; the worker runs them one at
a time and sends events back to the request's event loop. A request goes
to, in this order: the live session of its conversation (by the client's
session key, else by token or rendered-text prefix, ds4's match), the disk
cache's longest prefix when it is longer than what a live session shares
(the hit is looked up first and protected while room is made), a fork of
the live session sharing most with it, or a cold prefill. Live sessions are
kept under `--live-kv-mb`, least recently used out first, each checkpointed
("evict") before it goes. Checkpoints follow the store's policy: "cold"
after a cold prefill (the prompt's whole chunks), "continued" at every
interval frontier during prefill and generation (written by the store's
thread), "evict", and "shutdown" when the server stops. After a restart the
next turn comes from disk, or from the shared tier on another server.

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
from ..store import Hit, Store, StoreUnavailable
from ..store.live import Live, LiveSessions, Route
from .options import ServerOptions
from .protocol import ApiError

log = logging.getLogger("kvsession.server")

# Rows the spare session has ready (LiveSessions): a conversation of this size restores without first-touch
# costs; SmolLM2 ~280 MB of the live budget, Qwen2.5-Coder-0.5B ~150 MB.
SPARE_TOKENS = 4096


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
    session_key: str | None = None  # the client's name for its conversation (X-Session-Id, user, ...)
    warnings: list[str] = field(default_factory=list)  # what the request asked for and does not get (the trace)

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
    """Owns the engine, the live sessions and the store; runs jobs one at a time."""

    def __init__(self, engine, options: ServerOptions):
        super().__init__(name="kvsession-worker", daemon=True)
        self.engine = engine
        self.options = options
        self.ctx = options.ctx or engine.config.context_length
        self.jobs: queue.Queue = queue.Queue()
        self.live = LiveSessions(options.live_kv_mb << 20, self._new_session, SPARE_TOKENS)
        self.store = None
        self.store_health = StoreHealth(options.kv_disk_retry_seconds)
        if options.kv_disk_dir:
            self.store = Store(Path(options.kv_disk_dir).expanduser(), options.store)
        self.sessions = sessions_dir(options.sessions_dir)
        self.trace = open(options.trace, "a", encoding="utf-8") if options.trace else None
        self.served = 0
        self.ready = threading.Event()  # set once warmed up; /health says "loading" until then
        self.last_cancel_tokens: int | None = None  # tokens a cancelled request generated (for tests)

    def _new_session(self) -> Session:
        return self.engine.session(kv_dtype=self.options.kv_dtype, max_tokens=self.ctx)

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
        self.live.refill()
        self.ready.set()
        while True:
            self.live.refill(busy=lambda: not self.jobs.empty())  # the next conversation's, while nothing waits
            job = self.jobs.get()
            if job is None:
                for live in list(self.live.entries):
                    self._checkpoint("shutdown", live)
                if self.store is not None:
                    self.store.close(timeout=60)  # the continued checkpoints still being written
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

    def _store(self, op: str, *args, default=None, **kw):
        """self.store.<op>(*args, **kw), or `default` while the store is missing or failing."""
        if self.store is None or not self.store_health.usable():
            return default
        try:
            result = getattr(self.store, op)(*args, **kw)
        except (StoreUnavailable, OSError) as e:
            self.store_health.failed(e)
            return default
        self.store_health.ok()
        return result

    def _checkpoint(self, reason: str, live: Live, protect: Hit | None = None) -> None:
        """A checkpoint written now (the session is about to change or leave). protect: a hit about to be
        restored, which this checkpoint must not evict from the disk (ds4 #448)."""
        s = live.session
        if len(s) == live.saved_at or not len(s):
            return
        if self._store("put", s, reason, protect=protect) is not None:
            live.saved_at = len(s)
            log.info("checkpoint (%s): %d tokens", reason, len(s))

    def _continued(self, live: Live, *, whole: bool = False) -> None:
        """A "continued" checkpoint of a growing session, written by the store's thread while this one goes on
        prefilling or decoding: at each chunk-aligned frontier the policy sets, or (whole) all of it now."""
        if self.store is None or not self.store_health.usable():
            return
        s = live.session
        n = len(s) if whole else self.store.continued_frontier(len(s), live.saved_at)
        if not n or n <= live.saved_at:
            return
        future = self._store("checkpoint_async", s, "continued", n_tokens=n)
        if future is not None:
            live.saved_at = n
            future.add_done_callback(self._written)

    def _written(self, future) -> None:
        """The writer thread finished a continued checkpoint; a failure there marks the store as failing."""
        e = future.exception()
        if e is not None:
            self.store_health.failed(e)

    def _fit(self, keep: Live, protect: Hit | None = None) -> None:
        """Live sessions over the memory budget leave, least recently used first, each checkpointed first."""
        for live in self.live.over_budget(keep):
            self._checkpoint("evict", live, protect)
            self.live.drop(live)

    # --- generation ---

    def _prepare(self, g: Generation) -> tuple[Live, list[int], Reuse]:
        """The live session g runs in, and what it reuses: (session, tokens still to prefill, where the reused
        part came from)."""
        route = self.live.route(g.tokens, g.text, g.session_key, self.engine.tokenizer)
        if route.live is not None:
            live, rest, reuse = self._continue(g, route.live)
        elif route.donor is not None and g.session_key is not None and route.donor.key == g.session_key \
                and route.shared * 2 >= len(route.donor.session):
            live, rest, reuse = self._went_back(g, route)
        else:
            live, rest, reuse = self._start(g, route)
        self._fit(live)
        s = live.session
        if not rest and s.logits is None:  # the session is exactly the prompt, without logits: redo one token
            last = s.tokens[-1]
            s.truncate(len(s) - 1)
            rest, reuse.tokens = [last], reuse.tokens - 1
        return live, rest, reuse

    def _continue(self, g: Generation, live: Live) -> tuple[Live, list[int], Reuse]:
        """A live session holds g's conversation: as a token prefix, or a rendered-text prefix (ds4's match)."""
        s = live.session
        if common_prefix(g.tokens, s.tokens) == len(s.tokens):
            return live, g.tokens[len(s):], Reuse("live", len(s))
        return live, g.prompt.tokens_from(self.engine.tokenizer, len(s.text)), Reuse("live", len(s))

    def _went_back(self, g: Generation, route: Route) -> tuple[Live, list[int], Reuse]:
        """The key's own conversation went back (an edit, a retry, an interrupted turn): its session is cut back
        in place to where it agrees with g, after a checkpoint of what it held; or restored from disk, when the
        disk holds more of g."""
        live = route.donor
        s = live.session
        hit = self._disk_hit(g)
        self._checkpoint("evict", live, hit[0] if hit else None)  # keep what it held, then go back
        if hit is not None and hit[0].n_tokens > route.shared and self._restore(hit, live):
            return live, self._after_hit(g, hit), Reuse("disk", len(s))
        before = len(s)
        kept = s.cut_back(route.shared)
        live.saved_at = min(live.saved_at, kept)
        rest = g.prompt.tokens_from(self.engine.tokenizer, route.shared_chars) \
            if route.by_text and kept == route.shared else g.tokens[kept:]
        return live, rest, Reuse("live" if kept else "cold", kept,
                                 f"the keyed session ({before} tokens) went back to token {kept}")

    def _start(self, g: Generation, route: Route) -> tuple[Live, list[int], Reuse]:
        """No live session holds g's conversation: the longest of a disk checkpoint and another live session's
        shared prefix (forked), else a cold prefill."""
        hit = self._disk_hit(g)
        if hit is not None and hit[0].n_tokens > route.shared:
            live = self.live.add(self.live.take_new(), g.session_key)
            self._fit(live, hit[0])  # room first: evicted sessions are checkpointed, leaving the hit on disk
            if self._restore(hit, live):
                return live, self._after_hit(g, hit), Reuse("disk", len(live.session))
            self.live.drop(live)
        if route.shared > 0:
            live = self.live.fork(route.donor, route.shared, g.session_key)
            n = len(live.session)
            rest = g.prompt.tokens_from(self.engine.tokenizer, route.shared_chars) \
                if route.by_text and n == route.shared else g.tokens[n:]
            return live, rest, Reuse("live" if n else "cold", n, f"forked from a live session at token {n}")
        live = self.live.add(self.live.take_new(), g.session_key)
        return live, g.tokens, Reuse("cold", 0, self._miss())

    def _restore(self, hit, live: Live) -> bool:
        if not self._store("restore", hit[0], live.session, default=False):
            return False
        live.saved_at = len(live.session)
        return True

    def _after_hit(self, g: Generation, hit) -> list[int]:
        """What is left to prefill after a disk hit: by tokens, or the rest of the text when it matched by text."""
        if hit[1] is None:
            return g.tokens[hit[0].n_tokens:]
        return g.prompt.tokens_from(self.engine.tokenizer, len(g.text) - len(hit[1]))

    def _miss(self) -> str:
        if self.store is None:
            return "no live session shares its prefix; no disk cache"
        if self.store_health.reason is not None:
            return f"no live session shares its prefix; the disk cache is unusable ({self.store_health.reason})"
        return "no live session shares its prefix, nothing on disk does"

    def _disk_hit(self, g: Generation):
        """The disk cache's longest prefix of g, by tokens or by rendered text: (hit, rest of the text or None)."""
        kv_dtype = self.options.kv_dtype
        by_tokens = self._store("longest_prefix", g.tokens, self.engine, kv_dtype)
        by_text = self._store("longest_text_prefix", g.text, self.engine, kv_dtype)
        if by_text is not None and (by_tokens is None or by_text[0].n_tokens > by_tokens.n_tokens):
            return by_text
        return (by_tokens, None) if by_tokens is not None else None

    def _job_generate(self, job: Job) -> None:
        g: Generation = job.payload
        t0 = time.perf_counter()
        live, prompt, reuse = self._prepare(g)
        s = live.session
        total = reuse.tokens + len(prompt)
        if total >= self.ctx:
            raise ApiError(400, f"the prompt has {total} tokens; the context is {self.ctx}",
                           code="context_length_exceeded")
        job.emit("start", {"prompt_tokens": total, "cached_tokens": reuse.tokens, "source": reuse.source})

        prepared = time.perf_counter()
        marks = {"start": t0, "prepared": prepared}
        far = {"prefilled": 0}  # how far a cancelled request got, for its trace line

        def progress(done: int, n: int) -> None:
            far["prefilled"] = done
            if job.cancelled.is_set():  # between prefill chunks the session is consistent
                raise Cancelled
            self._continued(live)  # a long prefill killed halfway resumes from its last frontier
            job.emit("progress", done, n)

        def first_token() -> None:
            marks["first"] = time.perf_counter()
            if len(prompt) > reuse.tokens:  # after a mostly cold prefill, keep its whole chunks (not before a token)
                self._checkpoint("cold", live)

        choices, stats_all = [], []
        try:
            s.prefill(prompt, progress=progress)
            far["prefilled"] = len(prompt)
            marks["prefilled"] = time.perf_counter()
            prompt_logprobs = prompt_logprobs_of(self.engine, g.tokens, g.top_logprobs or 0) \
                if g.prompt_logprobs else None
            # forks share the prompt's rows; the live session keeps choice 0, the one a client sends back
            forks = [s] + [s.fork() for _ in range(g.n - 1)]
            for i, session in enumerate(forks):
                stats = Stats()
                stats_all.append(stats)
                choices.append(self._choice(job, g, i, session, stats, self.ctx - total - 1,
                                            first_token if i == 0 else None, live if i == 0 else None))
        except Cancelled:
            marks.setdefault("prefilled", time.perf_counter())
            self._trace(g, reuse, far["prefilled"], marks, sum(st.generated_tokens for st in stats_all),
                        sum(st.decode_seconds for st in stats_all), "cancelled")
            raise
        finally:
            self.served += 1
            # a stored response, or a fleet sharing its cache, needs the whole turn checkpointed (off this thread)
            self._continued(live, whole=g.checkpoint or bool(self.options.store.shared_url))
            self._fit(live)
        generated = sum(c["completion_tokens"] for c in choices)
        self._trace(g, reuse, len(prompt), marks, generated, sum(st.decode_seconds for st in stats_all),
                    choices[0]["finish_reason"])
        job.emit("done", {"choices": choices, "prompt_tokens": total, "cached_tokens": reuse.tokens,
                          "completion_tokens": generated, "prompt_logprobs": prompt_logprobs,
                          "source": reuse.source})

    def _choice(self, job: Job, g: Generation, index: int, s: Session, stats: Stats, room: int,
                after_first=None, live: Live | None = None) -> dict:
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
            if live is not None:
                self._continued(live)
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
        log.info("request: %d tokens reused (%s, %.1f ms), %d prefilled in %.1f ms, %d generated%s",
                 reuse.tokens, reuse.source, reuse_ms, prefilled, prefill_s * 1e3, generated,
                 " (cancelled)" if finish == "cancelled" else "")
        for w in g.warnings:
            log.warning("request: %s", w)
        if self.trace is None:
            return
        self.trace.write(json.dumps({
            "time": round(time.time(), 3), "endpoint": g.endpoint, "prompt_tokens": reuse.tokens + prefilled,
            "source": reuse.source, "reused_tokens": reuse.tokens, "miss": reuse.miss, "reuse_ms": round(reuse_ms, 1),
            "prefilled_tokens": prefilled, "prefill_tps": round(prefilled / prefill_s, 1) if prefilled else None,
            "first_token_ms": round(first_ms, 1) if first_ms is not None else None, "completion_tokens": generated,
            "decode_tps": round(generated / decode_s, 1) if decode_s and generated else None,
            "finish_reason": finish, **({"warnings": g.warnings} if g.warnings else {})}) + "\n")
        self.trace.flush()

    # --- named sessions ---

    def named_path(self, name: str) -> Path:
        try:
            return self.sessions / (check_session_name(name) + ".kvs")
        except InvalidSessionName as e:
            raise ApiError(400, str(e), param="name") from None

    def _job_save(self, job: Job) -> None:
        path = self.named_path(job.payload)
        latest = self.live.latest
        if latest is None:
            raise ApiError(409, "no live session to save yet", code="session_not_saved")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            info = latest.session.save(path)
        except (KvsessionError, OSError) as e:
            raise ApiError(409, f"cannot save session {job.payload!r}: {without_folder(str(e), self.sessions)}",
                           code="session_not_saved") from None
        job.emit("done", {"name": job.payload, "tokens": len(latest.session), "bytes": info.bytes,
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
        self._fit(self.live.add(session))
        job.emit("done", {"name": job.payload, "tokens": len(session), "bytes": path.stat().st_size,
                          "ms": round((time.perf_counter() - t0) * 1e3, 2)})


def without_folder(text: str, folder: Path) -> str:
    """A message without the server's sessions folder in it: a client names sessions, never paths."""
    return text.replace(str(folder.resolve()) + "/", "").replace(str(folder) + "/", "")
