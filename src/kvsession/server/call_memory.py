"""The memory of sampled tool-call turns.

ToolCallMemory keeps, per tool-call id, the exact text the model sampled for
the assistant turn that made the call, when it wrote the calls in the
format's tags (Frontend.remember). Agent clients send the calls back as
structured tool_calls; rendered by the template they become
`<tool_call>\\n{...}\\n</tool_call>`, which is not what this model wrote (a
fence, a bare object, other spacing), so the prompt would stop matching the
live session at that turn and everything after it would be prefilled again.
Substituting the sampled text keeps the rendered prompt byte-identical to
the session (ds4 keeps the same map): checked with Qwen's template, the turn
renders as `<|im_start|>assistant\\n` + raw + `<|im_end|>\\n` after the
prompt, and the session's tokens are a prefix of the new prompt's. It cannot
be identical where raw is not the session's text: a reply cut by a stop
string (the session holds the whole last token), control tokens the model
sampled but the text stream skipped (raw should be decode(tokens) with
special tokens kept; they then come back as guarded text, so only the text
prefix matches), and templates that rewrite an assistant's content (Gemma's
`| trim` drops the edges' whitespace). Tokens can also differ from a fresh
tokenization of raw when the model sampled an uncommon split; the text
prefix still matches.
"""
from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

from ..files import framing
from .reply_events import ToolCall


class ToolCallMemory:
    """Tool-call id -> the exact text the model sampled for the assistant turn that made the call.

    remember() after a reply with calls; substitute() before rendering a request: an assistant message whose
    tool_calls ids are all known, sampled together in that order, becomes {"role": "assistant", "content": raw}
    and renders as the session holds it. With a path, entries are appended to a JSON-lines file and reloaded
    at start; the file is rewritten without its oldest entries (and any torn last line) when opened and when
    it has grown to twice the capacity. Thread-safe: the worker writes while request threads read.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, capacity: int = 10_000):
        self.capacity = capacity
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._turns: OrderedDict[tuple[str, ...], dict] = OrderedDict()  # ids -> {"raw", "calls"}, oldest first
        self._by_id: dict[str, tuple[str, ...]] = {}
        self._ids = 0  # ids held
        self._lines = 0  # lines in the file
        if self.path is not None:
            self._load()

    def remember(self, ids: Sequence[str], raw_text: str, calls: Sequence[ToolCall] | None = None) -> None:
        """The turn that made the calls `ids` was sampled as `raw_text`. With `calls` (what was parsed from it),
        substitute() also checks that a client sent those calls back unchanged."""
        ids = tuple(ids)
        if not ids:
            return
        entry = {"raw": raw_text, "calls": [[c.name, json.loads(c.arguments)] for c in calls] if calls else None}
        with self._lock:
            self._put(ids, entry)
            if self.path is not None:
                with open(self.path, "a", encoding="utf-8", opener=framing.private_opener) as f:
                    f.write(json.dumps({"ids": list(ids), **entry}, ensure_ascii=False) + "\n")
                self._lines += 1
                if self._lines > 2 * self.capacity:
                    self._rewrite()

    def raw(self, call_id: str) -> str | None:
        with self._lock:
            ids = self._by_id.get(call_id)
            return self._turns[ids]["raw"] if ids is not None else None

    def substitute(self, messages: Sequence[dict]) -> list[dict]:
        """`messages` with each assistant tool-call turn the memory holds replaced by its sampled text."""
        out = []
        with self._lock:
            for m in messages:
                out.append(self._substituted(m) if m.get("role") == "assistant" and m.get("tool_calls") else m)
        return out

    def __len__(self) -> int:
        with self._lock:
            return self._ids

    def _substituted(self, m: dict) -> dict:
        calls = m["tool_calls"]
        ids = tuple(c.get("id") for c in calls if isinstance(c, dict))
        entry = self._turns.get(ids) if len(ids) == len(calls) else None
        if entry is None:
            return m
        if entry["calls"] is not None:
            try:
                sent = [[c["function"]["name"], _arguments(c["function"].get("arguments", {}))] for c in calls]
            except (KeyError, TypeError, json.JSONDecodeError):
                return m
            if sent != entry["calls"]:
                return m
        return {"role": "assistant", "content": entry["raw"]}

    def _put(self, ids: tuple[str, ...], entry: dict) -> None:
        for i in ids:  # an id seen again (it should not be) belongs to its newest turn
            old = self._by_id.pop(i, None)
            if old is not None and old in self._turns:
                self._drop(old)
        self._turns[ids] = entry
        for i in ids:
            self._by_id[i] = ids
        self._ids += len(ids)
        while self._ids > self.capacity and len(self._turns) > 1:
            self._drop(next(iter(self._turns)))

    def _drop(self, ids: tuple[str, ...]) -> None:
        del self._turns[ids]
        for i in ids:
            if self._by_id.get(i) == ids:
                del self._by_id[i]
        self._ids -= len(ids)

    def _load(self) -> None:
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                lines = f.read().split("\n")
        except FileNotFoundError:
            lines = []
        for line in lines:
            try:
                rec = json.loads(line)
                ids, entry = tuple(rec["ids"]), {"raw": rec["raw"], "calls": rec.get("calls")}
                if not ids or not all(isinstance(i, str) for i in ids) or not isinstance(entry["raw"], str):
                    continue
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a torn last line, or a damaged one: that entry is lost, the rest are not
            self._put(ids, entry)
        self._rewrite()

    def _rewrite(self) -> None:
        framing.private_folder(self.path.parent)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8", opener=framing.private_opener) as f:
            for ids, entry in self._turns.items():
                f.write(json.dumps({"ids": list(ids), **entry}, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._lines = len(self._turns)


def _arguments(args) -> object:
    return json.loads(args) if isinstance(args, str) else args
