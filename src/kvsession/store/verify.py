"""The whole folder checked: every chunk's and manifest's checksums and references; what fails them removed.

A lookup serves a checkpoint through its manifest and the chunks it names,
and a restore checks each file as it reads it: damage found then costs a
miss. `kvsession cache verify` (and the crash test after every kill) reads
everything now, under the folder's lock, and removes what no lookup should
find:

    damaged    a manifest or chunk whose framing, fields or any section's
               checksum fail, or whose content is not what its name says:
               a manifest whose chunk keys are not its tokens' chain, or
               whose key or chain root are not its own; a chunk whose
               tokens are not the ones its manifest names it for
    dangling   a manifest naming a chunk that is missing or damaged, or one
               whose size or ring flag it misstates
    orphan     a chunk, or a statistics file, that no kept checkpoint names
    temporary  a file a killed writer left half-written

Nothing sound is removed: a chunk goes only when its own checks fail or no
checkpoint is left to name it (no lookup can reach it then); a manifest
only when it or a chunk it needs fails. What opening the folder already
removed (temporaries, manifests whose header fails, orphans) is reported
with the rest (local.py's removed_at_open).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import CorruptSession, SessionNotFound
from ..files import framing
from ..model.fingerprint import Fingerprint
from .layout import STATS_SUFFIX, chain, chain_root, check_chunk, check_manifest, manifest_key
from .local import Damaged, Removal
from .tier import CHUNK, MANIFEST

if TYPE_CHECKING:
    from .local import FolderTier


def check_folder(folder: "FolderTier") -> list[Removal]:
    """Check every checkpoint and chunk of the folder (see the module's docstring); returns what was removed."""
    removed: list[Removal] = []
    with folder.writing(), folder.mutex:
        removed += folder.clean_temporaries()
        removed += folder.sync(force=True)
        chunks: dict[str, tuple[str | None, int, bool]] = {}  # key -> (what is wrong, bytes, ring): each read once
        for key in sorted(folder.entries):
            fields, problem = _manifest(folder, key)
            kind = "damaged"
            if problem is None:
                kind, problem = "dangling", _chunks_problem(folder, key, fields, chunks)
            if problem is None:
                continue
            removed.append(Removal(folder.path(MANIFEST, key), kind, problem))
            removed += [Removal(p, "orphan", f"named only by {key[:12]}, removed") for p in folder.delete(key)
                        if chunks.get(p.name[: -len(p.suffix)], (None,))[0] is None]
        for chunk, (why, _, _) in sorted(chunks.items()):
            if why is not None:
                folder.path(CHUNK, chunk).unlink(missing_ok=True)
                if why != MISSING:
                    removed.append(Removal(folder.path(CHUNK, chunk), "damaged", why))
        removed += folder.remove_orphan_chunks()
        for e in os.scandir(folder.stats_dir):  # a writer killed between a manifest's removal and its statistics'
            key = e.name[: -len(STATS_SUFFIX)]
            if e.name.endswith(STATS_SUFFIX) and key not in folder.entries and not e.is_dir(follow_symlinks=False):
                Path(e.path).unlink(missing_ok=True)
                removed.append(Removal(Path(e.path), "orphan", "statistics of no checkpoint"))
        folder.mark_synced()
    return removed


MISSING = "missing"


def _manifest(folder: "FolderTier", key: str) -> tuple[dict, str | None]:
    """A manifest's header fields, and what is wrong with it on its own in words (None: nothing): framing,
    fields, every checksum, its key and its chain."""
    path = folder.path(MANIFEST, key)
    c = folder.options.chunk_tokens
    try:
        with folder.reading(MANIFEST, key), framing.open_regular(path) as f:
            h = framing.read_header(f, str(path))
            check_manifest(h, key, c, str(path))
            for s in h.sections:
                framing.verify_section(f, h, s.name, where=str(path))
            tokens = np.frombuffer(framing.read_section(f, h, "tokens", where=str(path)), dtype="<i4").tolist()
    except Damaged as damaged:
        return {}, str(damaged.error)
    d = h.fields
    digest = Fingerprint(d["fingerprint"]["kv_shape"], d["fingerprint"]["weights"]).digest
    root = chain_root(digest, d["kv_dtype"], c, d.get("row_format", "exact"))
    if d["root"] != root:
        return d, f"chain root {d['root']} is not its model's and format's ({root})"
    if chain(root, tokens, c)[: len(d["chunks"])] != d["chunks"]:
        return d, "its chunk keys are not the chain of its tokens"
    base = d["chunks"][-1] if d["chunks"] else root
    if manifest_key(base, tokens[len(d["chunks"]) * c :]) != key:
        return d, "its key is not its tail's"
    return d, None


def _chunks_problem(folder: "FolderTier", key: str, manifest: dict,
                    chunks: dict[str, tuple[str | None, int, bool]]) -> str | None:
    """Whether every chunk a sound manifest names is there and sound, as the manifest describes it (its size
    and ring flag), in words, or None. Each chunk's own check lands in `chunks`."""
    c = folder.options.chunk_tokens
    tokens = folder.entries[key].tokens
    for j, (chunk, nbytes, ring) in enumerate(zip(manifest["chunks"], manifest["chunk_bytes"], manifest["chunk_ring"])):
        if chunk not in chunks:
            chunks[chunk] = _chunk(folder, chunk, j, manifest, tokens[j * c : (j + 1) * c])
        why, size, its_ring = chunks[chunk]
        if why is not None:
            return f"chunk {j} ({chunk[:12]}) is {MISSING if why == MISSING else 'damaged'}"
        if (size, its_ring) != (nbytes, ring):
            return f"chunk {j} ({chunk[:12]}) holds {size} bytes, ring {its_ring}; the manifest says {nbytes}, {ring}"
    return None


def _chunk(folder: "FolderTier", key: str, j: int, manifest: dict,
           tokens: np.ndarray) -> tuple[str | None, int, bool]:
    """Chunk j of a manifest's chain: what is wrong with it in words (MISSING when it is not there; None:
    nothing), its size and its ring flag."""
    path = folder.path(CHUNK, key)
    c = folder.options.chunk_tokens
    try:
        with folder.reading(CHUNK, key), framing.open_regular(path) as f:
            h = framing.read_header(f, str(path))
            layers = [(x["index"], x["kind"] == "sliding") for x in manifest["layers"]]
            check_chunk(h, key, j, c, manifest["kv_dtype"], manifest["row_shape"], layers, str(path))
            if h.fields.get("row_format", "exact") != manifest.get("row_format", "exact"):
                raise CorruptSession(f"{path}: rows in {h.fields.get('row_format', 'exact')}, its manifest's in "
                                     f"{manifest.get('row_format', 'exact')}")
            for s in h.sections:
                framing.verify_section(f, h, s.name, where=str(path))
            held = np.frombuffer(framing.read_section(f, h, "tokens", where=str(path)), dtype="<i4")
            size = os.fstat(f.fileno()).st_size
    except Damaged as damaged:
        return (MISSING if isinstance(damaged.error, SessionNotFound) else str(damaged.error)), 0, False
    if not np.array_equal(held, tokens):
        return f"{path}: its tokens are not the ones its key names", size, h.fields["ring"]
    return None, size, h.fields["ring"]
