"""The live sessions: conversations kept in memory between requests, under a byte budget.

An agent and its sub-agents, or two users, interleave their turns. With one
live session every switch would be a checkpoint and a disk restore; here
each conversation keeps its own session while the budget allows, and the
least recently used one leaves first (checkpointed by the caller before it
goes, so it comes back from disk when its conversation returns).

A request is routed to a session by, in this order: its key (the client's
`X-Session-Id` header or `user` field), a session whose tokens (or rendered
text) are a whole prefix of the prompt, else the session sharing the longest
token prefix with it, forked at that point so that the other conversation
keeps all of its tokens; with nothing shared, a new empty session (which the
disk cache may then fill).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..session import Session, common_prefix


@dataclass
class Live:
    session: Session
    key: str | None = None  # the client's session key, when it sent one
    saved_at: int = 0  # the session's length at its last checkpoint
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class Route:
    """Where a prompt goes: a live session that holds its conversation (live), or none, with the live
    session sharing the longest token prefix with it (donor, shared tokens) to fork from."""

    live: Live | None
    donor: Live | None = None
    shared: int = 0


def session_bytes(session: Session) -> int:
    """What a session holds in memory: every layer's K and V, and their float32 mirrors."""
    return sum(layer.memory_bytes for layer in session.cache)


class LiveSessions:
    def __init__(self, budget_bytes: int, new_session: Callable[[], Session]):
        self.budget_bytes = budget_bytes
        self.new_session = new_session
        self.entries: list[Live] = []

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def latest(self) -> Live | None:
        return max(self.entries, key=lambda e: e.last_used, default=None)

    def nbytes(self) -> int:
        return sum(session_bytes(e.session) for e in self.entries)

    def route(self, tokens: list[int], text: str, key: str | None) -> Route:
        """The live session of a prompt's conversation: its key's, else the longest whose tokens (or rendered
        text) are a whole prefix of the prompt; else none, and the session sharing most with it."""
        if key is not None:
            keyed = next((e for e in self.entries if e.key == key), None)
            if keyed is not None:
                return Route(self._use(keyed))
        whole = [e for e in self.entries if (key is None or e.key is None) and e.session.tokens
                 and _is_prefix(e.session, tokens, text)]
        if whole:
            return Route(self._use(max(whole, key=lambda e: len(e.session))))
        shared = [(common_prefix(tokens, e.session.tokens), e) for e in self.entries]
        n, donor = max(shared, key=lambda x: x[0], default=(0, None))
        return Route(None, donor, min(n, len(tokens) - 1))  # at least one token to prefill, for fresh logits

    def fork(self, donor: Live, n: int, key: str | None) -> Live:
        """A new live session holding the donor's first n tokens (fewer if its rings cannot go back that far);
        the donor keeps all of its own."""
        session = donor.session.fork()
        session.cut_back(n)
        return self.add(session, key)

    def add(self, session: Session, key: str | None = None) -> Live:
        live = Live(session, key)  # saved_at 0: its first checkpoint writes it whole (the store skips what it has)
        self.entries.append(live)
        return live

    def over_budget(self, keep: Live) -> list[Live]:
        """Least recently used sessions to drop, oldest first, until the rest fits (never `keep`)."""
        out, total = [], self.nbytes()
        for e in sorted(self.entries, key=lambda e: e.last_used):
            if total <= self.budget_bytes:
                break
            if e is not keep:
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
    """Whether the session's tokens, or its rendered text, begin the prompt."""
    n = len(session.tokens)
    return common_prefix(tokens, session.tokens) == n or text.startswith(session.text)
