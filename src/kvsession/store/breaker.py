"""A circuit breaker: a part that fails is skipped for a while, then tried again.

A cache that fails must cost its users the cache, never their requests. The
disk KV cache as the server sees it (a folder that is full, read-only or
deleted) and the store's shared Valkey tier (refused, timing out) both sit
behind a Breaker: the first failure is logged once, as an error, and the
part is skipped -- its callers serve without it -- until `retry_seconds` have
passed; then calls go through again, and the first one that works closes the
breaker, logged as a warning. A failure while open only pushes the next try
back. Callers ask `usable()` before a call and report `failed(error)` or
`ok()` after it; `reason` says why the part is skipped (a health check shows
it), None while it works; `last_error` the latest failure, kept after the
part works again (a health check shows a flapping part by it).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable


class Breaker:
    """Whether a part may be called now, and why not (see the module's docstring).

    name: the part, as the log says it ("the disk KV cache"); fallback: what its callers do meanwhile
    ("serving without it"); describe: an error as `reason` says it.
    """

    def __init__(self, name: str, fallback: str, retry_seconds: float, log: logging.Logger, *,
                 describe: Callable[[BaseException], str] = str):
        self.name = name
        self.fallback = fallback
        self.retry_seconds = retry_seconds
        self.log = log
        self.describe = describe
        self.reason: str | None = None
        self.last_error: str | None = None
        self.retry_at = 0.0  # time.monotonic() after which a call is tried again
        self._lock = threading.Lock()  # several threads report (a lookup, a background write): one log line

    def usable(self) -> bool:
        return self.reason is None or time.monotonic() >= self.retry_at

    def failed(self, error: BaseException) -> None:
        with self._lock:
            if self.reason is None:
                self.log.error("%s is unusable, %s: %s", self.name, self.fallback, error)
            self.reason = self.last_error = self.describe(error)
            self.retry_at = time.monotonic() + self.retry_seconds

    def ok(self) -> None:
        with self._lock:
            if self.reason is not None:
                self.log.warning("%s works again", self.name)
            self.reason = None
