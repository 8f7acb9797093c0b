"""The bytes a session becomes, pinned: session files (exact and q8 rows), raw exports, and the disk cache's
chunks and manifests are byte for byte those recorded in tests/vectors/golden_bytes.json.

A refactoring of how a session turns into bytes must not change a byte: files written before it load after
it and the store's content addresses stay the same. The session's rows are not computed here but written
from a seeded generator (through restore_rows, the session's own way in), so the bytes depend on the file
formats alone, not on the kernels of the CPU the test runs on; the clock is fixed. Set
KVSESSION_WRITE_GOLDEN=1 to record the digests again after a deliberate format change (and say why in
the commit).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kvsession.engine import Engine
from kvsession.sampling import SamplerParams
from kvsession.session import Session
from kvsession.store import CHUNK_SUFFIX, MANIFEST_SUFFIX, Store, StoreOptions
from tiny import TinySpec, write_tiny

GOLDEN = Path(__file__).parent / "vectors" / "golden_bytes.json"
# two full layers and two rings (window 8), one KV head of 32: rings, windows and chunk tails all appear
SPEC = TinySpec(arch="gemma3", n_layers=4, n_heads=4, n_kv_heads=1, head_dim=32, sliding_window=8, swa_pattern=2)
CLOCK = 1_800_000_000.0
N_TOKENS = 45  # two chunks of 16 and a tail of 13


@pytest.fixture
def session(tmp_path, monkeypatch) -> Session:
    monkeypatch.setattr("time.time", lambda: CLOCK)
    engine = Engine.load(write_tiny(tmp_path / "golden.gguf", SPEC), device="cpu", precision="f32")
    s = Session(engine, kv_dtype="f16", sampler=SamplerParams(temperature=0.7, seed=11))
    rng = np.random.default_rng(5)
    tokens = [int(t) for t in rng.integers(0, 256, N_TOKENS)]
    rows = {}
    for i, layer in enumerate(s.cache):
        start = max(0, N_TOKENS - layer.window) if layer.ring else 0
        k, v = (rng.standard_normal((N_TOKENS - start, *layer.row_shape)).astype(np.float16) for _ in range(2))
        rows[i] = [(start, k, v)]
    logits = torch.from_numpy(rng.standard_normal(engine.config.vocab_size).astype(np.float32))
    s.restore_rows(tokens, rows, logits, keep=0)
    s.meta = {"title": "golden", "messages": [{"role": "user", "content": "hello"}], "turns": [3]}
    return s


def _digests(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_session_files_raw_exports_chunks_and_manifests_keep_their_bytes(session, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    session.save(out / "exact.kvs")
    session.save(out / "q8.kvs", row_format="q8")
    session.save(out / "partial.kvs", layers=[1, 2])
    session.save(out / "raw.bin", format="raw")
    stored = {}
    for row_format, reason, n in (("exact", "cold", 32), ("exact", "continued", None), ("q8", "continued", None)):
        store_dir = tmp_path / f"store-{row_format}-{reason}"
        store = Store(store_dir, StoreOptions(chunk_tokens=16, min_tokens=1, row_format=row_format))
        try:
            store.put(session, reason, n_tokens=n)
        finally:
            store.close()
        stored |= {f"{store_dir.name}/{name}": digest for name, digest in _digests(store_dir).items()
                   if name.endswith((CHUNK_SUFFIX, MANIFEST_SUFFIX))}
    got = {"files": _digests(out), "store": stored}
    if os.environ.get("KVSESSION_WRITE_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(GOLDEN.read_text())
    assert len(stored) == 3 * 3  # two chunks and a manifest a checkpoint
