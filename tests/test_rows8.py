"""8-bit rows ("q8"): the blocks, session files (format 1.1, old files, unknown formats), the store."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import VECTORS
from test_store import PREFIX, session_of

from kvsession.errors import UnsupportedVersion
from kvsession.files import framing, session_file
from kvsession.generate import generate_tokens
from kvsession.kv.cache import KV_DTYPES
from kvsession.kv.rows import (
    decode_q8_into,
    encode_rows,
    encoded_row_bytes,
    host_tensor,
    q8_decode,
    q8_encode,
)
from kvsession.sampling import GREEDY
from kvsession.session import Session
from kvsession.store import Store, StoreOptions

Q8 = StoreOptions(chunk_tokens=16, min_tokens=16, row_format="q8")


def host(x: torch.Tensor) -> np.ndarray:
    """Host rows as the cache hands them out (bf16 as uint16 bits)."""
    return x.view(torch.int16).numpy().view(np.uint16) if x.dtype == torch.bfloat16 else x.numpy()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_q8_blocks_round_trip_within_half_a_step(dtype):
    x = (torch.randn(7, 3, 64) * torch.linspace(0.01, 30, 64)).to(dtype)  # channels of very different sizes
    q, d = q8_encode(host(x), dtype)
    assert q.shape == (7, 192) and q.dtype == np.int8 and d.shape == (7, 6) and d.dtype == np.float16
    y = q8_decode(q, d).view(7, 3, 64)
    step = torch.from_numpy(d.astype(np.float32)).repeat_interleave(32, dim=1).view(7, 3, 64)
    assert bool(((y - x.float()).abs() <= 0.5 * step + 1e-3 * x.float().abs() + 1e-6).all())
    assert encoded_row_bytes((3, 64), dtype, "q8") == 192 + 2 * 6


def test_a_row_32_does_not_divide_has_one_scale_and_zeros_stay_zero():
    x = torch.zeros(2, 1, 24, dtype=torch.float16)
    x[1, 0, 3] = 2.5
    q, d = q8_encode(host(x), torch.float16)
    assert d.shape == (2, 1) and d[0, 0] == 0 and q[0].tolist() == [0] * 24
    assert q8_decode(q, d)[1, 3] == pytest.approx(2.5, rel=1e-2)


def test_encode_and_decode_a_layers_rows():
    k = (np.random.default_rng(0).standard_normal((5, 2, 32)) * 4).astype(np.float16)
    v = -k
    bufs = encode_rows(k, v, torch.float16, "q8")
    blob = bytearray(b"".join(memoryview(b).cast("B").tobytes() for b in bufs))
    assert len(blob) == 2 * 5 * encoded_row_bytes((2, 32), torch.float16, "q8")
    k2, v2 = np.empty_like(k), np.empty_like(v)
    decode_q8_into(blob, k2, v2, torch.float16)
    np.testing.assert_allclose(k2, k, atol=0.05, rtol=0.02)
    np.testing.assert_allclose(v2, v, atol=0.05, rtol=0.02)
    assert encode_rows(k, v, torch.float16, "exact") == [k, v]
    with pytest.raises(ValueError, match="row format"):
        encode_rows(k, v, torch.float16, "q4")


@pytest.mark.parametrize("kv_dtype", ["f16", "bf16"])
def test_a_q8_session_file_is_about_half_and_loads_close(tiny_engine, tmp_path, kv_dtype):
    ids = PREFIX + list(range(60, 160))
    s = session_of(tiny_engine, ids, kv_dtype=kv_dtype)
    exact = s.save(tmp_path / "exact.kvs")
    q8 = s.save(tmp_path / "q8.kvs", row_format="q8")
    rows = sum(2 * len(ids) * layer.row_nbytes for layer in s.cache)
    assert q8.bytes - (exact.bytes - rows) == pytest.approx(rows * (32 + 2) / 64, rel=0.02)
    loaded = Session.load(tmp_path / "q8.kvs", tiny_engine)
    assert loaded.tokens == ids and torch.equal(loaded.logits, s.logits) and loaded.kv_dtype == kv_dtype
    dt = KV_DTYPES[kv_dtype]
    for a, b in zip(s.cache, loaded.cache):
        ka, _ = a.read_rows(0, len(ids))
        kb, _ = b.read_rows(0, len(ids))
        torch.testing.assert_close(host_tensor(kb, dt).float(), host_tensor(ka, dt).float(), atol=0.05, rtol=0.02)
    header = framing.read_header(open(tmp_path / "q8.kvs", "rb"), "q8.kvs")
    assert header.fields["row_format"] == "q8"
    with pytest.raises(ValueError, match="raw files"):
        s.save(tmp_path / "q8.raw", format="raw", row_format="q8")


def test_a_format_1_0_file_still_loads(tiny_engine, tmp_path, monkeypatch):
    s = session_of(tiny_engine, PREFIX)
    real = session_file.describe
    monkeypatch.setattr(framing, "VERSION", (1, 0))
    monkeypatch.setattr(session_file, "describe", lambda session, starts, row_format="exact": {
        k: v for k, v in real(session, starts).items() if k != "row_format"})
    s.save(tmp_path / "old.kvs")
    monkeypatch.undo()
    with open(tmp_path / "old.kvs", "rb") as f:
        assert framing.PREAMBLE.unpack(f.read(16))[1:3] == (1, 0)
    loaded = Session.load(tmp_path / "old.kvs", tiny_engine)
    assert loaded.tokens == s.tokens and torch.equal(loaded.logits, s.logits)


def test_an_unknown_row_format_is_refused_not_misread(tiny_engine, tmp_path, monkeypatch):
    s = session_of(tiny_engine, PREFIX)
    real = session_file.describe
    monkeypatch.setattr(session_file, "describe", lambda session, starts, row_format="exact": {
        **real(session, starts), "row_format": "q4_k"})
    s.save(tmp_path / "later.kvs")
    monkeypatch.undo()
    with pytest.raises(UnsupportedVersion, match="row format 'q4_k'"):
        Session.load(tmp_path / "later.kvs", tiny_engine)


def test_a_q8_store_restores_close_and_keeps_its_own_chain(tiny_engine, tmp_path):
    ids = PREFIX + list(range(60, 95))
    live = session_of(tiny_engine, ids)
    exact = Store(tmp_path / "exact", StoreOptions(chunk_tokens=16, min_tokens=16)).put(live, "continued")
    store = Store(tmp_path / "q8", Q8)
    e = store.put(live, "continued")
    assert e.row_format == "q8" and e.chunks != exact.chunks  # another root: never mixed with exact rows
    assert sum(e.chunk_bytes) < 0.62 * sum(exact.chunk_bytes)
    s = tiny_engine.session(sampler=GREEDY)
    assert store.restore(store.longest_prefix(ids, tiny_engine), s) and s.tokens == ids
    assert torch.equal(s.logits, live.logits)  # logits are kept exact
    s.prefill([5, 6, 7])
    live.prefill([5, 6, 7])
    torch.testing.assert_close(s.logits, live.logits, atol=0.05, rtol=0.05)
    # a chunk-boundary hit and a restore into a session that holds part of it
    part = session_of(tiny_engine, ids[:20])
    assert store.restore(store.longest_prefix(ids[:40] + [9], tiny_engine), part) and len(part) == 32
    # an exact store in the same folder does not see q8 checkpoints
    assert Store(tmp_path / "q8", StoreOptions(chunk_tokens=16, min_tokens=16)).longest_prefix(ids, tiny_engine) is None


@pytest.mark.slow
def test_smollm2_after_a_q8_round_trip_agrees_with_llamacpp(smollm2, tmp_path):
    """Teacher-forced argmax agreement with llama.cpp after the first 128..512 tokens went through a q8 store:
    at least the 95% llama.cpp reaches against itself (f16 vs f32 KV); and greedy continuations after a restore."""
    ref = json.loads((VECTORS / "smollm2-135m-instruct-q4_1.json").read_text())
    ids, top1 = ref["teacher_forced"]["ids"], np.array(ref["teacher_forced"]["top5"])[:, 0]
    store = Store(tmp_path, StoreOptions(chunk_tokens=64, min_tokens=64, row_format="q8"))
    agree = n = 0
    for split in (128, 256, 384, 512):
        s = smollm2.session()
        s.prefill(ids[:split])
        store.put(s, "continued")
        r = smollm2.session()
        assert store.restore(store.longest_prefix(ids[:split], smollm2), r)
        logits = smollm2.model.forward(ids[split:], range(split, len(ids)), r.cache, all_logits=True)
        agree += int((logits.float().argmax(-1).numpy() == top1[split:]).sum())
        n += len(ids) - split
    print(f"q8 rows: argmax agreement with llama.cpp {agree / n:.4f} over {n} positions")
    assert agree / n >= 0.95
    steps = same = 0
    for case in ref["greedy"]:
        s = smollm2.session(sampler=GREEDY)
        s.prefill(case["prompt_ids"] * 16)  # long enough for whole chunks
        store.put(s, "continued")
        r = smollm2.session(sampler=GREEDY)
        assert store.restore(store.longest_prefix(s.tokens, smollm2), r)
        a, b = list(generate_tokens(s, 16, ignore_eos=True)), list(generate_tokens(r, 16, ignore_eos=True))
        same += sum(x == y for x, y in zip(a, b))
        steps += len(a)
    print(f"greedy continuations after a q8 restore: {same}/{steps} tokens as without the round trip")
    assert same / steps >= 0.9
