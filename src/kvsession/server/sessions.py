"""The live sessions: conversations kept in memory between requests, under a byte budget.

An agent and its sub-agents, or two users, interleave their turns. With one
live session every switch would be a checkpoint and a disk restore; here
each conversation keeps its own session while the budget allows, and the
least recently used one leaves first (checkpointed by the caller before it
goes, so it comes back from disk when its conversation returns).

A request is routed to a session by, in this order: the longest session
whose tokens (or rendered text) are a whole prefix of the prompt, the one
with the request's key (the client's `X-Session-Id` header or `user`
field) on a tie; else the session sharing the most with it, by token
ids or by rendered text (a sampled split of the same text keeps its ids),
which the worker cuts back in place when it is the key's own conversation
going back (an edit, a retry, an interrupted turn) and forks otherwise, so
that the other conversation keeps all of its tokens. A session with another
key is forked from, never taken over. A key does not own a
conversation: Claude Code sends one `user_id` for an agent, its sub-agents
and its side requests, which share a system prompt and little else. With
nothing shared, a new empty session (which the disk cache may then fill).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..session import Session, common_prefix
from ..text.tokenizer import matching_text


@dataclass
class Live:
    session: Session
    key: str | None = None  # the client's session key, when it sent one
    saved_at: int = 0  # the session's length at its last checkpoint
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False  # a running request decodes into it: never taken, cut back or evicted, only forked from


@dataclass
class Route:
    """Where a prompt goes: a live session that holds its conversation (live), or none, with the live
    session sharing the most with it (donor): its first `shared` tokens agree with the prompt, as ids, or
    (by_text) as the prompt's first `shared_chars` characters, past the ids the two share."""

    live: Live | None
    donor: Live | None = None
    shared: int = 0
    shared_chars: int = 0
    by_text: bool = False


def session_bytes(session: Session) -> int:
    """What a session holds in memory: every layer's K and V."""
    return session.memory_bytes


class LiveSessions:
    """The live sessions, and one spare: a new session made ahead, between requests, with room for
    `spare_tokens` and its memory already touched (Session.prefault). A fresh session's first restore or
    prefill otherwise pays the kernel's first touch of that memory: ~40 ms of a ~65 ms restore of 2,000
    tokens of SmolLM2 in a fresh server. The spare counts against the budget and is the first to go."""

    def __init__(self, budget_bytes: int, new_session: Callable[[], Session], spare_tokens: int = 0):
        self.budget_bytes = budget_bytes
        self.new_session = new_session
        self.spare_tokens = spare_tokens
        self.spare: Session | None = None
        self._spare_bytes = 0  # what the last spare took, to know whether the next one fits
        self._spare_layers = 0  # of the spare's layers, how many are ready
        self.entries: list[Live] = []

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def latest(self) -> Live | None:
        return max(self.entries, key=lambda e: e.last_used, default=None)

    def nbytes(self) -> int:
        """The live sessions' memory, the spare's included."""
        spare = session_bytes(self.spare) if self.spare is not None else 0
        return spare + sum(session_bytes(e.session) for e in self.entries)

    def take_new(self) -> Session:
        """A new, empty session: the spare when there is one."""
        session, self.spare = self.spare, None
        return session if session is not None else self.new_session()

    def refill(self, busy: Callable[[], bool] = lambda: False) -> None:
        """Make the spare, when the budget has room for it, a layer at a time until `busy()` says a request
        waits (the caller does this while idle; the next idle moment goes on where this one stopped)."""
        if self.spare_tokens <= 0 or (self.spare is not None and self._spare_layers == self.spare.n_layers):
            return
        if self.spare is None:
            if self.nbytes() + self._spare_bytes > self.budget_bytes:
                return
            self.spare, self._spare_layers = self.new_session(), 0
        rows = min(self.spare_tokens, self.spare.max_tokens)
        for i in range(self._spare_layers, self.spare.n_layers):
            if busy():
                return
            self.spare.prefault(rows, layers=[i])
            self._spare_layers += 1
        self._spare_bytes = session_bytes(self.spare)
        if self.nbytes() > self.budget_bytes:
            self.spare = None

    def route(self, tokens: list[int], text: str, key: str | None, tokenizer) -> Route:
        """The live session of a prompt's conversation: the longest whose tokens (or rendered text) are a whole
        prefix of the prompt, the key's on a tie (a session of another key is forked from, never taken); else none,
        and the session sharing most with it."""
        whole = [e for e in self.entries if e.session.tokens and not e.busy
                 and (key is None or e.key in (None, key)) and _is_prefix(e.session, tokens, text)]
        if whole:
            return Route(self._use(max(whole, key=lambda e: (len(e.session), key is not None and e.key == key))))
        if not self.entries:
            return Route(None)
        best = max(self.entries, key=lambda e: common_prefix(tokens, e.session.tokens))
        keyed = next((e for e in self.entries if key is not None and e.key == key), None)
        routes = [self._agreement(e, tokens, text, tokenizer) for e in {id(best): best, id(keyed): keyed}.values()
                  if e is not None]
        return max(routes, key=lambda r: (r.shared, key is not None and r.donor.key == key))

    @staticmethod
    def _agreement(e: Live, tokens: list[int], text: str, tokenizer) -> Route:
        """How much of the prompt a session that is not its prefix agrees with: by ids, then by text."""
        s = e.session
        ids = common_prefix(tokens, s.tokens)
        n, chars = tokenizer.agreeing_prefix(s.tokens, text, at_least=ids)
        if n <= ids:  # the ids say it all: the prompt's own tokens follow (all of them: a retried prompt, whose
            return Route(None, e, ids)  # logits a hybrid's mark keeps, or Prefixes.prepare prefills its last again)
        return Route(None, e, n, chars, by_text=True)

    def fork(self, donor: Live, n: int, key: str | None) -> Live:
        """A new live session holding the donor's first n tokens (fewer if its rings cannot go back that far, or
        a hybrid's latest mark before n); the donor keeps all of its own."""
        return self.add(donor.session.fork(donor.session.reach(n)), key)

    def add(self, session: Session, key: str | None = None) -> Live:
        live = Live(session, key)  # saved_at 0: its first checkpoint writes it whole (the store skips what it has)
        self.entries.append(live)
        return live

    def over_budget(self, keep: Live) -> list[Live]:
        """Least recently used sessions to drop, oldest first, until the rest fits (never `keep`, nor a busy
        one). The spare goes before any of them."""
        if self.spare is not None and self.nbytes() > self.budget_bytes:
            self.spare = None
        out, total = [], self.nbytes()
        for e in sorted(self.entries, key=lambda e: e.last_used):
            if total <= self.budget_bytes:
                break
            if e is not keep and not e.busy:
                out.append(e)
                total -= session_bytes(e.session)
        return out

    def drop(self, live: Live) -> None:
        self.entries.remove(live)

    @staticmethod
    def _use(live: Live) -> Live:
        live.last_used = time.monotonic()
        return live


def _is_prefix(session: Session, tokens: list[int], text: str) -> bool:
    """Whether the session's tokens, or its rendered text (to its first U+FFFD: matching_text), begin the
    prompt."""
    n = len(session.tokens)
    if common_prefix(tokens, session.tokens) == n:
        return True
    rendered = session.text
    return matching_text(rendered) == rendered and text.startswith(rendered)
