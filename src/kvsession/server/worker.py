"""The worker: the one thread that owns the engine, the live sessions and the store, and serves many requests
at once.

HTTP handlers parse, validate and enqueue Jobs; the worker sends typed
events (events.py) back to each request's event loop. Generation requests
join a running set (at most `--parallel`, the rest waiting in arrival
order), and the worker runs it a step at a time, as llama.cpp's server and
ds4's batched sessions do:

- a request is admitted between steps: its prefix is found (prefixes.py:
  a live session, the disk cache, a fork, or nothing) and it starts to
  prefill;
- each step prefills one chunk (`--step-tokens`, at most) of the
  prefilling request with the fewest tokens left, so that a short prompt
  that arrives during a 20k-token one waits about a chunk, not the whole
  prefill; chunks are cut at the same places whatever else runs, so a
  prompt's numbers do not depend on its neighbours;
- then one pass through the model decodes a token of every decoding
  sequence at once (session.advance: each weight read once for all of
  them; on the CPU each sequence's logits are bit for bit its own), the
  `n` choices of a request among them;
- finished and cancelled requests leave at once. A client that goes away
  raises its job's `cancelled` flag; the worker looks at it every step.

Other jobs (named sessions' save, restore and delete) run between steps, one
at a time: a restore and a DELETE of the same name cannot interleave, so a
restore either happened or answered 404, never both.
Checkpoints are copied on this thread and written by the store's.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import kernels
from ..errors import KvsessionError, NotASessionFile, SessionFileError, SessionNotFound
from ..files import framing
from ..files.named import (
    InvalidSessionName,
    check_session_name,
    delete_saved,
    make_folder,
    sessions_dir,
)
from ..embedding import embedding_of, normalized
from ..generate import Decoding, Stats, TokenRules, prompt_logprobs_of
from ..sampling import Sampler
from ..session import DEFAULT_CHUNK, Session, advance, chunk_length
from .events import (
    Answer,
    Cancelled,
    ChoiceEnd,
    Done,
    Embedding,
    Failed,
    Generation,
    Job,
    Output,
    Progress,
    Started,
)
from .options import ServerOptions
from .prefixes import Prefixes, Reuse
from .protocol import ApiError, context_exceeded
from .sessions import Live
from .stats import ServerStats

log = logging.getLogger("kvsession.server")
IDLE_POLL_SECONDS = 0.5  # how often an idle worker wakes, for the signal handlers waiting to run on its thread


@dataclass
class Choice:
    """One sequence of a request being decoded: its session (the live one for choice 0, a fork for the others)."""

    index: int
    session: Session
    decoding: Decoding
    stats: Stats
    start: int  # the session's length before the reply
    truncated: bool = False  # its context was shifted


@dataclass
class Running:
    """A generation request in the running set."""

    job: Job
    g: Generation
    live: Live
    reuse: Reuse
    rest: list[int]  # the prompt's tokens still to prefill
    total: int  # the prompt's tokens, reused and prefilled
    marks: dict  # perf_counter times: start, prepared, prefilled, first
    slot: int  # its lane (llama-server's slot)
    started: float  # wall-clock time it took its lane
    prefilled: int = 0
    choices: list[Choice] = field(default_factory=list)
    prompt_logprobs: list | None = None

    @property
    def decoding(self) -> bool:
        return bool(self.choices)

    @property
    def over(self) -> bool:
        return bool(self.choices) and all(c.decoding.over for c in self.choices)


class Worker(threading.Thread):
    """Owns the engine, the live sessions and the store; runs the requests a step at a time."""

    def __init__(self, engine, options: ServerOptions):
        super().__init__(name="kvsession-worker", daemon=True)
        self.engine = engine
        self.options = options
        self.ctx = options.ctx or engine.config.context_length
        self.jobs: queue.Queue = queue.Queue()
        self.stats = ServerStats()
        self.prefixes = Prefixes(engine, options, self.ctx, self.stats)
        self.live = self.prefixes.live
        self.store = self.prefixes.store
        self.store_health = self.prefixes.disk.health
        self.sessions = sessions_dir(options.sessions_dir)
        for path in framing.remove_dead_temporaries(self.sessions):  # a save killed with an earlier server
            log.info("removed %s, left by a save that was killed", path)
        self.trace = open(options.trace, "a", encoding="utf-8") if options.trace else None
        self.served = 0
        self.ready = threading.Event()  # set once warmed up; /health says "loading" until then
        self.last_cancel_tokens: int | None = None  # tokens a cancelled request generated (for tests)
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: list[Running] = []
        # embedding jobs under way, one input a turn of the loop, so that a long list never stalls the running set:
        # each with its vectors so far and its start
        self.embedding: collections.deque[tuple[Job, list, float]] = collections.deque()
        # the running set's lanes (llama-server's slots): the request in each, and the live session it ran last
        self.slots: list[Running | None] = [None] * options.parallel
        self.slot_live: list[Live | None] = [None] * options.parallel
        self.stopping = False

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def stop(self) -> None:
        self.jobs.put(None)

    def run(self) -> None:
        self._warm_up()
        self.live.refill()
        self.ready.set()
        while not (self.stopping and not self.running):
            self._take_jobs()
            self._admit()
            if self.running:
                self._step()
            if self.embedding:
                self._guarded(self.embedding[0][0], self._embed_one)
        for live in list(self.live.entries):
            self.prefixes.checkpoint("shutdown", live)
        if self.store is not None:
            self.store.close(timeout=60)  # the checkpoints still being written
        if self.trace is not None:
            self.trace.close()

    def _warm_up(self) -> None:
        """Every path a request takes, once, before /health says ready (llama.cpp warms up too): the first pass of
        each picks kernels, allocates buffers and faults the weights' pages in, which cost the first request
        after a restart ~200 ms over a live one. A prompt (the GEMMs, attention over a chunk), then decode steps
        alone and two sessions together."""
        token = self.engine.tokenizer.bos_id or 0
        n = min(self.options.step_tokens, 64, self.ctx - 4)
        a, b = (self.engine.session(kv_dtype=self.options.kv_dtype, max_tokens=n + 4) for _ in range(2))
        a.prefill([token] * n)
        b.prefill([token] * 2)
        a.append(0)
        advance([(a, [0]), (b, [0])])
        advance([(a, [0, 0])], keep=[True])

    # --- the running set ---

    def _take_jobs(self) -> None:
        """Jobs from the queue: waiting while nothing runs (making the spare session meanwhile), else only those
        already there. Generation requests wait to be admitted; the others run now."""
        while True:
            idle = not self.running and not self.waiting and not self.embedding and not self.stopping
            if idle:
                self.live.refill(busy=lambda: not self.jobs.empty())  # the next conversation's, while nothing waits
            try:
                # idle, a wait with a timeout: a SIGTERM that lands on another of the process's threads runs its
                # Python handler (serve's stop) on this, the main thread, only when it next runs bytecode; a wait
                # with none left a server deaf to it until the next request
                job = self.jobs.get(timeout=IDLE_POLL_SECONDS) if idle else self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:
                self.stopping = True
                for waiting in [*self.waiting, *(e[0] for e in self.embedding)]:
                    waiting.emit(Cancelled())
                self.waiting.clear()
                self.embedding.clear()
            elif self.stopping or job.cancelled.is_set():
                job.emit(Cancelled())
            elif job.kind == "generate":
                self.waiting.append(job)
            else:
                self._guarded(job, getattr(self, f"_job_{job.kind}"), job)

    def _guarded(self, job: Job, fn, *args) -> bool:
        """fn(*args), its failure the job's: an ApiError as it is, a bug as a 500 (a bug costs one request,
        never the worker). False if it failed."""
        try:
            fn(*args)
            return True
        except ApiError as e:
            job.emit(Failed(e))
        except Exception as e:
            log.exception("request failed")
            job.emit(Failed(ApiError(500, f"internal error: {type(e).__name__}", "server_error")))
        return False

    def _admit(self) -> None:
        """Waiting requests into free lanes, in arrival order; one that asks for a busy lane (id_slot) waits for it
        while later ones go ahead."""
        held = []
        while self.waiting and len(self.running) < self.options.parallel:
            job = self.waiting.popleft()
            if job.cancelled.is_set():
                job.emit(Cancelled())
                continue
            wanted = job.payload.slot
            slot = self.slots.index(None) if wanted is None else wanted if self.slots[wanted] is None else None
            if slot is None:
                held.append(job)
                continue
            self._guarded(job, self._start, job, slot)
        self.waiting.extendleft(reversed(held))

    def _start(self, job: Job, slot: int) -> None:
        g: Generation = job.payload
        t0 = time.perf_counter()
        live, rest, reuse = self.prefixes.prepare(g)
        total = reuse.tokens + len(rest)
        if total >= self.ctx:
            raise context_exceeded(total, self.ctx)
        live.busy = True
        job.emit(Started(total, reuse.tokens, reuse.source, slot))
        r = Running(job, g, live, reuse, rest, total, {"start": t0, "prepared": time.perf_counter()}, slot,
                    time.time())
        self.running.append(r)
        self.slots[slot], self.slot_live[slot] = r, live
        if reuse.tokens:
            self.stats.reuse(reuse.tier, reuse.tokens)
        if not rest:
            self._begin_decoding(r)

    def _step(self) -> None:
        for r in [r for r in self.running if r.job.cancelled.is_set()]:
            self._leave(r, cancelled=True)
        alone = len(self.running) == 1  # one prompt, no one decoding: nobody waits between its chunks
        chunks = sorted(((r, self._chunk(r, alone)) for r in self.running if not r.decoding),
                        key=lambda x: len(x[0].rest) - x[0].prefilled)
        # a chunk of a few tokens goes through the decode stack, as it does alone (Model.forward)
        small = [(r, c) for r, c in chunks if len(c) <= kernels.KERNEL_TOKENS]
        large, budget = [], self.options.step_tokens
        for r, c in chunks:
            if len(c) > kernels.KERNEL_TOKENS and (not large or len(c) <= budget):
                large.append((r, c))
                budget -= len(c)
        if large:
            self._prefill(large)
        decoding = [r for r in self.running if r.decoding and not r.over]
        if decoding or small:
            self._decode(decoding, small)
        for r in [r for r in self.running if r.over]:
            self._guarded(r.job, self._finish, r)
            self._leave(r)

    def _chunk(self, r: Running, alone: bool) -> list[int]:
        """The next chunk of r's prompt, cut at multiples of the step's tokens from the first one prefilled: the
        same cuts whatever else runs, so that a prompt's numbers do not depend on its neighbours. A prompt alone
        takes several steps' tokens at once, up to DEFAULT_CHUNK (Session.prefill's): at 8k tokens on
        Qwen2.5-Coder-0.5B 512-token chunks prefill ~12% faster than 256-token ones, 1,024 no faster. A
        hybrid's chunk also stops at its next snapshot frontier (Prefixes.snapshot_step)."""
        step = self.options.step_tokens
        size = step * max(1, DEFAULT_CHUNK // step) if alone else step
        n = chunk_length(len(r.live.session), size, self.prefixes.snapshot_step)
        return r.rest[r.prefilled : r.prefilled + n]

    def _prefill(self, chunks: list[tuple[Running, list[int]]]) -> None:
        """Chunks of several prompts in one pass (the GEMMs read each weight once for all of them; a row's
        result does not depend on the others). If the pass fails, each goes alone: a bad prompt costs itself."""
        self.stats.passed(sum(len(c) for _, c in chunks), 0)
        if len(chunks) > 1:
            try:
                advance([(r.live.session, c) for r, c in chunks])
            except Exception:
                for one in chunks:
                    self._prefill([one])
                return
        else:
            (r, c), = chunks
            if not self._guarded(r.job, advance, [(r.live.session, c)]):
                self._leave(r, failed=True)
                return
        for r, c in chunks:
            self._prefilled(r, c)

    def _prefilled(self, r: Running, chunk: list[int]) -> None:
        r.prefilled += len(chunk)
        r.job.emit(Progress(r.prefilled, len(r.rest)))
        self.prefixes.continued(r.live)  # a long prefill killed halfway resumes from its last frontier
        self.prefixes.at_frontier(r.live)
        if r.prefilled == len(r.rest):
            self._begin_decoding(r)

    def _begin_decoding(self, r: Running) -> None:
        g, s = r.g, r.live.session
        r.marks["prefilled"] = time.perf_counter()
        self.stats.prompt_tokens += len(r.rest)
        self.stats.prompt_seconds += r.marks["prefilled"] - r.marks["start"]
        s.mark()  # the prompt's end, what a retried turn starts from: its logits, and a hybrid's state (Session.mark)
        if self.engine.config.recurrent:  # which only exists there: on disk too
            self.prefixes.continued(r.live, whole=True)
        if g.prompt_logprobs:
            r.prompt_logprobs = prompt_logprobs_of(self.engine, g.tokens, g.top_logprobs or 0)
        # a reply ends where the context does, unless a context shift makes room
        room = g.max_tokens if self.options.context_shift else self.ctx - r.total - 1
        # forks share the prompt's rows; the live session keeps choice 0, the one a client sends back
        for i, session in enumerate([s] + [s.fork() for _ in range(g.n - 1)]):
            seed = None if g.params.seed is None else g.params.seed + i
            session.sampler = Sampler(g.params if seed == g.params.seed else dataclasses.replace(g.params, seed=seed))
            rules = TokenRules(logit_bias=g.logit_bias, top_logprobs=g.top_logprobs, post_sampling=g.post_sampling,
                               constraint=g.constraint.new() if g.constraint is not None else None)
            stats = Stats()
            d = Decoding(session, min(g.max_tokens, room), stats, stop=g.stop, ignore_eos=g.ignore_eos, rules=rules,
                         speculative=self.options.spec == "ngram")
            r.choices.append(Choice(i, session, d, stats, len(session)))

    def _decode(self, rs: list[Running], prefills: list[tuple[Running, list[int]]] = ()) -> None:
        """One token of every decoding sequence, any drafts after them, and the prompts' last few tokens, in one
        pass through the model."""
        feeds: list[tuple[Running, Choice | None, list[int]]] = [(r, None, c) for r, c in prefills]
        for r in rs:
            for c in r.choices:
                if self.options.context_shift:
                    self._make_room(r, c)
                token = self._choose(r, c)
                if token is not None:
                    feeds.append((r, c, [token] + c.decoding.draft(token)))
        feeds = [f for f in feeds if f[0] in self.running]  # not those of a request whose grammar failed
        if feeds:
            self.stats.passed(sum(len(t) for _, _, t in feeds), len({id(r) for r, c, _ in feeds if c is not None}))
            self.stats.drafts += sum(1 for _, c, t in feeds if c is not None and len(t) > 1)
            if not self._feed(feeds):
                return
        for r in rs:
            if r.over and r in self.running:
                for c in r.choices:
                    tail = c.decoding.finish()
                    if tail is not None:
                        r.job.emit(Output(c.index, tail))

    def _feed(self, feeds: list[tuple[Running, Choice | None, list[int]]]) -> bool:
        """The chosen tokens (and prompt chunks: choice None) through the model in one pass, and what each
        settles; False if the pass failed."""
        try:
            rows = advance([(c.session if c is not None else r.live.session, tokens) for r, c, tokens in feeds],
                           keep=[c is not None and len(t) > 1 for _, c, t in feeds])
        except Exception as e:  # nothing was fed: every request of the pass fails, the worker goes on
            log.exception("a decode step failed")
            for r in {id(r): r for r, _, _ in feeds}.values():
                r.job.emit(Failed(ApiError(500, f"internal error: {type(e).__name__}", "server_error")))
                self._leave(r, failed=True)
            return False
        for (r, c, tokens), logits in zip(feeds, rows):
            if r not in self.running:  # another of its choices failed
                continue
            if c is None:
                self._prefilled(r, tokens)
                continue
            try:
                deltas = c.decoding.settle(tokens, logits)
            except KvsessionError as e:  # the grammar refused the token
                self._grammar_failed(r, c, e)
                continue
            for delta in deltas:
                r.job.emit(Output(c.index, delta))
            if c.index == 0:
                if "first" not in r.marks:
                    r.marks["first"] = time.perf_counter()
                    if len(r.rest) > r.reuse.tokens and not self.engine.config.recurrent:
                        # after a mostly cold prefill, keep its whole chunks (a hybrid kept its prompt's end)
                        self.prefixes.later(r.live, "cold")
                self.prefixes.continued(r.live)
        return True

    def _make_room(self, r: Running, c: Choice) -> None:
        """--context-shift: a choice whose session is full drops half of what follows the request's n_keep
        tokens (or its n_discard) and goes on, as llama-server does; one with nothing to drop ends (length)."""
        s = c.session
        if c.decoding.over or len(s) < s.max_tokens - 1:
            return
        keep = min(r.g.n_keep, len(s))
        discard = min(r.g.n_discard or (len(s) - keep) // 2, len(s) - keep)
        if discard <= 0:
            c.decoding.left = 0
            return
        c.decoding.shift(keep, discard)
        c.truncated = True
        self.stats.context_shifts += 1

    def _choose(self, r: Running, c: Choice) -> int | None:
        if r not in self.running:  # another of its choices failed
            return None
        try:
            return c.decoding.choose()
        except KvsessionError as e:  # a constraint with no token left
            self._grammar_failed(r, c, e)
            return None

    def _grammar_failed(self, r: Running, c: Choice, e: KvsessionError) -> None:
        """A grammar that cannot go on (llguidance compiled it, then gave up while generating, see grammar.py): the
        client's schema, not a bug. The request ends with a 400 naming the field the grammar came from (a stream
        with an error event, in its API's shape) and one log line."""
        field = getattr(r.g.constraint, "field", "the grammar")
        done = c.stats.generated_tokens
        log.warning("request: %s could not go on after %d tokens: %s", field, done, e)
        c.decoding.over = True
        r.job.emit(Failed(ApiError(400, f"{field}: the grammar could not go on after {done} tokens: {e}",
                                   param=field)))
        self._leave(r, failed=True)

    def _finish(self, r: Running) -> None:
        choices = [ChoiceEnd(c.index, c.stats.finish_reason, c.stats.stop_sequence, c.stats.generated_tokens,
                             c.session.tokens[c.start:] if not c.truncated else [], c.truncated) for c in r.choices]
        generated = sum(c.completion_tokens for c in choices)
        self._trace(r, len(r.rest), generated, choices[0].finish_reason)
        self.stats.requests += 1
        marks = r.marks
        r.job.emit(Done(choices, r.total, r.reuse.tokens, generated, r.prompt_logprobs, r.reuse.source, r.slot,
                        marks["prefilled"] - marks["start"], time.perf_counter() - marks["prefilled"]))

    def _leave(self, r: Running, *, cancelled: bool = False, failed: bool = False) -> None:
        """r leaves the running set; its session is free again, checkpointed as the store's policy says."""
        if r not in self.running:
            return
        self.running.remove(r)
        self.slots[r.slot] = None
        self.served += 1
        if "prefilled" in r.marks:
            st = self.stats
            st.predicted_tokens += sum(c.stats.generated_tokens for c in r.choices)
            st.predicted_steps += sum(max(0, c.stats.generated_tokens - 1) for c in r.choices)
            st.predicted_seconds += time.perf_counter() - r.marks["prefilled"]
            st.draft_tokens += sum(c.stats.draft_tokens for c in r.choices)
            st.accepted_tokens += sum(c.stats.accepted_tokens for c in r.choices)
        if cancelled:
            generated = sum(c.stats.generated_tokens for c in r.choices)
            self.last_cancel_tokens = generated
            self._trace(r, r.prefilled, generated, "cancelled")
            r.job.emit(Cancelled())
        r.live.busy = False
        shifted = r.live.session.shifted
        if shifted is not None:  # back to what a prefill of its tokens would hold: only that is reused or stored
            kept = r.live.session.cut_back(shifted)
            r.live.saved_at = min(r.live.saved_at, kept)
        # a stored response, a fleet sharing its cache, or a hybrid (whose state exists at the turn's end and its
        # marks only) needs the whole turn checkpointed (off this thread); a hybrid marks it too, for an edit of
        # the next turn to come back to
        if not failed:
            r.live.session.mark()
            self.prefixes.continued(r.live, whole=r.g.checkpoint or bool(self.options.store.shared_url)
                                    or self.engine.config.recurrent)
        self.prefixes.fit(r.live)

    def _trace(self, r: Running, prefilled: int, generated: int, finish: str | None) -> None:
        """A log line, and with --trace a JSON line: where the prefix came from, what it cost, how fast."""
        g, reuse, marks = r.g, r.reuse, r.marks
        reuse_ms = (marks["prepared"] - marks["start"]) * 1e3  # lookup, and a disk restore when there was one
        prefill_s = marks.get("prefilled", time.perf_counter()) - marks["prepared"]
        first_ms = (marks["first"] - marks["start"]) * 1e3 if "first" in marks else None
        decode_s = sum(c.stats.decode_seconds for c in r.choices)
        log.info("request: %d tokens reused (%s, %.1f ms), %d prefilled in %.1f ms, %d generated%s",
                 reuse.tokens, reuse.source, reuse_ms, prefilled, prefill_s * 1e3, generated,
                 " (cancelled)" if finish == "cancelled" else "")
        for w in g.warnings:
            log.warning("request: %s", w)
        if self.trace is None:
            return
        self.trace.write(json.dumps({
            "time": round(time.time(), 3), "started": round(r.started, 3), "slot": r.slot,
            "queued_ms": round((marks["start"] - r.job.arrived) * 1e3, 1), "endpoint": g.endpoint,
            "prompt_tokens": reuse.tokens + prefilled,
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
        latest = self.live.latest
        if latest is None:
            raise ApiError(409, "no live session to save yet", code="session_not_saved")
        job.emit(Answer(self._save(latest, job.payload)))

    def _job_restore(self, job: Job) -> None:
        job.emit(Answer(self._restore(job.payload)[1]))

    def _save(self, live: Live, name: str) -> dict:
        path = self.named_path(name)
        try:
            make_folder(path.parent)
            info = live.session.save(path)
        except (KvsessionError, OSError) as e:
            raise ApiError(409, f"cannot save session {name!r}: {without_folder(str(e), self.sessions)}",
                           code="session_not_saved") from None
        return {"name": name, "tokens": len(live.session), "bytes": info.bytes, "ms": round(info.seconds * 1e3, 2)}

    def _restore(self, name: str) -> tuple[Live, dict]:
        """The named session, loaded (checked whole) into a new live session."""
        path = self.named_path(name)
        t0 = time.perf_counter()
        try:
            size = path.stat().st_size  # before the load: a file gone after it must not fail a restore done
        except FileNotFoundError:
            raise ApiError(404, f"no session {name!r}", "not_found_error") from None
        except OSError as e:
            raise ApiError(400, f"session {name!r}: {e.strerror or e}") from None
        try:
            session = Session.load(path, self.engine, max_tokens=self.ctx)
        except NotASessionFile as e:
            if not path.exists():
                raise ApiError(404, f"no session {name!r}", "not_found_error") from None
            raise ApiError(400, f"session {name!r}: {without_folder(str(e), self.sessions)}") from None
        except SessionFileError as e:
            raise ApiError(400, f"session {name!r}: {without_folder(str(e), self.sessions)}") from None
        live = self.live.add(session)
        self.prefixes.fit(live)
        return live, {"name": name, "tokens": len(session), "bytes": size,
                      "ms": round((time.perf_counter() - t0) * 1e3, 2)}

    # --- slots: llama-server's lanes, each with the live session it ran last ---

    def slot_session(self, slot: int) -> Live | None:
        """The live session the lane ran last, while it is still live (the budget may have let it go)."""
        live = self.slot_live[slot]
        return live if live is not None and live in self.live.entries else None

    def _idle_slot(self, slot: int, action: str) -> None:
        if self.slots[slot] is not None:
            raise ApiError(409, f"slot {slot} is processing a request: {action} it once that has finished",
                           code="slot_busy")

    def _job_slot_save(self, job: Job) -> None:
        slot, name = job.payload
        self._idle_slot(slot, "save")
        live = self.slot_session(slot)
        if live is None or not len(live.session):
            raise ApiError(409, f"slot {slot} holds no session to save", code="session_not_saved")
        job.emit(Answer(self._save(live, name)))

    def _job_slot_restore(self, job: Job) -> None:
        slot, name = job.payload
        self._idle_slot(slot, "restore into")
        live, answer = self._restore(name)
        self.slot_live[slot] = live
        job.emit(Answer(answer))

    def _job_slot_erase(self, job: Job) -> None:
        slot, _ = job.payload
        self._idle_slot(slot, "erase")
        live = self.slot_session(slot)
        n = len(live.session) if live is not None else 0
        if live is not None:  # forgotten, not checkpointed: erasing is asking for its KV to be gone
            self.live.drop(live)
        self.slot_live[slot] = None
        job.emit(Answer({"tokens": n}))

    def _job_embed(self, job: Job) -> None:
        self.embedding.append((job, [], time.perf_counter()))

    def _embed_one(self) -> None:
        """The next input of the first embedding job through the model in a scratch session, pooled; its passes
        and tokens counted as a prompt's (llama-server counts them so: an embedding is a decode with nothing
        sampled). The job is answered after its last input."""
        job, vectors, t0 = self.embedding[0]
        e: Embedding = job.payload
        if job.cancelled.is_set():
            self.embedding.popleft()
            job.emit(Cancelled())
            return
        try:
            tokens = e.inputs[len(vectors)]
            v = embedding_of(self.engine, tokens, e.pooling, on_pass=lambda n: self.stats.passed(n, 0))
        except BaseException:
            self.embedding.popleft()  # its failure is the job's (_guarded); the others go on
            raise
        vectors.append((normalized(v, e.normalize) if v.ndim == 1 else v).numpy())
        self.stats.prompt_tokens += len(tokens)
        if len(vectors) == len(e.inputs):
            self.embedding.popleft()
            self.stats.prompt_seconds += time.perf_counter() - t0
            job.emit(Answer({"vectors": vectors}))

    def _job_delete(self, job: Job) -> None:
        path = self.named_path(job.payload)
        try:
            size = path.stat().st_size if path.is_file() else 0
            delete_saved(self.sessions, job.payload)
        except SessionNotFound:
            raise ApiError(404, f"no session {job.payload!r}", "not_found_error") from None
        except (KvsessionError, OSError) as e:
            raise ApiError(409, f"cannot delete session {job.payload!r}: {without_folder(str(e), self.sessions)}") \
                from None
        job.emit(Answer({"name": job.payload, "deleted": True, "bytes": size}))


def without_folder(text: str, folder: Path) -> str:
    """A message without the server's sessions folder in it: a client names sessions, never paths."""
    return text.replace(str(folder.resolve()) + "/", "").replace(str(folder) + "/", "")
