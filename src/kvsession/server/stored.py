"""Stored responses of the Responses API: what `previous_response_id` and GET / DELETE /v1/responses/{id} read.

A response keeps a record: its conversation (every message, its own output
included) and the response object. Records are small JSON files in the disk
cache's folder (responses/), so a continuation survives a restart; without a
disk cache, or while that folder fails, they are kept in memory. Either way
they take at most --responses-space-mb, the oldest leaving first: an agent
makes one per turn and nothing else would ever remove them. The folder is
listed once, at the first write or delete; the sizes are kept here after
that, never a scan per request.

A record belongs to the API key that made it (a digest of the key,
app.Frontend.owner): with several --api-key values, another key can neither
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

from .. import fileformat

log = logging.getLogger("kvsession.server")
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")


class StoredResponses:
    def __init__(self, folder: Path | None, budget_bytes: int):
        self.folder = folder
        self.budget = budget_bytes
        self.memory: dict[str, bytes] = {}  # the records not on disk, as JSON
        self.sizes: OrderedDict[str, int] | None = None  # every record's bytes, oldest first; None: not listed yet
        self.total = 0
        self.lock = threading.Lock()

    def put(self, rid: str, record: dict, owner: str | None) -> None:
        data = json.dumps({**record, "owner": owner}).encode()
        if len(data) > self.budget:
            log.warning("response %s not stored: its record has %d bytes, more than --responses-space-mb", rid,
                        len(data))
            return
        with self.lock:
            self._list()
            if not self._write(rid, data):
                self.memory[rid] = data
            self.sizes[rid] = len(data)
            self.total += len(data)
            self._prune()

    def get(self, rid: str, owner: str | None) -> dict | None:
        """The record of `rid` if `owner` made it, else None (also for a damaged or vanished file)."""
        if not RESPONSE_ID.fullmatch(rid):
            return None
        with self.lock:
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
                or record.get("owner") != owner:
            return None
        return record

    def delete(self, rid: str, owner: str | None) -> bool:
        """Remove the record of `rid` if `owner` made it; False if there is none."""
        if self.get(rid, owner) is None:
            return False
        with self.lock:
            self._list()
            self._remove(rid)
        return True

    # --- under the lock ---

    def _write(self, rid: str, data: bytes) -> bool:
        if self.folder is None:
            return False
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fileformat.atomic_write(self.folder / f"{rid}.json", lambda f: f.write(data), durable=False)
            return True
        except OSError as e:  # the folder failing costs the continuation after a restart only
            log.warning("cannot store response %s on disk, keeping it in memory: %s", rid, e)
            return False

    def _list(self) -> None:
        """The folder's records, oldest first, once; pruned at once if an earlier run left more than the budget."""
        if self.sizes is not None:
            return
        self.sizes = OrderedDict()
        for _, rid, size in sorted(self._files()):
            self.sizes[rid] = size
            self.total += size
        self._prune()

    def _files(self) -> list[tuple[float, str, int]]:
        """(mtime, id, bytes) of the records in the folder."""
        found = []
        if self.folder is None:
            return found
        try:
            with os.scandir(self.folder) as entries:
                for e in entries:
                    rid = e.name.removesuffix(".json")
                    if e.name.endswith(".json") and RESPONSE_ID.fullmatch(rid) and e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        found.append((st.st_mtime, rid, st.st_size))
        except OSError:  # no folder yet
            pass
        return found

    def _prune(self) -> None:
        while self.total > self.budget and self.sizes:
            self._remove(next(iter(self.sizes)))

    def _remove(self, rid: str) -> None:
        self.total -= self.sizes.pop(rid, 0)
        if self.memory.pop(rid, None) is not None or self.folder is None:
            return
        try:
            (self.folder / f"{rid}.json").unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot remove stored response %s: %s", rid, e)
