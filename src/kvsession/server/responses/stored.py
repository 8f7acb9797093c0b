"""Stored responses of the Responses API: what `previous_response_id` and GET / DELETE /v1/responses/{id} read.

A response keeps a record: its conversation (every message, its own output
included) and the response object. Records are small JSON files in the disk
cache's folder (responses/), so a continuation survives a restart; without a
disk cache, or while that folder fails, they are kept in memory. Either way
they take at most --responses-space-mb, the oldest leaving first: an agent
makes one per turn and nothing else would ever remove them. The folder is
listed once, at the first write or delete; the sizes and links are kept here
after that, never a scan per request.

A continuation (a response made with previous_response_id) stores a link to
its parent's record and only the messages after the parent's: an agent's
chain of N turns costs what its messages weigh once, not N times over (the
whole history again at every turn made the folder grow with N squared). Its
conversation is read back by following the links. Messages cannot be rebuilt
from the KV store's tokens, so the link is to the parent's record, not to a
manifest of the KV store. A record that leaves (pruned or deleted) first
hands its messages down to the records linked to it, so no continuation ever
loses its history because an older turn left.

A record belongs to the API key that made it (a digest of the key,
guard.owner): with several --api-key values, another key can neither
read, continue nor delete it; to that key it is not there (404).
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path

from ...files import framing

log = logging.getLogger("kvsession.server")
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
# a record's JSON opens with its link, so listing the folder reads a few bytes a file, not the records
_PARENT = re.compile(rb'\A\{"parent": (?:null|"(resp_[0-9a-f]{32})")')
_HEAD_BYTES = 64


class StoredResponses:
    def __init__(self, folder: Path | None, budget_bytes: int):
        self.folder = folder
        self.budget = budget_bytes
        self.memory: dict[str, bytes] = {}  # the records not on disk, as JSON
        self.sizes: OrderedDict[str, int] | None = None  # every record's bytes, oldest first; None: not listed yet
        self.parents: dict[str, str] = {}  # record -> the record it continues
        self.children: dict[str, set[str]] = {}  # record -> the records that continue it
        self.total = 0
        self.lock = threading.Lock()
        if folder is not None:
            for path in framing.remove_dead_temporaries(folder):
                log.info("removed %s, left by a write that was killed", path)

    def put(self, rid: str, record: dict, owner: str | None, parent: str | None = None) -> None:
        """Store `record` ({"messages": [...], "response": {...}}) as `rid`. parent: the response it continues,
        whose messages open this one's; only the messages after them are written."""
        messages = record["messages"]
        with self.lock:
            self._list()
            inherited = self._conversation(parent, owner) if parent is not None and parent in self.sizes else None
            if inherited is None or messages[:len(inherited)] != inherited:
                parent, inherited = None, []
            data = _encode(parent, messages[len(inherited):], record["response"], owner)
            chain = len(data) + self._chain_bytes(parent)
            if chain > self.budget:  # pruning could never make room for it without cutting its history
                log.warning("response %s not stored: its conversation has %d bytes, more than "
                            "--responses-space-mb", rid, chain)
                return
            self._store(rid, data, parent)
            self._prune()

    def get(self, rid: str, owner: str | None) -> dict | None:
        """The record of `rid`, its whole conversation, if `owner` made it; else None (also where a file is
        damaged or gone)."""
        if not RESPONSE_ID.fullmatch(rid):
            return None
        with self.lock:
            own = self._read(rid, owner)
            if own is None:
                return None
            messages = self._conversation(rid, owner, own)
        return None if messages is None else {"messages": messages, "response": own["response"]}

    def delete(self, rid: str, owner: str | None) -> bool:
        """Remove the record of `rid` if `owner` made it; False if there is none. Its continuations keep their
        history."""
        if not RESPONSE_ID.fullmatch(rid):
            return False
        with self.lock:
            self._list()
            if rid not in self.sizes or self._read(rid, owner) is None:
                return False
            self._remove(rid)
        return True

    # --- under the lock ---

    def _read(self, rid: str, owner: str | None) -> dict | None:
        """The record as stored (its own messages only) if `owner` made it, or None."""
        record = self._load(rid)
        return record if record is not None and record.get("owner") == owner else None

    def _load(self, rid: str) -> dict | None:
        """The record as stored, whoever made it; None for one gone or damaged."""
        data = self.memory.get(rid)
        if data is None and self.folder is not None:
            try:
                with open(self.folder / f"{rid}.json", "rb") as f:
                    data = f.read(self.budget + 1)
            except OSError:
                return None
        try:
            record = json.loads(data) if data is not None else None
        except (ValueError, RecursionError):
            return None
        if not isinstance(record, dict) or not isinstance(record.get("messages"), list) \
                or not isinstance(record.get("parent"), (str, type(None))):
            return None
        return record

    def _conversation(self, rid: str, owner: str | None, record: dict | None = None) -> list[dict] | None:
        """Every message of `rid`'s conversation, its parents' first; None where a link is broken."""
        parts = []
        seen = set()
        while rid is not None:
            if rid in seen:  # a loop only a hand-edited folder could make
                return None
            seen.add(rid)
            record = record if record is not None else self._read(rid, owner)
            if record is None:
                return None
            parts.append(record["messages"])
            rid, record = record.get("parent"), None
        return [m for part in reversed(parts) for m in part]

    def _store(self, rid: str, data: bytes, parent: str | None) -> None:
        """Write a record; one rewritten (handed its parent's messages) keeps its place in the order of age."""
        rewritten = rid in self.sizes
        if not self._write(rid, data, keep_age=rewritten):
            self.memory[rid] = data
        else:
            self.memory.pop(rid, None)
        self.total += len(data) - self.sizes.get(rid, 0)
        self.sizes[rid] = len(data)  # a key already there keeps its position
        self._link(rid, parent)

    def _link(self, rid: str, parent: str | None) -> None:
        old = self.parents.pop(rid, None)
        if old is not None:
            self.children.get(old, set()).discard(rid)
        if parent is not None:
            self.parents[rid] = parent
            self.children.setdefault(parent, set()).add(rid)

    def _write(self, rid: str, data: bytes, keep_age: bool = False) -> bool:
        """Write the record's file. keep_age: the file keeps its modification time, the age the folder's listing
        orders records by after a restart."""
        if self.folder is None:
            return False
        path = self.folder / f"{rid}.json"
        try:
            framing.private_folder(self.folder)  # under the cache's folder, and as private
            age = path.stat().st_mtime_ns if keep_age and path.exists() else None
            framing.atomic_write(path, lambda f: f.write(data), durable=False)
            if age is not None:
                os.utime(path, ns=(age, age))
            return True
        except OSError as e:  # the folder failing costs the continuation after a restart only
            log.warning("cannot store response %s on disk, keeping it in memory: %s", rid, e)
            return False

    def _list(self) -> None:
        """The folder's records, oldest first, and their links, once; pruned at once if an earlier run left more
        than the budget."""
        if self.sizes is not None:
            return
        self.sizes = OrderedDict()
        for _, rid, size, parent in sorted(self._files()):
            self.sizes[rid] = size
            self.total += size
            self._link(rid, parent)
        self._prune()

    def _chain_bytes(self, rid: str | None) -> int:
        """The bytes of `rid`'s record and its parents': what keeping its conversation takes (0 for None)."""
        total, seen = 0, set()
        while rid in self.sizes and rid not in seen:
            seen.add(rid)
            total += self.sizes[rid]
            rid = self.parents.get(rid)
        return total

    def _files(self) -> list[tuple[float, str, int, str | None]]:
        """(mtime, id, bytes, parent) of the records in the folder."""
        found = []
        if self.folder is None:
            return found
        try:
            with os.scandir(self.folder) as entries:
                for e in entries:
                    rid = e.name.removesuffix(".json")
                    if e.name.endswith(".json") and RESPONSE_ID.fullmatch(rid) and e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        found.append((st.st_mtime, rid, st.st_size, self._head_parent(Path(e.path))))
        except OSError:  # no folder yet
            pass
        return found

    @staticmethod
    def _head_parent(path: Path) -> str | None:
        try:
            with open(path, "rb") as f:
                m = _PARENT.match(f.read(_HEAD_BYTES))
        except OSError:
            return None
        return m.group(1).decode() if m and m.group(1) else None

    def _prune(self) -> None:
        while self.total > self.budget and self.sizes:
            self._remove(next(iter(self.sizes)))

    def _remove(self, rid: str) -> None:
        """Drop `rid`, first handing its messages down to the records that continue it (a child whose record
        cannot be rewritten loses its history: it reads as not there)."""
        heirs = self.children.pop(rid, set())
        if heirs:
            own = self._load(rid)
            for child in heirs:
                record = self._load(child)
                if own is None or record is None:
                    continue
                data = _encode(own.get("parent"), own["messages"] + record["messages"], record["response"],
                               record.get("owner"))
                self._store(child, data, own.get("parent"))
        self._link(rid, None)
        self.total -= self.sizes.pop(rid, 0)
        if self.memory.pop(rid, None) is not None or self.folder is None:
            return
        try:
            (self.folder / f"{rid}.json").unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot remove stored response %s: %s", rid, e)


def _encode(parent: str | None, messages: list[dict], response: dict, owner: str | None) -> bytes:
    """A record's JSON, its link first (what _PARENT reads when the folder is listed)."""
    return json.dumps({"parent": parent, "messages": messages, "response": response, "owner": owner}).encode()
