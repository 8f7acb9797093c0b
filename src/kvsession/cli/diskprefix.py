"""The disk KV cache as `run` and `chat` use it: prompts start from the longest prefix on disk.

ds4 keeps the KV of its system prompt in a file (sysprompt.kv) so that a new
chat starts without prefilling it. Here the store (store/) plays that part
for any prefix: before a prompt is prefilled, its longest stored prefix is
restored (a system prompt, a document read before, a server's checkpoint in
the same folder); then the rendered system prompt is checkpointed on its own
the first time it is prefilled, so the next conversation with it finds it;
and a prompt of STORE_TOKENS or more new tokens is checkpointed after its
turn (whole chunks: the part another prompt can share). A hybrid's prefill
stops at its snapshot frontiers and is checkpointed whole at each, as the
server's is (Store.snapshot_step): its recurrent states cannot be cut back,
so a later prompt that shares only part of this one restores from the last
frontier before they part and recomputes from there what this run did.

A store that fails (a folder deleted or read-only) costs the cache, never the
chat: the failure is said once and the rest of the run goes on without it
(store/soft.py, with a breaker that never retries).
"""
from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from ..session import common_prefix

if TYPE_CHECKING:
    from ..engine import Engine
    from ..session import Session
    from ..store import Store

log = logging.getLogger("kvsession.cli")

SYSTEM_MIN_TOKENS = 16  # fewer tokens prefill faster than a checkpoint is written or read
STORE_TOKENS = 512  # a turn that prefilled this many tokens is checkpointed (the server's --kv-disk-min-tokens)


@dataclass
class Start:
    """What `DiskPrefix.start` did before a prompt's own prefill."""

    rest: list[int]  # the tokens still to prefill
    restored: int = 0  # tokens read from disk
    within_system: bool = False  # the restored tokens were the system prompt (nothing past it)
    prefilled: int = 0  # tokens of the system prompt prefilled here, to checkpoint them on their own
    seconds: float = 0.0  # spent on both

    @property
    def note(self) -> str:
        if self.restored:
            what = "system prompt" if self.within_system else "prefix"
            return f"{what} restored from disk ({self.restored} tokens)"
        if self.prefilled:
            return f"system prompt saved to disk ({self.prefilled} tokens)"
        return ""


def open_store(folder: str | Path) -> "Store | None":
    """The store in `folder`, or None (said on stderr) when the folder cannot be used."""
    from ..store import Store, StoreOptions, StoreUnavailable

    try:
        return Store(folder, StoreOptions(min_tokens=1))  # a system prompt is a few dozen tokens
    except StoreUnavailable as e:
        print(f"kvsession: disk KV cache off: {e}", file=sys.stderr)
        return None


def system_tokens(engine: "Engine", messages: Sequence[dict]) -> list[int]:
    """The tokens every first turn after these messages' leading system messages begins with: the rendered
    system prompt and what the template writes before the user's text (two probe turns, compared)."""
    system = []
    for m in messages:
        if m["role"] != "system":
            break
        system.append(m)
    a = engine.chat_prompt([*system, {"role": "user", "content": "a"}]).tokens
    b = engine.chat_prompt([*system, {"role": "user", "content": "b"}]).tokens
    return a[: common_prefix(a, b)]


class DiskPrefix:
    def __init__(self, store: "Store | None"):
        from ..store.breaker import Breaker
        from ..store.soft import SoftStore

        self.store = SoftStore(store, Breaker("kvsession: the disk KV cache", "off for this run", math.inf, log))

    def start(self, session: "Session", rest: Sequence[int], system: Sequence[int] = ()) -> Start:
        """Before prefilling `rest` after what the session holds: restore the longest stored prefix of the
        whole, and checkpoint the system prompt (`system`, see system_tokens) when it is not on disk yet."""
        full = [*session.tokens, *rest]
        held = len(session)
        out = Start(list(rest))
        if not self.store.usable:
            return out
        t0 = time.perf_counter()
        hit = self.store.longest_prefix(full[:-1], session.engine, session.kv_dtype)  # >= 1 to prefill
        if hit is not None and hit.n_tokens >= held + SYSTEM_MIN_TOKENS and self.store.restore(hit, session):
            out.restored = hit.n_tokens - common_prefix(full[:held], hit.tokens)
        k = common_prefix(full, system)
        out.within_system = out.restored > 0 and len(session) <= k
        if SYSTEM_MIN_TOKENS <= k < len(full) and len(session) < k:
            out.prefilled = k - len(session)
            session.prefill(full[len(session):k])
            self.store.put(session, "cold")
        out.rest = full[len(session):]
        out.seconds = time.perf_counter() - t0
        return out

    def prefill_hooks(self, session: "Session", progress: Callable[[int, int], None] | None = None) -> dict:
        """What generate.stream takes for the prefill: for a hybrid, chunks that stop at its snapshot frontiers
        (`stops`) and a whole checkpoint at each (in `progress`, before the caller's own); else progress alone."""
        step = self.store.snapshot_step(session.engine, session.kv_dtype)
        if not step:
            return {"progress": progress}

        def at_chunk(done: int, total: int) -> None:
            if len(session) % step == 0:
                self.store.put(session, "continued")
            if progress:
                progress(done, total)

        return {"stops": step, "progress": at_chunk}

    def finish(self, session: "Session", prefilled: int) -> None:
        """After a turn that prefilled `prefilled` tokens: checkpoint a long prompt for the next one to share."""
        if prefilled >= STORE_TOKENS:
            self.store.put(session, "cold")
