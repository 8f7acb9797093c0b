"""The store: the calls the server and the CLI make of the disk KV cache, over its tiers.

The store finds, for a query, the longest prefix kept (a whole checkpoint or
a chunk boundary of one), restores it into a session, and checkpoints
sessions as they grow, within a byte budget. It is assembled from parts,
each holding explicit references to what it needs:

    local       the folder tier (local.py): files, lock, index, budget
    shared      a shared tier (valkey.py), optionally, with _tiering between
                the two (tiering.py): write-through, reads on a local miss
    _files      what a snapshot becomes on disk (checkpoint_files.py)
    _restorer   a hit read back and checked (restore.py)
    _writer     the thread that commits snapshots (checkpoint.py)

What stays here is the policy of each call: how much of a session a
checkpoint keeps, which prefix a query gets, what a damaged entry costs, and
the recovery of a folder that failed.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import time
from concurrent.futures import Future
from contextlib import suppress
from typing import TYPE_CHECKING, Sequence

from ..errors import SessionNotFound
from ..kv.cache import KV_DTYPES
from ..kv.recurrent import sequence_state_bytes
from ..kv.rows import encoded_row_bytes
from ..kv.state import SessionState
from ..model.fingerprint import Fingerprint
from ..session import common_prefix
from ..text.tokenizer import matching_text
from . import checkpoint, policy, verify
from .checkpoint_files import CheckpointFiles
from .layout import REASONS, Entry, Hit, chain, chain_root
from .local import Damaged, FolderTier, Removal, StoreError, StoreUnavailable
from .policy import Protected, StoreOptions
from .restore import Restorer
from .tier import FileKey, RemoteTier
from .tiering import Tiering

if TYPE_CHECKING:
    from ..engine import Engine
    from ..session import Session

log = logging.getLogger("kvsession.store")


def _available(method):
    """A public call of Store: it reopens the folder first when the last call found it unusable, and
    turns a failure of the folder itself (any OSError that is not one entry's damage) into StoreUnavailable."""

    @functools.wraps(method)
    def call(self: "Store", *args, **kwargs):
        try:
            if self._broken:
                self._open()
            return method(self, *args, **kwargs)
        except OSError as e:
            self._broken = True
            raise self.local.unavailable(e) from e
        except StoreUnavailable:
            self._broken = True
            raise

    return call


def _is_whole(hit: Hit) -> bool:
    return hit.entry is not None and hit.entry.n_tokens == hit.n_tokens


class Store:
    """A disk KV cache in a folder, optionally backed by a shared tier (Valkey).

    Failures. StoreUnavailable means the folder itself cannot be used; it is
    raised by the constructor and by every public method (lookups, restore,
    put, ls, get, delete, gc, clear, verify, verify_all, find_damage), and nothing stored
    is removed by it. Every one of them is safe to call again later: the
    first call after a failure reopens the folder -- creates it when it is
    missing, with its subfolders when none of chunks/ and manifests/ is
    there (stats/ always), re-reads the index -- and raises again, saying
    why, until the folder is usable. A failed put leaves no partial
    checkpoint; a failed restore leaves the session as it was; a retried
    delete of a checkpoint that is gone is StoreError("no checkpoint").
    One of chunks/ and manifests/ missing without the other is never made
    again empty: that would make every checkpoint look damaged, or every
    chunk an orphan, and lose them once the folder came back. A Store that
    cannot be constructed is retried by constructing it again. The shared
    tier never raises: while it fails, the store works from its folder alone.
    """

    def __init__(self, folder: str | os.PathLike, options: StoreOptions = StoreOptions(), *,
                 shared: RemoteTier | None = None):
        self.local = FolderTier(folder, options)
        self.dir = self.local.dir
        self._files = CheckpointFiles(self.local)
        self._restorer = Restorer(self.local)
        self._writer = checkpoint.Writer(lambda snap: self._commit(snap))
        self.local.pinned = self._writer.relied_keys
        self._broken = True  # the folder must be opened before use
        if shared is None and options.shared_url:
            from .valkey import ValkeyTier

            shared = ValkeyTier.from_options(options)
        self.shared = shared
        self._tiering = Tiering(self.local, shared) if shared is not None else None
        self.written = 0  # checkpoints this store wrote, and the bytes they added to the folder (/metrics)
        self.written_bytes = 0
        try:
            self._open()
        except OSError as e:
            raise self.local.unavailable(e) from e
        self._writer.start()

    def _open(self) -> None:
        self.local.open()
        self._broken = False

    @property
    def options(self) -> StoreOptions:
        """The options asked for, with the chunk size the folder was made with."""
        return self.local.options

    @property
    def entries(self) -> dict[str, Entry]:
        """The checkpoints in the folder's index, by key."""
        return self.local.entries

    def root(self, engine: "Engine", kv_dtype: str = "f16") -> str:
        """The chain root this store's checkpoints of `engine` with `kv_dtype` rows hang from."""
        return chain_root(engine.fingerprint.digest, kv_dtype, self.options.chunk_tokens, self.options.row_format)

    # --- sizes, value and policy ---------------------------------------------------------

    def total_bytes(self) -> int:
        return self.local.total_bytes()

    def exclusive_bytes(self, entry: Entry) -> int:
        """What deleting this checkpoint frees: its manifest and the chunks no other checkpoint names."""
        return policy.exclusive_bytes(entry, self.local.chunks)

    def decayed_hits(self, entry: Entry, now: float | None = None) -> float:
        return policy.decayed_hits(self.options, entry, now)

    def value(self, entry: Entry, now: float | None = None) -> float:
        """Eviction score: hits (decayed) plus one; lowest goes first, ties to the least recently used."""
        return policy.value(self.options, entry, now)

    def snapshot_step(self, engine: "Engine", kv_dtype: str) -> int:
        """For a hybrid, how far apart its prefill's whole checkpoints (its recurrent states at a chunk frontier)
        are (policy.snapshot_step); 0 for a model without recurrent layers."""
        c = engine.config
        if not c.recurrent:
            return 0
        row = encoded_row_bytes((c.n_kv_heads, c.head_dim), KV_DTYPES[kv_dtype], self.options.row_format)
        kv_per_token = 2 * sum(spec.attention for spec in c.layers) * row
        logits = c.vocab_size * 4  # a manifest's float32 logits
        return policy.snapshot_step(self.options, sequence_state_bytes(c) + logits, kv_per_token)

    def continued_frontier(self, n_tokens: int, last_saved: int) -> int:
        """The chunk-aligned frontier a growing session of n_tokens owes a "continued" checkpoint for
        (pass it as n_tokens to checkpoint_async), or 0. See policy.py."""
        return policy.continued_frontier(self.options, n_tokens, last_saved)

    def should_checkpoint(self, n_tokens: int, last_saved: int) -> bool:
        """A growing session has passed a continued frontier since its last checkpoint."""
        return self.continued_frontier(n_tokens, last_saved) > 0

    # --- checkpoints -----------------------------------------------------------------------

    @_available
    def put(self, session: "Session", reason: str, *, protect: Hit | None = None,
            n_tokens: int | None = None) -> Entry | None:
        """Checkpoint a session now, on this thread: its missing chunks, a manifest, then eviction.

        Returns the entry, or None when nothing was kept (below min_tokens, a cold prompt outside the
        cold policy, too big for the budget). protect: a hit about to be restored -- eviction leaves its
        checkpoint and chunks, and a checkpoint that does not fit beside them is cut to the whole chunks
        that do (or not kept). n_tokens: checkpoint only the first n_tokens (a continued frontier).
        """
        snap = self._snapshot(session, reason, protect, n_tokens, copy=False, skip_pending=False)
        return None if snap is None else self._commit(snap)

    def checkpoint_async(self, session: "Session", reason: str, *, protect: Hit | None = None,
                         n_tokens: int | None = None) -> Future:
        """put(), written by the store's writer thread: a Future of the Entry (or None).

        On this thread it copies only what the store does not hold yet (see checkpoint.py), so the session
        may change as soon as this returns. Failures -- StoreUnavailable among them -- are the future's."""
        future: Future = Future()
        try:
            snap = self._snapshot_checked(session, reason, protect, n_tokens)
            if snap is not None:
                return self._writer.submit(snap)
        except Exception as e:  # StoreUnavailable, a closed store, a bad argument
            future.set_exception(e)
            return future
        future.set_result(None)
        return future

    @_available
    def _snapshot_checked(self, session, reason, protect, n_tokens):
        return self._snapshot(session, reason, protect, n_tokens, copy=True, skip_pending=True)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every checkpoint submitted so far (and the shared tier's write-through); False on a timeout."""
        done = self._writer.flush(timeout)
        if self._tiering is not None:
            done = self._tiering.flush(timeout) and done
        return done

    def close(self, timeout: float | None = None) -> bool:
        """Write what is pending, then stop the writer threads. The store can still be read afterwards."""
        done = self._writer.close(timeout)
        if self._tiering is not None:
            done = self._tiering.close(timeout) and done
        return done

    def _snapshot(self, session: "Session", reason: str, protect: Hit | None, n_tokens: int | None, *,
                  copy: bool, skip_pending: bool) -> checkpoint.Snapshot | None:
        """How many tokens this checkpoint keeps (the policy), and a snapshot of them; None: nothing to keep."""
        if reason not in REASONS:
            raise ValueError(f"save reason {reason!r}: one of {', '.join(REASONS)}")
        o = self.options
        n = len(session) if n_tokens is None else n_tokens
        if not 0 <= n <= len(session):
            raise ValueError(f"n_tokens {n_tokens}: the session holds {len(session)} tokens")
        # a trimmed save needs the rings' rows at that point; a hybrid's checkpoints are whole (its recurrent
        # states, with the logits a hit at the end of a prompt needs)
        whole_only = bool(session.engine.config.recurrent)
        if reason == "cold":
            n = policy.cold_length(o, n)
            if n and (whole_only or not session.holds(n)):
                n = len(session)
        elif n < len(session) and (whole_only or not session.holds(n)):
            n = len(session)
        if n < o.min_tokens or n == 0:
            return None
        session.check_meta(f"store {self.dir}", error=StoreError)  # a manifest must be readable again
        state = session.state(n)
        root = self._root_of(state)
        keys = chain(root, state.tokens, o.chunk_tokens)
        with self.local.mutex:
            skip = set(self.local.chunks)
        if skip_pending:
            skip |= self._writer.pending_keys()
        return checkpoint.take(state, reason=reason, root=root, chunk=o.chunk_tokens, keys=keys, skip=skip,
                               copy=copy, protect=protect)

    def _root_of(self, state: SessionState) -> str:
        """The chain root of a session's state (as root() gives it for its engine and dtype)."""
        return chain_root(Fingerprint(**state.fingerprint).digest, state.kv_dtype, self.options.chunk_tokens,
                          self.options.row_format)

    @_available
    def _commit(self, snap: checkpoint.Snapshot) -> Entry | None:
        """Write a snapshot under the folder's lock: what fits of it, its missing chunks, its manifest."""
        local = self.local
        with local.writing():
            with local.mutex:
                local.sync()
                keep = Protected.of(snap.protect).with_chunks(local.pinned())
                created = time.time()
                n = self._files.plan(snap, keep, created)
                before = local.total_bytes()
            if not n:
                if snap.keys and snap.keys[0] not in local.chunks and snap.keys[0] not in snap.chunk_rows:
                    # its first chunks were left to a checkpoint queued before it, which failed (a full disk) or
                    # did not fit the budget
                    log.info("store: a checkpoint of %d tokens names chunks that an earlier checkpoint failed to "
                             "write; not kept", snap.n_tokens)
                else:
                    log.warning("store: a checkpoint of %d tokens does not fit the budget of %d bytes beside what "
                                "is protected; not kept", snap.n_tokens, self.options.budget_bytes)
                return None
            try:
                entry = self._files.write(snap, n, created)
            except OSError:
                with suppress(OSError):  # what is left now is removed at the next open
                    local.remove_orphan_chunks()
                raise
            with local.mutex:
                local.remember(entry)
                self.written += 1
                self.written_bytes += max(0, local.total_bytes() - before)
                local.evict_to_budget(keep, new=entry.key)
                local.mark_synced()
                kept = local.entries.get(entry.key)
        if kept is not None and self._tiering is not None:
            self._tiering.push(kept)
        return kept

    # --- lookups -------------------------------------------------------------------------

    @_available
    def longest_prefix(self, tokens: Sequence[int], engine: "Engine", kv_dtype: str = "f16") -> Hit | None:
        """The longest stored prefix of `tokens`: a whole checkpoint, or any chunk boundary of one (for a
        hybrid, whose recurrent layers' state a checkpoint holds at its end only, a whole checkpoint).

        With a shared tier, a longer prefix held there is brought into the folder first (verified like
        any file, then kept locally) and returned with source "shared"."""
        root = self.root(engine, kv_dtype)
        keys = chain(root, tokens, self.options.chunk_tokens)
        window = max((s.window for s in engine.config.layers if s.kind == "sliding"), default=0)
        whole = engine.config.recurrent
        with self.local.mutex:
            self.local.sync()
            best = self._local_prefix(tokens, root, keys, window, whole)
        if self._tiering is not None:
            remote = self._tiering.longest_prefix(tokens, root, keys, window, best)
            if remote is not None and (not whole or _is_whole(remote)):
                best = remote
        return best

    def _local_prefix(self, tokens: Sequence[int], root: str, keys: list[str], window: int,
                      whole: bool) -> Hit | None:
        """The folder's longest prefix of `tokens` (under its mutex); whole: whole checkpoints only."""
        c = self.options.chunk_tokens
        chunks, entries, by_base = self.local.chunks, self.local.entries, self.local.by_base
        best_chunks, matched = 0, []
        for j, key in enumerate(keys):
            if key not in chunks:
                break
            matched.append(key)
            # a boundary is restorable when its chunks hold the sliding layers' window before it
            first = max(0, (j + 1) * c - window) // c if window else j + 1
            if all(chunks[k].ring for k in matched[first:]):
                best_chunks = j + 1
        best: Hit | None = None
        for j in range(len(matched), -1, -1):  # the deepest base first: its checkpoints are the longest
            tails = by_base.get(matched[j - 1] if j else root)
            if not tails:
                continue
            rest = tuple(tokens[j * c : (j + 1) * c])
            lengths = sorted({len(t) for t in tails if len(t) <= len(rest)}, reverse=True)
            key = next((tails[rest[:n]] for n in lengths if rest[:n] in tails), None)
            if key is not None:
                e = entries[key]
                best = Hit(e.n_tokens, list(tokens[: e.n_tokens]), list(e.chunks), e)
                break
        if whole:
            return best
        if not window:  # a checkpoint that goes on past the query (a retried request) still holds its prefix
            tails = by_base.get(matched[-1] if matched else root, {})
            rest = tokens[len(matched) * c : (len(matched) + 1) * c]
            for tail, key in tails.items():
                n = len(matched) * c + common_prefix(tail, rest)
                if n > (best.n_tokens if best else 0) and n > len(matched) * c:
                    best = Hit(n, list(tokens[:n]), list(matched), entries[key])
        if best_chunks and (best is None or best_chunks * c > best.n_tokens):
            best = Hit(best_chunks * c, list(tokens[: best_chunks * c]), matched[:best_chunks])
        return best

    @_available
    def longest_text_prefix(self, text: str, engine: "Engine", kv_dtype: str = "f16") -> tuple[Hit, str] | None:
        """ds4's lookup by rendered bytes: the checkpoint whose text is the longest prefix of `text`
        (in this folder: the shared tier is looked up by tokens only).

        Returns the hit (its exact stored tokens) and the rest of the text, which
        is all the caller needs to tokenize.
        """
        root = self.root(engine, kv_dtype)
        with self.local.mutex:
            self.local.sync()
            best = None
            for e in self.local.entries.values():
                if e.root == root and text.startswith(e.text) and matching_text(e.text) == e.text \
                        and (best is None or len(e.text) > len(best.text)):
                    best = e
        if best is None:
            return None
        return Hit(best.n_tokens, best.tokens.tolist(), list(best.chunks), best), text[len(best.text):]

    # --- restore -------------------------------------------------------------------------

    @_available
    def restore(self, hit: Hit, session: "Session") -> bool:
        """Load a hit into a session, reusing the rows the session already holds for its prefix.

        Every byte is read and checked before the session changes (rows past its end may be filled
        in place first: no reader sees them). On a corrupt or vanished entry the entry is removed, the
        session is left as it was, and False is returned: a miss.
        """
        keep = min(common_prefix(session.tokens, hit.tokens), hit.n_tokens)
        e = hit.entry
        session.reserve(max(hit.n_tokens, e.n_tokens if e is not None else 0))  # growing moves rows: before any is read
        target = session.state()
        try:
            with self.local.mutex:
                rows, filled, logits, states = self._restorer.stage(hit, e, target, keep)
        except Damaged as damaged:
            log.warning("store: miss on a damaged %s (%s); removing it", damaged.kind, damaged.error)
            # a damaged chunk takes only the checkpoints that name it along: shared good chunks stay
            damage = [FileKey(self._root_of(target), damaged.kind, damaged.key)]
            self.local.remove(damage)
            if self.shared is not None and not isinstance(damaged.error, SessionNotFound):
                self.shared.remove(damage)
            return False
        session.restore_rows(hit.tokens, rows, logits, keep=keep, filled=filled, states=states)
        if e is not None:
            self._record_hit(e)
        return True

    def _record_hit(self, e: Entry) -> None:
        """Count a hit now; its statistics file is written by the writer thread (a rename costs a restore
        milliseconds)."""
        now = time.time()
        e.hits = self.decayed_hits(e, now) + 1.0
        e.hits_at = e.last_used = now
        stats = json.dumps({"hits": e.hits, "hits_at": e.hits_at, "last_used": e.last_used}).encode()
        self._writer.later(lambda: self.local.write_stats(e.key, stats))

    # --- housekeeping ----------------------------------------------------------------------

    @_available
    def ls(self) -> list[Entry]:
        with self.local.mutex:
            self.local.sync()
            return sorted(self.local.entries.values(), key=lambda e: e.last_used, reverse=True)

    @_available
    def get(self, key_prefix: str) -> Entry:
        with self.local.mutex:
            self.local.sync()
            found = [e for k, e in self.local.entries.items() if k.startswith(key_prefix)]
        if len(found) != 1:
            raise StoreError(f"{len(found)} checkpoints match {key_prefix!r}" + (": give more of the key"
                                                                                if found else ""))
        return found[0]

    @_available
    def delete(self, key: str) -> None:
        with self.local.writing(), self.local.mutex:
            self.local.sync()
            if key not in self.local.entries:
                raise StoreError(f"no checkpoint {key!r} in {self.dir}")
            self.local.delete(key)

    @_available
    def gc(self) -> dict:
        """Remove temporaries, orphan chunks and damaged entries; enforce the budget. Returns counts."""
        return self.local.gc()

    @_available
    def verify(self, e: Entry) -> bool:
        """Every checksum of a checkpoint and its chunks; a damaged one is logged."""
        return self.local.verify(e)

    @_available
    def verify_all(self) -> list[Removal]:
        """Every checkpoint's and chunk's checksums and references, under the folder's lock; what is damaged
        or dangling is removed, with the litter of killed writers, and nothing sound (verify.py). Returns what
        was removed, what opening the folder removed first among it."""
        removed, self.local.removed_at_open = self.local.removed_at_open, []
        return removed + verify.check_folder(self.local)

    @_available
    def find_damage(self, e: Entry) -> str | None:
        """The first check a checkpoint or one of its chunks fails, in words, or None when all hold.

        Streams every section (memory stays a block). A folder that cannot be read is StoreUnavailable,
        not damage.
        """
        return self.local.find_damage(e)

    @_available
    def clear(self) -> int:
        """Remove every checkpoint and chunk; returns how many checkpoints there were."""
        return self.local.clear()
