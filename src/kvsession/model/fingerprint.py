"""A model's fingerprint: what a KV cache row depends on, carried by every session file and checkpoint.

The fingerprint (architecture, every KV-shaping hyperparameter, a digest of
the weights) is what files carry to refuse the wrong model. Hashing a large
file costs a full read, so the digest is cached per file, keyed by path,
size, inode and modification time (cache_dir()/digests).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fingerprint:
    """What a KV cache row depends on: the KV shape and the exact weights."""

    kv_shape: dict  # ModelConfig.kv_shape()
    weights: str  # xxh3-128 hex digest of the tensor infos and tensor data

    @cached_property
    def digest(self) -> str:
        blob = json.dumps({"kv_shape": self.kv_shape, "weights": self.weights}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def to_dict(self) -> dict:
        return {"kv_shape": self.kv_shape, "weights": self.weights}






def cache_dir() -> Path:
    root = os.environ.get("KVSESSION_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvsession"
    )
    return Path(root)


_digests: dict[tuple, str] = {}


def cached_digest(path: Path, compute: Callable[[], str]) -> str:
    """compute() (a file's weights digest), remembered by path, size, inode and modification time, in this
    process and in cache_dir()/digests."""
    st = path.stat()
    real = os.path.realpath(path)
    key = (real, st.st_size, st.st_ino, st.st_mtime_ns)
    if key in _digests:
        return _digests[key]
    entry = cache_dir() / "digests" / (hashlib.sha256(real.encode()).hexdigest()[:24] + ".json")
    try:
        stored = json.loads(entry.read_text())
        if tuple(stored["key"]) == key:
            _digests[key] = stored["digest"]
            return stored["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = compute()
    _digests[key] = digest
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": list(key), "digest": digest}))
        os.replace(tmp, entry)
    except OSError as e:  # a read-only home only costs a re-hash next time
        log.debug("cannot cache weights digest in %s: %s", entry, e)
    return digest
