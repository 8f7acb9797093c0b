"""The disk KV cache for callers it must never fail: a failing folder costs them the cache, not the call.

The server and the CLI's run and chat use the store as an optimisation: a
folder that is full, read-only, deleted or replaced by a file must not fail
a request or a prompt. SoftStore is that use, written once: each call goes
to the Store unless its Breaker has it off (breaker.py: the first failure
logged once, the store skipped for `retry_seconds`, then tried again; the
CLI passes an infinite retry: off for the rest of the run), and a failure of
the folder (StoreUnavailable, an OSError) trips the breaker and gives the
call's fallback: no hit, no restore, no checkpoint. A checkpoint written by
the store's thread reports its failure the same way when it ends. A breaker
a write opened is closed by a write that works, not by a lookup: a full disk
still reads, and a lookup closing it made the breaker flap (two log lines
every retry while the disk stayed full). Bad arguments and bugs still raise.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

from .breaker import Breaker
from .layout import Entry, Hit
from .local import StoreUnavailable
from .store import Store

if TYPE_CHECKING:
    from ..engine import Engine
    from ..session import Session

T = TypeVar("T")


class SoftStore:
    """A Store (or none) behind a Breaker; every method gives its fallback while the store is off."""

    def __init__(self, store: Store | None, breaker: Breaker):
        self.store = store
        self.health = breaker
        self._write_failed = False  # whether the last failure was a write's

    @property
    def usable(self) -> bool:
        return self.store is not None and self.health.usable()

    def _guard(self, call: Callable[[Store], T], fallback: T, *, write: bool = False, proves: bool = True) -> T:
        """call(store), or the fallback while the store is off or when the call fails. proves: whether the
        call working shows the store works (checkpoint_async has only copied: its write proves it later)."""
        if not self.usable:
            return fallback
        try:
            result = call(self.store)
        except (StoreUnavailable, OSError) as e:
            self._failed(e, write=write)
            return fallback
        if proves and (write or not self._write_failed):
            self._worked()
        return result

    def _failed(self, e: BaseException, *, write: bool) -> None:
        self._write_failed = self._write_failed or write
        self.health.failed(e)

    def _worked(self) -> None:
        self._write_failed = False
        self.health.ok()

    def put(self, session: "Session", reason: str, *, protect: Hit | None = None,
            n_tokens: int | None = None) -> Entry | None:
        return self._guard(lambda s: s.put(session, reason, protect=protect, n_tokens=n_tokens), None, write=True)

    def checkpoint_async(self, session: "Session", reason: str, *, n_tokens: int | None = None) -> Future | None:
        """Store.checkpoint_async, whose end on the writer thread opens or closes the breaker; None while off."""
        future = self._guard(lambda s: s.checkpoint_async(session, reason, n_tokens=n_tokens), None, write=True,
                             proves=False)
        if future is not None:
            future.add_done_callback(self._written)
        return future

    def _written(self, future: Future) -> None:
        e = future.exception()
        if e is not None:
            self._failed(e, write=True)
        elif future.result() is not None:  # None: nothing was written, which proves nothing
            self._worked()

    def snapshot_step(self, engine: "Engine", kv_dtype: str) -> int:
        """Store.snapshot_step: a hybrid's prefill frontiers, 0 for other models or while the store is off."""
        return self._guard(lambda s: s.snapshot_step(engine, kv_dtype), 0, proves=False)

    def restore(self, hit: Hit, session: "Session") -> bool:
        return self._guard(lambda s: s.restore(hit, session), False)

    def longest_prefix(self, tokens: Sequence[int], engine: "Engine", kv_dtype: str) -> Hit | None:
        return self._guard(lambda s: s.longest_prefix(tokens, engine, kv_dtype), None)

    def longest_text_prefix(self, text: str, engine: "Engine", kv_dtype: str) -> tuple[Hit, str] | None:
        return self._guard(lambda s: s.longest_text_prefix(text, engine, kv_dtype), None)
