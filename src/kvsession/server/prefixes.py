"""Where a request's prefix comes from: the live sessions and the disk KV cache, and their checkpoints.

A request goes to, in this order: the live session of its conversation (a
session whose tokens or rendered text are a whole prefix of the prompt,
ds4's match; a client's session key breaks ties), the disk cache's longest
prefix when it is longer than what a live session shares (the hit is looked
up first and protected while room is made), the live session sharing most
with it (cut back in place when it is the key's own conversation going
back, forked otherwise), or a cold prefill. A session a running request is
decoding into is never taken, cut back or evicted; it may be forked from.
Live sessions are kept under `--live-kv-mb`, least recently used out
first, each checkpointed ("evict") before it goes. Checkpoints follow the
store's policy: "cold" after a cold prefill (the prompt's whole chunks),
"continued" at every interval frontier during prefill and generation,
"evict", and "shutdown" when the server stops; all but "evict" are written
by the store's thread. After a restart the next turn comes from disk, or
from the shared tier on another server.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ..session import Session, common_prefix
from ..store import Hit, Store
from ..store.breaker import Breaker
from ..store.soft import SoftStore
from .events import Generation
from .options import ServerOptions
from .sessions import Live, LiveSessions, Route
from .stats import ServerStats

log = logging.getLogger("kvsession.server")

# Rows the spare session has ready (LiveSessions): a conversation of this size restores without first-touch
# costs; SmolLM2 ~280 MB of the live budget, Qwen2.5-Coder-0.5B ~150 MB.
SPARE_TOKENS = 4096


@dataclass
class Reuse:
    """Where a request's prefix came from: "live", "disk" or "cold", and why not better."""

    source: str
    tokens: int
    miss: str | None = None
    shared: bool = False  # from disk, brought there from the shared tier by this request's lookup

    @property
    def tier(self) -> str:
        """Where its KV came from, for /metrics: "live", "disk" or "shared"."""
        return "shared" if self.shared else self.source


