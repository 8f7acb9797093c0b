"""KV caches and the raw row primitives: placement, ring wrap, bounds, host transfer."""
from __future__ import annotations

import pytest
import torch

from kvsession.config import LayerSpec, RopeConfig
from kvsession.errors import ContextFull
from kvsession.kv.cache import KVBoundsError, KVCache, LayerCache

ROPE = RopeConfig("norm", 10000.0, 4)


def ring(capacity=5, dtype=torch.float32):
    return LayerCache(LayerSpec("sliding", capacity, ROPE), 2, 4, dtype=dtype, device="cpu", capacity=capacity)


def full(capacity=8, max_capacity=None, dtype=torch.float32):
    return LayerCache(LayerSpec("full", 0, ROPE), 2, 4, dtype=dtype, device="cpu", capacity=capacity,
                      max_capacity=max_capacity)


def rows(n, first=1.0):
    """n rows whose every value is its row's number: first, first+1, ..."""
    vals = torch.arange(first, first + n).view(n, 1, 1).expand(n, 2, 4).contiguous()
    return vals, -vals


def test_store_rows_wraps_a_ring_like_ds4():
    c = ring(5)
    c.k.fill_(99)
    c.store_rows(3, *rows(4))
    # four rows at pos0 3 land in physical rows 3, 4, 0, 1; row 2 is untouched
    assert c.k[:, 0, 0].tolist() == [3.0, 4.0, 99.0, 1.0, 2.0]
    assert c.end == 7 and c.start == 3  # nothing was stored below position 3


def test_store_row_places_one_token():
    c = full(8)
    k, v = rows(1, first=5.0)
    c.store_row(0, k[0], v[0])
    c.store_row(1, k[0] + 1, v[0] - 1)
    assert c.k[:2, 0, 0].tolist() == [5.0, 6.0] and c.v[1, 1, 3].item() == -6.0 and c.end == 2


def test_read_rows_returns_logical_order_from_a_wrapped_ring():
    c = ring(5)
    c.store_rows(0, *rows(4))
    c.store_rows(4, *rows(3, first=5.0))  # positions 0..6; 2..6 live
    k, v = c.read_rows(2, 5)
    assert k[:, 0, 0].tolist() == [3.0, 4.0, 5.0, 6.0, 7.0]
    assert (v == -k).all()
    with pytest.raises(KVBoundsError, match="not all live"):
        c.read_rows(1, 2)  # position 1 was overwritten


def test_write_rows_round_trips_through_the_host():
    src = ring(5)
    src.store_rows(0, *rows(5))
    src.store_rows(5, *rows(3, first=6.0))
    k, v = src.read_rows(src.start, src.live_rows)
    dst = ring(5)
    dst.write_rows(src.start, k, v)
    assert torch.equal(dst.k, src.k) and dst.end == src.end


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_host_transfer_keeps_every_bit(dtype):
    c = full(8, dtype=dtype)
    k = torch.randn(6, 2, 4).to(dtype)
    v = torch.randn(6, 2, 4).to(dtype)
    c.store_rows(0, k, v)
    hk, hv = c.read_rows(0, 6)
    d = full(8, dtype=dtype)
    d.write_rows(0, hk, hv)
    assert torch.equal(d.k[:6], k) and torch.equal(d.v[:6], v)


def test_bounds_are_checked_before_any_write():
    c = full(4, max_capacity=4)
    c.k.fill_(7.0)
    before = c.k.clone()
    with pytest.raises(ContextFull, match="past the context of 4"):
        c.store_rows(2, *rows(3))
    with pytest.raises(KVBoundsError, match=">= 0"):
        c.store_rows(-1, *rows(1))
    with pytest.raises(KVBoundsError, match="expected"):
        c.store_rows(0, torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))
    assert torch.equal(c.k, before) and c.end == 0
    r = ring(5)
    with pytest.raises(KVBoundsError, match="ring of capacity 5"):
        r.store_rows(0, *rows(6))
    r.store_rows(0, *rows(5))
    r.store_rows(5, *rows(4))
    with pytest.raises(KVBoundsError, match="left the window"):
        r.store_rows(2, *rows(1))


def test_full_cache_grows_up_to_its_maximum():
    c = full(2, max_capacity=600)
    c.store_rows(0, *rows(2))
    c.store_rows(2, *rows(300, first=3.0))
    assert c.capacity >= 302 and c.k[:302, 0, 0].tolist() == list(map(float, range(1, 303)))
    with pytest.raises(ContextFull):
        c.store_rows(302, *rows(299))


def test_truncate():
    c = full(8)
    c.store_rows(0, *rows(6))
    c.truncate(3)
    assert c.end == 3
    with pytest.raises(KVBoundsError):
        c.truncate(4)
    r = ring(5)
    r.store_rows(0, *rows(4))
    r.truncate(2)  # not wrapped yet: fine
    r.store_rows(2, *rows(5, first=3.0))
    r.store_rows(7, *rows(1, first=8.0))
    with pytest.raises(KVBoundsError, match="wrapped"):
        r.truncate(7)


def test_layer_addressed_primitives(tiny_engine):
    cache = KVCache.for_model(tiny_engine.config)
    k, v = torch.ones(3, 2, 16), torch.zeros(3, 2, 16)
    cache.store_rows(1, 0, k, v)
    assert cache[1].end == 3 and cache[0].end == 0
    with pytest.raises(KVBoundsError, match="layer 7"):
        cache.store_rows(7, 0, k, v)


def test_rows_can_be_written_after_the_cache_grew_in_a_forward_pass(tiny_engine):
    s = tiny_engine.session()
    s.prefill([i % 256 for i in range(300)])  # past the first allocation: the cache grows inside the model's forward
    k, v = s.cache[0].read_rows(0, 300)
    s.cache[0].write_rows(0, k, v)  # outside inference mode, as a restore or a fork writes
    assert s.fork().tokens == s.tokens