class Prefixes:
    """The live sessions and the store of one worker, and what a request reuses of them."""

    def __init__(self, engine, options: ServerOptions, ctx: int, stats: ServerStats):
        self.engine = engine
        self.options = options
        self.ctx = ctx
        self.stats = stats
        self.live = LiveSessions(options.live_kv_mb << 20, self._new_session, SPARE_TOKENS)
        self.store = Store(Path(options.kv_disk_dir).expanduser(), options.store) if options.kv_disk_dir else None
        # a store whose folder fails (full, read-only, deleted, replaced by a file) costs the server its cache,
        # never its requests: logged once, served without, tried again every --kv-disk-retry seconds
        self.disk = SoftStore(self.store, Breaker("the disk KV cache", "serving without it",
                                                  options.kv_disk_retry_seconds, log))
        # a hybrid's prefill stops at these absolute frontiers and is checkpointed whole there, its recurrent
        # states with it: a prompt that shares part of a stored one restores from the last one before they part
        self.snapshot_step = self.store.snapshot_step(engine, options.kv_dtype) if self.store is not None else 0

    def _new_session(self) -> Session:
        return self.engine.session(kv_dtype=self.options.kv_dtype, max_tokens=self.ctx)

    def checkpoint(self, reason: str, live: Live, protect: Hit | None = None) -> None:
        """A checkpoint written now (the session is about to change or leave). protect: a hit about to be
        restored, which this checkpoint must not evict from the disk (ds4 #448)."""
        s = live.session
        n = _exact(s)
        if n == live.saved_at or not n:
            return
        if self.disk.put(s, reason, protect=protect, n_tokens=n if n < len(s) else None) is not None:
            live.saved_at = n
            log.info("checkpoint (%s): %d tokens", reason, n)

    def continued(self, live: Live, *, whole: bool = False) -> None:
        """A "continued" checkpoint of a growing session, written by the store's thread while this one goes on
        prefilling or decoding: at each chunk-aligned frontier the policy sets, or (whole) all of it now."""
        if not self.disk.usable:
            return
        s = live.session
        n = min(len(s) if whole else self.store.continued_frontier(len(s), live.saved_at), _exact(s))
        if not n or n <= live.saved_at:
            return
        self.later(live, "continued", n)

    def at_frontier(self, live: Live) -> None:
        """A hybrid's prefill that reached one of its snapshot frontiers: a whole checkpoint of it now (written
        by the store's thread, its states copied first)."""
        n = len(live.session)
        if self.snapshot_step and n % self.snapshot_step == 0 and n > live.saved_at and self.disk.usable:
            self.later(live, "continued")

    def later(self, live: Live, reason: str, n_tokens: int | None = None) -> None:
        """A checkpoint of the session's first n_tokens (None: as the store's policy has it for `reason`),
        written by the store's thread: what it needs is copied now, and the session goes on at once. A session
        after a context shift is stored only as far as it is exact (Session.shifted)."""
        if live.session.shifted is not None:
            n_tokens = min(n_tokens if n_tokens is not None else len(live.session), live.session.shifted)
        if self.disk.checkpoint_async(live.session, reason, n_tokens=n_tokens) is not None:
            live.saved_at = len(live.session) if n_tokens is None else n_tokens

    def fit(self, keep: Live, protect: Hit | None = None) -> None:
        """Live sessions over the memory budget leave, least recently used first, each checkpointed first."""
        for live in self.live.over_budget(keep):
            self.checkpoint("evict", live, protect)
            self.live.drop(live)

    # --- generation ---

    def prepare(self, g: Generation) -> tuple[Live, list[int], Reuse]:
        """The live session g runs in, and what it reuses: (session, tokens still to prefill, where the reused
        part came from)."""
        if not g.cache_prompt:  # the client asks for a whole prefill (llama-server's cache_prompt: false)
            live = self.live.add(self.live.take_new(), g.session_key)
            self.fit(live)
            return live, list(g.tokens), Reuse("cold", 0, "the request asked for no reuse (cache_prompt)")
        route = self.live.route(g.tokens, g.text, g.session_key, self.engine.tokenizer)
        if route.live is not None:
            live, rest, reuse = self._continue(g, route.live)
        elif route.donor is not None and g.session_key is not None and route.donor.key == g.session_key \
                and not route.donor.busy and route.shared * 2 >= len(route.donor.session):
            live, rest, reuse = self._went_back(g, route)
        else:
            live, rest, reuse = self._start(g, route)
        self.fit(live)
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
        self.checkpoint("evict", live, hit[0] if hit else None)  # keep what it held, then go back
        # a hybrid's session goes back in place only to its marks (Session.mark: each prompt's and turn's end);
        # a checkpoint on disk may hold more
        keeps = s.reach(route.shared)
        if hit is not None and hit[0].n_tokens > keeps and self._restore(hit, live):
            return live, self._after_hit(g, hit), Reuse("disk", len(s), shared=hit[0].source == "shared")
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
        # what a fork keeps: the shared prefix, unless the donor cannot go back to it (a ring that wrapped past
        # it; a hybrid's recurrent state, at its end and its marks)
        keeps = route.donor.session.reach(route.shared) if route.shared else 0
        if hit is not None and hit[0].n_tokens > keeps:
            live = self.live.add(self.live.take_new(), g.session_key)
            self.fit(live, hit[0])  # room first: evicted sessions are checkpointed, leaving the hit on disk
            if self._restore(hit, live):
                return live, self._after_hit(g, hit), Reuse("disk", len(live.session),
                                                            shared=hit[0].source == "shared")
            self.live.drop(live)
        if keeps > 0:
            live = self.live.fork(route.donor, route.shared, g.session_key)
            n = len(live.session)
            rest = g.prompt.tokens_from(self.engine.tokenizer, route.shared_chars) \
                if route.by_text and n == route.shared else g.tokens[n:]
            return live, rest, Reuse("live" if n else "cold", n, f"forked from a live session at token {n}")
        live = self.live.add(self.live.take_new(), g.session_key)
        return live, g.tokens, Reuse("cold", 0, self._miss())

    def _restore(self, hit, live: Live) -> bool:
        t0 = time.perf_counter()
        if not self.disk.restore(hit[0], live.session):
            return False
        self.stats.restores.observe(time.perf_counter() - t0)
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
        if self.disk.health.reason is not None:
            return f"no live session shares its prefix; the disk cache is unusable ({self.disk.health.reason})"
        return "no live session shares its prefix, nothing on disk does"

    def _disk_hit(self, g: Generation):
        """The disk cache's longest prefix of g, by tokens or by rendered text: (hit, rest of the text or None)."""
        kv_dtype = self.options.kv_dtype
        by_tokens = self.disk.longest_prefix(g.tokens, self.engine, kv_dtype)
        by_text = self.disk.longest_text_prefix(g.text, self.engine, kv_dtype)
        if by_text is not None and (by_tokens is None or by_text[0].n_tokens > by_tokens.n_tokens):
            return by_text
        return (by_tokens, None) if by_tokens is not None else None



def _exact(session: Session) -> int:
    """How much of a session a checkpoint may hold: all of it, or after a context shift the prefix before it."""
    return len(session) if session.shifted is None else session.shifted
